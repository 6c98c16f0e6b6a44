"""Streaming gather of ZeRO-3 parameters into HuggingFace safetensors shards, written by rank 0.

Why not ``save_16bit_model`` / ``save_pretrained``: both need the whole state dict in rank-0 RAM.
Here the shard layout is planned up front from parameter *metadata* (full shapes are known under
ZeRO-3 as ``ds_shape``), on every rank, so a dtype safetensors can't hold fails on every rank before
the first collective. Each shard's safetensors header is written first, and then parameters are
gathered and their bytes appended to the open shard. Two ways in, picked per parameter from facts
every rank shares:

* small parameters are all-gathered one module at a time (``GatheredParameters``);
* parameters of at least ``STREAM_BYTES`` are streamed: each rank's ZeRO-3 partition goes to
  rank 0 point to point, always through ``batch_isend_irecv`` (each other rank posts its send as
  one batch, rank 0 posts its receives a window of ranks per batch). Batched, NCCL runs them on
  the group's communicator instead of building a two-rank one per pair. Partitions travel on
  the backend's device (the GPU under NCCL, even when parameters are offloaded to CPU; CPU under
  gloo), and rank 0 copies each received piece to CPU to write it.

Which values are written: what ``finetune export`` rebuilds from the same checkpoint, bit for bit,
in every dtype. Export casts the optimizer's fp32 master weights; the 16-bit module weights of a
bf16/fp16 run are those masters already cast to 16 bits (DeepSpeed copies them over after every
step and on load), so they are the answer only in their own dtype. A trainable parameter whose
module dtype is neither the requested one nor the master's (bf16 weights written as fp32 or fp16)
is therefore streamed from each rank's partition of its fp32 master (``safe_get_local_fp32_param``;
on CPU under optimizer offload, staged like any partition), whatever its size. Frozen parameters
and buffers have no master: their module values are what export writes too. Every shard's
safetensors metadata records this (``SOURCE_KEY``), so export copies consolidated weights only
when they are what it would rebuild.

Rank 0's extra memory, whatever the shard size: one module's gathered small parameters, or for a
streamed parameter one window of received partitions (about ``STREAM_BYTES``, at least one
partition) plus the piece being written, on CPU.

A failure while writing (rank 0) or while staging a partition to send (other ranks) is recorded
and raised only after the last gather, so no rank is left waiting in a collective or a receive.

Tied parameters are written once, under the first name ``named_parameters`` gives them (what
``save_pretrained`` does; ``from_pretrained`` re-ties them). Frozen parameters are written too.

Used by the online save (checkpoint/contents.py, --save_consolidated) and by adapter.py (a LoRA
checkpoint's adapter file); the exports read ``SOURCE_KEY`` to decide whether a copy is exact.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

from finetune import distributed as dist
from finetune.checkpoint_format.outdir import step_of
from finetune.io import seams
from finetune.io.faults import fault_point
from finetune.weights.shards import ConsolidationError, ShardWriter, plan_shards

# Backends that move CPU tensors; any other one (nccl, hccl, ...) moves only accelerator tensors.
CPU_BACKENDS = frozenset({"gloo", "mpi", "ccl"})

# In each shard's safetensors metadata: what its trainable parameters were written from.
# FROM_MASTER: each is its fp32 master weight cast to the written dtype (read from the master, or
# from module weights that equal that cast bit for bit), which is what export rebuilds.
# FROM_MODULE: the module weights cast; checkpoints written before this record hold those too.
SOURCE_KEY = "finetune_weights_from"
FROM_MASTER = "fp32 master"
FROM_MODULE = "module weights"

# One tensor of the model: (full name, owning module, attribute name, is_param).
TensorEntry = tuple[str, torch.nn.Module, str, bool]


class ConsolidationFailed(RuntimeError):
    """The consolidated save failed *after* every rank finished its collectives (or before the
    first one, alike on every rank): safe to record and agree on. Anything else that escapes
    ``save_consolidated`` means the ranks may be out of step."""


def tensor_entries(model: torch.nn.Module) -> list[TensorEntry]:
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
            if (
                b is not None
                and attr not in module._non_persistent_buffers_set
                and id(b) not in seen
            ):
                seen.add(id(b))
                out.append((prefix + attr, module, attr, False))
    return out


class _FirstError:
    """The first error this rank hit, held until every rank is past the last gather.

    Raising mid-loop would leave the other ranks waiting in a collective or a receive for ever;
    the caller's agreement step turns the error raised at the end into a failed save everywhere.
    """

    def __init__(self) -> None:
        self.error: Exception | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def attempt(self, fn: Callable[..., object], *args: object) -> None:
        """``fn(*args)`` unless an error is already held; any exception it raises is held."""
        if self.error is not None:
            return
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001
            # OOM, I/O, a bug: all held and raised by raise_if_any
            self.hold(e)

    def hold(self, e: Exception) -> None:
        if self.error is None:
            self.error = e

    def raise_if_any(self) -> None:
        """Raise the held error as ConsolidationFailed: every rank is past every collective."""
        if self.error is not None:
            raise ConsolidationFailed(f"{type(self.error).__name__}: {self.error}") from self.error


def _module_groups(entries: Iterable[TensorEntry]) -> Iterator[list[TensorEntry]]:
    """Consecutive entries of the same module: gathered together, one collective per module."""
    group: list[TensorEntry] = []
    for e in entries:
        if group and group[-1][1] is not e[1]:
            yield group
            group = []
        group.append(e)
    if group:
        yield group


# Parameters at least this big are not gathered whole: each rank sends its partition to rank 0,
# which receives about this many bytes of partitions at a time (embeddings and LM heads are the
# large ones). Test seam: FINETUNE_STREAM_BYTES lowers it so tiny test models take that path too.
STREAM_BYTES = 8 << 20


def _stream_bytes() -> int:
    return int(seams.number(seams.STREAM_BYTES, STREAM_BYTES))


def _streamable(p: torch.nn.Parameter) -> bool:
    """Decided from facts every rank shares (full size, offload config), never from a rank's own
    partition: the answer picks send/recv or all-gather, and all ranks must pick the same."""
    on_nvme = str(getattr(getattr(p, "ds_tensor", None), "final_location", "")).endswith("nvme")
    return (
        hasattr(p, "ds_numel") and not on_nvme and p.ds_numel * p.element_size() >= _stream_bytes()
    )


def master_dtype(p: torch.nn.Parameter) -> torch.dtype | None:
    """The dtype of ``p``'s master weights in DeepSpeed's ZeRO-3 optimizer, or None when no
    optimizer holds it (frozen, or an engine built without one)."""
    optimizer = getattr(p, "_z3_optimizer", None)
    if optimizer is None or not p.requires_grad or not hasattr(p, "ds_id"):
        return None
    return getattr(optimizer, "master_weights_and_grads_dtype", torch.float32)


def reads_master(p: torch.nn.Parameter, dtype: torch.dtype) -> bool:
    """Whether ``p`` is written from its master weights rather than its module weights.

    The module weights are the master cast to ``p.dtype`` (DeepSpeed copies the fp32 partitions
    into them after each step and on load), so they are exact when written in their own dtype
    or when they are as wide as the master; any other cast of them would round twice. Decided
    from facts every rank shares (dtypes, trainability): it picks the collective.
    """
    master = master_dtype(p)
    return master is not None and p.dtype not in (dtype, master)


def weights_source(params: Iterable[torch.nn.Parameter]) -> str:
    """What consolidated trainable parameters are written from (``SOURCE_KEY``): FROM_MASTER when
    every one has master weights (read from them, or exact module weights), else FROM_MODULE."""
    trainable = [p for p in params if p.requires_grad and hasattr(p, "ds_id")]
    return (
        FROM_MASTER
        if trainable and all(master_dtype(p) is not None for p in trainable)
        else FROM_MODULE
    )


def comm_device(backend: str, accelerator: torch.device) -> torch.device:
    """Where a tensor must be for point-to-point on ``backend``, wherever it lives now.

    NCCL moves only accelerator tensors, so a CPU-offloaded partition goes to ``accelerator``
    first; gloo moves only CPU ones. A per-device backend string ("cpu:gloo,cuda:nccl") counts as
    accelerator-capable as soon as one of its backends is.
    """
    names = {part.rsplit(":", 1)[-1].strip() for part in backend.lower().split(",")}
    return accelerator if names - CPU_BACKENDS else torch.device("cpu")


def recv_window(partition_bytes: int, peers: int, budget: int) -> int:
    """How many ranks' partitions rank 0 receives in one batch: the window's buffers total at most
    ``max(budget, partition_bytes)`` bytes, so at least one rank, and never more than ``peers``."""
    return min(peers, max(1, budget // max(1, partition_bytes)))


def _p2p(ops: list[torch.distributed.P2POp]) -> None:
    import torch.distributed as tdist

    for req in tdist.batch_isend_irecv(ops):
        req.wait()


def _local_partition(
    p: torch.nn.Parameter, name: str, spec: torch.Tensor, master: bool
) -> torch.Tensor:
    """This rank's ZeRO-3 partition of ``p``, flat: of its master weights, or of
    its module weights."""
    if master:
        from deepspeed.utils import safe_get_local_fp32_param

        # Under optimizer offload the master lives on CPU; DeepSpeed
        # hands it back on the accelerator.
        part = safe_get_local_fp32_param(p)
    else:
        part = p.ds_tensor
    if part is None or part.numel() != spec.numel() or part.dtype != spec.dtype:
        got = "none" if part is None else f"{part.numel()} {part.dtype} elements"
        raise ConsolidationError(
            f"{name}: this rank's partition has {got}, planned {spec.numel()} {spec.dtype}"
        )
    return part.detach().reshape(-1)


def _partition_spec(p: torch.nn.Parameter, master: bool) -> torch.Tensor:
    """Shape and dtype of every rank's partition of ``p`` (a meta tensor), from metadata every rank
    shares: ZeRO-3 pads each parameter to a multiple of the world size and splits it evenly."""
    numel = -(-p.ds_numel // dist.world_size())
    return torch.empty(numel, dtype=master_dtype(p) if master else p.dtype, device="meta")


def _staged(
    fetch: Callable[[], torch.Tensor], device: torch.device, failed: _FirstError
) -> torch.Tensor | None:
    """``fetch()`` on ``device``; None, with the error held, if that fails."""
    try:
        return fetch().to(device).contiguous()
    except Exception as e:  # noqa: BLE001 — held: the point-to-point transfer goes ahead regardless
        failed.hold(e)
        return None


def _send_partition(
    fetch: Callable[[], torch.Tensor], spec: torch.Tensor, device: torch.device, failed: _FirstError
) -> None:
    """A non-zero rank's side: one batched isend of its partition to rank 0."""
    import torch.distributed as tdist

    staged = _staged(fetch, device, failed)
    if staged is None:
        # A placeholder of the planned size keeps rank 0's receive matched; the held
        # error fails the save. Should even this allocation fail, the error propagates
        # and the group's timeout ends it.
        staged = torch.zeros(spec.shape, dtype=spec.dtype, device=device)
    _p2p([tdist.P2POp(tdist.isend, staged, 0)])


def _received_partitions(
    spec: torch.Tensor, device: torch.device, peers: int
) -> Iterator[torch.Tensor]:
    """Rank 0's side: ranks 1..peers' partitions in rank order, a window of ranks per batch.

    The buffers are reused by the next window: each piece must be consumed before the next one.
    Failures of the transport itself (allocating these buffers, a broken connection) propagate:
    there is no way to keep the other ranks in step without them.
    """
    import torch.distributed as tdist

    window = recv_window(spec.numel() * spec.element_size(), peers, _stream_bytes())
    buffers = [torch.empty(spec.shape, dtype=spec.dtype, device=device) for _ in range(window)]
    for first in range(1, peers + 1, window):
        ranks = range(first, min(first + window, peers + 1))
        _p2p([tdist.P2POp(tdist.irecv, buf, r) for buf, r in zip(buffers, ranks)])
        yield from buffers[: len(ranks)]


def _stream_partitions(
    p: torch.nn.Parameter, writer: ShardWriter | None, name: str, failed: _FirstError, master: bool
) -> None:
    """Every rank must call this: the ZeRO-3 partitions of ``p`` (of its master weights when
    ``master``), in rank order, to rank 0.

    Partition r holds elements [r*n, (r+1)*n) of the flattened parameter (the last ones padded),
    so appending them in rank order and stopping at ds_numel rebuilds it; the fp32 master
    partitions are laid out the same way. Rank 0 receives every partition even after an error,
    since every other rank is sending regardless.
    """
    import torch.distributed as tdist

    peers = dist.world_size() - 1
    device = comm_device(tdist.get_backend(), dist.device()) if peers else torch.device("cpu")
    spec = _partition_spec(p, master)
    fetch = functools.partial(_local_partition, p, name, spec, master)
    if not dist.is_main():
        _send_partition(fetch, spec, device, failed)
        return
    failed.attempt(writer.begin, name)
    own = _staged(fetch, torch.device("cpu"), failed) if failed.ok else None
    remaining = p.ds_numel
    received = _received_partitions(spec, device, peers) if peers else ()
    for piece in itertools.chain([own] if own is not None else [], received):
        n = min(remaining, piece.numel())
        remaining -= n
        # copied to CPU before the next window reuses the buffer
        failed.attempt(writer.append, piece[:n])
    failed.attempt(writer.end, name, p.ds_numel)


def save_consolidated(
    model: torch.nn.Module,
    folder: Path,
    dtype: torch.dtype,
    max_shard_size: str | int,
    *,
    select: Callable[[list[TensorEntry]], list[TensorEntry]] | None = None,
    basename: str = "model",
) -> dict[str, tuple[int, str]]:
    """Write HF safetensors shards of ``model`` into ``folder``. Collective:
    every rank must call it.

    ``select`` picks (and may rename) the entries written, from ``tensor_entries(model)``, alike
    on every rank (the adapters alone: weights/adapter.py); ``basename`` names the files.
    Returns {file name: (size, checksum)} on rank 0, {} elsewhere. Any error a rank hits while
    writing or staging is raised only after every gather has been done, so the other ranks are
    never left waiting.
    """
    import deepspeed

    entries = tensor_entries(model)
    entries = select(entries) if select is not None else entries
    try:
        # Raises on every rank alike, before any collective.
        split, meta = plan_shards(entries, dtype, max_shard_size, basename)
    except ValueError as e:
        raise ConsolidationFailed(str(e)) from e
    metadata = {
        SOURCE_KEY: weights_source([getattr(m, a) for _, m, a, is_param in entries if is_param])
    }
    writer = ShardWriter(folder, split, meta, metadata) if dist.is_main() else None
    failed = _FirstError()
    # A rank's own work failing (held like any other: the gathers below still run on every rank).
    failed.attempt(lambda: fault_point("save.consolidated_gather", step_of(folder.name)))
    for group in _module_groups(entries):
        tensors = [(name, getattr(m, a), is_param) for name, m, a, is_param in group]
        # Master weights are only ever streamed: nothing gathers them whole on every rank.
        masters = {id(t) for _, t, is_param in tensors if is_param and reads_master(t, dtype)}
        streamed = masters | {id(t) for _, t, is_param in tensors if is_param and _streamable(t)}
        gathered = [
            t
            for _, t, is_param in tensors
            if is_param and hasattr(t, "ds_id") and id(t) not in streamed
        ]
        # Every rank must enter: this all-gathers the module's small partitioned parameters.
        with deepspeed.zero.GatheredParameters(
            gathered, modifier_rank=None, enabled=bool(gathered)
        ):
            for name, t, _ in tensors:
                if id(t) in streamed:
                    _stream_partitions(t, writer, name, failed, master=id(t) in masters)
                elif writer is not None:
                    failed.attempt(writer.write, name, t)
    if writer is None:
        failed.raise_if_any()
        return {}
    if failed.ok:
        try:
            return writer.finish()  # rank 0 alone, after the last collective
        except Exception as e:  # noqa: BLE001
            # a full disk at the last close or the index: agreed by the caller
            failed.hold(e)
    writer.abandon()  # never raises; frees the partial shards' space for the rest of the save
    failed.raise_if_any()
    return {}
