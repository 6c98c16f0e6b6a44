"""The best checkpoint and early stopping: one metric of the evaluation, compared as HF does.

``BestPolicy`` is --metric_for_best_model / --greater_is_better / --early_stopping_patience /
--early_stopping_threshold, resolved. Two things follow from it, both pure functions here:

  early stopping  after each evaluation (``record``) the training state counts the evaluations in
                  a row that did not beat the best so far by more than the threshold (HF's
                  EarlyStoppingCallback); the first evaluation (step 0) is the baseline. The
                  counters are part of TrainingState, so a resumed run stops where an
                  uninterrupted one does.
  best checkpoint each commit's manifest records the evaluation of its step (``eval``: the whole
                  metrics row, captured when the save was taken, so an --async_save committed
                  steps later still carries its own) and the best checkpoint of the line so far,
                  itself included (``best``: tag, metric, value). The run knows it from its
                  Lineage (read once at start, then extended per commit), never by reading
                  manifests per save; retention keeps it besides the --save_total_limit newest,
                  here and in the bucket (the newest remote manifest names it). A checkpoint of a
                  step without an evaluation has no metric and is never the best.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from finetune.config import DEFAULT_METRIC, ConfigError, metric_name

EVAL_KEY, BEST_KEY = "eval", "best"  # the manifest's fields


def lower_is_better(metric: str) -> bool:
    """HF's default for --greater_is_better: False for losses; perplexity is a loss too."""
    return metric.endswith("loss") or metric.endswith("perplexity")


@dataclass(frozen=True)
class BestPolicy:
    metric: str = DEFAULT_METRIC
    greater_is_better: bool = False
    patience: int | None = None  # None: no early stopping
    threshold: float = 0.0

    @classmethod
    def from_args(cls, train: Any) -> BestPolicy:
        """From TrainArgs (checked by ``TrainArgs.check``)."""
        metric = metric_name(train.metric_for_best_model)
        greater = train.greater_is_better
        return cls(
            metric,
            (not lower_is_better(metric)) if greater is None else bool(greater),
            train.early_stopping_patience,
            float(train.early_stopping_threshold or 0.0),
        )

    def value(self, row: Mapping | None) -> float | None:
        """The metric of an eval row; None when the row lacks it or it is not finite."""
        v = (row or {}).get(self.metric)
        return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None

    def better(self, value: float | None, best: float | None) -> bool:
        """Strictly better (what makes a new best checkpoint); anything beats no best."""
        if value is None:
            return False
        if best is None:
            return True
        return value > best if self.greater_is_better else value < best

    def improved(self, value: float | None, best: float | None) -> bool:
        """Better by more than the threshold (what resets early stopping's count)."""
        return self.better(value, best) and (best is None or abs(value - best) > self.threshold)


# --- early stopping: the training state's counters -------------------------------------------


def record(state: Any, policy: BestPolicy, row: Mapping) -> None:
    """After an evaluation: early stopping's count, then the best metric so far (TrainingState's
    best_metric, best_metric_step, evals_without_improvement). Every rank alike: the row is
    all-reduced."""
    value = policy.value(row)
    if state.best_metric is not None or value is None:
        if policy.improved(value, state.best_metric):
            state.evals_without_improvement = 0
        else:
            state.evals_without_improvement += 1
    if policy.better(value, state.best_metric):
        state.best_metric, state.best_metric_step = value, int(row["step"])


def exhausted(state: Any, policy: BestPolicy) -> bool:
    """Whether --early_stopping_patience evaluations in a row did not improve."""
    return policy.patience is not None and state.evals_without_improvement >= policy.patience


# --- the best checkpoint: manifest fields ------------------------------------------------------


def eval_at(row: Mapping | None, step: int) -> dict | None:
    """The eval row of ``step`` when the last evaluation was of that step, else None."""
    return dict(row) if row is not None and row.get("step") == step else None


def best_record(policy: BestPolicy, tag: str, value: float) -> dict:
    """A manifest's ``best`` field."""
    return {
        "tag": tag,
        "metric": policy.metric,
        "value": value,
        "greater_is_better": policy.greater_is_better,
    }


def best_of_line(policy: BestPolicy, evals: Iterable[tuple[str, Mapping | None]]) -> dict | None:
    """The best of a line's checkpoints (tag, eval row; oldest first) as a ``best`` record; an
    equal value later does not replace an earlier best (as HF)."""
    best = None
    for tag, row in evals:
        value = policy.value(row)
        if policy.better(value, best["value"] if best else None):
            best = best_record(policy, tag, value)
    return best


def after_commit(
    policy: BestPolicy, best: dict | None, tag: str, row: Mapping | None
) -> dict | None:
    """The best record once ``tag`` (evaluated as ``row``, or not) is committed."""
    value = policy.value(row)
    if best is not None and best.get("tag") == tag:  # a same-tag re-commit: its own eval decides
        best = None
    if policy.better(value, best["value"] if best else None):
        return best_record(policy, tag, value)
    return best


def named_best(manifests: Mapping[str, Mapping | None]) -> dict | None:
    """The best checkpoint that the newest commit (highest commit_seq) names, when that folder
    is among ``manifests`` (tag → manifest); None when no commit names one."""
    ordered = sorted(
        (m for m in manifests.values() if isinstance(m, Mapping) and _seq(m) is not None),
        key=_seq,
        reverse=True,
    )
    for manifest in ordered:
        best = manifest.get(BEST_KEY)
        if isinstance(best, Mapping) and isinstance(best.get("tag"), str):
            return dict(best) if best["tag"] in manifests else None
    return None


def _seq(manifest: Mapping) -> int | None:
    seq = manifest.get("commit_seq")
    return seq if isinstance(seq, int) else None


def protected(best: dict | None) -> str | None:
    return best.get("tag") if isinstance(best, Mapping) else None


# --- which flag asks for the best metric ------------------------------------------------------


def explicit(v: Any) -> str | None:
    """How errors name the flag that asks for the best metric explicitly, or None (flag values:
    a mapping, or TrainArgs)."""
    get = v.get if isinstance(v, Mapping) else lambda k: getattr(v, k)
    if get("early_stopping_patience") is not None:
        return "--early_stopping_patience"
    return "--metric_for_best_model" if get("metric_for_best_model") is not None else None


def require_evaluation(train: Any, evalset: Any) -> None:
    """After the data loaded (a hub dataset's validation split is known only then): early
    stopping or an explicit metric without an eval set is bad input. Raised alike on every rank
    (every rank holds the same eval set)."""
    named = explicit(train)
    if named and (evalset is None or len(evalset) == 0):
        raise ConfigError(
            f"`{named}` needs an evaluation, and the data has no eval set: give "
            "`--validation_file` or a `--validation_split_percentage` above 0"
        )
