"""Which rows each rank trains on, step by step: a resumable distributed sampler, the next step's
micro-batches prepared in the background, and evaluation batches.

Per optimizer step the work is O(batch), whatever the dataset's size: the epoch's permutation
is computed once per epoch, and the next step's rows are fetched and collated on a thread while
the current step computes.
"""

from __future__ import annotations

import errno
import itertools
import math
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from finetune.config import ConfigError
from finetune.data.balance import deal
from finetune.data.formats import label_tokens
from finetune.data.load import collate
from finetune.data.sequence import shard
from finetune.io import seams


@dataclass(frozen=True)
class SamplerState:
    epoch: int = 0
    consumed: int = 0  # samples of this epoch's global order already used, summed over ranks


class ResumableSampler:
    """Deterministic distributed order: one global permutation per (seed, epoch), dealt round-robin.

    The position is the number of *global* samples consumed, so the same state also means the
    same thing at another world size: the remaining global order is dealt to the new ranks.
    """

    def __init__(self, num_samples: int, world_size: int, rank: int, seed: int):
        self.num_samples, self.world_size, self.rank, self.seed = (
            num_samples,
            world_size,
            rank,
            seed,
        )
        self.state = SamplerState()
        # The trimmed order of the current and the next epoch (the prefetch may already be there).
        self._orders: dict[int, torch.Tensor] = {}

    def _epoch_tensor(self, epoch: int) -> torch.Tensor:
        order = self._orders.get(epoch)
        if order is None:
            g = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.num_samples, generator=g)
            if self.num_samples < 2**31:
                order = order.to(torch.int32)  # half the memory: 40 MB at 10M samples
            # Trim so every rank gets the same count: ranks must run the same number of collectives.
            order = order[: len(order) - len(order) % self.world_size]
            self._orders = {
                e: o for e, o in self._orders.items() if e in (epoch - 1, epoch + 1)
            } | {epoch: order}
        return order

    def epoch_order(self, epoch: int) -> list[int]:
        return self._epoch_tensor(epoch).tolist()

    def samples_per_rank(self) -> int:
        return self.num_samples // self.world_size

    def plan_step(
        self, state: SamplerState, per_rank: int
    ) -> tuple[SamplerState, torch.Tensor | None]:
        """The state after the next ``per_rank`` × world indices of the global order from
        ``state``, and those indices (None at the end of the epoch). Pure apart from the one-epoch
        cache; O(per_rank × world)."""
        order = self._epoch_tensor(state.epoch)
        end = state.consumed + per_rank * self.world_size
        if end > len(order):
            return state, None
        return SamplerState(state.epoch, end), order[state.consumed : end]

    def plan(self, state: SamplerState, per_rank: int) -> tuple[SamplerState, list[int] | None]:
        """The state after this rank's next ``per_rank`` indices from ``state``, and those indices
        (None at the end of the epoch), dealt round-robin."""
        after, rows = self.plan_step(state, per_rank)
        return after, None if rows is None else rows[self.rank :: self.world_size].tolist()

    def take(self, per_rank: int) -> list[int] | None:
        """This rank's next ``per_rank`` indices, advancing the state; None at epoch end."""
        self.state, idx = self.plan(self.state, per_rank)
        return idx

    def next_epoch(self) -> None:
        self.state = SamplerState(epoch=self.state.epoch + 1, consumed=0)

    def state_dict(self) -> dict:
        return {
            "epoch": self.state.epoch,
            "consumed": self.state.consumed,
            "seed": self.seed,
            "num_samples": self.num_samples,
        }

    def load_state_dict(self, sd: dict) -> None:
        if sd["num_samples"] != self.num_samples or sd["seed"] != self.seed:
            raise ConfigError(
                "--resume_from_checkpoint: the data order differs from the "
                f"checkpoint's ({self.num_samples} samples, seed {self.seed} vs "
                f"{sd['num_samples']}, {sd['seed']})"
            )
        self.state = SamplerState(epoch=sd["epoch"], consumed=sd["consumed"])


class TrainData:
    """Hands the trainer one optimizer step's micro-batches at a time.

    The step after the one handed out is prepared one step ahead: with ``prefetch`` fetched and
    collated on a background thread (pinned on GPUs) while the trainer computes, without it inline
    (a CPU device, whose cores the thread would only take from training); either way its label
    tokens are known at the next boundary. The sampler's state only advances when a step is handed
    out, so a checkpoint never records a prepared step as consumed. A failure while preparing is
    raised by the ``next_step`` (or reported by the ``ready``) that would have returned it.
    """

    def __init__(
        self,
        dataset,
        sampler: ResumableSampler,
        micro_batch: int,
        grad_accum: int,
        pad_id: int,
        prefetch: bool = True,
        pin_memory: bool = False,
        flatten: bool = False,
        sequence: tuple[int, int] | None = None,
        collate_fn: Callable[[list[dict]], dict] | None = None,
        count: Callable[[dict], int] = label_tokens,
        lengths: np.ndarray | None = None,
    ):
        self.dataset, self.sampler = dataset, sampler
        # every row's tokens (balance.token_lengths): each micro-step's rows dealt to the ranks by
        # length (balance.py); None: round-robin
        self.lengths = lengths
        # rows → a micro-batch (a preference objective's pairs: data/preference.collate_pairs),
        # and what the step-boundary all-reduce sums of one (the loss's token count, loss.py)
        self.collate_fn = collate_fn or (lambda rows: collate(rows, pad_id, flatten))
        self.count = count
        self.flatten = flatten  # packed micro-batches as one row (flash-attention's varlen path)
        # --sequence_parallel_size: (N, this rank's shard); each micro-batch cut to its shard
        self.sequence = sequence
        self.micro_batch, self.grad_accum, self.pad_id = micro_batch, grad_accum, pad_id
        self.pin_memory = pin_memory
        # A --dataset_mixture's sources (MixtureSampler); the step's tokens per source, as it
        # was handed out (None without a mixture).
        self.source_names: list[str] = list(getattr(sampler, "names", ()))
        self.source_tokens: list[int] | None = None
        self.steps_per_epoch = sampler.samples_per_rank() // (micro_batch * grad_accum)
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"--per_device_train_batch_size: {len(dataset)} training examples are "
                f"fewer than one step needs ({micro_batch} × {grad_accum} "
                f"accumulation × {sampler.world_size} ranks)"
            )
        # Pinning allocates through the thread's current CUDA device:
        # make it this rank's, not GPU 0.
        init = (
            (lambda d=torch.cuda.current_device(): torch.cuda.set_device(d)) if pin_memory else None
        )
        self._pool = (
            ThreadPoolExecutor(1, "finetune-prefetch", initializer=init) if prefetch else None
        )
        # (the state it starts from, its result)
        self._ahead: tuple[SamplerState, Future] | None = None

    def _plan(self, state: SamplerState) -> tuple[SamplerState, list[list[int]]]:
        """The state after the step from ``state``, and this rank's rows of each of its
        micro-batches."""
        per_rank = self.micro_batch * self.grad_accum
        after, rows = self.sampler.plan_step(state, per_rank)
        if rows is None:  # not a full step left: the epoch rolls
            after, rows = self.sampler.plan_step(SamplerState(state.epoch + 1, 0), per_rank)
        ranks, rank = self.sampler.world_size, self.sampler.rank
        if self.lengths is None or ranks == 1:
            mine = rows[rank::ranks].tolist()
            return after, [
                mine[i : i + self.micro_batch] for i in range(0, per_rank, self.micro_batch)
            ]
        # micro-batch i of every rank: the step's i-th micro_batch × ranks rows
        size = self.micro_batch * ranks
        return after, [
            deal(rows[i : i + size], self.lengths, ranks, rank) for i in range(0, len(rows), size)
        ]

    def _prepare(self, state: SamplerState) -> tuple[SamplerState, list[dict], list[int] | None]:
        after, micro = self._plan(state)
        if after.epoch == 0:
            _injected_failure(self.sampler.rank, after.consumed // self.rows_per_step)
        idx = [i for m in micro for i in m]
        rows = self._rows(idx)
        by_source = self.sampler.tokens_by_source(idx, rows) if self.source_names else None
        if by_source is not None and self.sequence is not None and self.sequence[1] != 0:
            by_source = [0] * len(by_source)  # a group's rows: counted by its first rank only
        bounds = [0, *itertools.accumulate(len(m) for m in micro)]
        batches = [self.collate_fn(rows[a:b]) for a, b in itertools.pairwise(bounds)]
        if self.sequence is not None:
            batches = [shard(b, *self.sequence, self.pad_id) for b in batches]
        if self.pin_memory:
            batches = [{k: v.pin_memory() for k, v in b.items()} for b in batches]
        return after, batches, by_source

    def _rows(self, idx: list[int]) -> list[dict]:
        # datasets: one Arrow take for all rows
        getitems = getattr(self.dataset, "__getitems__", None)
        return getitems(idx) if getitems is not None else [self.dataset[i] for i in idx]

    def _submit(self, state: SamplerState) -> None:
        if self._pool is not None:
            self._ahead = (state, self._pool.submit(self._prepare, state))
            return
        # No prefetch thread: prepared now, in this thread (its failure kept for ``ready``)
        done: Future = Future()
        try:
            done.set_result(self._prepare(state))
        except Exception as e:  # noqa: BLE001 — agreed at the boundary, like a prefetch's
            done.set_exception(e)
        self._ahead = (state, done)

    def start(self) -> None:
        """Begin preparing the step at the sampler's current state (after any resume)."""
        self._submit(self.sampler.state)

    def ready(self) -> BaseException | None:
        """Wait for the prefetched step; its error (not raised), or None. For agreeing on it."""
        if self._ahead is None or self._ahead[0] != self.sampler.state:
            return None
        return self._ahead[1].exception()

    def ahead_label_tokens(self) -> int | None:
        """The label tokens of the step prefetched from the current state (what ``next_step``
        will return), counted on the host; None when none is, or its preparation failed."""
        if self._ahead is None or self._ahead[0] != self.sampler.state:
            return None
        future = self._ahead[1]
        if not future.done() or future.exception() is not None:
            return None
        return sum(self.count(b) for b in future.result()[1])

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        state, ahead = self.sampler.state, self._ahead
        self._ahead = None
        # A prefetch from another state (the sampler was reloaded for a resume) is dropped.
        after, batches, self.source_tokens = (
            ahead[1].result() if ahead is not None and ahead[0] == state else self._prepare(state)
        )
        self.sampler.state = after
        self._submit(after)
        return batches

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    @property
    def rows_per_step(self) -> int:
        """The rows (pairs) a step trains, over all data-parallel ranks: a rank's own vary when
        they are dealt by length, and a sequence-parallel group's ranks share theirs."""
        return self.micro_batch * self.grad_accum * self.sampler.world_size

    @property
    def epoch_float(self) -> float:
        """Epochs consumed. A step DeepSpeed skipped consumed its batches too, and the trainer
        counts applied steps only, so a --num_train_epochs run with skips ends a few steps into
        the next epoch (which simply continues the next epoch's order)."""
        st = self.sampler.state
        if self.source_names:  # a mixture: one endless stream; an epoch is all its sources' rows
            return st.position / self.sampler.num_samples
        per_epoch = (
            self.steps_per_epoch * self.micro_batch * self.grad_accum * self.sampler.world_size
        )
        return st.epoch + min(st.consumed / per_epoch, 1.0)


def _injected_failure(rank: int, step: int) -> None:
    """Test seam: ``FINETUNE_FAIL_BATCH=R:K`` fails rank R preparing optimizer step K
    of the first epoch."""
    if seams.value(seams.FAIL_BATCH) == f"{rank}:{step}":
        raise OSError(errno.EIO, f"injected by {seams.FAIL_BATCH} while preparing a batch")


def eval_batches(
    dataset,
    batch_size: int,
    world_size: int,
    rank: int,
    pad_id: int,
    pin_memory: bool = False,
    flatten: bool = False,
    collate_fn: Callable[[list[dict]], dict] | None = None,
) -> Iterator[tuple[dict, bool]]:
    """This rank's eval batches and whether each is real; pinned with ``pin_memory`` (GPUs), so
    the copy to the device is asynchronous, like the training batches'.

    Every rank yields the same number of batches — under ZeRO-3 each forward all-gathers, so a
    rank with fewer batches would leave the others waiting. Filler batches repeat row 0 and
    must be given zero weight.
    """
    n_batches = math.ceil(math.ceil(len(dataset) / world_size) / batch_size)
    for b in range(n_batches):
        idx = list(range(rank, len(dataset), world_size)[b * batch_size : (b + 1) * batch_size])
        real = bool(idx)
        rows = [dataset[i] for i in (idx or [0])]
        batch = collate_fn(rows) if collate_fn is not None else collate(rows, pad_id, flatten)
        yield ({k: v.pin_memory() for k, v in batch.items()} if pin_memory else batch), real
