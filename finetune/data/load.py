"""Datasets: loading, tokenization, collation (packing is packing.py's).

Rows are encoded by the data format the flags choose (formats.py: plain text, prompt + completion
with the prompt masked, chat through the template); nothing here depends on which one it is.
"""

from __future__ import annotations

import os

import torch

from finetune.config import RESOURCES_DIR, ConfigError, DataArgs, data_format
from finetune.data.eval_sets import seeded_subset
from finetune.data.formats import IGNORE, Format, choose

EMBEDDED_DATA = {
    "train": str(RESOURCES_DIR / "data" / "train.jsonl"),
    "validation": str(RESOURCES_DIR / "data" / "validation.jsonl"),
}
# The embedded pairs a preference --objective trains on when no data is given.
EMBEDDED_PREFERENCE_DATA = {
    "train": str(RESOURCES_DIR / "data" / "preference_train.jsonl"),
    "validation": str(RESOURCES_DIR / "data" / "preference_validation.jsonl"),
}


def data_files(args: DataArgs) -> dict[str, str]:
    """The local files a run reads: --train_file (and --validation_file), else the embedded set
    of its format (pairs for a preference objective, text otherwise)."""
    if not args.train_file:
        embedded = EMBEDDED_PREFERENCE_DATA if choose(args).pairs else EMBEDDED_DATA
        files = dict(embedded)
    else:
        files = {"train": args.train_file}
    if args.validation_file:
        files["validation"] = args.validation_file
    return files


# --- loading -------------------------------------------------------------------------------


def load_raw(args: DataArgs, seed: int):
    """Return (train, eval or None) as `datasets.Dataset`s, with columns checked."""
    import datasets

    datasets.disable_progress_bars()
    raw = load_splits(args)
    if "train" not in raw:
        raise ConfigError(
            f"--dataset_name: '{args.dataset_name}' has no 'train' split (has: {', '.join(raw)})"
        )
    train = raw["train"]
    evalset = raw.get("validation")
    if evalset is None and args.validation_split_percentage > 0 and len(train) > 1:
        split = train.train_test_split(
            test_size=args.validation_split_percentage / 100, seed=seed, shuffle=True
        )
        train, evalset = split["train"], split["test"]
    if args.max_train_samples:
        train = train.select(range(min(args.max_train_samples, len(train))))
    if evalset is not None:  # a fixed subset drawn with the seed, not the file's first rows
        evalset = seeded_subset(evalset, args.max_eval_samples, seed)
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
            raise ConfigError(
                f"--dataset_name: cannot load '{args.dataset_name}': {str(e).splitlines()[0]}"
            ) from None
    files = data_files(args)
    fmt = data_format(files["train"])
    for flag in ("train_file", "validation_file"):
        # datasets' json builder raises a bare StopIteration on an empty file.
        if getattr(args, flag) and os.path.getsize(getattr(args, flag)) == 0:
            raise ConfigError(f"--{flag}: {getattr(args, flag)} is empty")
    try:
        return datasets.load_dataset(fmt, data_files=files)
    except (ValueError, OSError, datasets.exceptions.DatasetGenerationError) as e:
        raise ConfigError(
            f"{source_flag(args)}: cannot read {files['train']}: {_root_cause(e)}"
        ) from None


def _root_cause(e: BaseException) -> str:
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def source_flag(args: DataArgs) -> str:
    return "--dataset_name" if args.dataset_name else "--train_file"


def _check_columns(args: DataArgs, ds, what: str) -> None:
    fmt = choose(args)
    for flag, col in fmt.columns.items():
        if col not in ds.column_names:
            raise ConfigError(
                f"--{flag}: no column '{col}' in the {what} "
                f"(available: {', '.join(ds.column_names)})"
            )
    fmt.check(ds)


# --- tokenization ---------------------------------------------------------------------------


def tokenize(
    ds, tokenizer, args: DataArgs, max_len: int, num_proc: int = 1, cache_file: str | None = None
):
    """Map raw rows to {'input_ids', 'labels'} (int32); drop rows left with nothing to learn.

    ``cache_file``: where the result is written (with ``num_proc`` > 1, one file per process);
    None keeps it in memory.
    """
    import datasets

    fmt = choose(args)
    fmt.check_tokenizer(tokenizer)
    features = datasets.Features(
        {name: datasets.Sequence(datasets.Value("int32")) for name in fmt.features}
    )
    out = ds.map(
        _BatchEncoder(tokenizer, fmt, max_len),
        batched=True,
        batch_size=1000,
        features=features,
        remove_columns=ds.column_names,
        num_proc=num_proc if num_proc > 1 else None,
        load_from_cache_file=False,
        keep_in_memory=cache_file is None,
        cache_file_name=cache_file,
        desc="tokenizing",
    )
    return out


class _BatchEncoder:
    """``datasets.map`` function: a batch of raw rows → the rows worth training on, encoded.

    A class, not a closure: with ``num_proc`` it is pickled to the worker processes.
    """

    def __init__(self, tokenizer, fmt: Format, max_len: int):
        self.tokenizer, self.fmt, self.max_len = tokenizer, fmt, max_len

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        rows = self.fmt.encode(batch, self.tokenizer, self.max_len)
        rows = [r for r in rows if self.fmt.keeps(r)]
        return {name: [r[name] for r in rows] for name in self.fmt.features}


def nothing_to_learn(args: DataArgs, tokenizer, raw, max_len: int) -> str:
    """Why tokenizing kept no training example (none has a label to learn from): the message.

    Re-encodes a sample without truncation: if rows then have labels, --max_seq_length cut them
    all away (a prompt at least that long); otherwise the data itself has nothing to learn from.
    """
    fmt = choose(args)
    sample = raw.select(range(min(100, len(raw))))[:]
    if _BatchEncoder(tokenizer, fmt, 2**31)(sample)[fmt.features[0]]:
        return (
            f"--max_seq_length {max_len}: in every training example the prompt fills the "
            f"first {max_len} tokens, leaving nothing to learn from "
            f"({source_flag(args)}); raise --max_seq_length"
        )
    return f"{source_flag(args)}: no training example has a token to learn from ({fmt.empty_rows})"


# Keys of a collated batch that are counts for the trainer, not model inputs (``model_inputs``).
NUM_TOKENS, NUM_ROWS = "num_tokens", "num_rows"


def collate(rows: list[dict], pad_id: int, flatten: bool = False) -> dict[str, torch.Tensor]:
    """Rows → a padded micro-batch, plus its counts (NUM_TOKENS real tokens, NUM_ROWS rows).

    Rows with ``position_ids`` (packed blocks) get no ``attention_mask``: transformers then builds
    the block-diagonal causal mask from the position ids (masking_utils), so packed examples do not
    attend to each other; padding gets positions from 0 (a sequence of its own, after every real
    token). ``flatten``: packed rows concatenated into one row with no padding, for
    flash-attention's varlen path (which reads sequence boundaries from the position ids of a
    single row).
    """
    packed = "position_ids" in rows[0]
    n_tokens = sum(len(r["input_ids"]) for r in rows)
    counts = {NUM_TOKENS: torch.tensor(n_tokens), NUM_ROWS: torch.tensor(len(rows))}
    if packed and flatten:
        return {
            k: torch.tensor([x for r in rows for x in r[k]], dtype=torch.long).unsqueeze(0)
            for k in ("input_ids", "labels", "position_ids")
        } | counts
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    if packed:
        positions = torch.arange(width, dtype=torch.long).repeat(len(rows), 1)
    else:
        mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"])
        labels[i, :n] = torch.tensor(r["labels"])
        if packed:
            positions[i, :n] = torch.tensor(r["position_ids"])
            positions[i, n:] = torch.arange(width - n)
        else:
            mask[i, :n] = 1
    extra = {"position_ids": positions} if packed else {"attention_mask": mask}
    return {"input_ids": ids, "labels": labels, **extra} | counts


def model_inputs(batch: dict) -> tuple[dict, int, int]:
    """A collated batch → (the model's inputs, real tokens, rows): the counts are read on the host
    copy, before the inputs move to the device."""
    inputs = dict(batch)
    return inputs, int(inputs.pop(NUM_TOKENS)), int(inputs.pop(NUM_ROWS))


def to_device(batch: dict, device: torch.device) -> dict:
    """A micro-batch's tensors on the device (DeepSpeed's forward does not move inputs).
    Asynchronous only from pinned memory (TrainData and eval_batches pin on GPUs); from pageable
    memory CUDA copies synchronously, so correct either way. PyTorch's pinned-memory allocator
    records the copy on its stream and reuses a block only after the copy has finished."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
