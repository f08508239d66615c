"""Data-loader throughput: tokens/s of tokenization (Ray Data actor pool) and of batch serving, by pool size.

    python benchmarks/data_bench.py                          # 1, 2, 4 actors, byte-level, generated corpus
    python benchmarks/data_bench.py --tokenizer DIR --documents 50000 --workers 1,2,4,8

For each pool size it tokenizes the same generated jsonl corpus into a fresh cache (``tokenize``:
tokens written per second of wall time, Ray Data start-up included) and then serves ``--steps``
batches from that corpus through as many loader actors, two requests in flight per actor as the
trainer does (``serve``: tokens per second delivered to the driver). Tokenization is the part
that needs the pool; on a machine with fewer cores than actors it stops scaling at the core count.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import ray

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatrain_ray.config import load_config  # noqa: E402
from megatrain_ray.data.builtin import builtin_corpus  # noqa: E402
from megatrain_ray.data.loader import loader_spec  # noqa: E402


def _corpus(path: str, documents: int) -> None:
    docs = builtin_corpus(num_documents=documents, seed=7).split("\n")
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")


def measure(workers: int, data: str, tokenizer: str | None, work: str, seq_len: int, steps: int) -> dict:
    """One pool size: tokenize into a fresh cache, then serve ``steps`` batches; returns tokens/s of each."""
    cache = os.path.join(work, f"cache-{workers}")
    overrides = [f"data.path={data}", f"data.cache_dir={cache}", f"data.num_workers={workers}",
                 f"train.seq_len={seq_len}", "train.micro_batch_size=8", "train.num_micro_batches=2",
                 f"model.vocab_size={2**20}"]  # measuring the loader, not matching a model's vocabulary
    if tokenizer:
        overrides.append(f"data.tokenizer={tokenizer}")
    cfg = load_config(None, overrides)
    start = time.perf_counter()
    cls, args = loader_spec(cfg, log=lambda line: None)
    tokenize_s = time.perf_counter() - start
    with open(os.path.join(args[0].path, "meta.json")) as f:
        corpus_tokens = json.load(f)["splits"]["train"]["tokens"]
    actors = [ray.remote(cls).options(num_cpus=0.25).remote(*args) for _ in range(workers)]
    try:
        ray.get([a.__ray_ready__.remote() for a in actors])
        start = time.perf_counter()
        pending, served = [], 0
        for step in range(steps):
            pending.append(actors[step % workers].batch.remote(step))
            if len(pending) >= 2 * workers:
                served += ray.get(pending.pop(0))["input_ids"].size
        served += sum(b["input_ids"].size for b in ray.get(pending))
        serve_s = time.perf_counter() - start
    finally:
        for a in actors:
            ray.kill(a)
    shutil.rmtree(cache, ignore_errors=True)
    return {"workers": workers, "corpus_tokens": corpus_tokens, "tokenize_tokens_per_s": corpus_tokens / tokenize_s,
            "serve_tokens_per_s": served / serve_s}


def main(argv: list[str] | None = None, log=print) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python benchmarks/data_bench.py", description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="1,2,4", help="comma-separated pool sizes (default 1,2,4)")
    parser.add_argument("--documents", type=int, default=20000, help="documents in the generated corpus")
    parser.add_argument("--tokenizer", help="a Hugging Face tokenizer directory (default: byte-level)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200, help="batches served per pool size")
    args = parser.parse_args(argv)
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    work = tempfile.mkdtemp(prefix="megatrain-data-bench-")
    try:
        data = os.path.join(work, "corpus.jsonl")
        _corpus(data, args.documents)
        rows = []
        for n in (int(w) for w in args.workers.split(",")):
            row = measure(n, data, args.tokenizer, work, args.seq_len, args.steps)
            rows.append(row)
            log(f"workers {n:>2} | tokenize {row['tokenize_tokens_per_s']:>12,.0f} tokens/s | "
                f"serve {row['serve_tokens_per_s']:>12,.0f} tokens/s | corpus {row['corpus_tokens']:,} tokens")
        return rows
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
