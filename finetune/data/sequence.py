"""A collated micro-batch cut into one rank's part of each row (--sequence_parallel_size N).

No collective: every rank of a sequence-parallel group collates the same rows (its sampler is
dealt by data-parallel rank) and keeps its own contiguous slice. The row is padded to a multiple of
N, its labels shifted once before the cut (``shift_labels``: a shard's last token predicts the next
shard's first, which only the whole row knows), and the slice keeps the row's global
``position_ids``, which DeepSpeed's Ulysses attention gathers to mask causally. The attention mask
is dropped (Ulysses drops it anyway): rows are right-padded, so causal attention alone keeps every
real token off the padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from finetune.data.formats import IGNORE
from finetune.data.load import NUM_ROWS, NUM_TOKENS


def shard(batch: dict[str, torch.Tensor], n: int, rank: int, pad_id: int) -> dict:
    """``batch`` (``collate``'s) → this rank's ``rank``-th of ``n`` slices of every row: the
    model's inputs (``labels`` = ``shift_labels``: transformers' loss needs labels present and
    then reads the shifted ones), its own real-token count (NUM_TOKENS) and the rows (NUM_ROWS)."""
    ids, labels = batch["input_ids"], batch["labels"]
    rows, width = ids.shape
    pad = -width % n
    real = batch.get("attention_mask")
    if real is None:  # packed: flattened into one row without padding (flash attention's varlen)
        if rows != 1:
            raise ValueError("packed rows are sharded flattened into one row (flash attention)")
        real = torch.ones_like(ids)
    if "position_ids" in batch:  # packed: the examples' own positions; the padding a sequence
        positions = torch.cat(
            [batch["position_ids"], torch.arange(pad, dtype=torch.long).expand(rows, pad)], 1
        )
    else:
        positions = torch.arange(width + pad, dtype=torch.long).expand(rows, width + pad)
    shifted = F.pad(labels[:, 1:], (0, pad + 1), value=IGNORE)
    size = (width + pad) // n
    part = slice(rank * size, (rank + 1) * size)

    def cut(t: torch.Tensor) -> torch.Tensor:
        return t[:, part].contiguous()

    mine = cut(shifted)
    return {
        "input_ids": cut(F.pad(ids, (0, pad), value=pad_id)),
        "labels": mine,
        "shift_labels": mine,
        "position_ids": cut(positions),
        NUM_TOKENS: cut(F.pad(real, (0, pad))).sum(),
        NUM_ROWS: batch[NUM_ROWS],
    }
