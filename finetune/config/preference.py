"""The objective's flags (``PreferenceArgs``): next-token SFT or a preference objective (DPO and
its cousins), its strength, and where a reference model's log-probabilities come from; and their
checks, on the values alone (the rules that read the data or model flags are flag_checks')."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from finetune.config.fields import ConfigError, flag

SFT = "sft"
OBJECTIVES = (SFT, "dpo", "ipo", "simpo", "orpo")
# The objectives that compare the policy with a reference model, and those that need none.
NEEDS_REFERENCE = ("dpo", "ipo")
REFERENCE_FREE = ("simpo", "orpo")
REFERENCES = ("precompute", "live", "none")
# What each preference objective's flags default to (TRL's DPOConfig, CPOConfig, ORPOConfig).
DEFAULT_BETA = 0.1
DEFAULT_SIMPO_GAMMA = 0.5


def is_preference(objective: str | None) -> bool:
    return objective not in (None, SFT)


@dataclass(frozen=True)
class PreferenceArgs:
    objective: str = flag(
        SFT,
        "What the model is trained to do. sft: predict the next token of the data. dpo, ipo, "
        "simpo, orpo: prefer each example's chosen completion over its rejected one (TRL's "
        "DPOTrainer loss_type sigmoid and ipo, CPOTrainer's simpo with cpo_alpha 0, "
        "ORPOTrainer); the data then has prompt/chosen/rejected columns. See docs/PREFERENCE.md.",
        choices=OBJECTIVES,
    )
    beta: float | None = flag(
        None,
        "The preference objective's strength, as TRL's beta: DPO's and SimPO's inverse "
        "temperature, IPO's regularization (the target margin is 1 / (2 beta)), ORPO's weight "
        "of the odds-ratio term (its lambda) (default 0.1).",
    )
    simpo_gamma: float | None = flag(
        None, "SimPO's target reward margin, as TRL's simpo_gamma (default 0.5; simpo only)."
    )
    reference: str | None = flag(
        None,
        "Where dpo and ipo get the reference model's log-probabilities. precompute (their "
        "default): one pass over the data with the initial weights before training, kept in the "
        "tokenized-data cache and recomputed from --model_name_or_path when the cache is gone; "
        "live: a frozen ZeRO-3-partitioned copy of the initial model (with --use_peft, the "
        "base model with the adapters off: no copy); none: what simpo and orpo use, and the "
        "only value they take. A resume must keep it.",
        choices=REFERENCES,
    )

    @classmethod
    def check(cls, v: Mapping[str, Any]) -> None:
        """The objective's flags alone: each failure names its flag."""
        objective = v["objective"]
        if not is_preference(objective):
            given = [name for name in ("beta", "simpo_gamma", "reference") if v[name] is not None]
            if given:
                raise ConfigError(
                    f"`--{given[0]}` needs a preference `--objective` "
                    f"({', '.join(OBJECTIVES[1:])}); the objective is sft"
                )
            return
        if v["beta"] is not None and not v["beta"] > 0:
            raise ConfigError(f"`--beta` must be positive, got {v['beta']}")
        if v["simpo_gamma"] is not None and objective != "simpo":
            raise ConfigError(
                f"`--simpo_gamma` is SimPO's: it needs `--objective simpo`, not {objective}"
            )
        reference = v["reference"]
        if objective in REFERENCE_FREE and reference not in (None, "none"):
            raise ConfigError(
                f"`--objective {objective}` uses no reference model: `--reference` must be none "
                f"(got {reference})"
            )
        if objective in NEEDS_REFERENCE and reference == "none":
            raise ConfigError(
                f"`--objective {objective}` compares the model with a reference: `--reference "
                "none` cannot give one (use precompute or live, or --objective simpo or orpo)"
            )


def preference_values(v: Mapping[str, Any]) -> dict[str, Any]:
    """The objective's unset flags filled: beta, SimPO's gamma and the reference, by objective."""
    objective = v["objective"]
    if not is_preference(objective):
        return {}
    return {
        "beta": DEFAULT_BETA if v["beta"] is None else v["beta"],
        "simpo_gamma": (
            (DEFAULT_SIMPO_GAMMA if v["simpo_gamma"] is None else v["simpo_gamma"])
            if objective == "simpo"
            else None
        ),
        "reference": v["reference"] or ("precompute" if objective in NEEDS_REFERENCE else "none"),
    }
