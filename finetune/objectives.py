"""The preference objectives' losses and metrics: DPO, IPO, SimPO and ORPO as TRL 1.16.0 defines
them (DPOTrainer loss_type sigmoid and ipo, CPOTrainer loss_type simpo with cpo_alpha 0,
ORPOTrainer), on one forward of a micro-batch's pairs (chosen rows, then rejected rows).

A completion's log-probability is the sum of its tokens' (dpo, ipo: IPO then divides each log-ratio
by the completion's length, TRL's length normalisation) or their mean (simpo, orpo, TRL's
``average_log_prob``). A step's preference loss is the mean over the step's pairs across
micro-batches and ranks: every micro-batch holds the same number of pairs, so its mean over its
own pairs, averaged by DeepSpeed over micro-batches and ranks, is that mean with no count to share.
ORPO's NLL term (over the chosen rows' prompt and completion, as TRL's) stays token-weighted like
SFT's loss: its sum over the micro-batch / ``items``, the step's NLL tokens per micro-batch and
rank (loss.py).

The metrics are TRL's names, summed per micro-batch (``STATS``) and divided once per logged row by
the window's pairs (NLL by its tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from finetune.data.formats import IGNORE

# What a micro-batch adds to the log window, in this order: the pairs, then the sums of the
# per-pair metrics over them, then ORPO's NLL sum and its tokens (zero for the others).
PAIR_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
ORPO_METRICS = ("log_odds_ratio", "log_odds_chosen")
STATS = ("pairs", "pair_loss", *PAIR_METRICS, *ORPO_METRICS, "nll_sum", "nll_tokens")


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation (TRL's ORPO)."""
    t = -math.log(2.0)
    return torch.where(x < t, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's next-token log-probabilities of its labels (shifted; IGNORE scores 0) and which
    positions count: ``(logps, mask)``, both (rows, width - 1). In float32, one row at a time (a
    row's log-softmax, not the whole batch's, is held at once)."""
    targets = labels[:, 1:]
    mask = targets != IGNORE
    index = targets.clamp(min=0)
    rows = []
    for row_logits, row_index in zip(logits[:, :-1], index, strict=True):
        row_logits = row_logits.float()
        picked = row_logits.gather(-1, row_index.unsqueeze(-1)).squeeze(-1)
        rows.append(picked - torch.logsumexp(row_logits, dim=-1))
    return torch.stack(rows) * mask, mask


@dataclass(frozen=True)
class Objective:
    """A preference objective (--objective) with its flags."""

    name: str  # dpo, ipo, simpo or orpo
    beta: float
    simpo_gamma: float | None = None

    @property
    def needs_reference(self) -> bool:
        return self.name in ("dpo", "ipo")

    @property
    def averages(self) -> bool:
        """A completion's log-probability is its tokens' mean (simpo, orpo), not their sum."""
        return self.name in ("simpo", "orpo")

    @property
    def metric_names(self) -> tuple[str, ...]:
        names = PAIR_METRICS + (ORPO_METRICS + ("nll_loss",) if self.name == "orpo" else ())
        return names

    def nll_tokens(self, batch: dict) -> int:
        """The tokens ORPO's NLL term is a mean over in this micro-batch (the chosen rows' real
        tokens after the first; 0 for the others): what the step-boundary all-reduce sums for
        ``items``. On the host copy."""
        if self.name != "orpo":
            return 0
        pairs = batch["input_ids"].shape[0] // 2
        return int(batch["attention_mask"][:pairs, 1:].sum())

    def sequence_logps(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        """Each row's completion log-probability: summed, or averaged over its scored tokens."""
        logps, mask = token_logps(logits, batch["labels"])
        sums = logps.sum(-1)
        return sums / mask.sum(-1) if self.averages else sums

    def loss(
        self,
        logits: torch.Tensor,
        batch: dict,
        reference: tuple[torch.Tensor, torch.Tensor] | None,
        items: torch.Tensor | float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch's loss and its STATS (a float64 vector, detached). ``reference``: the
        reference model's (chosen, rejected) sums, for dpo and ipo; ``items``: ORPO's NLL tokens
        per micro-batch and rank (None: this micro-batch's own, as in evaluation)."""
        pairs = logits.shape[0] // 2
        logps = self.sequence_logps(logits, batch)
        chosen, rejected = logps[:pairs], logps[pairs:]
        zero = chosen.new_zeros(())
        nll_sum, nll_tokens, extra = zero, zero, [zero, zero]
        # what the rewards are beta times: the log-ratios to the reference, or the log-probs
        chosen_scores, rejected_scores = chosen, rejected
        if self.needs_reference:
            if reference is None:
                raise ValueError(f"{self.name} needs the reference model's log-probabilities")
            ref_chosen, ref_rejected = (r.to(chosen) for r in reference)
            chosen_scores, rejected_scores = chosen - ref_chosen, rejected - ref_rejected
            if self.name == "dpo":
                losses = -F.logsigmoid(self.beta * (chosen_scores - rejected_scores))
            else:  # ipo: each log-ratio per completion token, TRL's normalisation
                lengths = _completion_lengths(batch["labels"])
                delta = chosen_scores / lengths[:pairs] - rejected_scores / lengths[pairs:]
                losses = (delta - 1 / (2 * self.beta)) ** 2
            total = losses.mean()
        elif self.name == "simpo":
            margin = chosen - rejected - self.simpo_gamma / self.beta
            losses = -F.logsigmoid(self.beta * margin)
            total = losses.mean()
        else:  # orpo
            log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
            ratio = F.logsigmoid(log_odds)
            losses = -self.beta * ratio
            nll_sum, nll_tokens = self._nll_sum(logits[:pairs], batch, pairs)
            # on the device: no host sync per micro-batch (a kept pair's chosen row has a token)
            nll = nll_sum / (nll_tokens.clamp(min=1) if items is None else items)
            total = nll + losses.mean()
            extra = [ratio.detach().sum(), log_odds.detach().sum()]
        chosen_rewards = self.beta * chosen_scores.detach()
        rejected_rewards = self.beta * rejected_scores.detach()
        stats = torch.stack(
            [
                chosen.new_tensor(float(pairs)),
                losses.detach().sum(),
                chosen_rewards.sum(),
                rejected_rewards.sum(),
                (chosen_rewards > rejected_rewards).float().sum(),
                (chosen_rewards - rejected_rewards).sum(),
                chosen.detach().sum(),
                rejected.detach().sum(),
                *extra,
                nll_sum.detach(),
                nll_tokens.to(chosen.dtype),
            ]
        ).double()
        return total, stats

    def _nll_sum(
        self, logits: torch.Tensor, batch: dict, pairs: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ORPO's NLL over the chosen rows' prompt and completion (every real token: TRL's
        labels are the input ids where the attention mask is 1): its sum and its tokens."""
        ids, mask = batch["input_ids"][:pairs], batch["attention_mask"][:pairs]
        labels = ids.masked_fill(mask == 0, IGNORE)
        logps, scored = token_logps(logits, labels)
        return -logps.sum(), scored.sum()

    def eval_loss(self, sums: list[float]) -> float:
        """An evaluation's loss from its STATS: the pairs' mean (and ORPO's NLL per token)."""
        by = dict(zip(STATS, sums, strict=True))
        loss = by["pair_loss"] / max(by["pairs"], 1.0)
        return loss + (by["nll_sum"] / max(by["nll_tokens"], 1.0) if self.name == "orpo" else 0.0)

    def metrics(self, sums: list[float], prefix: str = "") -> dict[str, float]:
        """A row's metrics from STATS summed over a window (or an evaluation) and the ranks."""
        by = dict(zip(STATS, sums, strict=True))
        pairs = max(by["pairs"], 1.0)
        row = {f"{prefix}{name}": by[name] / pairs for name in PAIR_METRICS}
        if self.name == "orpo":
            row |= {f"{prefix}{name}": by[name] / pairs for name in ORPO_METRICS}
            row[f"{prefix}nll_loss"] = by["nll_sum"] / max(by["nll_tokens"], 1.0)
        return row


def _completion_lengths(labels: torch.Tensor) -> torch.Tensor:
    """Each row's completion tokens (TRL's completion mask, unshifted), at least 1."""
    return (labels != IGNORE).sum(-1).clamp(min=1).to(torch.float32)


def from_config(preference) -> Objective | None:
    """The run's preference objective (PreferenceArgs), or None for sft."""
    if preference.objective in (None, "sft"):
        return None
    return Objective(preference.objective, float(preference.beta), preference.simpo_gamma)
