"""A weighted mixture's training order, and its sources tokenized and cached one by one.

The order is a stream of global sample positions p = 0, 1, 2, ... Position p's source comes from
its chunk of ``CHUNK`` positions, drawn at once with ``torch.multinomial`` (the normalized weights,
with replacement) from a generator seeded by (seed, chunk); the row within the source is the
source's k-th draw (k counts the source's earlier positions): row ``perm(seed, source,
k // n)[k % n]`` of a permutation of its n rows drawn for each of its own epochs. So a source that
runs out starts its next epoch in a new order while the others go on (``interleave_datasets``'
``all_exhausted``), and everything is a function of the seed.

The state is (position, each source's draw count at that position): O(sources), and it means the
same at any world size. Each step deals the global slice [p, p + batch × world) round-robin to the
ranks, as ResumableSampler does, so a resume on another world size continues the same global
order. Per step the work is O(global batch): the chunk's draw is amortized over its positions and a
source's permutation over its epoch (as ResumableSampler's, once per epoch).

An epoch of a mixture (--num_train_epochs, the "epoch" of metrics rows) is as many samples as all
its sources hold together, whatever their weights.
"""

from __future__ import annotations

import bisect
import hashlib
import logging
from dataclasses import dataclass, replace

import torch

from finetune import distributed as dist
from finetune.config import ConfigError, RunConfig
from finetune.data.cache import prepare
from finetune.data.formats import row_tokens, token_columns
from finetune.data.mixture import FLAG, Source, probabilities, sources

CHUNK = 4096  # positions whose sources one generator call draws


@dataclass(frozen=True)
class MixtureState:
    position: int = 0  # global samples consumed, summed over ranks
    draws: tuple[int, ...] = ()  # per source: how many of those positions it supplied
    epoch_len: int = 1  # samples per epoch (all sources' rows): for `epoch` and `consumed`

    # What TrainData and the resume log read from a sampler state.
    @property
    def epoch(self) -> int:
        return self.position // self.epoch_len

    @property
    def consumed(self) -> int:
        return self.position % self.epoch_len


def _seed(*parts) -> int:
    """A generator seed from the parts (stable across runs and machines, unlike hash())."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # manual_seed takes < 2**63 here


class MixtureSampler:
    """The ResumableSampler interface (plan, samples_per_rank, state, state_dict) over the
    concatenation of the sources' rows (source s's rows start at ``offsets[s]``)."""

    def __init__(
        self,
        sizes: list[int],
        weights: list[float],
        world_size: int,
        rank: int,
        seed: int,
        names: list[str] | None = None,
    ):
        if any(n <= 0 for n in sizes):
            raise ValueError(f"every source needs rows, got sizes {sizes}")
        self.sizes, self.weights = list(sizes), list(weights)
        self.names = list(names) if names else [str(i) for i in range(len(sizes))]
        self.world_size, self.rank, self.seed = world_size, rank, seed
        self.probs = torch.tensor(probabilities(self.weights), dtype=torch.float64)
        self.offsets = [0]
        for n in self.sizes:
            self.offsets.append(self.offsets[-1] + n)
        self.num_samples = self.offsets[-1]
        self.state = MixtureState(0, (0,) * len(sizes), self.num_samples)
        self._chunks: dict[int, torch.Tensor] = {}
        self._perms: dict[tuple[int, int], torch.Tensor] = {}

    # --- the order --------------------------------------------------------------------------

    def _chunk(self, c: int) -> torch.Tensor:
        chunk = self._chunks.get(c)
        if chunk is None:
            g = torch.Generator().manual_seed(_seed(self.seed, "positions", c))
            chunk = torch.multinomial(self.probs, CHUNK, replacement=True, generator=g)
            # the chunks a step or two spans (a dropped prefetch may plan from an older state)
            self._chunks = {k: v for k, v in self._chunks.items() if c - 2 <= k <= c + 2}
            self._chunks[c] = chunk
        return chunk

    def sources_at(self, start: int, end: int) -> torch.Tensor:
        """The source of each global position in [start, end)."""
        parts, c = [], start // CHUNK
        while c * CHUNK < end:
            lo, hi = max(start - c * CHUNK, 0), min(end - c * CHUNK, CHUNK)
            parts.append(self._chunk(c)[lo:hi])
            c += 1
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def permutation(self, s: int, epoch: int) -> torch.Tensor:
        """Source ``s``'s row order in its own epoch ``epoch``."""
        key = (s, epoch)
        perm = self._perms.get(key)
        if perm is None:
            g = torch.Generator().manual_seed(_seed(self.seed, "source", self.names[s], epoch))
            perm = torch.randperm(self.sizes[s], generator=g)
            if self.sizes[s] < 2**31:
                perm = perm.to(torch.int32)  # half the memory
            self._perms = {
                k: v for k, v in self._perms.items() if k[0] != s or abs(k[1] - epoch) <= 1
            }
            self._perms[key] = perm
        return perm

    def _rows(self, s: int, first: int, count: int) -> torch.Tensor:
        """Rows (global indices) of source ``s``'s draws first .. first + count - 1."""
        k = torch.arange(first, first + count, dtype=torch.long)
        n = self.sizes[s]
        epochs, within = k // n, k % n
        rows = torch.empty(count, dtype=torch.long)
        # one epoch, or two where the source runs out inside the step (more only when the step
        # draws more than its rows)
        for e in range(first // n, (first + count - 1) // n + 1):
            m = epochs == e
            rows[m] = self.permutation(s, e)[within[m]].long()
        return rows + self.offsets[s]

    def plan(self, state: MixtureState, per_rank: int) -> tuple[MixtureState, list[int]]:
        """The state after the next global step from ``state``, and this rank's rows of it, dealt
        round-robin."""
        after, rows = self.plan_step(state, per_rank)
        return after, rows[self.rank :: self.world_size].tolist()

    def plan_step(self, state: MixtureState, per_rank: int) -> tuple[MixtureState, torch.Tensor]:
        """The state after the next global step of ``per_rank`` × world samples from ``state``, and
        the step's rows (dataset indices). Pure apart from the caches; O(per_rank × world). Never
        None: the stream has no end (a source that runs out starts its next epoch)."""
        start, size = state.position, per_rank * self.world_size
        src = self.sources_at(start, start + size)
        rows = torch.empty(size, dtype=torch.long)
        draws = list(state.draws)
        for s in range(len(self.sizes)):
            where = (src == s).nonzero().flatten()
            if len(where):
                rows[where] = self._rows(s, draws[s], len(where))
                draws[s] += len(where)
        return MixtureState(start + size, tuple(draws), self.num_samples), rows

    def take(self, per_rank: int) -> list[int]:
        self.state, idx = self.plan(self.state, per_rank)
        return idx

    def samples_per_rank(self) -> int:
        """An epoch's share of each rank: an epoch is as many samples as the sources hold."""
        return self.num_samples // self.world_size

    def source_of(self, row: int) -> int:
        return bisect.bisect_right(self.offsets, row) - 1

    def tokens_by_source(self, idx: list[int], rows: list[dict]) -> list[int]:
        """Tokens of this rank's rows ``rows`` (at global indices ``idx``) per source, counted as
        the trainer's tokens_seen is (a row's tokens, padding not included)."""
        counts = [0] * len(self.sizes)
        for i, row in zip(idx, rows):
            counts[self.source_of(i)] += row_tokens(row)
        return counts

    # --- checkpoint -------------------------------------------------------------------------

    def state_dict(self) -> dict:
        st = self.state
        return {
            "position": st.position,
            "draws": list(st.draws),
            # what the resume log reports for any sampler
            "epoch": st.epoch,
            "consumed": st.consumed,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "sources": dict(zip(self.names, self.sizes)),
            "weights": dict(zip(self.names, self.weights)),
        }

    def load_state_dict(self, sd: dict) -> None:
        mine = self.state_dict()
        if "draws" not in sd:
            raise ConfigError(
                "--resume_from_checkpoint: the checkpoint was trained on one dataset, this run "
                "on a --dataset_mixture; resume it without the mixture"
            )
        for key in ("seed", "sources", "weights"):
            if sd.get(key) != mine[key]:
                raise ConfigError(
                    f"--resume_from_checkpoint: the mixture's data order differs from the "
                    f"checkpoint's ({key}: {mine[key]} vs {sd.get(key)})"
                )
        self.state = MixtureState(int(sd["position"]), tuple(sd["draws"]), self.num_samples)


# --- the sources' data ------------------------------------------------------------------------


def prepare_mixture(cfg: RunConfig, tokenizer, world_size: int, rank: int):
    """(train, eval or None, sampler): each source tokenized and cached as a single dataset would
    be (its own cache entry), the training sets concatenated (memory-mapped still) under a
    MixtureSampler, the eval sets concatenated. Collective."""
    import datasets

    mix = sources(cfg.data)
    trains, evals = [], []
    for i, source in enumerate(mix):
        # uses_embedded_data: a source is never the bundled data (the cache key's split seed)
        one = replace(cfg, data=source.args, uses_embedded_data=False)
        try:
            train, evalset = prepare(one, tokenizer)
        except ConfigError as e:  # raised alike on every rank (prepare agrees): name the entry
            raise ConfigError(f"{FLAG}[{i}] ({source.name}): {e}") from None
        trains.append(train)
        if evalset is not None and len(evalset):
            evals.append(evalset)
    sampler = MixtureSampler(
        [len(t) for t in trains],
        [s.weight for s in mix],
        world_size,
        rank,
        cfg.train.seed,
        [s.name for s in mix],
    )
    _log_sources(mix, trains)
    train = datasets.concatenate_datasets(trains) if len(trains) > 1 else trains[0]
    evalset = (
        (datasets.concatenate_datasets(evals) if len(evals) > 1 else evals[0]) if evals else None
    )
    return train, evalset, sampler


def token_count(ds) -> int:
    """Tokens in a tokenized set (``row_tokens`` of every row): from its Arrow list offsets,
    without reading the tokens."""
    return sum(n * _column_tokens(ds, name) for name, n in token_columns(ds.column_names).items())


def _column_tokens(ds, name: str) -> int:
    column = ds.data.column(name)
    if getattr(ds, "_indices", None) is None:
        return sum(int(c.offsets[-1].as_py()) - int(c.offsets[0].as_py()) for c in column.chunks)
    return sum(len(r) for r in ds[name])  # a selection: the rows themselves


def _log_sources(mix: list[Source], trains: list) -> None:
    shares = probabilities([s.weight for s in mix])
    for source, train, share in zip(mix, trains, shares):
        dist.log_main(
            logging.INFO,
            "mixture source %s (%s): %s rows, %s tokens; weight %g = %.1f%% of samples",
            source.name,
            source.described,
            f"{len(train):,}",
            f"{token_count(train):,}",
            source.weight,
            100 * share,
        )
