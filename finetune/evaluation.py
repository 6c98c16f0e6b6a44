"""Evaluation: the eval set's loss and metrics, over the whole set, every rank the same batches.

Next-token objectives: the token-weighted loss (every label token of the set counts once, however
the batches split it), its perplexity and the tokens. A preference objective: the pairs' mean loss
(ORPO adds its NLL per token) and TRL's metrics with the eval_ prefix (objectives.py). Sums stay on
the device and are read once per set, in one all-reduce: no host sync per batch. Named sets
(--eval_datasets) are each summed alone (metrics eval_<name>_...) and all together (eval_...).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from finetune import distributed as dist
from finetune.data import eval_batches, model_inputs, to_device
from finetune.data.formats import label_tokens
from finetune.loss import sum_dtype
from finetune.objectives import STATS, Objective

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

    from finetune.data import TrainData


@dataclass
class Evaluation:
    engine: DeepSpeedEngine
    batch_size: int
    pad_id: int
    data: TrainData  # how the training data is collated (pinned, flattened, pairs)

    def _batches(self, evalset, **collation):
        yield from eval_batches(
            evalset,
            self.batch_size,
            dist.world_size(),
            dist.rank(),
            self.pad_id,
            pin_memory=self.data.pin_memory,
            **collation,
        )

    @torch.no_grad()
    def token_sums(self, evalset) -> list[float]:
        """[loss summed over every label token, label tokens] over the set and the ranks."""
        device = self.engine.device
        loss_sum = torch.zeros((), dtype=sum_dtype(device), device=device)
        n_tokens = 0
        for batch, real in self._batches(evalset, flatten=self.data.flatten):
            batch, _, _ = model_inputs(batch)
            n = label_tokens(batch)  # on the host copy: no device sync
            out = self.engine(**to_device(batch, device))
            if real:
                loss_sum += out.loss.detach().double() * n
                n_tokens += n
        return dist.all_reduce_sum([float(loss_sum), n_tokens])

    @torch.no_grad()
    def pair_sums(
        self, evalset, score: Callable[[dict, None], tuple[torch.Tensor, torch.Tensor]]
    ) -> list[float]:
        """The objective's STATS over the set's pairs and the ranks; ``score`` is the trainer's
        loss of a micro-batch of pairs (on the device)."""
        sums = torch.zeros(len(STATS), dtype=torch.float64, device=self.engine.device)
        for batch, real in self._batches(evalset, collate_fn=self.data.collate_fn):
            batch, _, _ = model_inputs(batch)
            _, stats = score(to_device(batch, self.engine.device), None)
            if real:
                sums += stats
        return dist.all_reduce_sum(sums.tolist())


def token_metrics(sums: list[float], prefix: str = "eval_") -> dict[str, float]:
    """{prefix}loss (token-weighted), {prefix}perplexity, {prefix}tokens from ``token_sums``."""
    total, count = sums
    loss = total / max(count, 1)
    return {
        f"{prefix}loss": loss,
        f"{prefix}perplexity": math.exp(min(loss, 50.0)),
        f"{prefix}tokens": int(count),
    }


def pair_metrics(objective: Objective, sums: list[float], prefix: str = "eval_") -> dict:
    """{prefix}loss (the pairs' mean), {prefix}pairs and the objective's metrics."""
    return {
        f"{prefix}loss": objective.eval_loss(sums),
        f"{prefix}pairs": int(sums[0]),
        **objective.metrics(sums, prefix=prefix),
    }


def describe(row: dict) -> str:
    """An eval row in the log: its loss, and its perplexity or reward accuracy."""
    text = f"eval_loss {row['eval_loss']:.4f}"
    if "eval_perplexity" in row:
        return f"{text} (perplexity {row['eval_perplexity']:.2f})"
    return f"{text}, eval_rewards/accuracies {row['eval_rewards/accuracies']:.3f}"
