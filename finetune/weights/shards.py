"""HuggingFace safetensors shards written as a stream: the layout planned up front from tensor
metadata, each shard's header first, then each tensor's bytes appended in the planned order.

Used by the consolidated save (rank 0, tensors arriving from gathers) and by export (tensors
rebuilt from rank files).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from finetune.checkpoint_format.outdir import step_of
from finetune.config.checkpoint import size_bytes
from finetune.io import seams
from finetune.io.durable import HashingWriter, write_json_durably
from finetune.io.faults import fault_point

SAFE_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
INDEX = "model.safetensors.index.json"


class ConsolidationError(RuntimeError):
    """The gathered tensors don't match the plan (order, shape or element count)."""


def full_shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(t, "ds_shape", t.shape))


def _out_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    return dtype if t.is_floating_point() else t.dtype


@dataclass
class ShardPlan:
    filename_to_tensors: dict[str, list[str]]
    tensor_to_filename: dict[str, str]
    total_size: int

    @property
    def is_sharded(self) -> bool:
        return len(self.filename_to_tensors) > 1

    def write_index(self, folder: Path) -> dict[str, tuple[int, str]]:
        """model.safetensors.index.json beside the shards when there are several:
        {name: (size, checksum)}."""
        if not self.is_sharded:
            return {}
        index = {"metadata": {"total_size": self.total_size}, "weight_map": self.tensor_to_filename}
        return {INDEX: write_json_durably(folder / INDEX, index)}


def plan_shards(
    entries: Iterable[tuple[str, Any, str, bool]],
    dtype: torch.dtype,
    max_shard_size: str | int,
    basename: str = "model",
) -> tuple[ShardPlan, dict[str, torch.Tensor]]:
    """Fill shards in gather order (a new shard when the next tensor would overflow), HF file names
    (``basename``.safetensors, or ``basename``-0000i-of-0000n.safetensors). ``entries``: (name,
    owner, attribute, is_param), the tensor being ``getattr(owner, attribute)`` (a module's
    parameter or buffer, or a holder of a tensor rebuilt from rank files). Returns the plan and
    each tensor's written shape and dtype (meta tensors).

    Order matters: tensors are streamed as they are gathered, so each shard must hold a
    contiguous run of the gather order (huggingface_hub's planner may reorder). Raises ValueError
    for a dtype safetensors can't hold: from metadata every rank shares, so every rank raises it
    before the first collective rather than rank 0 alone in the middle of the gathers.
    """
    limit = size_bytes(max_shard_size) if isinstance(max_shard_size, str) else int(max_shard_size)
    meta: dict[str, torch.Tensor] = {}
    shards: list[list[str]] = [[]]
    size = 0  # bytes in the last shard
    for name, module, attr, _ in entries:
        t = getattr(module, attr)
        out = _out_dtype(t, dtype)
        if out not in SAFE_DTYPES:
            supported = ", ".join(sorted(str(d).removeprefix("torch.") for d in SAFE_DTYPES))
            raise ValueError(f"can't write {name} as {out} to safetensors (supported: {supported})")
        meta[name] = torch.empty(full_shape(t), dtype=out, device="meta")
        n = meta[name].numel() * meta[name].element_size()
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    if len(shards) == 1:
        files = {f"{basename}.safetensors": shards[0]}
    else:
        files = {
            f"{basename}-{i + 1:05d}-of-{len(shards):05d}.safetensors": names
            for i, names in enumerate(shards)
        }
    total = sum(m.numel() * m.element_size() for m in meta.values())
    return ShardPlan(files, {n: f for f, names in files.items() for n in names}, total), meta


def read_header(path: Path) -> dict:
    """A safetensors file's JSON header: {"__metadata__": {...}, name: {"dtype", "shape",
    "data_offsets"}}."""
    with open(path, "rb") as f:
        return json.loads(f.read(int.from_bytes(f.read(8), "little")))


SAFE_TO_DTYPE = {name: dtype for dtype, name in SAFE_DTYPES.items()}


def shard_header(
    names: list[str], meta: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> bytes:
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name in names:
        t = meta[name]
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": SAFE_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data section to 8 bytes
    return struct.pack("<Q", len(raw)) + raw


class ShardWriter:
    """Rank 0's open shard files; tensors must arrive in the planned order."""

    def __init__(
        self,
        folder: Path,
        split: ShardPlan,
        meta: dict[str, torch.Tensor],
        metadata: dict[str, str] | None = None,
    ):
        self.folder = folder
        self.split = split
        self.meta = meta
        self.metadata = metadata
        self.order = [
            (fname, name) for fname, names in split.filename_to_tensors.items() for name in names
        ]
        self.pos = 0
        self.file: BinaryIO | None = None  # the open shard
        self.writer: HashingWriter | None = None  # hashes what goes into it
        self.current: str | None = None
        self.files: dict[str, tuple[int, str]] = {}
        self.created: list[Path] = []  # every shard file opened, for abandon()
        self.step = step_of(folder.name)  # the save's, for the fault sites

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.meta and tuple(tensor.shape) != tuple(self.meta[name].shape):
            raise ConsolidationError(
                f"{name}: gathered shape {tuple(tensor.shape)}, planned "
                f"{tuple(self.meta[name].shape)}"
            )
        self.begin(name)
        self.append(tensor)
        self.end(name, tensor.numel())

    def begin(self, name: str) -> None:
        if self.pos >= len(self.order):
            raise ConsolidationError(
                f"consolidation order broke: got {name} after the last planned tensor"
            )
        fname, expected = self.order[self.pos]
        if name != expected:
            raise ConsolidationError(f"consolidation order broke: got {name}, planned {expected}")
        if fname != self.current:
            self._close()
            self.current = fname
            self.file = open(self.folder / fname, "wb")
            self.created.append(self.folder / fname)
            self.writer = HashingWriter(self.file)
            self.writer.write(
                shard_header(self.split.filename_to_tensors[fname], self.meta, self.metadata)
            )
            fault_point("save.consolidated_write", self.step)  # after the open and the header
            if seams.value(seams.SLOW_SAVE):  # a moment for a test to fill the disk mid-shard
                self.writer.flush()
                seams.pause(seams.SLOW_SAVE)
        self.appended = 0

    def append(self, piece: torch.Tensor) -> None:
        """The next elements of the current tensor, in flattened order."""
        # To CPU first: a received or gathered piece may be on the GPU, and the cast needs no GPU
        # memory there.
        data = (
            piece.detach()
            .reshape(-1)
            .cpu()
            .to(self.meta[self.order[self.pos][1]].dtype)
            .contiguous()
        )
        raw = data.view(torch.uint8).numpy()
        half = len(raw) // 2
        self.writer.write(raw[:half])
        # mid-tensor: half of this piece is written
        fault_point("save.consolidated_append", self.step)
        self.writer.write(raw[half:])
        self.appended += data.numel()

    def end(self, name: str, numel: int) -> None:
        if not self.appended == numel == self.meta[name].numel():
            raise ConsolidationError(
                f"{name}: wrote {self.appended} of {numel} elements, "
                f"planned {self.meta[name].numel()}"
            )
        self.pos += 1

    def _close(self) -> None:
        if self.file is not None:
            fault_point("save.consolidated_close", self.step)
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            self.files[self.current] = (self.writer.size, self.writer.digest())
            self.file = None

    def abandon(self) -> None:
        """After a failure: close the open shard and delete every shard this writer created, so
        the rest of the save (a full disk's last bytes) has their space back. Never raises: closing
        a file whose buffer cannot be flushed (ENOSPC, EIO) fails again, and it is this failure's
        second report; a file that cannot be deleted is left for the caller's cleanup."""
        if self.file is not None:
            file = self.file
            self.file = None
            try:
                # the buffered bytes are flushed once more and fail; the descriptor is closed anyway
                file.close()
            except OSError:
                pass
        for path in self.created:
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass  # removed with the staging, or by the agree step's cleanup
        self.created = []
        self.files = {}

    def finish(self) -> dict[str, tuple[int, str]]:
        self._close()
        if self.pos != len(self.order):
            raise ConsolidationError(f"wrote {self.pos} of {len(self.order)} planned tensors")
        self.files.update(self.split.write_index(self.folder))
        return self.files
