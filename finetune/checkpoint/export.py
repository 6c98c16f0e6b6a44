"""Offline export of a checkpoint, in one plain process: no launcher, no torch.distributed, no GPU.

``export_hf`` turns a partitioned ZeRO-3 checkpoint into a HuggingFace model folder. What the
rank files hold (the format DeepSpeed's zero_to_fp32.py reads too):

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
  * the shard layout is planned up front (``consolidate.plan_shards``), each header written first,
    then every parameter is copied rank by rank in chunks of at most CHUNK_BYTES, straight from the
    mapping into the output file;
  * mapped pages count in RSS once touched, so each chunk's pages are handed back with
    madvise(MADV_DONTNEED) as soon as they are written. They are clean pages of a private file
    mapping: the kernel drops them and would re-read them from the file, so nothing is lost.
    (Checked per file against /proc/self/maps; where that can't be checked, nothing is released.)

Tied parameters are written once, under the name DeepSpeed stored (the one ``save_pretrained``
keeps, e.g. ``model.embed_tokens.weight``; ``from_pretrained`` re-ties ``lm_head.weight``).

The rank files are DeepSpeed pickles; classes from ``deepspeed.*`` in them (an enum, the loss
scaler) are read as inert placeholders, so an export never imports DeepSpeed.

``export_universal`` runs DeepSpeed's own ds_to_universal: the format resume loads on another
world size, which reuses a ``universal/`` folder found inside the checkpoint.
"""

from __future__ import annotations

import ctypes
import json
import math
import mmap
import os
import pickle
import re
import resource
import shutil
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from finetune.checkpoint.consolidate import INDEX, _header, plan_shards
from finetune.checkpoint.manifest import MANIFEST, read_manifest
from finetune.checkpoint.storage import LATEST, find_checkpoint, fsync_path
from finetune.config import ConfigError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HF_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
SAFE_TO_TORCH = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
DEFAULT_SHARD_SIZE = "5GB"
CHUNK_BYTES = 8 << 20  # read, converted and written at a time
UNIVERSAL = "universal"
MODEL_FILE = "zero_pp_rank_{r}_mp_rank_00_model_states.pt"
OPTIM_FILES = ("zero_pp_rank_{r}_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
MODEL_FILE_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")
WEIGHTS_RE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
# What a checkpoint holds that is not part of a HF model folder: DeepSpeed's and our own files.
INTERNAL_NAMES = {MANIFEST, "trainer_state.json", LATEST}
INTERNAL_RE = re.compile(r"(\.pt$)|(^zero_to_.*\.py$)")


@dataclass
class ExportResult:
    folder: Path  # the checkpoint exported
    out: Path
    tensors: int
    bytes: int  # of weights written
    dtype: torch.dtype
    files: list[str]
    seconds: float
    peak_rss: int  # bytes, this process's high-water mark
    copied: bool  # consolidated weights copied rather than rebuilt

    def summary(self) -> str:
        how = "copied the consolidated weights" if self.copied else "rebuilt from the rank files"
        shards = sum(1 for f in self.files if f.endswith(".safetensors"))
        return (f"Exported {self.folder} to {self.out} ({how}): {self.tensors} tensors, {self.bytes / 1e6:.1f} MB "
                f"{HF_DTYPE_NAMES[self.dtype]} in {shards} shard(s), {self.seconds:.2f} s, "
                f"peak RSS {self.peak_rss / 1e6:.0f} MB")


# --- entry points ------------------------------------------------------------------------------

def export_hf(checkpoint: str | os.PathLike, out: str | os.PathLike, dtype: str | None = None,
              max_shard_size: str | None = None, exclude_frozen: bool = False, progress: bool = True) -> ExportResult:
    """Write a HF model folder at ``out`` from ``checkpoint`` (a checkpoint folder or an output dir).

    Consolidated weights already in the checkpoint are copied when they fit the request (no
    ``dtype`` other than theirs, no ``max_shard_size``, no ``exclude_frozen``); otherwise the
    weights are rebuilt from the rank files. ``out`` appears complete or not at all.
    """
    start = time.perf_counter()
    folder = resolve_checkpoint(checkpoint)
    out = _check_out(out)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{folder / 'config.json'}: missing (export needs the model config)")
    consolidated = _consolidated_files(folder)
    stored = _stored_dtype(folder, consolidated) if consolidated else None
    want = DTYPES[dtype] if dtype else None
    copy = bool(consolidated) and want in (None, stored) and max_shard_size is None and not exclude_frozen
    source = None
    if not copy:
        source = ZeroCheckpoint(folder)  # validates the rank files before anything is written
        want = want or _training_dtype(folder)
    staging = out.parent / f".{out.name}.export-tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        if copy:
            tensors, size, files = _copy_weights(folder, staging, consolidated)
            want = stored or torch.float32
        else:
            tensors, size, files = source.write_hf(staging, want, max_shard_size or DEFAULT_SHARD_SIZE,
                                                   exclude_frozen, progress)
        files += _copy_model_files(folder, staging, want)
        fsync_path(staging)
        os.replace(staging, out)  # over an empty `out` too: rename(2) replaces an empty directory
        fsync_path(out.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ExportResult(folder, out, tensors, size, want, sorted(files), time.perf_counter() - start,
                        peak_rss_bytes(), copy)


def export_universal(checkpoint: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Convert ``checkpoint`` to DeepSpeed's universal format in ``out`` (default: CHECKPOINT/universal)."""
    folder = resolve_checkpoint(checkpoint)
    ZeroCheckpoint.check_files(folder)
    target = _check_out(out if out is not None else folder / UNIVERSAL)
    error = to_universal(folder, target)
    if error:
        raise RuntimeError(f"DeepSpeed's ds_to_universal failed on {folder}: {error}")
    return target


def to_universal(folder: Path, target: Path) -> str | None:
    """Run DeepSpeed's ds_to_universal on ``folder`` into ``target``: staged in ``target.tmp``,
    renamed into place on success. Returns None, or DeepSpeed's last output line on failure."""
    tmp = target.with_name(f"{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    workers = str(max(1, min(4, os.cpu_count() or 1)))
    proc = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                           str(folder), "--output_folder", str(tmp), "--num_extract_workers", workers,
                           "--num_merge_workers", workers], capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        return ((proc.stderr or proc.stdout).strip().splitlines() or ["no output"])[-1]
    os.replace(tmp, target)
    return None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint folder ``path`` names (itself, or an output dir's newest); ConfigError if none."""
    folder = find_checkpoint(path)
    if folder is not None and (folder / "mp_rank_00_model_states.pt").exists() and not _rank_model_files(folder):
        raise ConfigError(f"{folder}: a ZeRO-1/2 checkpoint; export rebuilds ZeRO-3 ones (for this one use "
                          f"DeepSpeed's zero_to_fp32.py)")
    if folder is None or not (any(_rank_model_files(folder)) or _consolidated_files(folder)):
        raise ConfigError(f"{path}: not a checkpoint (no DeepSpeed rank files or safetensors weights)")
    return folder


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


# --- checks and plain files -----------------------------------------------------------------------

def _check_out(out: str | os.PathLike) -> Path:
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: exists and is not an empty directory (won't overwrite it)")
    return out


def _rank_model_files(folder: Path) -> dict[int, Path]:
    found = {}
    for p in folder.iterdir():
        m = MODEL_FILE_RE.match(p.name)
        if m:
            found[int(m.group(1))] = p
    return found


def _consolidated_files(folder: Path) -> list[str]:
    names = [p.name for p in folder.iterdir() if WEIGHTS_RE.match(p.name)]
    if (folder / INDEX).exists():
        try:
            shards = sorted(set(json.loads((folder / INDEX).read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise ConfigError(f"{folder / INDEX}: unreadable ({type(e).__name__})") from e
        for shard in shards:
            if not (folder / shard).is_file():
                raise ConfigError(f"{folder / shard}: missing (listed in {INDEX})")
        return shards + [INDEX]
    return names if names == ["model.safetensors"] else []


def _tensors_in(path: Path) -> dict[str, dict]:
    """A safetensors file's header: {name: {"dtype", "shape", "data_offsets"}}."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    header.pop("__metadata__", None)
    return header


def _stored_dtype(folder: Path, files: list[str]) -> torch.dtype | None:
    """The floating dtype of consolidated weights, from the first shard's header."""
    kinds = {v["dtype"] for v in _tensors_in(folder / files[0]).values()}
    return next((SAFE_TO_TORCH[k] for k in kinds if k in SAFE_TO_TORCH), None)


def _training_dtype(folder: Path) -> torch.dtype:
    """The training precision trainer_state.json records; fp32 when absent or fp32."""
    try:
        saved = json.loads((folder / "trainer_state.json").read_text()).get("dtype")
    except (OSError, ValueError):
        saved = None
    return DTYPES.get(saved, torch.float32)


def _copy_weights(folder: Path, staging: Path, files: list[str]) -> tuple[int, int, list[str]]:
    tensors = size = 0
    for name in files:
        shutil.copyfile(folder / name, staging / name)  # kernel-side copy: no RSS growth
        if name != INDEX:
            header = _tensors_in(staging / name)
            tensors += len(header)
            size += sum(v["data_offsets"][1] - v["data_offsets"][0] for v in header.values())
    return tensors, size, files


def _copy_model_files(folder: Path, staging: Path, dtype: torch.dtype) -> list[str]:
    """Config, generation config, tokenizer and chat template: every top-level file that is neither
    DeepSpeed's nor ours nor weights. config.json's dtype is set to the exported weights' dtype."""
    copied = []
    for p in sorted(folder.iterdir()):
        if (not p.is_file() or p.name in INTERNAL_NAMES or INTERNAL_RE.search(p.name)
                or WEIGHTS_RE.match(p.name) or p.name == INDEX):
            continue
        if p.name == "config.json":
            config = json.loads(p.read_text())
            config["dtype"] = HF_DTYPE_NAMES[dtype]
            if "torch_dtype" in config:  # the name before transformers 4.56
                config["torch_dtype"] = HF_DTYPE_NAMES[dtype]
            (staging / p.name).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        else:
            shutil.copyfile(p, staging / p.name)
        copied.append(p.name)
    return copied


# --- reading the rank files ---------------------------------------------------------------------

class _Placeholder:
    """Stands in for a class from ``deepspeed.*`` in its pickles: keeps the constructor arguments
    (an enum's value) and the state, so reading the files needs no ``import deepspeed``."""

    def __new__(cls, *args, **kwargs):
        return super().__new__(cls)

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.state = state


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module == "deepspeed" or module.startswith("deepspeed."):
            return type(name, (_Placeholder,), {"__module__": module})
        return super().find_class(module, name)


_PICKLE = types.SimpleNamespace(Unpickler=_Unpickler, load=pickle.load, __name__="pickle")


def _load(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False, pickle_module=_PICKLE)
    except (RuntimeError, pickle.UnpicklingError, EOFError, OSError) as e:
        raise ConfigError(f"{path}: unreadable DeepSpeed file ({type(e).__name__}: {e})") from e


class _Pager:
    """Hands consumed pages of one memory-mapped file back to the kernel (see the module doc)."""

    PAGE = mmap.PAGESIZE
    MADV_DONTNEED = 4
    _madvise = None

    def __init__(self, path: Path, sample: torch.Tensor | None):
        found = sample is not None and sample.numel() > 0 and self._libc() is not None
        self.span = _mapping_of(sample.data_ptr(), path) if found else None  # [start, end) of the file's mapping
        self.enabled = self.span is not None

    @classmethod
    def _libc(cls):
        if cls._madvise is None and sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(None, use_errno=True).madvise
            except (OSError, AttributeError):
                return None
            fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
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
    """The span of the mapping of ``path`` that holds ``address``, or None when ``address`` is not in
    one (then MADV_DONTNEED could lose data: it is never called)."""
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
    """Slices of a 1-D tensor of at most CHUNK_BYTES; each one's pages are released once consumed."""
    step = max(1, CHUNK_BYTES // max(flat.element_size(), 1))
    for i in range(0, flat.numel(), step):
        piece = flat[i:i + step]
        yield piece
        pager.release(piece)


@dataclass
class _Entry:
    name: str
    shape: torch.Size
    dtype: torch.dtype  # as stored
    kind: str  # "trainable", "frozen" or "buffer"
    offset: int = 0  # trainable: where its partition starts in every rank's flat fp32 space


class _Flat:
    """One rank's fp32 flat groups, addressed as if they were one tensor end to end."""

    def __init__(self, groups: list[torch.Tensor], pager: _Pager):
        self.groups, self.pager = [g.reshape(-1) for g in groups], pager
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
            yield from _chunks(g[max(start, lo) - lo:min(end, hi) - lo], self.pager)


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
        self.flats = [_Flat(s["optimizer_state_dict"]["fp32_flat_groups"], _Pager(p, _first(s)))
                      for p, s in zip(optim_paths, optims)]
        self.model_pagers = [_Pager(p, _first_fragment(m)) for p, m in zip(model_paths, self.models)]
        self.entries = self._entries()
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    @staticmethod
    def check_files(folder: Path) -> tuple[list[Path], list[Path]]:
        """Every rank's model and optimizer states file, for the world size the checkpoint records."""
        found = _rank_model_files(folder)
        if not found:
            raise ConfigError(f"{folder}: not a partitioned checkpoint (no {MODEL_FILE.format(r=0)})")
        world = _declared_world(folder) or max(found) + 1
        models, optims = [], []
        for r in range(world):
            model = folder / MODEL_FILE.format(r=r)
            optim = next((folder / n.format(r=r) for n in OPTIM_FILES if (folder / n.format(r=r)).exists()), None)
            if not model.exists() or optim is None:
                missing = model if not model.exists() else folder / OPTIM_FILES[0].format(r=r)
                raise ConfigError(f"{missing}: missing (rank {r} of {world}); the checkpoint is incomplete")
            models.append(model)
            optims.append(optim)
        return models, optims

    def _check_optim(self, path: Path, state: dict) -> None:
        osd = state.get("optimizer_state_dict") if isinstance(state, dict) else None
        if not isinstance(osd, dict) or "fp32_flat_groups" not in osd:
            stage = _stage(osd.get("zero_stage")) if isinstance(osd, dict) else None
            raise ConfigError(f"{path}: no ZeRO-3 fp32 weights in it (ZeRO stage {stage}); "
                              f"export reads ZeRO-3 checkpoints, use DeepSpeed's zero_to_fp32.py for others")
        count = osd.get("partition_count")
        count = max(count) if isinstance(count, (list, tuple)) else count
        if count != self.world:
            raise ConfigError(f"{path}: written by {count} ranks, but the folder has {self.world} ranks' files")
        osd.pop("optimizer_state_dict", None)  # Adam's moments: never needed (and never read: mapped)

    def _entries(self) -> list[_Entry]:
        """Every tensor to write, in the model's state-dict order; tied aliases left out."""
        meta = self.models[0]
        found: dict[str, _Entry] = {}
        offset = 0
        for group in meta["param_shapes"]:
            for name, shape in group.items():
                found[name] = _Entry(name, torch.Size(shape), torch.float32, "trainable", offset)
                offset += math.ceil(torch.Size(shape).numel() / self.world)
        for r, flat in enumerate(self.flats):
            if flat.numel != offset:
                raise ConfigError(f"{self.folder}: rank {r}'s fp32 groups hold {flat.numel} elements, "
                                  f"its parameters need {offset}")
        frozen = meta.get("frozen_param_fragments") or {}
        for name, shape in (meta.get("frozen_param_shapes") or {}).items():
            if name not in frozen:
                raise ConfigError(f"{self.folder}: frozen parameter {name} has no saved fragments")
            found[name] = _Entry(name, torch.Size(shape), frozen[name].dtype, "frozen")
        module = meta.get("module") or {}
        for name in meta.get("buffer_names") or []:
            if name in module:
                found[name] = _Entry(name, module[name].shape, module[name].dtype, "buffer")
        aliases = set(meta.get("shared_params") or {})
        order = [n for n in module if n in found] + [n for n in found if n not in module]
        return [found[n] for n in order if n not in aliases]

    def pieces(self, e: _Entry) -> Iterator[torch.Tensor]:
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
                    raise RuntimeError(f"{e.name}: rank {r}'s frozen fragment has {fragment.numel()} elements, "
                                       f"expected {part}")
                yield from _chunks(fragment[:n], self.model_pagers[r])

    def write_hf(self, staging: Path, dtype: torch.dtype, max_shard_size: str, exclude_frozen: bool,
                 progress: bool) -> tuple[int, int, list[str]]:
        from tqdm.auto import tqdm

        entries = [e for e in self.entries if not (exclude_frozen and e.kind == "frozen")]
        by_name = {e.name: e for e in entries}
        holders = {e.name: types.SimpleNamespace(t=torch.empty(e.shape, dtype=e.dtype, device="meta")) for e in entries}
        split, meta = plan_shards([(e.name, holders[e.name], "t", e.kind != "buffer") for e in entries],
                                  dtype, max_shard_size)
        bar = tqdm(total=split.total_size, unit="B", unit_scale=True, desc="export", disable=not progress,
                   file=sys.stderr, mininterval=0.5 if sys.stderr.isatty() else 30)
        with bar:
            for fname, names in split.filename_to_tensors.items():
                with open(staging / fname, "wb") as f:
                    f.write(_header(names, meta))
                    for name in names:
                        bar.update(self._write_tensor(f, by_name[name], meta[name]))
                    f.flush()
                    os.fsync(f.fileno())
        files = list(split.filename_to_tensors)
        if split.is_sharded:
            index = {"metadata": {"total_size": split.total_size}, "weight_map": split.tensor_to_filename}
            (staging / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            files.append(INDEX)
        return len(entries), split.total_size, files

    def _write_tensor(self, f, entry: _Entry, out: torch.Tensor) -> int:
        """Append one tensor's bytes, converted to the planned dtype, chunk by chunk."""
        written = 0
        for piece in self.pieces(entry):
            data = piece
            if piece.dtype != out.dtype:  # converted into one reused buffer: no allocation per chunk
                data = self._buffer(out.dtype, piece.numel())[:piece.numel()]
                data.copy_(piece)
            f.write(data.view(torch.uint8).numpy() if data.numel() else b"")
            written += data.numel() * data.element_size()
        expected = out.numel() * out.element_size()
        if written != expected:
            raise RuntimeError(f"{entry.name}: rebuilt {written} bytes, its shape needs {expected}")
        return written


    def _buffer(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        buf = self._buffers.get(dtype)
        if buf is None or buf.numel() < numel:
            buf = self._buffers[dtype] = torch.empty(max(numel, CHUNK_BYTES // 4), dtype=dtype)
        return buf


def _first(state: dict) -> torch.Tensor | None:
    groups = state["optimizer_state_dict"]["fp32_flat_groups"]
    return next((g for g in groups if g.numel()), None)


def _first_fragment(state: dict) -> torch.Tensor | None:
    tensors = [*(state.get("frozen_param_fragments") or {}).values(), *(state.get("module") or {}).values()]
    return next((t for t in tensors if isinstance(t, torch.Tensor) and t.numel()), None)


def _stage(value) -> int | None:
    value = value.args[0] if isinstance(value, _Placeholder) and value.args else value
    return int(value) if isinstance(value, int) else None


def _declared_world(folder: Path) -> int | None:
    manifest = read_manifest(folder)
    if manifest and manifest.get("world_size"):
        return int(manifest["world_size"])
    try:
        return int(json.loads((folder / "trainer_state.json").read_text())["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
