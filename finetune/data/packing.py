"""--packing: whether the tokenized sets are packed into blocks of --max_seq_length tokens, and
how (--packing_strategy): ``pack_sets`` is the one place that decides.

bfd keeps examples apart: whole examples placed into blocks by best-fit decreasing.

Each block is a row of at most ``--max_seq_length`` tokens holding whole examples; its
``position_ids`` restart at 0 with every example. transformers builds the block-diagonal causal
mask from them (masking_utils.find_packed_sequence_indices) when no ``attention_mask`` is given, so
an example attends to itself only (when the model runs without a KV cache, as finetune's always
does: modeling.load_model sets use_cache False; with one, transformers ignores them).
flash-attention's varlen path reads the same ``position_ids`` from a micro-batch flattened into
one row (``collate(..., flatten=True)``). The loss shifts labels inside the model, so each
example's first label is set to IGNORE: otherwise the last token of the previous example would be
trained to predict it. In an unpacked row that label is never a target
either, so an example contributes exactly the same loss terms packed or not.

The placement is exact best-fit decreasing (TRL's ``bfd``): examples in decreasing length, each
into the open block with the least room that fits it, a new block when none does. It runs on
counts, not examples: blocks with the same room are interchangeable, so all examples of one length
are placed with a few numpy operations per (length, room) pair. 10M examples of up to 4,096 tokens
pack in seconds; the blocks are then written a chunk at a time, memory bounded by the chunk.

concat (``pack_concat``) concatenates every example and cuts full blocks, for continuation text.
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING

import numpy as np

from finetune.config import ConfigError, DataArgs
from finetune.data.balance import token_lengths
from finetune.data.formats import IGNORE

if TYPE_CHECKING:
    from datasets import Dataset

COLUMNS = ("input_ids", "labels", "position_ids")


def pack_sets(
    args: DataArgs, train: Dataset, evalset: Dataset | None, folder: str
) -> tuple[Dataset, Dataset | None, dict | None]:
    """The tokenized train and eval sets as --packing wants them: without it, unchanged (and no
    stats); with it, each packed by --packing_strategy into an Arrow file under ``folder``.
    Returns (train, evalset, the train set's packing stats)."""
    if not args.packing:
        return train, evalset, None
    pack = STRATEGIES[args.packing_strategy]
    max_len = args.max_seq_length
    train, stats = pack(train, max_len, os.path.join(folder, "train-packed.arrow"))
    if evalset is not None and len(evalset):
        evalset, _ = pack(evalset, max_len, os.path.join(folder, "eval-packed.arrow"))
    return train, evalset, stats


def plan_bfd(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """Best-fit decreasing: the block of each example (by index into ``lengths``) and the number of
    blocks. Every length must be in [1, capacity]. Within a block, examples are placed (and so
    written) in decreasing length."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and (lengths.min() < 1 or lengths.max() > capacity):
        raise ValueError(f"every example must have 1..{capacity} tokens")
    block_of = np.full(len(lengths), -1, dtype=np.int64)
    # room[r]: the ids of open blocks with r tokens of room, as a list of arrays (FIFO chunks)
    room: list[list[np.ndarray]] = [[] for _ in range(capacity + 1)]
    sizes = np.zeros(capacity + 1, dtype=np.int64)
    n_blocks = 0
    order = np.argsort(-lengths, kind="stable")
    for group in np.split(order, np.flatnonzero(np.diff(lengths[order])) + 1):
        n, placed = int(lengths[group[0]]), 0
        while placed < len(group):
            left = len(group) - placed
            fits = np.flatnonzero(sizes[n:])
            # The best fit is the smallest room r >= n (or a new block, room = capacity). A block
            # that takes one example of n keeps being the best fit while its room stays >= n, so
            # each block takes r // n of them in a row (the last one fewer if the group runs out).
            r = n + int(fits[0]) if len(fits) else capacity
            per = r // n
            k = -(-left // per) if not len(fits) else min(int(sizes[r]), -(-left // per))
            if len(fits):
                ids = _take(room[r], k)
                sizes[r] -= k
            else:
                ids = np.arange(n_blocks, n_blocks + k)
                n_blocks += k
            count = min(left, k * per)
            block_of[group[placed : placed + count]] = ids[np.arange(count) // per]
            placed += count
            full, rest = divmod(count, per)
            if full:
                room[r - per * n].append(ids[:full])
                sizes[r - per * n] += full
            if rest:
                room[r - rest * n].append(ids[full : full + 1])
                sizes[r - rest * n] += 1
    return block_of, n_blocks


def _take(chunks: list[np.ndarray], k: int) -> np.ndarray:
    """Pop ``k`` ids from the front of a room's chunks."""
    out, need = [], k
    while need:
        head = chunks[0]
        if len(head) <= need:
            out.append(chunks.pop(0))
            need -= len(head)
        else:
            out.append(head[:need])
            chunks[0] = head[need:]
            need = 0
    return np.concatenate(out) if len(out) > 1 else out[0]


def pack_bfd(
    ds: Dataset, max_len: int, path: str | None = None, chunk_blocks: int = 8192
) -> tuple[Dataset, dict]:
    """``ds`` ({'input_ids', 'labels'}, rows of 1..max_len tokens) → a dataset of blocks with
    'input_ids', 'labels' and 'position_ids', memory-mapped from the Arrow file ``path`` (default:
    a temporary one). Returns (dataset, stats)."""
    import datasets
    import pyarrow as pa

    arrow = ds.with_format("arrow")
    lengths = token_lengths(ds)
    if len(lengths) == 0:
        raise ConfigError("--packing: no example to pack")
    block_of, n_blocks = plan_bfd(lengths, max_len)
    # examples grouped by block; within a block in placement order (decreasing length)
    placed = np.argsort(-lengths, kind="stable")
    members = placed[np.argsort(block_of[placed], kind="stable")]
    per_block = np.bincount(block_of, minlength=n_blocks)
    first = np.concatenate([[0], np.cumsum(per_block)])
    schema = pa.schema([(c, pa.list_(pa.int32())) for c in COLUMNS])
    if path is None:
        path = os.path.join(tempfile.mkdtemp(prefix="finetune-pack-"), "packed.arrow")
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for b0 in range(0, n_blocks, chunk_blocks):
            b1 = min(b0 + chunk_blocks, n_blocks)
            rows = members[first[b0] : first[b1]]
            writer.write_table(_blocks(arrow[rows.tolist()], per_block[b0:b1], schema))
    tokens = int(lengths.sum())
    stats = {
        "strategy": "bfd",
        "examples": len(lengths),
        "blocks": int(n_blocks),
        "tokens": tokens,
        "efficiency": round(tokens / (n_blocks * max_len), 6),
    }
    return datasets.Dataset.from_file(path), stats


def _blocks(table, examples_per_block: np.ndarray, schema):
    """The rows of ``table`` (whole examples, in block order) → one Arrow row per block."""
    import pyarrow as pa

    ids = table.column("input_ids").combine_chunks()
    labels = table.column("labels").combine_chunks()
    lens = np.diff(ids.offsets.to_numpy())
    flat_ids = ids.flatten().to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
    flat_labels = labels.flatten().to_numpy(zero_copy_only=False).astype(np.int32, copy=True)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    positions = (np.arange(len(flat_ids)) - np.repeat(starts, lens)).astype(np.int32)
    # the previous example's last token must not be trained to predict this example's first
    flat_labels[starts] = IGNORE
    ex_end = np.cumsum(examples_per_block)
    token_end = np.concatenate([[0], np.cumsum(lens)])[np.concatenate([[0], ex_end])]
    offsets = pa.array(token_end.astype(np.int32))
    return pa.table(
        {
            name: pa.ListArray.from_arrays(offsets, pa.array(values))
            for name, values in zip(COLUMNS, (flat_ids, flat_labels, positions), strict=True)
        },
        schema=schema,
    )


def pack_concat(
    ds: Dataset, max_len: int, path: str | None = None, chunk_rows: int = 10_000
) -> tuple[Dataset, dict]:
    """``--packing_strategy concat``: concatenate all examples and cut into full blocks of
    ``max_len`` (the tail is dropped). Examples attend to the ones before them in a block and are
    cut across blocks: for continuation (pretraining-style) data only; packing.pack_bfd keeps
    examples whole and apart. Returns (dataset, stats).

    Streams: a chunk of rows at a time through numpy, blocks written as they fill, so memory
    stays bounded by a chunk whatever the dataset's size. ``path``: the Arrow file to write
    (default: a temporary one), memory-mapped back.
    """
    import datasets
    import pyarrow as pa

    schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32()))])
    if path is None:
        path = os.path.join(tempfile.mkdtemp(prefix="finetune-pack-"), "packed.arrow")
    carry = {k: np.zeros(0, np.int32) for k in ("input_ids", "labels")}
    blocks = tokens = 0
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for table in ds.with_format("arrow").iter(batch_size=chunk_rows):
            flat = {
                k: np.concatenate(
                    [
                        carry[k],
                        table.column(k)
                        .combine_chunks()
                        .flatten()
                        .to_numpy(zero_copy_only=False)
                        .astype(np.int32, copy=False),
                    ]
                )
                for k in carry
            }
            tokens += len(flat["input_ids"]) - len(carry["input_ids"])
            n = len(flat["input_ids"]) // max_len
            if n:
                offsets = pa.array(np.arange(0, n * max_len + 1, max_len, dtype=np.int32))
                writer.write_table(
                    pa.table(
                        {
                            k: pa.ListArray.from_arrays(offsets, pa.array(v[: n * max_len]))
                            for k, v in flat.items()
                        },
                        schema=schema,
                    )
                )
                blocks += n
            carry = {k: v[n * max_len :] for k, v in flat.items()}
    if blocks == 0:
        raise ConfigError(
            f"--packing: the data has {tokens} tokens, fewer than one "
            f"block of --max_seq_length {max_len}"
        )
    stats = {"strategy": "concat", "blocks": blocks, "tokens": tokens, "efficiency": 1.0}
    return datasets.Dataset.from_file(path), stats


# --packing_strategy's values (DataArgs' choices) → the packer.
STRATEGIES = {"bfd": pack_bfd, "concat": pack_concat}
