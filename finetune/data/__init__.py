"""The data path: the data formats (formats.py), load and tokenize (load.py), cache the tokenized
sets (cache.py), and deal rows to ranks step by step (sampler.py)."""

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
from finetune.data.load import EMBEDDED_DATA, collate, load_raw, pack, tokenize
from finetune.data.sampler import ResumableSampler, SamplerState, TrainData, eval_batches

__all__ = [
    "EMBEDDED_DATA",
    "FORMATS",
    "IGNORE",
    "Format",
    "ResumableSampler",
    "SamplerState",
    "TrainData",
    "choose",
    "collate",
    "encode_chat",
    "encode_prompt_completion",
    "encode_text",
    "eval_batches",
    "load_raw",
    "pack",
    "register",
    "tokenize",
]
