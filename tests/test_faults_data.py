"""A run's data is fixed at its start, with real files changed, appended to or removed under it.

- Restarts read the token cache the run was tokenized into, never data.path again: rows appended
  to the source mid-run and a compute worker killed leave one ``data: tokenized`` line, and the
  steps trained twice have the losses they had before the kill (the same weights, the same batches).
- A source rewritten while it is tokenized is refused in one sentence, and no cache (not even the
  temporary one) is left.
- ``--resume`` against a changed source is refused before anything is tokenized, in one sentence
  that says how to start afresh; random windows (read straight from a .txt) likewise, and a restart
  of a windows run whose file changed is refused rather than trained on other text.
- The token cache removed under a running run: its restart says so in one sentence.
- A file gone while it is tokenized, an interrupt during tokenization, a tokenizer actor killed as
  it starts: one sentence (or the interrupt), and no cache left; the unfinished cache of a process
  killed while it tokenized is removed by the next run, with a line.
- A pool that stalls after its idle tokenizer actor was killed (its one block never finishes) is
  stopped within cluster.actor_timeout_s in one sentence, its actors killed, no cache left.
"""

import json
import os
import re
import signal

import pytest

from processes import finish

from megatrain_ray.config import load_config
from megatrain_ray.data.loader import corpus_ref
from megatrain_ray.errors import ConfigError, DataError, MegatrainError
from megatrain_ray.io import checkpoint
from megatrain_ray.orchestration.pipeline import train
from test_faults import _role_pid

DOC = "the quick brown fox number {i} jumps over the lazy dog and keeps running far away"


def _jsonl(path, start: int, count: int, mode: str = "w") -> None:
    with open(path, mode) as f:
        for i in range(start, start + count):
            f.write(json.dumps({"text": DOC.format(i=i)}) + "\n")


def _cfg(tmp_path, shm_dir, *extra):
    return load_config(None, [f"memory.shm_dir={shm_dir}", f"train.run_dir={tmp_path / 'runs'}",
                              "compute.device=cpu", "train.seq_len=32", "train.micro_batch_size=2",
                              "cluster.actor_timeout_s=300", f"data.cache_dir={tmp_path / 'cache'}", *extra])


def _step_losses(lines):
    """[(step, loss text)] of the step lines, in the order they were logged."""
    return [(int(m.group(1)), m.group(2)) for m in (re.match(r"step\s+(\d+)/\d+ \| loss (\S+)", ln) for ln in lines)
            if m]


def _append_and_kill_at(step: int, cls: str, change, lines: list):
    """A log callback: at the line of ``step``, ``change()`` the data, then SIGKILL the ``cls`` actor."""
    def log(line):
        lines.append(line)
        if re.match(rf"step\s+{step}/", line) and not any(ln.startswith("killed") for ln in lines):
            change()
            os.kill(_role_pid(cls), signal.SIGKILL)
            lines.append("killed")
    return log


def _restartable(tmp_path, shm_dir, data):
    """A 10-step run on the text rows of ``data`` that checkpoints every 2 steps and restarts once."""
    return _cfg(tmp_path, shm_dir, f"data.path={data}", "data.format=text", "train.steps=10",
                "train.checkpoint_every=2", "cluster.max_restarts=1")


@pytest.mark.slow  # kills a compute worker mid-run and restarts the pipeline
def test_rows_appended_mid_run_are_not_tokenized_again_on_restart(ray_cluster, shm_dir, tmp_path):
    data = tmp_path / "docs.jsonl"
    _jsonl(data, 0, 300)
    lines = []
    cfg = _restartable(tmp_path, shm_dir, data)
    result = train(cfg, log=_append_and_kill_at(5, "ComputeWorker", lambda: _jsonl(data, 300, 3000, "a"), lines))
    tokenized = [ln for ln in lines if ln.startswith("data: tokenized")]
    assert len(tokenized) == 1, tokenized  # the restart read the cache of the run's start
    assert any(ln.startswith("restart 1 of 1: the compute actor died") for ln in lines), lines
    (cache,) = os.listdir(tmp_path / "cache")
    # The steps trained twice (from the restart's checkpoint up to the kill) have the same losses.
    losses = _step_losses(lines)
    restart = lines.index(next(ln for ln in lines if ln.startswith("restart ")))
    before = dict(_step_losses(lines[:restart]))
    after = _step_losses(lines[restart:])
    assert after and all(before[s] == loss for s, loss in after if s in before), (before, after)
    assert [s for s, _ in losses[-1:]] == [10]
    for ckpt in filter(os.path.isdir, result.checkpoints):  # the data fingerprint recorded: the data trained on
        assert checkpoint.read_meta(ckpt)["data"]["fingerprint"] == cache
    assert os.listdir(shm_dir) == []


def test_a_source_rewritten_while_it_is_tokenized_is_refused_and_leaves_no_cache(ray_cluster, tmp_path):
    data = tmp_path / "docs.jsonl"
    _jsonl(data, 0, 200)
    cfg = _cfg(tmp_path, "/dev/shm", f"data.path={data}", "data.format=text", "data.val_fraction=0.1")

    def rewrite(_cfg):  # called once the cache key is taken, just before the files are read
        _jsonl(data, 1000, 20)

    with pytest.raises(DataError) as info:
        corpus_ref(cfg, connect=rewrite)
    assert str(info.value) == (f"data.path '{data}' changed while it was being tokenized (a file's size or "
                               "modification time differs from when tokenizing began), so its cache was not kept; "
                               "train again once nothing writes to it.")
    assert os.listdir(tmp_path / "cache") == []  # no cache, no temporary one


def _short_run(tmp_path, shm_dir, *extra):
    train(_cfg(tmp_path, shm_dir, "train.steps=4", "train.checkpoint_every=2", *extra), log=lambda line: None)
    (run,) = os.listdir(tmp_path / "runs")
    return checkpoint.latest(str(tmp_path / "runs" / run / "checkpoints"))


@pytest.mark.slow  # trains a short run, then resumes it
def test_a_resume_against_a_changed_source_is_refused_before_tokenizing(ray_cluster, shm_dir, tmp_path):
    data = tmp_path / "docs.jsonl"
    _jsonl(data, 0, 300)
    ckpt = _short_run(tmp_path, shm_dir, f"data.path={data}", "data.format=text")
    caches = os.listdir(tmp_path / "cache")
    _jsonl(data, 300, 10, "a")
    cfg = _cfg(tmp_path, shm_dir, f"data.path={data}", "data.format=text", "train.steps=6")
    with pytest.raises(DataError) as info:
        train(cfg, resume=ckpt, log=lambda line: None)
    assert str(info.value) == (f"cannot resume from {ckpt}: it was trained on other data (the files of data.path "
                               f"'{data}' changed since (a size or a modification time is not what it was)); restore "
                               "the data it was trained on, or start afresh from its weights with `megatrain-ray "
                               f"train --set train.init_from={ckpt}` (no --resume).")
    assert os.listdir(tmp_path / "cache") == caches  # nothing tokenized for it
    # Another setting of the data named as such.
    _jsonl(data, 0, 300)
    with pytest.raises(DataError, match=r"\(data.val_fraction differs from the run's\)"):
        train(_cfg(tmp_path, shm_dir, f"data.path={data}", "data.format=text", "data.val_fraction=0.2",
                   "train.steps=6"), resume=ckpt, log=lambda line: None)
    # The advice works: the checkpoint's weights start a fresh run.
    fresh = load_config(None, [f"train.init_from={ckpt}"], model_from=lambda d, given: _cfg(
        tmp_path, shm_dir).model)
    assert fresh.train.init_from == ckpt
    assert os.listdir(shm_dir) == []


@pytest.mark.slow  # trains a short run, then resumes it
def test_a_resume_of_random_windows_whose_text_changed_is_refused(ray_cluster, shm_dir, tmp_path):
    text = tmp_path / "book.txt"
    text.write_text("\n\n".join(DOC.format(i=i) for i in range(200)))
    ckpt = _short_run(tmp_path, shm_dir, f"data.path={text}")
    with open(text, "a") as f:
        f.write("\n\nand one more paragraph at the end")
    with pytest.raises(DataError) as info:
        train(_cfg(tmp_path, shm_dir, f"data.path={text}", "train.steps=6"), resume=ckpt, log=lambda line: None)
    assert str(info.value).startswith("cannot resume: the checkpoint was trained on other tokens (the text of "
                                      "data.path changed since, or another file is named); ")
    assert os.listdir(shm_dir) == []


@pytest.mark.slow  # kills a compute worker mid-run
def test_a_restart_of_random_windows_whose_text_changed_is_refused(ray_cluster, shm_dir, tmp_path):
    text = tmp_path / "book.txt"
    text.write_text("\n\n".join(DOC.format(i=i) for i in range(200)))
    lines = []

    def change():
        with open(text, "a") as f:
            f.write("\n\nanother paragraph appended while the run trains")

    cfg = _cfg(tmp_path, shm_dir, f"data.path={text}", "train.steps=10", "train.checkpoint_every=2",
               "cluster.max_restarts=1")
    with pytest.raises(MegatrainError) as info:
        train(cfg, log=_append_and_kill_at(5, "ComputeWorker", change, lines))
    message = str(info.value)
    assert message.startswith(f"data.path '{text}' changed since the run started (its tokens differ from those it "
                              "began with), so the run cannot go on with the data it trained on; restore the file, "
                              "or start a new run on the changed data; the last good checkpoint is "), message
    assert "\n" not in message and os.listdir(shm_dir) == []


@pytest.mark.slow  # kills a compute worker mid-run
def test_a_token_cache_removed_under_a_run_is_named_at_its_restart(ray_cluster, shm_dir, tmp_path):
    import shutil

    data = tmp_path / "docs.jsonl"
    _jsonl(data, 0, 300)
    lines = []
    cfg = _restartable(tmp_path, shm_dir, data)
    with pytest.raises(DataError) as info:
        train(cfg, log=_append_and_kill_at(5, "ComputeWorker", lambda: shutil.rmtree(tmp_path / "cache"), lines))
    assert re.match(rf"the token cache {tmp_path / 'cache'}/\w+ of data.path '{data}' is gone \(removed while the "
                    r"run used it\); train again, which tokenizes the data anew; the last good checkpoint is ",
                    str(info.value)), str(info.value)
    assert os.listdir(shm_dir) == []


# ---------------------------------------------------------------------------------------------
# Sources that vanish, and tokenizations that stop half-way.

def test_a_data_path_that_is_gone_is_named(tmp_path):
    with pytest.raises(ConfigError) as info:
        _cfg(tmp_path, "/dev/shm", f"data.path={tmp_path / 'gone.jsonl'}", "data.format=text")
    assert str(info.value) == f"data.path does not name a readable file or directory: '{tmp_path / 'gone.jsonl'}'."


def test_a_file_removed_from_a_data_directory_while_it_is_tokenized_is_named(ray_cluster, tmp_path):
    (tmp_path / "docs").mkdir()
    for k in range(3):
        _jsonl(tmp_path / "docs" / f"part-{k}.jsonl", 100 * k, 100)
    cfg = _cfg(tmp_path, "/dev/shm", f"data.path={tmp_path / 'docs'}", "data.format=text", "data.val_fraction=0.1")

    def remove(_cfg):  # once the cache key is taken, before the files are read
        os.unlink(tmp_path / "docs" / "part-1.jsonl")

    with pytest.raises(DataError) as info:
        corpus_ref(cfg, connect=remove)
    assert str(info.value) == (f"data.path '{tmp_path / 'docs'}': its file {tmp_path / 'docs' / 'part-1.jsonl'} is "
                               "gone; restore it, or point data.path at the data meant.")
    assert os.listdir(tmp_path / "cache") == []


def test_an_interrupt_during_tokenization_leaves_no_cache(tmp_path):
    _jsonl(tmp_path / "docs.jsonl", 0, 50)
    cfg = _cfg(tmp_path, "/dev/shm", f"data.path={tmp_path / 'docs.jsonl'}", "data.format=text",
               "data.val_fraction=0.1")

    def interrupted(_cfg):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        corpus_ref(cfg, connect=interrupted)
    assert os.listdir(tmp_path / "cache") == []


def test_the_unfinished_cache_of_a_killed_process_is_removed_by_the_next_run(ray_cluster, tmp_path):
    import subprocess
    import sys

    _jsonl(tmp_path / "docs.jsonl", 0, 50)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a process that is gone, as one killed with -9 half-way through tokenizing
    stale = tmp_path / "cache" / f"0123456789abcdef0123.tmp-{dead.pid}"
    stale.mkdir(parents=True)
    (stale / "train.tokens.bin").write_bytes(b"\0" * 64)
    lines = []
    cfg = _cfg(tmp_path, "/dev/shm", f"data.path={tmp_path / 'docs.jsonl'}", "data.format=text",
               "data.val_fraction=0.1")
    ref = corpus_ref(cfg, log=lines.append)
    assert lines[0] == f"data: removed {stale}, the unfinished cache of process {dead.pid}, which is gone"
    assert os.listdir(tmp_path / "cache") == [os.path.basename(ref.path)]


@pytest.mark.slow  # trains a short run, then resumes it
def test_a_resume_after_the_tokenizer_files_changed_is_refused(ray_cluster, shm_dir, tmp_path):
    from megatrain_ray.data.tokenizer import save_byte_tokenizer

    save_byte_tokenizer(str(tmp_path / "tok"))
    data = tmp_path / "docs.jsonl"
    _jsonl(data, 0, 300)
    sets = (f"data.path={data}", "data.format=text", f"data.tokenizer={tmp_path / 'tok'}")
    ckpt = _short_run(tmp_path, shm_dir, *sets)
    config = tmp_path / "tok" / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_max_length": 12345}))
    with pytest.raises(DataError) as info:
        train(_cfg(tmp_path, shm_dir, *sets, "train.steps=6"), resume=ckpt, log=lambda line: None)
    assert str(info.value).startswith(
        f"cannot resume from {ckpt}: it was trained on other data (the files of data.path '{data}' or of "
        f"data.tokenizer '{tmp_path / 'tok'}' changed since"), str(info.value)
    assert os.listdir(shm_dir) == []


@pytest.mark.slow  # tokenizes 120k rows on an actor pool and kills one of its actors
def test_a_tokenizer_actor_killed_as_it_starts_is_one_sentence_and_leaves_no_cache(ray_cluster, tmp_path):
    import threading
    import time

    import psutil

    from test_faults import _cmdline

    data = tmp_path / "docs.jsonl"
    _jsonl(data, 0, 120_000)
    cfg = _cfg(tmp_path, "/dev/shm", f"data.path={data}", "data.format=text", "data.val_fraction=0.01",
               "data.num_workers=2")
    killed, stop = [], threading.Event()

    def kill_the_first_tokenizer():  # as soon as a pool actor's process is there: it waits for its first block
        while not stop.is_set() and not killed:
            for p in psutil.Process().children(recursive=True):
                if _cmdline(p).startswith("ray::MapWorker(MapBatches(TokenizeBatch))"):
                    p.kill()
                    killed.append(p.pid)
                    break
            time.sleep(0.05)

    killer = threading.Thread(target=kill_the_first_tokenizer)
    killer.start()
    started = time.monotonic()
    try:
        with pytest.raises(DataError) as info:
            corpus_ref(cfg, log=lambda line: None)
    finally:
        stop.set()
        killer.join()
    assert killed, "no tokenizer actor was seen"
    message = str(info.value)
    assert message.startswith(f"a tokenizer actor of data.path '{data}' died ("), message
    assert "\n" not in message and time.monotonic() - started < 300
    assert os.listdir(tmp_path / "cache") == []  # no cache, no temporary one


def test_the_tokenize_watchdog_stops_a_quiet_pool_only_once_an_actor_died():
    """The watchdog's decision, on a clock of the test's: quiet for less than the bound, or quiet with
    every actor alive (a slow pool), is no stall; quiet for the bound with a dead actor is one sentence
    naming the data, the dead actor's process and what to do; a block written starts the bound anew."""
    from megatrain_ray.data.watchdog import TokenizeWatchdog

    now, dead, asked = [100.0], [], []

    def dead_actors():
        asked.append(now[0])
        return list(dead)

    watchdog = TokenizeWatchdog("data.path '/d.jsonl'", 30.0, dead_actors, clock=lambda: now[0])
    now[0] = 129.0
    assert watchdog.check() is None and asked == []  # quiet for less than the bound: the GCS is not asked
    now[0] = 131.0
    assert watchdog.check() is None and asked == [131.0]  # quiet, every actor alive: a slow pool
    dead.append(4242)
    watchdog.beat()
    now[0] = 160.0
    assert watchdog.check() is None  # a block was written at 131
    now[0] = 161.5
    assert str(watchdog.check()) == (
        "tokenizing data.path '/d.jsonl' stalled: a tokenizer actor of its pool died (process 4242) and no block "
        "was tokenized for 30 s (cluster.actor_timeout_s), so the step was stopped and nothing was cached; train "
        "again, which tokenizes the data anew.")


def test_a_tokenizing_step_that_fails_kills_the_actors_its_pool_started(ray_cluster, tmp_path):
    """A step that ends in an error Ray Data raises (a tokenizer actor it reports dead, a block its
    reader could not read) leaves no actor of its pool behind: Ray Data's own shutdown on an error
    only drops its handles, so an actor busy with a block would go on with it. A pool whose actor
    never finishes its block; once it is busy, the reader of the other block fails, the consumer
    raises, and on the way out of the watchdog the busy actor is killed."""
    import glob
    import time

    import psutil
    import ray
    import ray.data

    from megatrain_ray.data.watchdog import SeenExecutor, TokenizeWatchdog

    busy, release = str(tmp_path / "busy-"), str(tmp_path / "release")

    class Stuck:  # local, so Ray pickles it by value into the pool
        def __call__(self, table):
            open(f"{busy}{os.getpid()}", "w").close()
            while not os.path.exists(release):
                time.sleep(0.05)
            return table

    def fail_once_the_pool_is_busy(row):
        if row["id"] == 1:
            deadline = time.monotonic() + 120
            while not glob.glob(f"{busy}*") and time.monotonic() < deadline:
                time.sleep(0.05)
            raise ValueError("a block its reader could not read")
        return row

    ctx = ray.data.DataContext.get_current()
    saved = list(ctx.custom_execution_callback_classes), ctx.enable_progress_bars
    ctx.custom_execution_callback_classes, ctx.enable_progress_bars = [*saved[0], SeenExecutor], False
    try:
        ds = ray.data.range(2, override_num_blocks=2).map(fail_once_the_pool_is_busy).map_batches(
            Stuck, batch_format="pyarrow", batch_size=1, num_cpus=0.1,
            compute=ray.data.ActorPoolStrategy(size=2, max_tasks_in_flight_per_actor=1))
        with pytest.raises(Exception, match="a block its reader could not read"), \
                TokenizeWatchdog("data.path 'x'", 600, lambda: []):
            for _ in ds.iter_batches(batch_format="pyarrow", batch_size=None):
                pass
    finally:
        ctx.custom_execution_callback_classes, ctx.enable_progress_bars = saved
    pids = [int(n[len(busy):]) for n in glob.glob(f"{busy}*")]
    assert len(pids) == 1, pids
    gone, alive = psutil.wait_procs([psutil.Process(pids[0])], timeout=60)
    open(release, "w").close()  # lets an actor that was left go (the test has failed by then)
    assert not alive, "the busy actor of the failed step was left running"


@pytest.mark.slow  # an actor pool whose block never finishes, and its idle actor killed
def test_a_pool_stalled_after_its_idle_tokenizer_actor_was_killed_is_stopped_in_one_sentence(
        ray_cluster, tmp_path, monkeypatch, capfd):
    """A pool of two tokenizer actors: one takes the data's only block and never finishes it (it waits
    for a file the test never writes: the stuck pool), the other, idle, is killed. Within
    cluster.actor_timeout_s of no block written the step stops with one sentence naming the step, the
    killed actor's process and what to do; no cache (not the temporary one), no pool actor, no thread
    left. Without the watchdog it would wait forever: the test then releases the block after a
    generous deadline, the step ends, and the missing error fails the test."""
    import threading
    import time

    import psutil

    from megatrain_ray.data import prepare
    from test_faults import _cmdline

    release = tmp_path / "release"

    class StuckTokenizeBatch(prepare.TokenizeBatch):  # local, so Ray pickles it by value into the pool
        def __call__(self, table):
            open(os.path.join(os.path.dirname(str(release)), f"busy-{os.getpid()}"), "w").close()
            while not os.path.exists(str(release)):
                time.sleep(0.05)
            return super().__call__(table)

    monkeypatch.setattr(prepare, "TokenizeBatch", StuckTokenizeBatch)
    data = tmp_path / "docs.jsonl"
    _jsonl(data, 0, 1)  # one row: one block, one task, so the other actor stays idle
    cfg = _cfg(tmp_path, "/dev/shm", f"data.path={data}", "data.format=text", "data.val_fraction=0",
               "data.num_workers=2", "cluster.actor_timeout_s=2")
    killed, pool, stop = [], {}, threading.Event()

    def kill_the_idle_actor():
        while not stop.is_set() and not killed:
            busy = [int(n.name.split("-")[1]) for n in tmp_path.glob("busy-*")]
            workers = [p for p in psutil.Process().children(recursive=True)
                       if _cmdline(p).startswith("ray::MapWorker(MapBatches(StuckTokenizeBatch))")]
            pool.update({p.pid: p for p in workers})
            idle = [p for p in workers if busy and p.pid not in busy]
            if idle:
                idle[0].kill()
                killed.append(idle[0].pid)
                break
            stop.wait(0.05)
        if not stop.wait(240):  # the fail-safe of a run that would wait forever: its block is released
            release.touch()

    killer = threading.Thread(target=kill_the_idle_actor)
    killer.start()
    try:
        with pytest.raises(DataError) as info:
            corpus_ref(cfg, log=lambda line: None)
    finally:
        stop.set()
        killer.join()
    assert killed, "no idle tokenizer actor was seen"
    assert not release.exists(), "the step did not stop by itself"
    stalled = (f"tokenizing data.path '{data}' stalled: a tokenizer actor of its pool died (process {killed[0]}) "
               "and no block was tokenized for 2 s (cluster.actor_timeout_s), so the step was stopped and nothing "
               "was cached; train again, which tokenizes the data anew.")
    died = (f"a tokenizer actor of data.path '{data}' died (its process was killed or crashed) while it tokenized, "
            "so nothing was cached; train again, which tokenizes the data anew.")
    # Ray Data may also report the kill itself (a call of its pool to that actor failing): the run then
    # ends in that sentence before the stall bound; either way one sentence, no hang
    assert str(info.value) in (stalled, died), str(info.value)
    printed = "".join(capfd.readouterr())  # Ray Data's account of the stop (a traceback) is in its log file only
    assert "Exception occurred in Ray Data" not in printed and "Full stack trace" not in printed, printed[-3000:]
    assert os.listdir(tmp_path / "cache") == []  # no cache, no temporary one
    gone, alive = psutil.wait_procs(list(pool.values()), timeout=60)  # the stuck actor was killed too
    assert len(pool) == 2 and not alive, [_cmdline(p)[:80] for p in alive]


@pytest.mark.slow  # a private Ray in a subprocess, 120k rows tokenized on an actor pool, one of its actors killed
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_tokenizer_actor_killed_mid_tokenization_ends_the_command_in_one_sentence(sig, tmp_path):
    """``megatrain-ray train`` as a user runs it; once the cache has its first tokens, a tokenizer actor of
    the pool is killed (kill -9, or SIGTERM): the command ends with status 2 and one line, naming what
    died and what to do; nothing of Ray's (not the raylet's account of the worker) on the terminal; no
    cache, no temporary one, no run directory; none of its processes left.

    The pool may have handed out its last block before the signal lands (the writer trails the actors
    by as much as Ray Data buffers, more so on a busy machine); the actor then held no work, and the run
    goes on: that outcome passes only with a clean terminal and a cache equal, file for file, to the
    documents tokenized here in this process."""
    import subprocess
    import sys
    import threading
    import time

    import psutil

    from test_faults import _cmdline

    data = tmp_path / "docs.jsonl"
    _jsonl(data, 0, 120_000)
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
           "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    proc = subprocess.Popen([sys.executable, "-m", "megatrain_ray.cli", "train", "--set", "cluster.ray_address=local",
                             "--set", "compute.device=cpu", "--set", f"data.path={data}", "--set", "data.format=text",
                             "--set", "data.num_workers=2", "--set", f"data.cache_dir={tmp_path / 'cache'}",
                             "--set", f"train.run_dir={tmp_path / 'runs'}"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed, family = [], {}

    def tokens_written() -> bool:
        bins = (tmp_path / "cache").glob("*.tmp-*/train.tokens.bin")
        return any(b.stat().st_size > 0 for b in bins if b.exists())

    def kill_a_tokenizer_once_tokens_are_written():
        while proc.poll() is None and not killed:
            try:
                children = psutil.Process(proc.pid).children(recursive=True)
            except psutil.Error:
                return
            family.update({p.pid: p for p in children})
            if tokens_written():
                for p in children:
                    if _cmdline(p).startswith("ray::MapWorker(MapBatches(TokenizeBatch))"):
                        p.send_signal(sig)
                        killed.append(p.pid)
                        return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_a_tokenizer_once_tokens_are_written)
    killer.start()
    try:
        out, _ = finish(proc, 600)
    finally:
        killer.join()
    assert killed, out[-3000:]
    if proc.returncode == 0:  # the killed actor held no block any more: nothing lost, the run went on
        _assert_the_cache_is_whole(tmp_path / "cache", data)
        assert "Traceback" not in out and "raylet" not in out and "(pid=" not in out, out[-3000:]
        assert not [line for line in out.splitlines() if "error" in line.lower() or "died" in line], out[-3000:]
        return
    assert proc.returncode == 2, out[-3000:]
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines[-1] == (f"error: a tokenizer actor of data.path '{data}' died (its process was killed or crashed) "
                         "while it tokenized, so nothing was cached; train again, which tokenizes the data anew."), \
        out[-3000:]
    assert [line for line in lines if "error" in line.lower() or "died" in line] == [lines[-1]], out[-3000:]
    assert "Traceback" not in out and "raylet" not in out and "(pid=" not in out, out[-3000:]
    assert os.listdir(tmp_path / "cache") == [] and not list(tmp_path.glob("runs/*/config.json"))
    gone, alive = psutil.wait_procs(list(family.values()), timeout=60)
    assert not alive, [_cmdline(p)[:80] for p in alive]


def _assert_the_cache_is_whole(cache, data) -> None:
    """The one finished cache under ``cache`` holds, byte for byte, what tokenizing every row of the
    JSONL file ``data`` in this process writes (same tokenizer, same train/val split)."""
    import filecmp

    import pyarrow.json

    from megatrain_ray.data.prepare import CacheWriter, TokenizeBatch, _write_table

    done = [d for d in os.listdir(cache) if os.path.isfile(cache / d / "meta.json")]
    assert done == os.listdir(cache), os.listdir(cache)  # one cache and no temporary one beside it
    with open(cache / done[0] / "meta.json") as f:
        plan = json.load(f)["plan"]
    expected = cache.parent / "expected"
    expected.mkdir()
    writer = CacheWriter(str(expected), plan["val_fraction"], plan["has_labels"])
    work = TokenizeBatch(plan["format"], plan["tokenizer"], plan["text_key"], plan["kind"])
    for batch in pyarrow.json.read_json(data).to_batches(max_chunksize=4096):
        _write_table(writer, work(pyarrow.Table.from_batches([batch])))
    writer.close()
    names = sorted(n for n in os.listdir(expected))
    assert names == sorted(n for n in os.listdir(cache / done[0]) if n != "meta.json")
    assert all(filecmp.cmp(expected / n, cache / done[0] / n, shallow=False) for n in names), names


def _arrow_text(path, docs: int, stream: bool = False) -> None:
    """An Arrow IPC file (the file format, or the stream format) of ``docs`` text rows, 500 a batch."""
    import pyarrow as pa

    table = pa.table({"text": [DOC.format(i=i) for i in range(docs)]})
    with (pa.ipc.new_stream if stream else pa.ipc.new_file)(str(path), table.schema) as w:
        for batch in table.to_batches(max_chunksize=500):
            w.write_batch(batch)


def test_an_arrow_file_cut_short_is_named_with_the_rows_read_and_leaves_no_cache(tmp_path):
    """An .arrow stream whose copy did not finish: its first batches read, then one sentence naming the
    file, the rows it held before it broke off and what to do; no cache, no temporary one."""
    whole = tmp_path / "whole.arrow"
    _arrow_text(whole, 3000, stream=True)
    data = tmp_path / "docs.arrow"
    data.write_bytes(whole.read_bytes()[: int(whole.stat().st_size * 0.7)])
    with pytest.raises(DataError) as info:
        corpus_ref(_cfg(tmp_path, "/dev/shm", f"data.path={data}", "data.format=text"), log=lambda line: None)
    message = str(info.value)
    assert re.fullmatch(rf"data.path '{re.escape(str(data))}' cannot be read after its row (\d+) \(.+\); it is cut "
                        r"short or damaged: copy it again\.", message), message
    assert 0 < int(re.search(r"row (\d+)", message).group(1)) < 3000
    assert os.listdir(tmp_path / "cache") == []


TOKENIZE = """
import json, sys
from megatrain_ray.config import load_config
from megatrain_ray.data.loader import corpus_ref
lines = []
ref = corpus_ref(load_config(None, sys.argv[1:]), log=lines.append)
print(json.dumps({"path": ref.path, "lines": lines}))
"""


def test_two_runs_tokenizing_the_same_data_into_one_cache_at_once_both_get_it_whole(tmp_path):
    """Two processes (two runs started together on the same data and data.cache_dir) tokenize the same
    .arrow file at the same time: each writes its own temporary cache, the first to finish renames it
    into place and the other takes that one; both read the same complete cache, none is left half-written.
    (Whether they overlap or one finds the other's finished cache, the outcome is the same.)"""
    import subprocess
    import sys

    data = tmp_path / "docs.arrow"
    _arrow_text(data, 20_000)
    args = [f"data.path={data}", "data.format=text", f"data.cache_dir={tmp_path / 'cache'}"]
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    procs = [subprocess.Popen([sys.executable, "-c", TOKENIZE, *args], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert results[0]["path"] == results[1]["path"]
    assert os.listdir(tmp_path / "cache") == [os.path.basename(results[0]["path"])]  # no temporary one left
    meta = json.load(open(os.path.join(results[0]["path"], "meta.json")))
    tokenized = [line for r in results for line in r["lines"] if line.startswith("data: tokenized")]
    assert 1 <= len(tokenized) <= 2 and len(set(tokenized)) == 1
    assert f"{meta['splits']['train']['tokens']:,} train tokens" in tokenized[0]

