"""A run's metrics.jsonl as it is read back: by a resume (which drops the rows it trains again) and by
``megatrain-ray plot``.

The driver writes one JSON row per line, each flushed whole; a driver killed in the middle of a
write leaves its last line cut short. That line is the only one a crash can damage, so it is read
past (:func:`read` says it was there); a damaged line before it is no crash's doing and is refused,
naming the line.
"""

from __future__ import annotations

import json
import os

from ..errors import ConfigError

NAME = "metrics.jsonl"


def read(path: str) -> tuple[list[dict], bool]:
    """(the rows of ``path`` in file order, whether a cut-short last line was left out)."""
    with open(path) as f:
        lines = f.read().split("\n")
    rows, numbered = [], [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    for k, (n, line) in enumerate(numbered):
        try:
            row = json.loads(line)
            int(row["step"])
        except (ValueError, KeyError, TypeError):
            if k == len(numbered) - 1:  # the last line: a write the driver did not live to finish
                return rows, True
            raise ConfigError(f"line {n} of {path} is not a metrics row (JSON with a step); remove that line "
                              "(or the file) and run again.") from None
        rows.append(row)
    return rows, False


def drop_rows(run_dir: str, step: int) -> bool:
    """Keep the rows of ``run_dir``'s metrics.jsonl up to ``step`` (updates done) and drop those after it,
    which are trained again; a file whose rows counted steps from 0 (an older run resumed in place) is
    renumbered first. Returns whether a cut-short last line was dropped with them."""
    path = os.path.join(run_dir, NAME)
    if not os.path.exists(path):
        return False
    rows, torn = read(path)
    shift = 1 if any(r["step"] == 0 for r in rows) else 0
    with open(path + ".tmp", "w") as f:
        f.writelines(json.dumps({**r, "step": r["step"] + shift}) + "\n" for r in rows if r["step"] + shift <= step)
    os.replace(path + ".tmp", path)
    return torn


def missing_steps(run_dir: str, first: int, last: int) -> list[int]:
    """The steps in (``first``, ``last``] (updates done) that ``run_dir``'s metrics.jsonl has no row for."""
    path = os.path.join(run_dir, NAME)
    have = {int(r["step"]) for r in read(path)[0]} if os.path.exists(path) else set()
    return [s for s in range(first + 1, last + 1) if s not in have]


def step_ranges(steps: list[int]) -> str:
    """[1, 2, 3, 7, 9, 10] -> "1-3, 7, 9-10"."""
    out, k = [], 0
    while k < len(steps):
        j = k
        while j + 1 < len(steps) and steps[j + 1] == steps[j] + 1:
            j += 1
        out.append(str(steps[k]) if j == k else f"{steps[k]}-{steps[j]}")
        k = j + 1
    return ", ".join(out)
