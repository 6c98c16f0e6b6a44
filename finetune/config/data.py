"""The data's flags (``DataArgs``): where the data comes from, its format's columns, lengths and
packing, the tokenized cache, a mixture of sources; and their checks, on the values alone (the
formats' own rules are the format registry's: data/formats.check_flags)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.config.fields import ConfigError, flag, require_positive

DATA_EXTENSIONS = {
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".txt": "text",
}
# The flags that name a single dataset's data, which a mixture's sources each name for themselves.
SINGLE_DATASET_FLAGS = ("train_file", "dataset_name", "dataset_config_name", "validation_file")
# Those a mixture cannot be given with (a --validation_file beside it is the run's eval set).
NOT_WITH_A_MIXTURE = ("train_file", "dataset_name", "dataset_config_name")


def data_format(path: str) -> str | None:
    """The `datasets` builder for a local data file, from its extension."""
    return DATA_EXTENSIONS.get(Path(path).suffix.lower())


@dataclass(frozen=True)
class DataArgs:
    dataset_name: str | None = flag(None, "Hub dataset id (loaded with datasets.load_dataset).")
    dataset_config_name: str | None = flag(None, "Hub dataset configuration name.")
    train_file: str | None = flag(
        None, "Local training file: .json, .jsonl, .csv, .parquet or .txt."
    )
    validation_file: str | None = flag(
        None,
        "Local validation file (same formats as --train_file); beside a --dataset_mixture, the "
        "run's held-out eval set (the sources' own validation splits are then not used).",
    )
    validation_dataset_name: str | None = flag(
        None,
        "Hub dataset id whose validation split is the run's eval set (the training data is then "
        "not split).",
    )
    eval_datasets: list | None = flag(
        None,
        "Several named eval sets, evaluated together at each --eval_steps: a list (a --config "
        "file's eval_datasets:, or JSON here), each with a unique name (letters, digits, _ . -), "
        "a validation_file or a dataset_name (its validation split; dataset_config_name), the "
        "format's column keys and its own max_eval_samples. Each is logged as eval_<name>_loss, "
        "beside eval_loss over all of them; the training data is then not split. See "
        "docs/MIXTURES.md.",
        json=list,
    )
    text_column: str = flag("text", "Column holding plain text.")
    prompt_column: str | None = flag(
        None, "Column holding prompts (loss masked); needs --completion_column."
    )
    completion_column: str | None = flag(None, "Column holding completions (trained on).")
    messages_column: str | None = flag(
        None, "Column holding chat messages, rendered with the tokenizer's chat template."
    )
    chosen_column: str | None = flag(
        None,
        "Column holding each example's preferred completion under a preference --objective: "
        "text, or a list of messages (then the prompt is the messages it shares with "
        "--rejected_column's, or a `prompt` column of messages) (default chosen).",
    )
    rejected_column: str | None = flag(
        None,
        "Column holding each example's dispreferred completion under a preference --objective "
        "(default rejected). The prompt is the `prompt` column (TRL's name), if there is one.",
    )
    max_seq_length: int | None = flag(
        None,
        "Truncate (or pack) sequences to this many tokens (default "
        "512; 128 for the embedded model).",
    )
    max_prompt_length: int | None = flag(
        None,
        "Under a preference --objective: prompts keep their last this many tokens; then "
        "prompt + completion keep their first --max_seq_length (default: no limit of its own). "
        "A pair left with no completion token, or whose completions are then equal, is dropped "
        "and counted.",
    )
    packing: bool = flag(
        False,
        "Pack examples into blocks of up to --max_seq_length tokens, so fewer tokens are "
        "padding. Examples stay whole and attend only to themselves (see --packing_strategy).",
    )
    packing_strategy: str = flag(
        "bfd",
        "How --packing builds blocks. bfd: whole examples placed by best-fit decreasing, "
        "position ids restarting at each example, no attention across examples and no loss on "
        "an example's first token from the previous one (an unpacked run's loss terms, exactly). "
        "concat: every example concatenated and cut into full blocks; examples "
        "attend to the ones before them and are cut across blocks: for continuation "
        "(pretraining-style) text only.",
        choices=("bfd", "concat"),
    )
    balance_by_length: bool = flag(
        True,
        "Deal each micro-step's rows to the data-parallel ranks by length: sorted longest first "
        "and cut so every rank computes about the same tokens, padding included (ranks with long "
        "rows get fewer), instead of round-robin, where the rank that drew a long row pads all "
        "its rows to it and the others wait. The step trains the same rows and its loss is the "
        "same up to the order of float sums. Preference pairs are dealt round-robin.",
        resume_may_change=True,
    )
    validation_split_percentage: int = flag(
        5,
        "Percent of the training data held out for eval when there is no validation split (not "
        "used with a held-out set: --validation_dataset_name, --eval_datasets, or "
        "--validation_file beside a --dataset_mixture).",
    )
    max_train_samples: int | None = flag(None, "Truncate the training set to this many examples.")
    max_eval_samples: int | None = flag(
        None,
        "Evaluate at most this many examples of an eval set: a fixed subset drawn with --seed "
        "(each --eval_datasets set may give its own).",
    )
    dataset_cache_dir: str | None = flag(
        None,
        "Where tokenized datasets are cached and reused by later runs "
        "(default: datasets' cache, $HF_DATASETS_CACHE).",
    )
    preprocessing_num_workers: int | None = flag(
        None,
        "Processes that tokenize a dataset not yet in the cache "
        "(default: the cores this process may use; 1 below 20,000 examples).",
    )
    dataset_mixture: list | None = flag(
        None,
        "Train on several sources sampled by weight instead of one --train_file/--dataset_name: "
        "a list (a --config file's dataset_mixture:, or JSON here) of sources, each with the "
        "keys one dataset takes (train_file or dataset_name, dataset_config_name, "
        "validation_file, the format's columns, validation_split_percentage, max_train_samples, "
        "max_eval_samples), a weight > 0 (normalized into sampling probabilities) and an "
        "optional unique name. A source that runs out starts its next epoch; an epoch of the "
        "mixture is as many samples as all sources hold. See docs/MIXTURES.md.",
        json=list,
    )

    @classmethod
    def check(cls, v: Mapping[str, Any]) -> None:
        """The data flags' own rules, on the flag values before any file is read (a mixture's
        entries already normalized: data/mixture.normalize): each failure names its flag."""
        if v["dataset_name"] and v["train_file"]:
            raise ConfigError("Can't give both `--dataset_name` and `--train_file`")
        if v["dataset_mixture"]:
            for name in NOT_WITH_A_MIXTURE:
                if v[name]:
                    raise ConfigError(
                        f"Can't give both `--dataset_mixture` and `--{name}` (a mixture's "
                        "sources each name their own data)"
                    )
        if v["validation_file"] and not (
            v["train_file"] or v["dataset_name"] or v["dataset_mixture"]
        ):
            raise ConfigError(
                "`--validation_file` needs `--train_file`, `--dataset_name` or `--dataset_mixture`"
            )
        held = [f for f in ("validation_file", "validation_dataset_name") if v[f]]
        if len(held) == 2 or (held and v["eval_datasets"]):
            raise ConfigError(
                f"Can't give both `--{held[0]}` and "
                f"`--{held[1] if len(held) == 2 else 'eval_datasets'}`: name the held-out set as "
                "an entry of eval_datasets instead"
            )
        require_positive(
            v,
            (
                "max_seq_length",
                "max_prompt_length",
                "max_train_samples",
                "max_eval_samples",
                "preprocessing_num_workers",
            ),
        )
        if v["max_seq_length"] is not None and v["max_seq_length"] < 2:
            raise ConfigError(
                f"`--max_seq_length` must be at least 2 (a token to predict the next one from), "
                f"got {v['max_seq_length']}"
            )
        if not 0 <= v["validation_split_percentage"] < 100:
            raise ConfigError(
                "`--validation_split_percentage` must be in [0, 100), got "
                f"{v['validation_split_percentage']}"
            )
