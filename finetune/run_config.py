"""Run config files: ``--config run.yaml|json`` in, ``OUT/run_config.yaml`` out.

A file's keys are the training flags' names (``learning_rate: 2.0e-5``); the command line overrides
it. Values are checked against each flag's type and choices here, with the file and key named, so
a typo in a job script's config fails in a second with exit 2, not after the model has loaded.
The file a run writes holds every flag's resolved value, so
``finetune --config OUT/run_config.yaml`` runs the same training again (give another
``--output_dir`` to keep the first).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from finetune.config import GROUPS, ConfigError, RunConfig
from finetune.data.formats import exclusive_flags
from finetune.io.durable import replace_text

FILE_NAME = "run_config.yaml"
_FIELDS = {f.name: f for _, cls in GROUPS for f in dataclasses.fields(cls)}
# Flags that are spelled differently in a file: the command line's shorthands.
_ALIASES = {
    "bf16": "precision: bf16",
    "fp16": "precision: fp16",
    "config": "a file cannot include another",
}


def load(path: str) -> dict[str, Any]:
    """The flag values a config file sets (flag name → value), checked;
    ConfigError names the key."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config: file not found: {path}")
    suffix = p.suffix.lower()
    if suffix not in (".yaml", ".yml", ".json"):
        raise ConfigError(f"--config {path}: must be a .yaml, .yml or .json file")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config {path}: cannot read it: {_first_line(e)}") from None
    if suffix == ".json":
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"--config {path}: not valid JSON: {_first_line(e)}") from None
    else:
        yaml = _yaml()
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"--config {path}: not valid YAML: {_first_line(e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"--config {path}: must hold a mapping of flag names to "
            f"values, got {type(data).__name__}"
        )
    return {str(key): _check(path, str(key), value) for key, value in data.items()}


# Flags that exclude each other: one given on the command line replaces the other from the file
# (`--max_steps 3` over a file's num_train_epochs is a short try of the same recipe). The data
# formats' flags are paired by their registry (data/formats.py exclusive_flags).
_EITHER = (
    ({"max_steps"}, {"num_train_epochs"}),
    ({"train_file"}, {"dataset_name", "dataset_config_name"}),
    ({"model_name_or_path"}, {"config_name"}),
    ({"train_file", "dataset_name"}, {"dataset_mixture"}),
)


def overridden(from_file: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """The file's values less those that a flag on the command line excludes."""
    dropped: set[str] = set()
    for one, other in (*_EITHER, *exclusive_flags()):
        for side, counterpart in ((one, other), (other, one)):
            if side & given.keys():
                dropped |= counterpart - given.keys()
    return {k: v for k, v in from_file.items() if k not in dropped}


def _check(path: str, key: str, value: Any) -> Any:
    f = _FIELDS.get(key.lstrip("-").replace("-", "_"))
    if f is None or key.startswith("-"):
        if key in _ALIASES:
            raise ConfigError(f"--config {path}: unknown key `{key}` (use {_ALIASES[key]})")
        close = difflib.get_close_matches(key, _FIELDS, n=1)
        hint = (
            f"; did you mean `{close[0]}`?"
            if close
            else " (keys are the training flags' names, without --)"
        )
        raise ConfigError(f"--config {path}: unknown key `{key}`{hint}")
    if key != f.name:
        raise ConfigError(f"--config {path}: unknown key `{key}`; did you mean `{f.name}`?")
    value = _typed(path, f, value)
    choices = f.metadata.get("choices")
    if choices and value is not None and value not in choices:
        raise ConfigError(
            f"--config {path}: `{key}` must be one of {', '.join(choices)}, got {value!r}"
        )
    return value


def _typed(path: str, f: dataclasses.Field, value: Any) -> Any:
    kind = str(f.type)
    if value is None:
        if f.default is None:
            return None  # unset, as when the flag is not given
        expected = "true or false" if "bool" in kind else _expected(kind)
        raise ConfigError(f"--config {path}: `{f.name}` must be {expected}, got null")
    if "bool" in kind:
        ok = isinstance(value, bool)
    elif "int" in kind:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif "float" in kind:
        # YAML 1.1 reads 1e-5 (no dot) as a string; it is meant as a number
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif f.metadata.get("json"):
        # a mapping or list in the file; the command line's JSON text is parsed by resolve
        ok = isinstance(value, (f.metadata["json"], str))
        kind = "a mapping" if f.metadata["json"] is dict else "a list"
    elif f.metadata.get("nargs") and isinstance(value, list):
        # lora_target_modules: [q_proj, v_proj]
        ok = all(isinstance(v, str) for v in value)
        kind = "a string or a list of strings"
    else:
        ok = isinstance(value, str)
    if not ok:
        expected = "true or false" if "bool" in kind else _expected(kind)
        raise ConfigError(
            f"--config {path}: `{f.name}` must be {expected}, got {value!r} ({_yaml_type(value)})"
        )
    return value


def _expected(kind: str) -> str:
    if kind.startswith("a "):
        return kind
    if "int" in kind:
        return "an integer"
    if "float" in kind:
        return "a number"
    return "a string"


def _yaml_type(value: Any) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "a mapping",
    }.get(type(value), type(value).__name__)


def _first_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def _yaml():
    import yaml  # PyYAML: a dependency of transformers and huggingface_hub

    return yaml


def write(cfg: RunConfig, output_dir: str, version: str) -> Path:
    """OUT/run_config.yaml: every flag's resolved value, grouped as in --help. Atomic (a reader
    never sees half a file); rank 0 calls it once the run has started."""
    yaml = _yaml()
    when = datetime.now(timezone.utc).isoformat(timespec="seconds")
    parts = [
        f"# finetune {version}: the resolved configuration of the run started {when} (world size "
        f"{cfg.world_size}).\n# Run it again with: finetune --config "
        f"{Path(output_dir) / FILE_NAME} --output_dir NEW_DIR\n"
    ]
    for name, group in cfg.to_json_dict().items():
        parts.append(
            f"\n# {name}\n" + yaml.safe_dump(group, sort_keys=False, default_flow_style=False)
        )
    path = Path(output_dir) / FILE_NAME
    replace_text(path, "".join(parts))
    return path


def write_best_effort(cfg: RunConfig, output_dir: str, version: str) -> None:
    """``write``, logging instead of raising: not worth failing a run over (the same flags are in
    every checkpoint's trainer_state.json). Rank 0, not collective."""
    try:
        write(cfg, output_dir, version)
    except OSError as e:
        logging.getLogger("finetune").warning(
            "could not write %s (%s)", Path(output_dir) / FILE_NAME, e
        )
