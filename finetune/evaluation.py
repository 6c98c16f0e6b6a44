"""Evaluation: the eval set's loss and metrics, over the whole set, every rank the same batches.

Next-token objectives: the token-weighted loss (every label token of the set counts once, however
the batches split it), its perplexity and the tokens. A preference objective: the pairs' mean loss
(ORPO adds its NLL per token) and TRL's metrics with the eval_ prefix (objectives.py). Sums stay on
the device and are read once, in one all-reduce: no host sync per batch.
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
    def tokens(self, evalset) -> dict[str, float]:
        """eval_loss (token-weighted), eval_perplexity, eval_tokens. Collective."""
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
        total, count = dist.all_reduce_sum([float(loss_sum), n_tokens])
        eval_loss = total / max(count, 1)
        return {
            "eval_loss": eval_loss,
            "eval_perplexity": math.exp(min(eval_loss, 50.0)),
            "eval_tokens": int(count),
        }

    @torch.no_grad()
    def pairs(
        self,
        evalset,
        objective: Objective,
        score: Callable[[dict, None], tuple[torch.Tensor, torch.Tensor]],
    ) -> dict[str, float]:
        """eval_loss (the pairs' mean), eval_pairs and the objective's eval_ metrics; ``score``
        is the trainer's loss of a micro-batch of pairs (on the device). Collective."""
        sums = torch.zeros(len(STATS), dtype=torch.float64, device=self.engine.device)
        for batch, real in self._batches(evalset, collate_fn=self.data.collate_fn):
            batch, _, _ = model_inputs(batch)
            _, stats = score(to_device(batch, self.engine.device), None)
            if real:
                sums += stats
        totals = dist.all_reduce_sum(sums.tolist())
        return {
            "eval_loss": objective.eval_loss(totals),
            "eval_pairs": int(totals[0]),
            **objective.metrics(totals, prefix="eval_"),
        }


def describe(row: dict) -> str:
    """An eval row in the log: its loss, and its perplexity or reward accuracy."""
    text = f"eval_loss {row['eval_loss']:.4f}"
    if "eval_perplexity" in row:
        return f"{text} (perplexity {row['eval_perplexity']:.2f})"
    return f"{text}, eval_rewards/accuracies {row['eval_rewards/accuracies']:.3f}"
