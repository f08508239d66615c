"""The embedding backward on the GPU: index_add_ (atomics) against add_embedding_grad (fixed order).

For shapes of the models the benchmark trains (7B-like: a 32k and a 152k vocabulary, hidden 4096 and
3584, 16k tokens per micro-batch), times both formulations and runs each 10 times on the same input,
counting how many distinct results each gives (index_add_: usually several; ours must give one), and
how far ours is from a float64 sum. Writes ``embed_grad.json`` to the folder given and prints a table.

    python benchmarks/embed_grad_bench.py OUT_DIR
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.probes import cuda_ms  # noqa: E402
from megatrain_ray.engine.compute.embed_grad import add_embedding_grad  # noqa: E402


def case(vocab: int, hidden: int, tokens: int) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (tokens,), generator=g)
    ids[torch.randperm(tokens, generator=g)[:tokens // 10]] = 2  # a frequent token (EOS, padding)
    dx = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    ids_d, dx_d = ids.cuda(), dx.cuda()
    table = torch.zeros(vocab, hidden, device="cuda")

    def old():
        table.zero_()
        table.index_add_(0, ids_d, dx_d.float())

    def new():
        table.zero_()
        add_embedding_grad(table, ids_d, dx_d)

    row = {"vocab": vocab, "hidden": hidden, "tokens": tokens}
    for name, fn in (("index_add", old), ("fixed_order", new)):
        row[f"{name}_ms"] = cuda_ms(fn, reps=10)
        seen = set()
        for _ in range(10):
            fn()
            seen.add(hash(table.cpu().numpy().tobytes()))
        row[f"{name}_distinct_of_10"] = len(seen)
    new()
    rows = ids.unique()[:256]  # the frequent token and others: float64 truth on the CPU for a sample of rows
    truth = torch.zeros(vocab, hidden, dtype=torch.float64).index_add_(0, ids, dx.double())[rows]
    row["fixed_order_max_abs_err_vs_f64"] = (table.cpu()[rows].double() - truth).abs().max().item()
    return row


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    rows = [case(32000, 4096, 16384), case(152064, 3584, 16384), case(32000, 4096, 65536)]
    with open(os.path.join(out, "embed_grad.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=2)
    print(f"{'vocab':>7} {'hidden':>6} {'tokens':>6} | {'index_add ms':>12} {'distinct':>8} | "
          f"{'fixed ms':>9} {'distinct':>8} {'err vs f64':>10}")
    for r in rows:
        print(f"{r['vocab']:>7} {r['hidden']:>6} {r['tokens']:>6} | {r['index_add_ms']:>12.2f} "
              f"{r['index_add_distinct_of_10']:>8} | {r['fixed_order_ms']:>9.2f} {r['fixed_order_distinct_of_10']:>8} "
              f"{r['fixed_order_max_abs_err_vs_f64']:>10.2e}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/embed_grad")
