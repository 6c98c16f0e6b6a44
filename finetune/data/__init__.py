"""The data path: load and tokenize (load.py), cache the tokenized sets (cache.py), and deal
rows to ranks step by step (sampler.py)."""

from finetune.data.load import (
    EMBEDDED_DATA,
    IGNORE,
    collate,
    encode_chat,
    encode_prompt_completion,
    encode_text,
    load_raw,
    pack,
    tokenize,
)
from finetune.data.sampler import ResumableSampler, SamplerState, TrainData, eval_batches

__all__ = ["EMBEDDED_DATA", "IGNORE", "collate", "encode_chat", "encode_prompt_completion", "encode_text", "load_raw",
           "pack", "tokenize", "ResumableSampler", "SamplerState", "TrainData", "eval_batches"]
