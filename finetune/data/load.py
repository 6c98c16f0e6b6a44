"""Datasets: loading, formatting, tokenization, packing, collation.

Formats: plain text (`--text_column`); prompt + completion with the prompt masked from the loss;
chat messages rendered through the tokenizer's chat template with only assistant turns trained on.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from finetune.config import RESOURCES_DIR, ConfigError, DataArgs, data_format

IGNORE = -100  # label value the loss skips
EMBEDDED_DATA = {"train": str(RESOURCES_DIR / "data" / "train.jsonl"),
                 "validation": str(RESOURCES_DIR / "data" / "validation.jsonl")}


# --- loading -------------------------------------------------------------------------------

def load_raw(args: DataArgs, seed: int):
    """Return (train, eval or None) as `datasets.Dataset`s, with columns checked."""
    import datasets

    datasets.disable_progress_bars()
    raw = load_splits(args)
    if "train" not in raw:
        raise ConfigError(f"--dataset_name: '{args.dataset_name}' has no 'train' split (has: {', '.join(raw)})")
    train = raw["train"]
    evalset = raw.get("validation")
    if evalset is None and args.validation_split_percentage > 0 and len(train) > 1:
        split = train.train_test_split(test_size=args.validation_split_percentage / 100, seed=seed, shuffle=True)
        train, evalset = split["train"], split["test"]
    if args.max_train_samples:
        train = train.select(range(min(args.max_train_samples, len(train))))
    if evalset is not None and args.max_eval_samples:
        evalset = evalset.select(range(min(args.max_eval_samples, len(evalset))))
    _check_columns(args, train, "training data")
    if evalset is not None:
        _check_columns(args, evalset, "validation data")
    if len(train) == 0:
        raise ConfigError(f"{source_flag(args)}: the training data is empty")
    return train, evalset


def load_splits(args: DataArgs):
    """The raw splits as datasets loads them (from its own cache of the raw files)."""
    import datasets

    if args.dataset_name:
        try:
            return datasets.load_dataset(args.dataset_name, args.dataset_config_name)
        except (FileNotFoundError, ValueError, ConnectionError, OSError) as e:
            raise ConfigError(f"--dataset_name: cannot load '{args.dataset_name}': {str(e).splitlines()[0]}") from None
    files = EMBEDDED_DATA if not args.train_file else {"train": args.train_file}
    if args.validation_file:
        files["validation"] = args.validation_file
    fmt = data_format(files["train"])
    for flag in ("train_file", "validation_file"):
        # datasets' json builder raises a bare StopIteration on an empty file.
        if getattr(args, flag) and os.path.getsize(getattr(args, flag)) == 0:
            raise ConfigError(f"--{flag}: {getattr(args, flag)} is empty")
    try:
        return datasets.load_dataset(fmt, data_files=files)
    except (ValueError, OSError, datasets.exceptions.DatasetGenerationError) as e:
        raise ConfigError(f"{source_flag(args)}: cannot read {files['train']}: {_root_cause(e)}") from None


def _root_cause(e: BaseException) -> str:
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def source_flag(args: DataArgs) -> str:
    return "--dataset_name" if args.dataset_name else "--train_file"


def _check_columns(args: DataArgs, ds, what: str) -> None:
    if args.messages_column:
        needed = {"--messages_column": args.messages_column}
    elif args.prompt_column:
        needed = {"--prompt_column": args.prompt_column, "--completion_column": args.completion_column}
    else:
        needed = {"--text_column": args.text_column}
    for flag, col in needed.items():
        if col not in ds.column_names:
            raise ConfigError(f"{flag}: no column '{col}' in the {what} (available: {', '.join(ds.column_names)})")
    if args.messages_column and len(ds):
        _messages(ds[0][args.messages_column], args.messages_column)  # before tokenizing: the first row's shape


# --- formatting and tokenization -------------------------------------------------------------

def tokenize(ds, tokenizer, args: DataArgs, max_len: int, num_proc: int = 1, cache_file: str | None = None):
    """Map raw rows to {'input_ids', 'labels'} (int32); drop rows left with nothing to learn.

    ``cache_file``: where the result is written (with ``num_proc`` > 1, one file per process);
    None keeps it in memory.
    """
    import datasets

    if args.messages_column and not getattr(tokenizer, "chat_template", None):
        raise ConfigError("--messages_column: the tokenizer has no chat template (pass --tokenizer_name with one)")
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32")),
                                  "labels": datasets.Sequence(datasets.Value("int32"))})
    out = ds.map(_BatchEncoder(tokenizer, args, max_len), batched=True, batch_size=1000, features=features,
                 remove_columns=ds.column_names, num_proc=num_proc if num_proc > 1 else None,
                 load_from_cache_file=False, keep_in_memory=cache_file is None, cache_file_name=cache_file,
                 desc="tokenizing")
    return out


class _BatchEncoder:
    """``datasets.map`` function: a batch of raw rows → the rows worth training on, encoded.

    A class, not a closure: with ``num_proc`` it is pickled to the worker processes. Prompts,
    completions and texts are tokenized a batch at a time (one call into the Rust tokenizer);
    the ids are the same as one call per row.
    """

    def __init__(self, tokenizer, args: DataArgs, max_len: int):
        self.tokenizer, self.args, self.max_len = tokenizer, args, max_len

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        a, tok = self.args, self.tokenizer
        eos = tok.eos_token_id  # once: each attribute read goes through the tokenizer's __getattr__
        if a.messages_column:
            rows = [encode_chat(tok, _messages(m, a.messages_column), self.max_len) for m in batch[a.messages_column]]
        elif a.prompt_column:
            prompts = _batch_ids(tok, batch[a.prompt_column], True)
            completions = _batch_ids(tok, batch[a.completion_column], False)
            rows = [_prompt_completion(eos, p, c, self.max_len) for p, c in zip(prompts, completions)]
        else:
            rows = [_text(eos, ids, self.max_len) for ids in _batch_ids(tok, batch[a.text_column], True)]
        rows = [r for r in rows if any(x != IGNORE for x in r["labels"][1:])]
        return {"input_ids": [r["input_ids"] for r in rows], "labels": [r["labels"] for r in rows]}


def _batch_ids(tokenizer, texts: list, special: bool) -> list[list[int]]:
    return tokenizer([str(t or "") for t in texts], add_special_tokens=special)["input_ids"]


def _ids(tokenizer, text: str, special: bool) -> list[int]:
    return tokenizer(text, add_special_tokens=special)["input_ids"]


def _with_eos(eos: int | None, ids: list[int]) -> list[int]:
    return ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids


def encode_text(tokenizer, text: Any, max_len: int) -> dict:
    return _text(tokenizer.eos_token_id, _ids(tokenizer, str(text or ""), True), max_len)


def _text(eos: int | None, ids: list[int], max_len: int) -> dict:
    ids = _with_eos(eos, ids)[:max_len]
    return {"input_ids": ids, "labels": list(ids)}


def encode_prompt_completion(tokenizer, prompt: Any, completion: Any, max_len: int) -> dict:
    return _prompt_completion(tokenizer.eos_token_id, _ids(tokenizer, str(prompt or ""), True),
                              _ids(tokenizer, str(completion or ""), False), max_len)


def _prompt_completion(eos: int | None, p: list[int], c: list[int], max_len: int) -> dict:
    if p and p[-1] == eos:
        p = p[:-1]  # tokenizers that append eos themselves: eos belongs after the completion
    c = _with_eos(eos, c)
    ids = (p + c)[:max_len]
    labels = ([IGNORE] * len(p) + c)[:max_len]
    return {"input_ids": ids, "labels": labels}


def _messages(value: Any, column: str) -> list[dict]:
    """A row's conversation: a list of {"role", "content"} messages (CSV and some exports carry it as
    a JSON string). Anything else is bad input naming the column, not a traceback from the template."""
    messages = value
    if isinstance(value, str):
        try:
            messages = json.loads(value)
        except ValueError:
            messages = None
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                          for m in messages):
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise ConfigError(f"--messages_column: column '{column}' must hold lists of {{\"role\", \"content\"}} "
                          f"messages, found {shown}")
    return list(messages)


def nothing_to_learn(args: DataArgs, tokenizer, raw, max_len: int) -> str:
    """Why tokenizing kept no training example (none has a label to learn from): the message.

    Re-encodes a sample without truncation: if rows then have labels, --max_seq_length cut them
    all away (a prompt at least that long); otherwise the data itself has nothing to learn from.
    """
    sample = raw.select(range(min(100, len(raw))))[:]
    if _BatchEncoder(tokenizer, args, 2**31)(sample)["input_ids"]:
        return (f"--max_seq_length {max_len}: in every training example the prompt fills the first {max_len} tokens, "
                f"leaving nothing to learn from ({source_flag(args)}); raise --max_seq_length")
    what = "chats with no assistant turn" if args.messages_column else "empty rows"
    return f"{source_flag(args)}: no training example has a token to learn from ({what})"


def encode_chat(tokenizer, messages: list[dict], max_len: int) -> dict:
    """Render with the chat template; train only on the assistant turns.

    Each assistant turn's span is the text between the render of the conversation before it
    (with the generation prompt) and the render including it; tokens whose characters start in
    such a span are labelled, the rest are masked.
    """
    render = lambda msgs, gen: tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)  # noqa: E731
    full = render(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m.get("role") == "assistant":
            start = len(render(messages[:i], True)) if i else 0
            spans.append((start, len(render(messages[: i + 1], False))))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    labels = [tok if any(s <= off[0] < e for s, e in spans) else IGNORE for tok, off in zip(ids, enc["offset_mapping"])]
    return {"input_ids": ids[:max_len], "labels": labels[:max_len]}


def pack(ds, max_len: int, path: str | None = None, chunk_rows: int = 10_000):
    """Concatenate all examples and cut into full blocks of ``max_len`` (the tail is dropped).

    Streams: a chunk of rows at a time through numpy, blocks written as they fill, so memory
    stays bounded by a chunk whatever the dataset's size. ``path``: the Arrow file to write
    (default: a temporary one), memory-mapped back.
    """
    import tempfile

    import datasets
    import numpy as np
    import pyarrow as pa

    schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32()))])
    if path is None:
        path = os.path.join(tempfile.mkdtemp(prefix="finetune-pack-"), "packed.arrow")
    carry = {k: np.zeros(0, np.int32) for k in ("input_ids", "labels")}
    blocks = tokens = 0
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for table in ds.with_format("arrow").iter(batch_size=chunk_rows):
            flat = {k: np.concatenate([carry[k], table.column(k).combine_chunks().flatten().to_numpy(zero_copy_only=False)
                                       .astype(np.int32, copy=False)]) for k in carry}
            tokens += len(flat["input_ids"]) - len(carry["input_ids"])
            n = len(flat["input_ids"]) // max_len
            if n:
                offsets = pa.array(np.arange(0, n * max_len + 1, max_len, dtype=np.int32))
                writer.write_table(pa.table({k: pa.ListArray.from_arrays(offsets, pa.array(v[:n * max_len]))
                                             for k, v in flat.items()}, schema=schema))
                blocks += n
            carry = {k: v[n * max_len:] for k, v in flat.items()}
    if blocks == 0:
        raise ConfigError(f"--packing: the data has {tokens} tokens, fewer than one block of --max_seq_length {max_len}")
    return datasets.Dataset.from_file(path)


def collate(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"])
        labels[i, :n] = torch.tensor(r["labels"])
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


