"""Reading a ZeRO-3 checkpoint's rank files without DeepSpeed, torch.distributed
or the original ranks.

What the rank files hold (the format DeepSpeed's zero_to_fp32.py reads too):

  zero_pp_rank_{r}_mp_rank_00_model_states.pt
      param_shapes            one {name: full shape} per optimizer group: the trainable parameters,
                              in the order their partitions sit in the flat fp32 groups
      frozen_param_shapes     {name: full shape}; frozen_param_fragments: rank r's partition of each
      buffer_names, module    persistent buffers, whole on every rank (parameters are empty there)
      shared_params           {alias: name} for tied parameters, stored once under ``name``
  zero_pp_rank_{r}_mp_rank_00_optim_states.pt
      optimizer_state_dict.fp32_flat_groups   1-D fp32 tensors; end to end, they hold for each
                              parameter in param_shapes order rank r's ceil(numel / world) elements
                              of the flattened parameter (the last rank's tail is padding)

So a parameter is the concatenation over ranks of one slice at the same offset on every rank,
trimmed to numel. Memory stays bounded whatever the model size:
  * the rank files are memory-mapped (``torch.load(mmap=True)``): only the fp32 master weights are
    ever read; Adam's two moments, two thirds of each file, are never touched;
  * the shard layout is planned up front (``shards.plan_shards``), each header written first,
    then every parameter is copied rank by rank in chunks of at most CHUNK_BYTES, straight from the
    mapping into the output file;
  * mapped pages count in RSS once touched, so each chunk's pages are handed back with
    madvise(MADV_DONTNEED) as soon as they are written. They are clean pages of a private file
    mapping: the kernel drops them and would re-read them from the file, so nothing is lost.
    (Checked per file against /proc/self/maps; where that can't be checked, nothing is released.)

The rank files are DeepSpeed pickles: they are read with ``torch.load(weights_only=True)`` and the
allow-list of ``safe_load`` (anything else is refused, named), DeepSpeed's classes in them (an enum,
the loss scaler) as inert placeholders, so reading never runs code from the files nor imports
DeepSpeed.

Used by the offline exports (offline/export.py, lora_export.py, model_files.py).
"""

from __future__ import annotations

import ctypes
import json
import math
import mmap
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from finetune.checkpoint_format.manifest import RANK_FILE_PATTERNS, read_manifest
from finetune.checkpoint_format.outdir import step_of
from finetune.checkpoint_format.state import TRAINER_STATE
from finetune.config import ConfigError
from finetune.io.faults import fault_point
from finetune.weights import safe_load

CHUNK_BYTES = 8 << 20  # read, converted and written at a time
MODEL_FILE = RANK_FILE_PATTERNS[0]
OPTIM_FILES = (RANK_FILE_PATTERNS[1], "bf16_" + RANK_FILE_PATTERNS[1])
MODEL_FILE_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")


def rank_model_files(folder: Path) -> dict[int, Path]:
    """{rank: its model-states file} for the files present in ``folder``."""
    found = {}
    for p in folder.iterdir():
        m = MODEL_FILE_RE.match(p.name)
        if m:
            found[int(m.group(1))] = p
    return found


# --- reading the rank files ---------------------------------------------------------------------


def _load(path: Path) -> dict:
    try:
        fault_point("export.read_rank_file", step_of(path.parent.name))
        return safe_load.load(path, "cpu", mmap=True, inert=True)
    except (RuntimeError, EOFError, OSError) as e:
        raise ConfigError(f"{path}: unreadable DeepSpeed file ({type(e).__name__}: {e})") from e


class _Pager:
    """Hands consumed pages of one memory-mapped file back to the kernel (see the module doc)."""

    PAGE = mmap.PAGESIZE
    MADV_DONTNEED = 4
    _madvise = None

    def __init__(self, path: Path, sample: torch.Tensor | None):
        found = sample is not None and sample.numel() > 0 and self._libc() is not None
        # [start, end) of the file's mapping
        self.span = _mapping_of(sample.data_ptr(), path) if found else None
        self.enabled = self.span is not None

    @classmethod
    def _libc(cls) -> Callable[[int, int, int], int] | None:
        """libc's madvise, once; None where there is none (not Linux)."""
        if cls._madvise is None and sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(None, use_errno=True).madvise
            except (OSError, AttributeError):
                return None
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
            cls._madvise = fn
        return cls._madvise

    def release(self, t: torch.Tensor) -> None:
        """Drop the whole pages under ``t`` (its last, partial page goes with the next chunk)."""
        if not self.enabled or t.numel() == 0:
            return
        begin = max(t.data_ptr() & ~(self.PAGE - 1), self.span[0])
        end = (t.data_ptr() + t.numel() * t.element_size()) & ~(self.PAGE - 1)
        if t.data_ptr() >= self.span[0] and end <= self.span[1] and end > begin:
            self._madvise(begin, end - begin, self.MADV_DONTNEED)


def _mapping_of(address: int, path: Path) -> tuple[int, int] | None:
    """The span of the mapping of ``path`` that holds ``address``, or None when ``address`` is not
    in one (then MADV_DONTNEED could lose data: it is never called)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    real = os.path.realpath(path)
    for line in maps:
        fields = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= address < hi:
            return (lo, hi) if len(fields) == 6 and fields[5].strip() == real else None
    return None


def _chunks(flat: torch.Tensor, pager: _Pager) -> Iterator[torch.Tensor]:
    """Slices of a 1-D tensor of at most CHUNK_BYTES; each one's pages are
    released once consumed."""
    step = max(1, CHUNK_BYTES // max(flat.element_size(), 1))
    for i in range(0, flat.numel(), step):
        piece = flat[i : i + step]
        yield piece
        pager.release(piece)


@dataclass
class Entry:
    """One tensor to write, as the rank files describe it; ``ZeroCheckpoint.pieces`` streams it."""

    name: str
    shape: torch.Size
    dtype: torch.dtype  # as stored
    kind: str  # "trainable", "frozen" or "buffer"
    offset: int = 0  # trainable: where its partition starts in every rank's flat fp32 space


class _Flat:
    """One rank's fp32 flat groups, addressed as if they were one tensor end to end."""

    def __init__(self, groups: list[torch.Tensor], pager: _Pager):
        self.groups = [g.reshape(-1) for g in groups]
        self.pager = pager
        self.starts = [0]
        for g in self.groups:
            self.starts.append(self.starts[-1] + g.numel())

    @property
    def numel(self) -> int:
        return self.starts[-1]

    def read(self, start: int, n: int) -> Iterator[torch.Tensor]:
        end = start + n
        for g, lo, hi in zip(self.groups, self.starts, self.starts[1:]):
            if hi <= start or lo >= end:
                continue
            yield from _chunks(g[max(start, lo) - lo : min(end, hi) - lo], self.pager)


class ZeroCheckpoint:
    """The rank files of one ZeRO-3 checkpoint, memory-mapped; streams each tensor's bytes."""

    def __init__(self, folder: Path):
        self.folder = folder
        model_paths, optim_paths = self.check_files(folder)
        self.world = len(model_paths)
        self.models = [_load(p) for p in model_paths]
        optims = [_load(p) for p in optim_paths]
        for path, state in zip(optim_paths, optims):
            self._check_optim(path, state)
        self.flats = [
            _Flat(s["optimizer_state_dict"]["fp32_flat_groups"], _Pager(p, _first(s)))
            for p, s in zip(optim_paths, optims)
        ]
        self.model_pagers = [
            _Pager(p, _first_fragment(m)) for p, m in zip(model_paths, self.models)
        ]
        self.entries = self._entries()

    @staticmethod
    def check_files(folder: Path) -> tuple[list[Path], list[Path]]:
        """Every rank's model and optimizer states file, for the world size the
        checkpoint records."""
        found = rank_model_files(folder)
        if not found:
            raise ConfigError(
                f"{folder}: not a partitioned checkpoint (no {MODEL_FILE.format(r=0)})"
            )
        world = _declared_world(folder) or max(found) + 1
        models: list[Path] = []
        optims: list[Path] = []
        for r in range(world):
            model = folder / MODEL_FILE.format(r=r)
            optim = next(
                (folder / n.format(r=r) for n in OPTIM_FILES if (folder / n.format(r=r)).exists()),
                None,
            )
            if not model.exists() or optim is None:
                missing = model if not model.exists() else folder / OPTIM_FILES[0].format(r=r)
                raise ConfigError(
                    f"{missing}: missing (rank {r} of {world}); the checkpoint is incomplete"
                )
            models.append(model)
            optims.append(optim)
        return models, optims

    def _check_optim(self, path: Path, state: dict) -> None:
        osd = state.get("optimizer_state_dict") if isinstance(state, dict) else None
        if not isinstance(osd, dict) or "fp32_flat_groups" not in osd:
            stage = _stage(osd.get("zero_stage")) if isinstance(osd, dict) else None
            raise ConfigError(
                f"{path}: no ZeRO-3 fp32 weights in it (ZeRO stage {stage}); "
                f"export reads ZeRO-3 checkpoints, use DeepSpeed's zero_to_fp32.py for others"
            )
        count = osd.get("partition_count")
        count = max(count) if isinstance(count, (list, tuple)) else count
        if count != self.world:
            raise ConfigError(
                f"{path}: written by {count} ranks, but the folder has {self.world} ranks' files"
            )
        # Adam's moments: never needed (and never read: mapped)
        osd.pop("optimizer_state_dict", None)

    def _entries(self) -> list[Entry]:
        """Every tensor to write, in the model's state-dict order; tied aliases left out."""
        meta = self.models[0]
        found: dict[str, Entry] = {}
        offset = 0
        for group in meta["param_shapes"]:
            for name, shape in group.items():
                found[name] = Entry(name, torch.Size(shape), torch.float32, "trainable", offset)
                offset += math.ceil(torch.Size(shape).numel() / self.world)
        for r, flat in enumerate(self.flats):
            if flat.numel != offset:
                raise ConfigError(
                    f"{self.folder}: rank {r}'s fp32 groups hold {flat.numel} elements, "
                    f"its parameters need {offset}"
                )
        frozen = meta.get("frozen_param_fragments") or {}
        for name, shape in (meta.get("frozen_param_shapes") or {}).items():
            if name not in frozen:
                raise ConfigError(f"{self.folder}: frozen parameter {name} has no saved fragments")
            found[name] = Entry(name, torch.Size(shape), frozen[name].dtype, "frozen")
        module = meta.get("module") or {}
        for name in meta.get("buffer_names") or []:
            if name in module:
                found[name] = Entry(name, module[name].shape, module[name].dtype, "buffer")
        aliases = set(meta.get("shared_params") or {})
        order = [n for n in module if n in found] + [n for n in found if n not in module]
        return [found[n] for n in order if n not in aliases]

    def pieces(self, e: Entry) -> Iterator[torch.Tensor]:
        """The flattened tensor's bytes in order, as 1-D slices of the mapped files."""
        if e.kind == "buffer":
            yield from _chunks(self.models[0]["module"][e.name].reshape(-1), self.model_pagers[0])
            return
        numel = e.shape.numel()
        part = math.ceil(numel / self.world)
        for r in range(self.world):
            n = max(0, min(part, numel - r * part))
            if e.kind == "trainable":
                yield from self.flats[r].read(e.offset, n)
            else:
                fragment = self.models[r]["frozen_param_fragments"][e.name].reshape(-1)
                if fragment.numel() < n:
                    raise RuntimeError(
                        f"{e.name}: rank {r}'s frozen fragment has {fragment.numel()} elements, "
                        f"expected {part}"
                    )
                yield from _chunks(fragment[:n], self.model_pagers[r])


def _first(state: dict) -> torch.Tensor | None:
    groups = state["optimizer_state_dict"]["fp32_flat_groups"]
    return next((g for g in groups if g.numel()), None)


def _first_fragment(state: dict) -> torch.Tensor | None:
    tensors = [
        *(state.get("frozen_param_fragments") or {}).values(),
        *(state.get("module") or {}).values(),
    ]
    return next((t for t in tensors if isinstance(t, torch.Tensor) and t.numel()), None)


def _stage(value: object) -> int | None:
    value = value.args[0] if isinstance(value, safe_load.Placeholder) and value.args else value
    return int(value) if isinstance(value, int) else None


def _declared_world(folder: Path) -> int | None:
    manifest = read_manifest(folder)
    if manifest and manifest.get("world_size"):
        return int(manifest["world_size"])
    try:
        return int(json.loads((folder / TRAINER_STATE).read_text())["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
