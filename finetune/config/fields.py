"""What every group of flags shares: the error they raise, the field that carries a flag's help,
where the package's files are, and the checks of one value that several groups make."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import field
from pathlib import Path
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parent.parent
RESOURCES_DIR = PACKAGE_DIR / "resources"
# configs/ lives at the repository root (the package is installed editable by `make setup`).
CONFIGS_DIR = PACKAGE_DIR.parent / "configs"
DEFAULT_DS_CONFIG = "configs/ds_zero3.json"


class ConfigError(ValueError):
    """Bad usage or input: the CLI prints the message as one line and exits 2."""


def flag(default: Any, help: str, **kw: Any) -> Any:
    """A flag's field: its default, its help text (the CLI's and FLAGS.md's), and what else the
    parser needs (choices, nargs, json) or resume reads (resume_may_change)."""
    return field(default=default, metadata={"help": help, **kw})


def require_positive(v: Mapping[str, Any], names: Iterable[str]) -> None:
    """Each named flag, when set, is above 0 (``not > 0`` also refuses a NaN)."""
    for name in names:
        if v[name] is not None and not v[name] > 0:
            raise ConfigError(f"`--{name}` must be positive, got {v[name]}")


def require_not_negative(v: Mapping[str, Any], names: Iterable[str]) -> None:
    """Each named flag, when set, is 0 or above."""
    for name in names:
        if v[name] is not None and v[name] < 0:
            raise ConfigError(f"`--{name}` must not be negative, got {v[name]}")


def split_names(value: str | list | tuple | None) -> list[str]:
    """A module-name list flag's names: given space-separated (argparse's nargs), comma-separated or
    as a YAML list."""
    if value is None:
        return []
    parts = value if isinstance(value, (list, tuple)) else [value]
    return [name for part in parts for name in re.split(r"[,\s]+", str(part)) if name]
