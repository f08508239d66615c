"""The embedding's backward: each token's input gradient added into its id's row, the same on every run.

``table.index_add_(0, ids, dx)`` is the textbook formulation, but on CUDA it adds with atomics, so
rows of ids that occur several times in a batch are summed in whatever order the threads arrive:
run-to-run differences in the last bit (enough to make a resumed run differ from a straight one).

:func:`add_embedding_grad` makes the same additions in a fixed order: the tokens are grouped by id
with a stable sort (so each group keeps token order), each group is laid out as [the id's current
row, its tokens' rows in order], and ``torch.segment_reduce`` sums every group left to right (one
thread per group and column: no atomics, on CPU and CUDA alike). Each row is then written back
once. That is exactly the order of the CPU's sequential ``index_add_``, so on the CPU the result is
bit for bit the old one, and on a GPU it is the same on every run.
"""

from __future__ import annotations

import torch


def add_embedding_grad(table: torch.Tensor, ids: torch.Tensor, dx: torch.Tensor) -> None:
    """table [V, H] fp32 += dx [N, H] (any float dtype, summed in fp32) at rows ids [N] (int64), in token order."""
    n, dev = ids.numel(), ids.device
    if n == 0:
        return
    order = torch.argsort(ids, stable=True)  # [N] token indices grouped by id, each group in token order
    uniq, counts = torch.unique_consecutive(ids[order], return_counts=True)  # [U] ids, [U] tokens of each
    groups = uniq.numel()
    rank = torch.empty_like(order)
    rank[order] = torch.arange(n, device=dev)  # [N] each token's place in sorted order (distinct: no race)
    group_of_rank = torch.repeat_interleave(torch.arange(groups, device=dev), counts)  # [N]
    first = torch.cumsum(counts, 0) - counts + torch.arange(groups, device=dev)  # [U] where each group begins
    data = torch.empty(groups + n, table.shape[1], dtype=table.dtype, device=dev)  # [U + N, H]
    data[first] = table[uniq]
    data[rank + group_of_rank[rank] + 1] = dx.to(table.dtype)  # every destination distinct: no race
    table[uniq] = torch.segment_reduce(data, "sum", lengths=counts + 1, axis=0, unsafe=True)
