"""The run's pace (megatrain_ray.orchestration.pace): the expected step time `plan` prints, the
timeouts that follow from it, and a stall told only by the evidence of no progress.

The waits are tested through one real queue host (a Ray actor). Their timing is controlled by
construction: "progressing" is a loop that moves items without pause until the waiting role has
waited several of its timeouts, "stalled" is nothing moving at all; no test depends on how long a
sleep takes.
"""

import queue
import re
import threading
import time

import pytest
import ray

from megatrain_ray import cli
from megatrain_ray.config import load_config
from megatrain_ray.engine.prefetch import prefetcher
from megatrain_ray.engine.sink import gradient_sink
from megatrain_ray.engine import tickets
from megatrain_ray.engine.tickets import wait_while_moving
from megatrain_ray.errors import ActorDied
from megatrain_ray.model import flops
from megatrain_ray.orchestration import gpu_work, pace
from megatrain_ray.orchestration.health import Health
from megatrain_ray.orchestration.queues import LocalQueue, QueueClient, QueueHost

H200 = ["--device", "cuda", "--gpu-memory", "141", "--host-memory", "120"]  # the H200 box's
LONG_7B = ["model.model_type=qwen2", "model.vocab_size=152064", "model.hidden_size=3584",
           "model.intermediate_size=18944", "model.num_hidden_layers=28", "model.num_attention_heads=28",
           "model.num_key_value_heads=4", "model.max_position_embeddings=524288", "train.seq_len=524288",
           "train.micro_batch_size=1", "train.num_micro_batches=1", "optim.state=8bit", "memory.mlp_chunk_size=16384"]


def _plan(capsys, *args) -> str:
    capsys.readouterr()
    cli.main(["plan", *args])
    return capsys.readouterr().out


def test_plan_prints_the_expected_step_time_from_the_flops_and_the_rates(capsys):
    out = _plan(capsys, *H200, "--gpu-tflops", "800", *sum((["--set", s] for s in LONG_7B), []))
    line = re.search(r"^expected step time: ~(\d+) min \(([\d.]+) PFLOP per GPU: ([\d.]+) PFLOP of the model counting "
                     r"attention \(PaLM; 6NT: ([\d.]+) PFLOP\) \+ ([\d.]+) PFLOP recomputed in the backward; at the "
                     r"H200's rates x 800/989 \(the rate given\): dense GEMMs (\d+) s \(([\d.]+) PFLOP\), attention "
                     r"(\d+) min \(([\d.]+) PFLOP\), the host update's turn .*; the link .*, overlapped\)$", out, re.M)
    assert line, out
    cfg = load_config(None, LONG_7B)
    tokens = 524288
    palm, six = flops.palm_model_flops(cfg.model, tokens, tokens), flops.flops_6nt(cfg.model, tokens)
    kept = int(re.search(r"^activations \(.*\): (\d+) layers kept whole", out, re.M).group(1))
    recomputed = flops.recompute_flops(cfg.model, tokens, tokens, 28 - kept)
    assert float(line.group(3)) == pytest.approx(palm / 1e15, abs=0.05)
    assert float(line.group(4)) == pytest.approx(six / 1e15, abs=0.05)
    assert float(line.group(5)) == pytest.approx(recomputed / 1e15, abs=0.05)
    # attention, the causal half of PaLM's full S x S count: 6 S d per token per layer (forward 2,
    # backward 4), 2 S d more per recomputed layer, d = 28 heads x 128
    attention = tokens * 28 * 128 * tokens * (6 * 28 + 2 * (28 - kept))
    assert float(line.group(9)) == pytest.approx(attention / 1e15, abs=0.05)
    rate = gpu_work.ATTENTION_TFLOPS * 1e12 * 800 / 989
    assert int(line.group(8)) == round(attention / rate / 60)
    # attention dominates at this length: more than nine tenths of the model FLOPs and of the step
    assert palm - 6 * flops.matmul_params(cfg.model) * tokens > 0.9 * palm
    assert attention / rate > 0.8 * int(line.group(1)) * 60
    stall = re.search(r"^stall check: the run is called stalled when no message moves between its roles for (\d+) min "
                      r"\(3 x the expected step time\)", out, re.M)
    assert stall and abs(int(stall.group(1)) - 3 * int(line.group(1))) <= 2, out


def test_a_short_cpu_step_keeps_the_configured_floor(capsys):
    out = _plan(capsys, "--device", "cpu")
    assert re.search(r"^expected step time: ~\d+ ms \(.* at [\d.]+ GFLOP/s: a nominal 10 GFLOP/s per CPU core x \d+; "
                     r"\+ 48 ms of fixed costs, 4 units x 12 ms\)$", out, re.M), out
    assert re.search(r"^stall check: .* for 5 min \(cluster.actor_timeout_s, the floor; 3 x the expected step time is "
                     r"\d+ ms\)", out, re.M), out


def test_the_roles_wait_twice_the_stall_window_which_follows_the_step_time():
    cfg = load_config(None, LONG_7B)
    p = pace.expected_pace(cfg, "cuda", 28, gpu_name="NVIDIA H200")
    assert p.tflops == 989 and "NVIDIA H200's nominal 989" in p.rate_note
    assert 7 * 60 < p.step_s < 10 * 60  # ~8 minutes; measured 532-550 s, compile included
    assert pace.stall_s(p, 300) == pytest.approx(3 * p.step_s)
    assert pace.role_wait_s(p, 300) == pytest.approx(6 * p.step_s)
    tiny = pace.expected_pace(load_config(None), "cpu", 2)
    assert pace.stall_s(tiny, 300) == 300 and pace.role_wait_s(tiny, 300) == 600
    unknown = pace.expected_pace(cfg, "cuda", 28, gpu_name="Some GPU")
    assert unknown.tflops == 989 and "not in the table" in unknown.rate_note


def test_only_the_health_check_calls_a_run_stalled():
    import inspect

    for module in (prefetcher, gradient_sink, tickets):
        assert "stalled" not in inspect.getsource(module), module.__name__


@pytest.fixture
def host(ray_cluster):
    actor = ray.remote(QueueHost).options(num_cpus=0).remote()
    ray.get(actor.size.remote("up", 0))
    yield actor
    ray.kill(actor, no_restart=True)


def _keep_moving(q: QueueClient, until) -> int:
    """Put and take items on ``q`` without pause until ``until()``; returns the items moved."""
    n = 0
    while not until():
        q.put(n)
        q.get(timeout=1)
        n += 1
    return n


def test_a_slow_message_is_waited_for_while_other_messages_move(host):
    grad, fetch = QueueClient(host, "grad"), QueueClient(host, "fetch-0", 3)
    timeout = 0.5
    got, began = [], time.monotonic()
    waiter = threading.Thread(target=lambda: got.append(
        wait_while_moving(lambda t: grad.get(timeout=t), grad, timeout)))
    waiter.start()
    moved = _keep_moving(fetch, lambda: time.monotonic() - began > 6 * timeout)
    grad.put("gradient")
    waiter.join(timeout=30)
    assert not waiter.is_alive() and got == ["gradient"] and moved > 0
    assert time.monotonic() - began > 6 * timeout  # it waited six of its timeouts, and was not given up on


def test_a_wait_gives_up_when_nothing_moves_at_all(host):
    grad = QueueClient(host, "grad")
    began = time.monotonic()
    with pytest.raises(queue.Empty):
        wait_while_moving(lambda t: grad.get(timeout=t), grad, 0.5)
    assert time.monotonic() - began >= 0.5
    polled = []
    assert wait_while_moving(lambda t: polled.append(t), grad, 0.2) is None  # a poll that finds nothing: None
    assert polled


def test_the_health_check_calls_the_pipeline_stalled_only_when_no_message_moves(host):
    fetch = QueueClient(host, "fetch-0", 3)
    health = Health({"queues": host}, {}, timeout_s=30, start_timeout_s=30, stall_s=1.0, hosts={"queues"})
    began = time.monotonic()

    def checked() -> bool:
        health.check()  # raises if it sees a stall
        return time.monotonic() - began > 3.0

    _keep_moving(fetch, checked)  # three stall windows, items moving all the time: no verdict
    with pytest.raises(ActorDied, match=r"^the pipeline is stalled: no message moved between its roles for \d+ s "
                                        r"\(1 s is a few times the expected step time"):
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            health.check()
            time.sleep(0.05)


def test_the_stall_names_who_waits_for_what(host):
    grad = QueueClient(host, "grad")
    health = Health({"queues": host}, {}, timeout_s=30, start_timeout_s=30, stall_s=0.5, hosts={"queues"})
    waiter = threading.Thread(target=lambda: pytest.raises(queue.Empty, grad.get, timeout=5))
    waiter.start()
    while ("grad", "get") not in ray.get(host.waiting.remote()):  # the get has reached the host
        time.sleep(0.01)
    try:
        with pytest.raises(ActorDied, match="while the gradient sink waits for a gradient;"):
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                health.check()
                time.sleep(0.05)
    finally:
        waiter.join()


def test_local_queues_share_their_node_s_clock():
    moved = [0.0]  # long ago
    a, b = LocalQueue(2, moved), LocalQueue(0, moved)
    assert b.quiet_s() > 1.0
    a.put(1)
    assert b.quiet_s() < 1.0  # a's put is progress for a wait on b
    with pytest.raises(queue.Empty):
        wait_while_moving(lambda t: b.get(timeout=t), b, 0.01)


def test_the_tiny_cpu_step_is_expected_near_its_measured_time(monkeypatch):
    """The built-in tiny run on 2 cores: 101 ms a step measured, of which the FLOPs at the CPU's rate
    account for 51 ms; the units' fixed costs make up the rest, within a fifth."""
    monkeypatch.setattr(pace, "usable_cpus", lambda: 2)
    p = pace.expected_pace(load_config(None), "cpu", 2)
    assert (p.palm + p.recompute) / (p.tflops * 1e12) == pytest.approx(0.051, rel=0.05)  # the FLOPs alone
    assert p.step_s == pytest.approx(0.101, rel=0.2)
    cfg = load_config(None)  # on a GPU: a fixed cost per unit per micro-batch instead
    gpu = pace.expected_pace(cfg, "cuda", 2)
    assert gpu.units == (cfg.model.num_hidden_layers + 2) * cfg.train.num_micro_batches
    assert gpu.fixed_s == pytest.approx(gpu_work.UNIT_PASS_S * gpu.units)
