"""The data path: the data formats (formats.py), load and tokenize (load.py), cache the tokenized
sets (cache.py), and deal rows to ranks step by step (sampler.py).

The names below are imported on first use (PEP 562): the CLI reads the formats' flags while it
parses arguments, and a mistake in them should be reported without importing torch (~3 s) first.
"""

import importlib

_FROM = {
    "finetune.data.formats": (
        "FORMATS",
        "IGNORE",
        "Format",
        "choose",
        "encode_chat",
        "encode_prompt_completion",
        "encode_text",
        "register",
    ),
    "finetune.data.load": ("EMBEDDED_DATA", "collate", "load_raw", "pack", "tokenize"),
    "finetune.data.sampler": ("ResumableSampler", "SamplerState", "TrainData", "eval_batches"),
}
_MODULE_OF = {name: module for module, names in _FROM.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
