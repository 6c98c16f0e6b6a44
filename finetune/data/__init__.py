"""The data path: the data formats (formats.py), load and tokenize (load.py), pack (packing.py),
cache the tokenized sets (cache.py), deal rows to ranks step by step (sampler.py), and cut each
row into a rank's shard under sequence parallelism (sequence.py).

load.py and sampler.py import torch (packing.py numpy); their names load on first use (PEP 562),
so that the CLI, which reads the formats' flags while it parses arguments, reports a bad flag
without importing torch (~3 s) first.
"""

import importlib

from finetune.data import preference  # noqa: E402,F401 — registers the preference format
from finetune.data.formats import (
    FORMATS,
    IGNORE,
    Format,
    choose,
    encode_chat,
    encode_prompt_completion,
    encode_text,
    register,
)

_LAZY = {
    **dict.fromkeys(
        ("EMBEDDED_DATA", "collate", "load_raw", "model_inputs", "to_device", "tokenize"), "load"
    ),
    "pack_concat": "packing",
    **dict.fromkeys(("ResumableSampler", "SamplerState", "TrainData", "eval_batches"), "sampler"),
}

__all__ = [
    "FORMATS",
    "IGNORE",
    "Format",
    "choose",
    "encode_chat",
    "encode_prompt_completion",
    "encode_text",
    "register",
    *_LAZY,
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value  # once: later lookups find it directly
    return value
