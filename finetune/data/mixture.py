"""``dataset_mixture``: several training sources sampled by weight, as one training set.

A mixture is a list of sources (a --config file's ``dataset_mixture:`` list, or a JSON string on the
command line). Each source takes the keys a single dataset takes (``SOURCE_KEYS``) plus ``weight``
(> 0; the weights are normalized into each sample's probability of coming from that source, as
``datasets.interleave_datasets``' ``probabilities``) and an optional unique ``name`` (default: the
file's stem or the hub dataset's name). Each source becomes the ``DataArgs`` of a single dataset
(``source_args``), so it is loaded, checked, tokenized and cached exactly as one would be: one
cache entry per source, shared by every mixture that uses it.

Pure: no data is read here (sources.py checks the files), and torch is not imported, so the CLI
reports a bad entry in a second. The sampler is mixture_sampler.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from finetune.config import SINGLE_DATASET_FLAGS, ConfigError, DataArgs
from finetune.data.formats import FORMATS, check_flags

FLAG = "--dataset_mixture"
# Where a source's data comes from: the flags that name a single dataset's.
LOCATION_KEYS = SINGLE_DATASET_FLAGS
# The data formats' column keys (formats.py): a source that gives any of them has its own format;
# one that gives none inherits the top-level format flags.
FORMAT_KEYS = tuple(dict.fromkeys(f for cls in FORMATS.values() for f in cls.flags))
# Run-wide data flags a source may set for itself; unset, it inherits the top-level value.
# A preference objective's format keys (data/preference.py).
PAIR_KEYS = FORMATS["preference"].flags
OWN_KEYS = ("validation_split_percentage", "max_train_samples", "max_eval_samples")
SOURCE_KEYS = (*LOCATION_KEYS, *FORMAT_KEYS, *OWN_KEYS)
META_KEYS = ("name", "weight")


@dataclasses.dataclass(frozen=True)
class Source:
    name: str
    weight: float
    args: DataArgs  # the source as a single dataset

    @property
    def described(self) -> str:
        return self.args.train_file or self.args.dataset_name or self.name


def parse(
    value: Any, flag: str = FLAG, entry: str = "source", keys: str = "train_file, weight, ..."
) -> list[dict] | None:
    """A list flag's value (a JSON string from the command line, or a list from a --config file)
    as a list of entries, each a mapping; None when unset. Checks the shape only. ``entry`` and
    ``keys`` say in errors what an entry is and holds (also --eval_datasets')."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ConfigError(f"`{flag}`: not valid JSON: {e}") from None
    if not isinstance(value, (list, tuple)):
        raise ConfigError(
            f"`{flag}` must be a list of {entry}s (each a mapping of {keys}), "
            f"got {type(value).__name__}"
        )
    if not value:
        raise ConfigError(f"`{flag}` is empty: give at least one {entry}")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise ConfigError(
                f"`{flag}[{i}]` must be a mapping of keys ({keys}), got {type(item).__name__}"
            )
    return [dict(e) for e in value]


def normalize(entries: list[dict]) -> list[dict]:
    """Check each entry's keys and weight and fill in its name: what the run records (JSON-able,
    so OUT/run_config.yaml runs the same mixture again). ConfigError names the entry."""
    out, names = [], {}
    allowed = (*META_KEYS, *SOURCE_KEYS)
    for i, entry in enumerate(entries):
        where = f"{FLAG}[{i}]"
        for key in entry:
            if key not in allowed:
                import difflib

                close = difflib.get_close_matches(str(key), allowed, n=1)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                raise ConfigError(f"{where}: unknown key '{key}'{hint}")
        if bool(entry.get("train_file")) == bool(entry.get("dataset_name")):
            raise ConfigError(f"{where}: give one of 'train_file' or 'dataset_name'")
        for key in SOURCE_KEYS:
            value, kind = entry.get(key), int if key in OWN_KEYS else str
            if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
                raise ConfigError(
                    f"{where}: '{key}' must be {'an integer' if kind is int else 'a string'}, "
                    f"got {value!r}"
                )
        weight = entry.get("weight")
        if weight is None:
            raise ConfigError(f"{where}: 'weight' is missing (a number > 0)")
        if isinstance(weight, str):
            try:
                weight = float(weight)
            except ValueError:
                pass
        if (
            isinstance(weight, bool)
            or not isinstance(weight, (int, float))
            or not math.isfinite(weight)
            or weight <= 0
        ):
            raise ConfigError(f"{where}: 'weight' must be a number > 0, got {entry['weight']!r}")
        name = entry.get("name") or default_name(entry)
        if not isinstance(name, str):
            raise ConfigError(f"{where}: 'name' must be a string, got {name!r}")
        if name in names:
            raise ConfigError(
                f"{where}: duplicate name '{name}' (also {FLAG}[{names[name]}]); "
                "give each source a unique 'name'"
            )
        names[name] = i
        out.append({**entry, "name": name, "weight": float(weight)})
    return out


def default_name(entry: dict) -> str:
    if entry.get("train_file"):
        return Path(str(entry["train_file"])).stem
    name = str(entry["dataset_name"]).rstrip("/").rsplit("/", 1)[-1]
    config = entry.get("dataset_config_name")
    return f"{name}-{config}" if config else name


def check_source_formats(v: Mapping[str, Any]) -> None:
    """Each source's format flags as a single dataset's (its own keys over the top-level flags),
    from the formats' registry; ConfigError names the entry."""
    for i, entry in enumerate(v["dataset_mixture"]):
        try:
            check_flags(source_values(v, entry))
        except ConfigError as e:
            raise ConfigError(f"{FLAG}[{i}] ({entry['name']}): {e}") from None


def source_values(top: Mapping[str, Any], entry: dict) -> dict:
    """A source's flag values as a single dataset: the top-level data flags, less the mixture and
    the location, with the source's keys over them (its format keys replacing the top-level
    format when it gives any)."""
    defaults = {f.name: f.default for f in dataclasses.fields(DataArgs)}
    v = {f.name: top[f.name] for f in dataclasses.fields(DataArgs)}
    v.update(dict.fromkeys(LOCATION_KEYS), dataset_mixture=None, eval_datasets=None)
    v["validation_dataset_name"] = None
    if any(k in entry for k in FORMAT_KEYS):
        # a preference run's pairs keep its columns: a source may rename one of them
        kept = PAIR_KEYS if top.get("chosen_column") else ()
        v.update({k: defaults[k] for k in FORMAT_KEYS if k not in kept})
    v.update({k: entry[k] for k in SOURCE_KEYS if k in entry})
    return v


def sources(data: DataArgs) -> list[Source]:
    """The resolved mixture's sources, each as the DataArgs of a single dataset. With held-out
    eval sets (data/eval_sets.py) a source is not split and its validation_file is not read."""
    top = dataclasses.asdict(data)
    held_out = top["validation_file"] or top["validation_dataset_name"] or top["eval_datasets"]
    out = []
    for e in data.dataset_mixture or ():
        v = source_values(top, e)
        if held_out:
            v.update(validation_split_percentage=0, validation_file=None)
        out.append(Source(e["name"], e["weight"], DataArgs(**v)))
    return out


def probabilities(weights: list[float]) -> list[float]:
    total = sum(weights)
    return [w / total for w in weights]


# --- accounting, for `finetune ls` ------------------------------------------------------------


def tokens_by_source(trainer_state: dict) -> dict[str, int] | None:
    """A checkpoint's tokens per source up to its step (trainer_state.json: those of the logged
    rows, plus the log window's since the last one); None without a mixture."""
    sampler = trainer_state.get("sampler")
    names = list(sampler.get("sources") or {}) if isinstance(sampler, dict) else []
    if not names:
        return None
    seen = trainer_state.get("tokens_seen_by_source") or {}
    window = (trainer_state.get("window") or {}).get("source_tokens") or []
    window = list(window) + [0] * (len(names) - len(window))
    return {name: int(seen.get(name, 0)) + int(n) for name, n in zip(names, window)}


def describe_tokens(by_source: dict[str, int]) -> str:
    total = sum(by_source.values()) or 1
    return ", ".join(f"{k} {n:,} ({100 * n / total:.1f}%)" for k, n in by_source.items())


def read_tokens_by_source(folder: Path) -> dict[str, int] | None:
    """``tokens_by_source`` of a local checkpoint's trainer_state.json (None if unreadable)."""
    from finetune.checkpoint_format.state import TRAINER_STATE

    try:
        state = json.loads((folder / TRAINER_STATE).read_text())
    except (OSError, ValueError):
        return None
    return tokens_by_source(state) if isinstance(state, dict) else None


def source_lines(checkpoints) -> list[str]:
    """``finetune ls``: a line per checkpoint of a mixture, its cumulative tokens per source."""
    return [
        f"{c.tag} tokens by source: {describe_tokens(c.tokens_by_source)}"
        for c in checkpoints
        if c.tokens_by_source
    ]
