"""Datasets: loading, formatting, tokenization, packing, and a resumable distributed sampler.

Formats: plain text (`--text_column`); prompt + completion with the prompt masked from the loss;
chat messages rendered through the tokenizer's chat template with only assistant turns trained on.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from finetune.config import RESOURCES_DIR, ConfigError, DataArgs, data_format
from finetune.distributed import logger

IGNORE = -100  # label value the loss skips
EMBEDDED_DATA = {"train": str(RESOURCES_DIR / "data" / "train.jsonl"),
                 "validation": str(RESOURCES_DIR / "data" / "validation.jsonl")}


# --- loading -------------------------------------------------------------------------------

def load_raw(args: DataArgs, seed: int):
    """Return (train, eval or None) as `datasets.Dataset`s, with columns checked."""
    import datasets

    datasets.disable_progress_bars()
    raw = _load(args)
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
        raise ConfigError(f"{_source_flag(args)}: the training data is empty")
    return train, evalset


def _load(args: DataArgs):
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
        raise ConfigError(f"{_source_flag(args)}: cannot read {files['train']}: {_root_cause(e)}") from None


def _root_cause(e: BaseException) -> str:
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _source_flag(args: DataArgs) -> str:
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


# --- formatting and tokenization -------------------------------------------------------------

def tokenize(ds, tokenizer, args: DataArgs, max_len: int):
    """Map raw rows to {'input_ids', 'labels'}; drop rows left with nothing to learn."""
    if args.messages_column and not getattr(tokenizer, "chat_template", None):
        raise ConfigError("--messages_column: the tokenizer has no chat template (pass --tokenizer_name with one)")
    if args.messages_column:
        fn = lambda row: encode_chat(tokenizer, _messages(row[args.messages_column]), max_len)  # noqa: E731
    elif args.prompt_column:
        fn = lambda row: encode_prompt_completion(tokenizer, row[args.prompt_column], row[args.completion_column], max_len)  # noqa: E731
    else:
        fn = lambda row: encode_text(tokenizer, row[args.text_column], max_len)  # noqa: E731
    out = ds.map(fn, remove_columns=ds.column_names, load_from_cache_file=False, keep_in_memory=True)
    kept = out.filter(lambda row: any(x != IGNORE for x in row["labels"][1:]), keep_in_memory=True)
    if len(kept) < len(out):
        logger.warning("dropped %d of %d examples with no trainable tokens after truncation", len(out) - len(kept), len(out))
    return kept


def _ids(tokenizer, text: str, special: bool) -> list[int]:
    return tokenizer(text, add_special_tokens=special)["input_ids"]


def _with_eos(tokenizer, ids: list[int]) -> list[int]:
    eos = tokenizer.eos_token_id
    return ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids


def encode_text(tokenizer, text: Any, max_len: int) -> dict:
    ids = _with_eos(tokenizer, _ids(tokenizer, str(text or ""), True))[:max_len]
    return {"input_ids": ids, "labels": list(ids)}


def encode_prompt_completion(tokenizer, prompt: Any, completion: Any, max_len: int) -> dict:
    p = _ids(tokenizer, str(prompt or ""), True)
    if p and p[-1] == tokenizer.eos_token_id:
        p = p[:-1]  # tokenizers that append eos themselves: eos belongs after the completion
    c = _with_eos(tokenizer, _ids(tokenizer, str(completion or ""), False))
    ids = (p + c)[:max_len]
    labels = ([IGNORE] * len(p) + c)[:max_len]
    return {"input_ids": ids, "labels": labels}


def _messages(value: Any) -> list[dict]:
    # CSV and some exports carry the messages as a JSON string.
    return json.loads(value) if isinstance(value, str) else list(value)


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


def pack(ds, max_len: int):
    """Concatenate all examples and cut into full blocks of ``max_len`` (the tail is dropped)."""
    ids: list[int] = []
    labels: list[int] = []
    for row in ds:
        ids.extend(row["input_ids"])
        labels.extend(row["labels"])
    n = len(ids) // max_len
    if n == 0:
        raise ConfigError(f"--packing: the data has {len(ids)} tokens, fewer than one block of --max_seq_length {max_len}")
    import datasets

    return datasets.Dataset.from_dict({"input_ids": [ids[i * max_len:(i + 1) * max_len] for i in range(n)],
                                       "labels": [labels[i * max_len:(i + 1) * max_len] for i in range(n)]})


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


# --- sampling --------------------------------------------------------------------------------

@dataclass
class SamplerState:
    epoch: int = 0
    consumed: int = 0  # samples of this epoch's global order already used, summed over ranks


class ResumableSampler:
    """Deterministic distributed order: one global permutation per (seed, epoch), dealt round-robin.

    The position is the number of *global* samples consumed, so the same state also means the
    same thing at another world size: the remaining global order is dealt to the new ranks.
    """

    def __init__(self, num_samples: int, world_size: int, rank: int, seed: int):
        self.num_samples, self.world_size, self.rank, self.seed = num_samples, world_size, rank, seed
        self.state = SamplerState()

    def epoch_order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(self.num_samples, generator=g).tolist()
        # Trim so every rank gets the same count: ranks must run the same number of collectives.
        return order[: len(order) - len(order) % self.world_size]

    def samples_per_rank(self) -> int:
        return self.num_samples // self.world_size

    def take(self, per_rank: int) -> list[int] | None:
        """This rank's next ``per_rank`` indices, advancing the state; None at epoch end."""
        order = self.epoch_order(self.state.epoch)
        start = self.state.consumed
        end = start + per_rank * self.world_size
        if end > len(order):
            return None
        self.state.consumed = end
        return order[start:end][self.rank::self.world_size]

    def next_epoch(self) -> None:
        self.state = SamplerState(epoch=self.state.epoch + 1, consumed=0)

    def state_dict(self) -> dict:
        return {"epoch": self.state.epoch, "consumed": self.state.consumed, "seed": self.seed,
                "num_samples": self.num_samples}

    def load_state_dict(self, sd: dict) -> None:
        if sd["num_samples"] != self.num_samples or sd["seed"] != self.seed:
            raise ConfigError(f"--resume_from_checkpoint: the data order differs from the checkpoint's "
                              f"({self.num_samples} samples, seed {self.seed} vs {sd['num_samples']}, {sd['seed']})")
        self.state = SamplerState(epoch=sd["epoch"], consumed=sd["consumed"])


class TrainData:
    """Hands the trainer one optimizer step's micro-batches at a time."""

    def __init__(self, dataset, sampler: ResumableSampler, micro_batch: int, grad_accum: int, pad_id: int):
        self.dataset, self.sampler = dataset, sampler
        self.micro_batch, self.grad_accum, self.pad_id = micro_batch, grad_accum, pad_id
        self.steps_per_epoch = sampler.samples_per_rank() // (micro_batch * grad_accum)
        if self.steps_per_epoch == 0:
            raise ConfigError(f"--per_device_train_batch_size: {len(dataset)} training examples are fewer than one "
                              f"step needs ({micro_batch} × {grad_accum} accumulation × {sampler.world_size} ranks)")

    def next_step(self) -> list[dict[str, torch.Tensor]]:
        idx = self.sampler.take(self.micro_batch * self.grad_accum)
        if idx is None:
            self.sampler.next_epoch()
            idx = self.sampler.take(self.micro_batch * self.grad_accum)
        rows = [self.dataset[i] for i in idx]
        return [collate(rows[i:i + self.micro_batch], self.pad_id) for i in range(0, len(rows), self.micro_batch)]

    @property
    def epoch_float(self) -> float:
        st = self.sampler.state
        per_epoch = self.steps_per_epoch * self.micro_batch * self.grad_accum * self.sampler.world_size
        return st.epoch + min(st.consumed / per_epoch, 1.0)


def eval_batches(dataset, batch_size: int, world_size: int, rank: int, pad_id: int) -> Iterator[tuple[dict, bool]]:
    """This rank's eval batches and whether each is real.

    Every rank yields the same number of batches — under ZeRO-3 each forward all-gathers, so a
    rank with fewer batches would leave the others waiting. Filler batches repeat row 0 and
    must be given zero weight.
    """
    shard = list(range(rank, len(dataset), world_size))
    n_batches = math.ceil(math.ceil(len(dataset) / world_size) / batch_size)
    for b in range(n_batches):
        idx = shard[b * batch_size:(b + 1) * batch_size]
        real = bool(idx)
        rows = [dataset[i] for i in (idx or [0])]
        yield collate(rows, pad_id), real
