"""Held-out evaluation sets: what the run is judged on, apart from what it trains on.

Two ways to give them:
  one set       --validation_file (beside a --dataset_mixture too) or --validation_dataset_name (a
                hub dataset's validation split): the run's eval set, logged as eval_loss
  named sets    ``eval_datasets:`` (a --config file's list, or JSON here), each entry with a unique
                ``name``, its data (``validation_file``, or ``dataset_name`` [+
                ``dataset_config_name``]: its validation split), the format's column keys and its
                own ``max_eval_samples``; each logged as eval_<name>_loss (HF's naming) beside an
                aggregate eval_loss over all of them (token-weighted; pair-weighted for a
                preference objective)

With either, the training data is not split: a single dataset's --validation_split_percentage and a
mixture's sources' own validation splits are not used. Each set becomes the DataArgs of a single
dataset (``set_args``) whose rows are tokenized and cached exactly as training data is (one cache
entry per set); a set larger than its ``max_eval_samples`` is evaluated on a fixed subset drawn
with the run's seed (``seeded_subset``).

Pure: no data is read here and torch is not imported (the CLI reports a bad entry at once).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from finetune.config import ConfigError, DataArgs
from finetune.data.formats import check_flags
from finetune.data.mixture import FORMAT_KEYS, source_values
from finetune.data.mixture import parse as parse_entries

FLAG = "--eval_datasets"
LOCATION_KEYS = ("validation_file", "dataset_name", "dataset_config_name")
ENTRY_KEYS = ("name", *LOCATION_KEYS, *FORMAT_KEYS, "max_eval_samples")
# A hub eval set's train split is cut to this many rows (tokenized with it, never used).
HUB_TRAIN_ROWS = 64
# A name goes into metric keys (eval_<name>_loss) and file-safe places: letters, digits, _ . -
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclasses.dataclass(frozen=True)
class EvalSet:
    name: str | None  # None: the run's one eval set (eval_loss)
    args: DataArgs  # the set as a single dataset: its rows are the "train" part (a file), or
    # the hub dataset's validation split
    from_hub: bool = False

    @property
    def prefix(self) -> str:
        """Its metrics' prefix: eval_ for the one set, eval_<name>_ for a named one."""
        return metric_prefix(self.name)

    @property
    def described(self) -> str:
        where = self.args.train_file or self.args.dataset_name
        return where if self.name is None else f"{self.name} ({where})"


def parse(value: Any) -> list[dict] | None:
    """The flag's value (JSON text, or a list from a --config file) as a list of mappings."""
    return parse_entries(value, FLAG, "set", "name, validation_file or dataset_name, ...")


def normalize(entries: list[dict]) -> list[dict]:
    """Check each entry's keys, name and data; ConfigError names the entry."""
    names: dict[str, int] = {}
    for i, entry in enumerate(entries):
        where = f"{FLAG}[{i}]"
        unknown = [k for k in entry if k not in ENTRY_KEYS]
        if unknown:
            raise ConfigError(
                f"{where}: unknown key '{unknown[0]}' (a set takes: {', '.join(ENTRY_KEYS)})"
            )
        name = entry.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ConfigError(
                f"{where}: 'name' must be letters, digits, '_', '.' or '-' (it becomes the "
                f"metric eval_<name>_loss), got {name!r}"
            )
        if name in names:
            raise ConfigError(
                f"{where}: duplicate name '{name}' (also {FLAG}[{names[name]}]); give each set "
                "a unique 'name'"
            )
        names[name] = i
        if bool(entry.get("validation_file")) == bool(entry.get("dataset_name")):
            raise ConfigError(f"{where} ({name}): give one of 'validation_file' or 'dataset_name'")
        n = entry.get("max_eval_samples")
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ConfigError(f"{where} ({name}): 'max_eval_samples' must be a whole number > 0")
    return entries


def check_set_formats(v: Mapping[str, Any]) -> None:
    """Each named set's format flags as a single dataset's (its own keys over the top-level
    flags), from the formats' registry; ConfigError names the set."""
    for i, entry in enumerate(v["eval_datasets"]):
        one = {k: entry[k] for k in FORMAT_KEYS if k in entry}
        try:
            check_flags(source_values(v, one))
        except ConfigError as e:
            raise ConfigError(f"{FLAG}[{i}] ({entry['name']}): {e}") from None


def held_out(data: DataArgs) -> list[EvalSet]:
    """The run's held-out sets, each as a single dataset: the named ones, or the one set given
    beside a mixture or as a hub dataset's validation split; [] when the eval set comes with the
    training data (its validation split, or --validation_file beside --train_file)."""
    top = dataclasses.asdict(data)
    if data.eval_datasets:
        return [_set(top, e["name"], e) for e in data.eval_datasets]
    if data.validation_dataset_name:
        return [_set(top, None, {"dataset_name": data.validation_dataset_name})]
    if data.dataset_mixture and data.validation_file:
        return [_set(top, None, {"validation_file": data.validation_file})]
    return []


def has_held_out(v: Mapping[str, Any]) -> bool:
    """Whether the flags give held-out sets (then the training data is not split)."""
    return bool(
        v["eval_datasets"]
        or v["validation_dataset_name"]
        or (v["dataset_mixture"] and v["validation_file"])
    )


def _set(top: dict, name: str | None, entry: Mapping[str, Any]) -> EvalSet:
    """An entry as the DataArgs of a single dataset, as a mixture's source is made one (the
    top-level format flags, or the entry's own replacing them), not split, unpacked, with the
    set's own max_eval_samples: a file's rows are that dataset's train part; a hub dataset's eval
    set is its validation split (its train split cut to HUB_TRAIN_ROWS rows, never used)."""
    one: dict[str, Any] = {k: entry[k] for k in FORMAT_KEYS if k in entry}
    one.update(
        validation_split_percentage=0,
        max_eval_samples=entry.get("max_eval_samples", top["max_eval_samples"]),
        max_train_samples=None,  # every row of the set
    )
    if entry.get("validation_file"):
        one["train_file"] = entry["validation_file"]
    else:
        one.update(dataset_name=entry["dataset_name"], max_train_samples=HUB_TRAIN_ROWS)
        one["dataset_config_name"] = entry.get("dataset_config_name")
    # evaluated unpacked: its bound counts examples, not blocks
    args = DataArgs(**{**source_values(top, one), "packing": False})
    return EvalSet(name, args, from_hub=not entry.get("validation_file"))


def metric_prefix(name: str | None) -> str:
    """The prefix of a set's metrics: eval_ for the run's one set (or all sets together),
    eval_<name>_ for a named one (HF's naming)."""
    return "eval_" if name is None else f"eval_{name}_"


def seeded_subset(ds, n: int | None, seed: int):
    """``ds`` itself, or a fixed subset of ``n`` of its rows drawn with ``seed`` (in their order):
    an eval set larger than its bound costs the same at every evaluation and in every run."""
    if n is None or len(ds) <= n:
        return ds
    import random

    return ds.select(sorted(random.Random(seed).sample(range(len(ds)), n)))
