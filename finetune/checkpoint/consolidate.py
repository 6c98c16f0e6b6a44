"""Streaming gather of ZeRO-3 parameters into HuggingFace safetensors shards, written by rank 0.

Why not ``save_16bit_model`` / ``save_pretrained``: both need the whole state dict in rank-0 RAM.
Here the shard layout is planned up front from parameter *metadata* (full shapes are known under
ZeRO-3 as ``ds_shape``), each shard's safetensors header is written first, and then parameters
are gathered one module at a time and their bytes appended to the open shard. Rank 0's extra
memory is about one module's gathered parameters, whatever the shard size.

Tied parameters are written once, under the first name ``named_parameters`` gives them (what
``save_pretrained`` does; ``from_pretrained`` re-ties them). Frozen parameters are written too.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from finetune import distributed as dist
from finetune.checkpoint.manifest import HashingWriter, write_json_durably

SAFE_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
               torch.bool: "BOOL"}
INDEX = "model.safetensors.index.json"


def tensor_entries(model) -> list[tuple[str, torch.nn.Module, str, bool]]:
    """(full name, owning module, attribute name, is_param) in module order, each tensor once."""
    seen: set[int] = set()
    out = []
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for attr, p in module.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                out.append((prefix + attr, module, attr, True))
        for attr, b in module.named_buffers(recurse=False):
            if b is not None and attr not in module._non_persistent_buffers_set and id(b) not in seen:
                seen.add(id(b))
                out.append((prefix + attr, module, attr, False))
    return out


def _full_shape(t: torch.Tensor) -> tuple[int, ...]:
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


def plan_shards(entries, dtype: torch.dtype, max_shard_size: str | int) -> tuple[ShardPlan, dict]:
    """Fill shards in gather order (a new shard when the next tensor would overflow), HF file names.

    Order matters: tensors are streamed as they are gathered, so each shard must hold a
    contiguous run of the gather order (huggingface_hub's planner may reorder).
    """
    from huggingface_hub.serialization._base import parse_size_to_int

    limit = parse_size_to_int(max_shard_size) if isinstance(max_shard_size, str) else int(max_shard_size)
    meta, shards, size = {}, [[]], 0
    for name, module, attr, _ in entries:
        t = getattr(module, attr)
        meta[name] = torch.empty(_full_shape(t), dtype=_out_dtype(t, dtype), device="meta")
        n = meta[name].numel() * meta[name].element_size()
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    if len(shards) == 1:
        files = {"model.safetensors": shards[0]}
    else:
        files = {f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors": names for i, names in enumerate(shards)}
    total = sum(m.numel() * m.element_size() for m in meta.values())
    return ShardPlan(files, {n: f for f, names in files.items() for n in names}, total), meta


def _header(names: list[str], meta: dict[str, torch.Tensor]) -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        t = meta[name]
        n = t.numel() * t.element_size()
        header[name] = {"dtype": SAFE_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data section to 8 bytes
    return struct.pack("<Q", len(raw)) + raw


class _ShardWriter:
    """Rank 0's open shard files; tensors must arrive in the planned order."""

    def __init__(self, folder: Path, split, meta):
        self.folder, self.split, self.meta = folder, split, meta
        self.order = [(fname, name) for fname, names in split.filename_to_tensors.items() for name in names]
        self.pos = 0
        self.file = self.writer = None
        self.current: str | None = None
        self.files: dict[str, tuple[int, str]] = {}

    def write(self, name: str, tensor: torch.Tensor) -> None:
        assert tuple(tensor.shape) == tuple(self.meta[name].shape), f"{name}: gathered {tuple(tensor.shape)}"
        self.begin(name)
        self.append(tensor)
        self.end(name, tensor.numel())

    def begin(self, name: str) -> None:
        fname, expected = self.order[self.pos]
        assert name == expected, f"consolidation order broke: got {name}, planned {expected}"
        if fname != self.current:
            self._close()
            self.current = fname
            self.file = open(self.folder / fname, "wb")
            self.writer = HashingWriter(self.file)
            self.writer.write(_header(self.split.filename_to_tensors[fname], self.meta))
        self.appended = 0

    def append(self, piece: torch.Tensor) -> None:
        """The next elements of the current tensor, in flattened order."""
        data = piece.detach().reshape(-1).to(self.meta[self.order[self.pos][1]].dtype).contiguous().cpu()
        if data.numel():
            self.writer.write(data.view(torch.uint8).numpy())
        self.appended += data.numel()

    def end(self, name: str, numel: int) -> None:
        assert self.appended == numel == self.meta[name].numel(), f"{name}: wrote {self.appended} of {numel} elements"
        self.pos += 1

    def _close(self) -> None:
        if self.file is not None:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            self.files[self.current] = (self.writer.size, self.writer.digest())
            self.file = None

    def finish(self) -> dict[str, tuple[int, str]]:
        self._close()
        assert self.pos == len(self.order), f"wrote {self.pos} of {len(self.order)} tensors"
        if self.split.is_sharded:
            index = {"metadata": {"total_size": self.split.total_size}, "weight_map": self.split.tensor_to_filename}
            self.files[INDEX] = write_json_durably(self.folder / INDEX, index)
        return self.files


def _module_groups(entries) -> Iterator[list[tuple[str, torch.nn.Module, str, bool]]]:
    """Consecutive entries of the same module: gathered together, one collective per module."""
    group: list = []
    for e in entries:
        if group and group[-1][1] is not e[1]:
            yield group
            group = []
        group.append(e)
    if group:
        yield group


# Parameters at least this big are not gathered whole: each rank sends its partition to rank 0 in
# turn, so rank 0 holds 1/world of one parameter (embeddings and LM heads are the large ones).
# Test seam: FINETUNE_STREAM_BYTES lowers it so tiny test models take the streaming path too.
STREAM_BYTES = 8 << 20


def _streamable(p) -> bool:
    """Decided from facts every rank shares (full size, offload config), never from a rank's own
    partition: the answer picks send/recv or all-gather, and all ranks must pick the same."""
    threshold = int(os.environ.get("FINETUNE_STREAM_BYTES", STREAM_BYTES))
    on_nvme = str(getattr(getattr(p, "ds_tensor", None), "final_location", "")).endswith("nvme")
    return hasattr(p, "ds_numel") and not on_nvme and p.ds_numel * p.element_size() >= threshold


def _stream_partitions(p, writer: _ShardWriter | None, name: str, write: bool) -> BaseException | None:
    """Every rank must call this: the ZeRO-3 partitions of ``p``, in rank order, to rank 0.

    Partition r holds elements [r*n, (r+1)*n) of the flattened parameter (the last ones padded),
    so appending them in rank order and stopping at ds_numel rebuilds it.
    """
    import torch.distributed as tdist

    part = p.ds_tensor.detach()
    if not dist.is_main():
        tdist.send(part.contiguous(), dst=0)
        return None
    # Rank 0 receives every partition even when it is not writing (after an earlier error).
    error, remaining = (None, p.ds_numel) if write else (RuntimeError("skipped"), p.ds_numel)
    if write:
        try:
            writer.begin(name)
        except (OSError, AssertionError) as e:
            error = e
    buf = torch.empty_like(part) if dist.world_size() > 1 else None
    for r in range(dist.world_size()):
        piece = part
        if r:
            tdist.recv(buf, src=r)  # received even after a write error: rank r is sending regardless
            piece = buf
        n = min(remaining, piece.numel())
        remaining -= n
        if error is None:
            try:
                writer.append(piece[:n])
            except OSError as e:
                error = e
    if error is None:
        try:
            writer.end(name, p.ds_numel)
        except AssertionError as e:
            error = e
    return error if write else None


def save_consolidated(model, folder: Path, dtype: torch.dtype, max_shard_size: str | int) -> dict[str, tuple[int, str]]:
    """Write HF safetensors shards of ``model`` into ``folder``. Collective: every rank must call it.

    Returns {file name: (size, checksum)} on rank 0, {} elsewhere. A write error on rank 0 is
    raised only after every gather has been done, so the other ranks are never left waiting.
    """
    import deepspeed

    entries = tensor_entries(model)
    split, meta = plan_shards(entries, dtype, max_shard_size)
    writer = _ShardWriter(folder, split, meta) if dist.is_main() else None
    error: BaseException | None = None
    for group in _module_groups(entries):
        tensors = [(name, getattr(m, a), is_param) for name, m, a, is_param in group]
        streamed = {id(t) for _, t, is_param in tensors if is_param and _streamable(t)}
        gathered = [t for _, t, is_param in tensors if is_param and hasattr(t, "ds_id") and id(t) not in streamed]
        # Every rank must enter: this all-gathers the module's small partitioned parameters.
        with deepspeed.zero.GatheredParameters(gathered, modifier_rank=None, enabled=bool(gathered)):
            for name, t, _ in tensors:
                if id(t) in streamed:
                    error = _stream_partitions(t, writer, name, write=error is None) or error
                elif writer is not None and error is None:
                    try:
                        writer.write(name, t)
                    except (OSError, AssertionError) as e:
                        error = e
    if writer is None:
        return {}
    if error is not None:
        raise error
    return writer.finish()
