"""A new model's random weights (engine.store.init_weights): drawn on threads or on spawned processes that
map the store's segments, the store holds the same bytes, for an fp32 master and for a quantized base."""

import os
import uuid

import pytest
import torch

from megatrain_ray.config import load_config
from megatrain_ray.engine.store import init_weights, shm
from megatrain_ray.engine.store.host_store import HostStore, StoreSpec
from megatrain_ray.model.precision import resolve_precision

SMALL_MOE = ["model.model_type=qwen3_moe", "model.hidden_size=64", "model.intermediate_size=96",
             "model.moe_intermediate_size=32", "model.num_experts=4", "model.num_experts_per_tok=2",
             "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.head_dim=16",
             "model.vocab_size=300", "model.num_hidden_layers=3"]


def _store(shm_dir: str, sets: list[str]) -> HostStore:
    cfg = load_config(None, [f"memory.shm_dir={shm_dir}", *sets])
    spec = StoreSpec.of_run(cfg, resolve_precision(cfg.precision, "cpu"), "cpu", os.getpid(), "w" + uuid.uuid4().hex[:6])
    return HostStore(spec, create=True)


@pytest.mark.parametrize("sets", [[], ["precision.master_dtype=bfloat16"],
                                  ["lora.rank=2", "lora.base_format=mxfp4", "lora.target_modules=q_proj"],
                                  ["lora.rank=2", "lora.base_format=nf4", "lora.target_modules=q_proj"]],
                         ids=["fp32", "bf16", "mxfp4-base", "nf4-base"])
def test_processes_draw_the_bytes_threads_draw(sets, shm_dir):
    stores = [_store(shm_dir, SMALL_MOE + sets) for _ in range(2)]
    try:
        threads, processes = stores
        init_weights.draw_random(threads, threads.spec, seed=5, processes=False)
        threads_before = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            init_weights.draw_random(processes, processes.spec, seed=5, processes=True)
        finally:
            torch.set_num_threads(threads_before)
        assert threads.arrays.keys() == processes.arrays.keys()
        for kind, array in threads.arrays.items():
            assert torch.equal(array.view(torch.uint8), processes.arrays[kind].view(torch.uint8)), kind
        assert threads.arrays["master"].view(torch.uint8).any()  # drawn (the segments start as zeros)
    finally:
        for s in stores:
            _remove(s)


def _remove(store: HostStore) -> None:
    shm.remove_run(store.spec.shm_dir, store.spec.owner_pid, store.spec.run_id)


def test_a_large_model_is_drawn_by_processes(monkeypatch, shm_dir):
    """From PROCESS_DRAW_MIN parameters on, with more than one thread to give it."""
    chosen = []
    monkeypatch.setattr(init_weights, "_draw_in_processes", lambda mapping, spec, seed, units, workers: chosen.append(workers))
    store = _store(shm_dir, SMALL_MOE)
    try:
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            init_weights.draw_random(store, store.spec, 0)
            assert chosen == []  # a small model: threads
            monkeypatch.setattr(init_weights, "PROCESS_DRAW_MIN", store.layout.num_params)
            init_weights.draw_random(store, store.spec, 0)
            assert chosen == [2]
            torch.set_num_threads(1)
            init_weights.draw_random(store, store.spec, 0)
            assert chosen == [2]  # one thread to give: no pool of processes
        finally:
            torch.set_num_threads(threads)
    finally:
        _remove(store)
