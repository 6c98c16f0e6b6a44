"""Which data-parallel rank trains which of a micro-step's rows: dealt by length, so that no rank
pads far more tokens than the others.

A step's rows are a slice of the sampler's global order, and each micro-step (one micro-batch on
every data-parallel rank) takes the next ``micro_batch`` × ranks of them. Dealt round-robin, every
rank pads its micro-batch to its own longest row, and the micro-step lasts as long as the rank
with the most tokens to compute, padding included: with many ranks, almost every micro-step has a
rank that drew a long row and pads all of its rows to it.

Dealt by length, the micro-step's rows are sorted longest first and cut into one run of
consecutive rows per rank, each run's rows × its longest row (the tokens its rank computes) kept
under the smallest bound that one run per rank can meet: ranks with long rows get fewer of them,
ranks with short rows more, and rows of one length end up padded together.

The step trains the same rows either way, and its loss is the mean over all of the step's label
tokens wherever they are (loss.py), so the gradient is the same up to the order of float sums.
No rank computes more tokens than round-robin's worst rank could (``micro_batch`` rows of the
longest length), so memory stays within what --per_device_train_batch_size asks already. The deal
is a function of the rows' positions in the global order and their lengths: every rank computes
the same runs, and a resume deals a step again exactly as before. Per micro-step it is
O(rows × log rows) on each rank, from an array of every row's length read once from the Arrow
offsets (4 bytes a row).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def token_lengths(ds) -> np.ndarray:
    """Each row's ``input_ids`` length, in the dataset's row order (a selection's too), read from
    the Arrow list offsets: no token is read."""
    import pyarrow.compute as pc

    arrow = ds.with_format("arrow")
    chunks = [
        pc.list_value_length(t.column("input_ids")).to_numpy(zero_copy_only=False)
        for t in arrow.iter(batch_size=100_000)
    ]
    return np.concatenate(chunks).astype(np.int32) if chunks else np.zeros(0, dtype=np.int32)


def runs(lengths: Sequence[int], parts: int) -> list[int]:
    """The sizes of ``parts`` consecutive non-empty runs of ``lengths`` (sorted longest first, at
    least ``parts`` of them) whose largest rows × first length is as small as it can be."""
    ls = [max(1, int(n)) for n in lengths]
    if len(ls) < parts:
        raise ValueError(f"{len(ls)} rows cannot fill {parts} runs")
    # a run costs at least its tokens, so the largest at least 1/parts of them; equal runs fit
    lo, hi = max(ls[0], -(-sum(ls) // parts)), -(-len(ls) // parts) * ls[0]
    sizes = _greedy(ls, hi, parts)
    while lo < hi:
        mid = (lo + hi) // 2
        fit = _greedy(ls, mid, parts)
        if fit is None:
            lo = mid + 1
        else:
            hi, sizes = mid, fit
    while len(sizes) < parts:  # halving the largest run never raises its cost
        j = sizes.index(max(sizes))
        sizes[j : j + 1] = [sizes[j] - sizes[j] // 2, sizes[j] // 2]
    return sizes


def _greedy(ls: list[int], bound: int, parts: int) -> list[int] | None:
    """Runs that each take as many rows as ``bound`` allows, or None when more than ``parts``
    are needed. Taking the most rows first needs the fewest runs: a later run starts at a row no
    longer, so it can only hold more."""
    sizes, i = [], 0
    while i < len(ls):
        take = min(bound // ls[i], len(ls) - i)
        if take == 0 or len(sizes) == parts:
            return None
        sizes.append(take)
        i += take
    return sizes


def deal(rows: Sequence[int], lengths: np.ndarray, ranks: int, rank: int) -> list[int]:
    """``rank``'s rows of a micro-step's ``rows`` (dataset indices, in the sampler's order), given
    every row's length: the ``rank``-th run of the rows sorted longest first (ties in the
    sampler's order)."""
    rows = np.asarray(rows, dtype=np.int64)
    ls = lengths[rows]
    order = np.argsort(-ls, kind="stable")
    sizes = runs(ls[order].tolist(), ranks)
    start = sum(sizes[:rank])
    return rows[order[start : start + sizes[rank]]].tolist()
