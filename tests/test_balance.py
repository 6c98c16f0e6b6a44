"""Rows dealt to the data-parallel ranks by length (finetune/data/balance.py): the runs are the
best a contiguous cut of the sorted rows can do, every row of a micro-step goes to exactly one
rank, no rank computes more tokens than round-robin's worst, and TrainData's step holds the same
rows as round-robin's, in as many micro-batches on every rank."""

from __future__ import annotations

import itertools

import datasets
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from finetune.data import ResumableSampler, TrainData
from finetune.data.balance import deal, runs, token_lengths

PAD = 0


def _cost(lengths: list[int], sizes: list[int]) -> int:
    """The largest run's rows × first (longest) row."""
    starts = np.cumsum([0, *sizes[:-1]])
    return max(n * lengths[s] for s, n in zip(starts, sizes))


def _best_cost(lengths: list[int], parts: int) -> int:
    """Every cut of the sorted rows into ``parts`` non-empty runs, tried."""
    n, best = len(lengths), None
    for cuts in itertools.combinations(range(1, n), parts - 1):
        sizes = np.diff([0, *cuts, n]).tolist()
        c = _cost(lengths, sizes)
        best = c if best is None else min(best, c)
    return best


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=11), st.integers(1, 5))
def test_runs_are_the_best_contiguous_cut(lengths, parts):
    lengths = sorted(lengths, reverse=True)
    if len(lengths) < parts:
        with pytest.raises(ValueError, match="cannot fill"):
            runs(lengths, parts)
        return
    sizes = runs(lengths, parts)
    assert len(sizes) == parts and all(n >= 1 for n in sizes) and sum(sizes) == len(lengths)
    assert _cost(lengths, sizes) == _best_cost(lengths, parts)


def test_rows_of_one_length_are_dealt_evenly():
    assert runs([7] * 32, 2) == [16, 16]
    assert runs([5] * 12, 4) == [3, 3, 3, 3]


def test_long_rows_go_to_a_rank_with_fewer_of_them():
    # one rank takes the 4 rows of 100 (400 tokens), the other the 12 of 30 (360), where
    # round-robin pads 8 rows to 100 on both (800)
    assert runs([100] * 4 + [30] * 12, 2) == [4, 12]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 200), min_size=4, max_size=64),
    st.integers(1, 4),
    st.randoms(use_true_random=False),
)
def test_a_deal_gives_every_row_to_one_rank_and_never_pads_more_than_round_robin(
    lengths, ranks, rnd
):
    micro_batch = len(lengths) // ranks
    lengths = np.array(lengths[: micro_batch * ranks], dtype=np.int64)
    rows = list(range(len(lengths)))
    rnd.shuffle(rows)
    dealt = [deal(rows, lengths, ranks, r) for r in range(ranks)]
    assert sorted(i for d in dealt for i in d) == sorted(rows)
    assert all(d for d in dealt)
    balanced = max(len(d) * lengths[d].max() for d in dealt)
    round_robin = max(micro_batch * lengths[rows[r::ranks]].max() for r in range(ranks))
    assert balanced <= round_robin
    assert balanced <= micro_batch * lengths.max()  # the memory --per_device_train_batch_size asks
    assert dealt == [deal(rows, lengths, ranks, r) for r in range(ranks)]  # the same on every call


def _rows(lengths: list[int]) -> list[dict]:
    return [{"input_ids": [10 + i] * n, "labels": [10 + i] * n} for i, n in enumerate(lengths)]


def _ids(batch) -> list[int]:
    return [int(x) - 10 for x in batch["input_ids"][:, 0]]


@pytest.mark.parametrize("grad_accum", [1, 3])
def test_a_balanced_step_trains_round_robins_rows_in_as_many_micro_batches(grad_accum):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, size=400).tolist()
    rows, world, micro = _rows(lengths), 2, 4

    def data(rank: int, balance: bool) -> TrainData:
        return TrainData(
            rows,
            ResumableSampler(len(rows), world, rank, seed=5),
            micro,
            grad_accum,
            PAD,
            prefetch=False,
            lengths=np.array(lengths) if balance else None,
        )

    plain = [data(r, False) for r in range(world)]
    dealt = [data(r, True) for r in range(world)]
    padded = {"plain": 0, "dealt": 0}
    for _ in range(2 * plain[0].steps_per_epoch):  # into the next epoch
        p = [d.next_step() for d in plain]
        b = [d.next_step() for d in dealt]
        assert all(len(steps) == grad_accum for steps in p + b)
        for i in range(grad_accum):  # each micro-step: the same rows, once each
            assert sorted(x for s in p for x in _ids(s[i])) == sorted(
                x for s in b for x in _ids(s[i])
            )
            padded["plain"] += max(s[i]["input_ids"].numel() for s in p)
            padded["dealt"] += max(s[i]["input_ids"].numel() for s in b)
        assert [d.sampler.state for d in dealt] == [d.sampler.state for d in plain]
    # the micro-steps' slowest rank computes fewer tokens, padding included
    assert padded["dealt"] < 0.9 * padded["plain"], padded


def test_token_lengths_follow_a_selection():
    ds = datasets.Dataset.from_list(_rows([3, 1, 4, 1, 5]))
    assert token_lengths(ds).tolist() == [3, 1, 4, 1, 5]
    assert token_lengths(ds.select([4, 0, 2])).tolist() == [5, 3, 4]
