"""Offline export of a checkpoint, in one plain process: no launcher, no torch.distributed, no GPU.

``export_hf`` turns a partitioned ZeRO-3 checkpoint into a HuggingFace model folder, reading the
rank files through ``zero_files.ZeroCheckpoint`` (memory-mapped, bounded RSS: see that module) and
writing shards planned with ``shards.plan_shards``: trainable parameters are the fp32 master
weights cast to the requested dtype (default: the training dtype). Consolidated weights in the
checkpoint are copied instead only when they are exactly what that rebuild writes (``exact_copy``),
so the same command gives the same weights whether or not the run saved them.

Tied parameters are written once, under the name DeepSpeed stored (the one ``save_pretrained``
keeps, e.g. ``model.embed_tokens.weight``; ``from_pretrained`` re-ties ``lm_head.weight``).

``export_universal`` converts with DeepSpeed's own ZeRO-3 conversion (universal.py, resumable):
the format resume loads on another world size, which reuses a ``universal/`` folder found inside
the checkpoint.

Safe loading: before any file of the checkpoint is read, it is checked against the checkpoint's
manifest (size and checksum; ``verify_inputs``): every file export reads must be listed there and
intact, so damage is named up front instead of surfacing as garbage weights or an unpickling error
(``verify=False``, the CLI's ``--no_verify``, skips this). Whether verified or not, the rank files
are unpickled with ``torch.load(weights_only=True)`` and an allow-list (``safe_load``): a
checkpoint from someone else can't run code here. ds_to_universal runs under the same restriction.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path

import torch

from finetune.checkpoint.adapter import is_adapter_checkpoint
from finetune.checkpoint.consolidate import FROM_MASTER, SOURCE_KEY
from finetune.checkpoint.shards import INDEX, plan_shards, read_header, shard_header
from finetune.checkpoint.durable import fsync_path
from finetune.checkpoint.faults import fault_point
from finetune.checkpoint.manifest import MANIFEST, check_file, read_manifest
from finetune.checkpoint.universal import UNIVERSAL, to_universal
from finetune.checkpoint.storage import LATEST, find_checkpoint, step_of
from finetune.checkpoint.zero_files import CHUNK_BYTES, ZeroCheckpoint, rank_model_files
from finetune.config import ConfigError
from finetune.modeling import DTYPES

HF_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
SAFE_TO_TORCH = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
DEFAULT_SHARD_SIZE = "5GB"
WEIGHTS_RE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
# What a checkpoint holds that is not part of a HF model folder: DeepSpeed's and our own files.
# (A LoRA checkpoint's consolidated adapter_model.safetensors is weights too: export rebuilds it.)
INTERNAL_NAMES = {MANIFEST, "trainer_state.json", LATEST, "adapter_model.safetensors"}
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
    verified: tuple[int, float] | None = None  # (bytes, seconds) checked against the manifest; None: not
    how: str | None = None  # what was written, when not the model's weights (a LoRA checkpoint's export)

    def summary(self) -> str:
        how = self.how or ("copied the consolidated weights" if self.copied else "rebuilt from the rank files")
        shards = sum(1 for f in self.files if f.endswith(".safetensors"))
        checked = (f"{self.verified[0] / 1e6:.1f} MB verified in {self.verified[1]:.2f} s" if self.verified
                   else "unverified: --no_verify")
        return (f"Exported {self.folder} to {self.out} ({how}): {self.tensors} tensors, {self.bytes / 1e6:.1f} MB "
                f"{HF_DTYPE_NAMES[self.dtype]} in {shards} shard(s), {self.seconds:.2f} s, {checked}, "
                f"peak RSS {self.peak_rss / 1e6:.0f} MB")


# --- entry points ------------------------------------------------------------------------------

def export_hf(checkpoint: str | os.PathLike, out: str | os.PathLike, dtype: str | None = None,
              max_shard_size: str | None = None, exclude_frozen: bool = False, progress: bool = True,
              verify: bool = True, merge_lora: bool = False, base_model: str | None = None) -> ExportResult:
    """Write a HF model folder at ``out`` from ``checkpoint`` (a checkpoint folder or an output dir).

    The weights are rebuilt from the rank files in ``dtype`` (default: the training dtype).
    Consolidated weights already in the checkpoint are copied instead when they are exactly what
    the rebuild would write (see ``exact_copy``) and nothing else is asked (no ``max_shard_size``,
    no ``exclude_frozen``); a checkpoint with no rank files can only be copied. ``out`` appears
    complete or not at all. ``verify``: each file is checked against the manifest before it is read.
    A LoRA checkpoint gives its adapter folder, or with ``merge_lora`` the base with the adapters
    merged (``base_model``: where the base is, if not where the run loaded it): lora_export.py.
    """
    start = time.perf_counter()
    folder = resolve_checkpoint(checkpoint)
    lora = is_adapter_checkpoint(folder)
    if (merge_lora or base_model) and not lora:
        raise ConfigError(f"`--merge_lora`/`--base_model`: {folder} is not a LoRA checkpoint (no adapter_config.json)")
    if lora:
        if exclude_frozen:
            raise ConfigError("`--exclude_frozen_parameters`: a LoRA checkpoint holds no frozen parameter")
        from finetune.checkpoint.lora_export import export_lora  # it imports this module

        return export_lora(folder, out, dtype, max_shard_size, merge_lora, base_model, verify, progress)
    out = _check_out(out)
    verified = [0, 0.0] if verify else None
    if verify:  # what decides copy or rebuild, and what is copied: before any of it is read
        _add(verified, verify_inputs(folder, _plain_inputs(folder)))
    config = _read_config(folder)
    copy, want = _copy_or_rebuild(folder, DTYPES[dtype] if dtype else None,
                                  max_shard_size is None and not exclude_frozen)
    source = None
    if not copy:
        if verify:
            models, optims = ZeroCheckpoint.check_files(folder)
            _add(verified, verify_inputs(folder, [p.name for p in models + optims]))
        source = ZeroCheckpoint(folder)  # validates the rank files before anything is written
    staging = out.parent / f".{out.name}.export-tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        if copy:
            tensors, size, files = _copy_weights(folder, staging, copy)
        else:
            tensors, size, files = _write_hf(source, staging, want, max_shard_size or DEFAULT_SHARD_SIZE,
                                                   exclude_frozen, progress)
        files += _copy_model_files(folder, staging, want, config)
        fsync_path(staging)
        fault_point("export.publish", step_of(folder.name))
        os.replace(staging, out)  # over an empty `out` too: rename(2) replaces an empty directory
        fsync_path(out.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ExportResult(folder, out, tensors, size, want, sorted(files), time.perf_counter() - start,
                        peak_rss_bytes(), bool(copy), tuple(verified) if verified else None)


def _add(total: list, part: tuple[int, float]) -> None:
    total[0] += part[0]
    total[1] += part[1]


def export_universal(checkpoint: str | os.PathLike, out: str | os.PathLike | None = None,
                     verify: bool = True) -> tuple[Path, str]:
    """Convert ``checkpoint`` to DeepSpeed's universal format in ``out`` (default: CHECKPOINT/universal);
    ``verify``: DeepSpeed's files are checked against the manifest first. Returns the folder and the
    converter's summary (pieces done now and before, the longest piece)."""
    folder = resolve_checkpoint(checkpoint)
    ZeroCheckpoint.check_files(folder)
    target = _check_out(out if out is not None else folder / UNIVERSAL)
    if verify:  # every rank file ds_to_universal picks up (it globs the folder)
        verify_inputs(folder, sorted(p.name for p in folder.glob("*_states.pt")))
    summary = to_universal(folder, target)  # resumes what an interrupted export --universal finished
    return target, summary


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint folder ``path`` names (itself, or an output dir's newest); ConfigError if none."""
    folder = find_checkpoint(path)
    if folder is not None and (folder / "mp_rank_00_model_states.pt").exists() and not rank_model_files(folder):
        raise ConfigError(f"{folder}: a ZeRO-1/2 checkpoint; export rebuilds ZeRO-3 ones (for this one use "
                          f"DeepSpeed's zero_to_fp32.py)")
    if folder is None or not (rank_model_files(folder) or any(WEIGHTS_RE.match(p.name) for p in folder.iterdir())):
        raise ConfigError(f"{path}: not a checkpoint (no DeepSpeed rank files or safetensors weights)")
    return folder


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


# --- checks and plain files -----------------------------------------------------------------------

def verify_inputs(folder: Path, names: list[str]) -> tuple[int, float]:
    """Each file is listed in ``folder``'s manifest with its size and checksum, and matches them;
    otherwise ConfigError naming each problem (nothing of the checkpoint has been read yet).
    Returns (bytes checked, seconds)."""
    start = time.perf_counter()
    manifest = read_manifest(folder)
    if manifest is None:
        raise ConfigError(f"{folder}: no readable {MANIFEST} to verify it against (not saved by finetune, or "
                          f"an incomplete save); pass --no_verify to export it unverified")
    listed = manifest.get("files") if isinstance(manifest.get("files"), dict) else {}
    problems, checked = [], 0
    for name in dict.fromkeys(names):
        meta = listed.get(name)
        if not (isinstance(meta, dict) and isinstance(meta.get("size"), int) and "checksum" in meta):
            problems.append(f"{name}: not in {MANIFEST}" if meta is None else f"{name}: unreadable {MANIFEST} entry")
            continue
        problems += check_file(folder / name, name, meta, checksums=True)
        checked += meta["size"]
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise ConfigError(f"{folder}: does not verify against its {MANIFEST} ({shown}); nothing was read. "
                          f"Pass --no_verify to export it anyway")
    return checked, time.perf_counter() - start


def _check_out(out: str | os.PathLike) -> Path:
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: exists and is not an empty directory (won't overwrite it)")
    return out


def _plain_inputs(folder: Path) -> list[str]:
    """The files export reads besides the rank files: trainer_state.json, the model files it copies
    (those present, and those the manifest lists: a missing tokenizer is damage too) and, unless
    the manifest says the consolidated save failed, the consolidated weights present."""
    manifest = read_manifest(folder) or {}
    names = [n for n in ("trainer_state.json",) if (folder / n).exists()]
    listed = {n for n in manifest.get("files") or {} if _is_model_file(n)}
    names += sorted({p.name for p in _model_files(folder)} | listed)
    if manifest.get("consolidated") is not False:
        names += sorted(p.name for p in folder.iterdir() if WEIGHTS_RE.match(p.name) or p.name == INDEX)
    return names


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
    header = read_header(path)
    header.pop("__metadata__", None)
    return header


def _stored_weights(folder: Path, files: list[str]) -> tuple[torch.dtype | None, str | None]:
    """The floating dtype of consolidated weights, and what the consolidated save recorded they
    were written from (None before it recorded that), from the first shard's header."""
    header = read_header(folder / files[0])
    metadata = header.pop("__metadata__", None) or {}
    kinds = {v["dtype"] for v in header.values()}
    return next((SAFE_TO_TORCH[k] for k in kinds if k in SAFE_TO_TORCH), None), metadata.get(SOURCE_KEY)


def exact_copy(stored: torch.dtype | None, training: torch.dtype, weights_from: str | None) -> bool:
    """Whether consolidated weights in ``stored`` dtype are bit for bit what a rebuild in that dtype
    writes: the fp32 master weights cast to it. True when they were written from the masters
    (FROM_MASTER); module weights (recorded as such, or unrecorded: older checkpoints) are the
    masters cast to the training dtype, so they are exact only in that dtype, or when training
    ran in fp32. bf16 weights upcast to fp32 are not: the masters carry bits they dropped.
    """
    return weights_from == FROM_MASTER or training in (stored, torch.float32)


def _copy_or_rebuild(folder: Path, want: torch.dtype | None, as_saved: bool) -> tuple[list[str], torch.dtype]:
    """(the consolidated files to copy, or [] to rebuild from the rank files; the dtype to write).

    ``want`` defaults to the training dtype, whether or not the run saved consolidated weights;
    they are copied only when they are exactly what the rebuild would write and ``as_saved``
    (no other sharding, nothing left out). Without rank files they are all there is.
    """
    # What a failed consolidated save left is not listed and not weights to copy: never read.
    files = [] if (read_manifest(folder) or {}).get("consolidated") is False else _consolidated_files(folder)
    stored, weights_from = _stored_weights(folder, files) if files else (None, None)
    training = _training_dtype(folder)
    if not rank_model_files(folder):  # nothing to rebuild from: copied as they are, or an error later
        stored = stored or torch.float32
        want = want or stored
        return (files if as_saved and want == stored else []), want
    want = want or training
    exact = bool(files) and want == stored and exact_copy(stored, training, weights_from)
    return (files if exact and as_saved else []), want


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
        fault_point("export.write", step_of(folder.name))
        shutil.copyfile(folder / name, staging / name)  # kernel-side copy: no RSS growth
        if name != INDEX:
            header = _tensors_in(staging / name)
            tensors += len(header)
            size += sum(v["data_offsets"][1] - v["data_offsets"][0] for v in header.values())
    return tensors, size, files


def _model_files(folder: Path) -> list[Path]:
    """Config, generation config, tokenizer and chat template: every top-level file that is neither
    DeepSpeed's nor ours nor weights."""
    return [p for p in sorted(folder.iterdir()) if p.is_file() and _is_model_file(p.name)]


def _is_model_file(name: str) -> bool:
    return not (name in INTERNAL_NAMES or INTERNAL_RE.search(name) or WEIGHTS_RE.match(name) or name == INDEX
                or "/" in name)


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: missing (export needs the model config)")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:  # damaged, and not verified (--no_verify)
        raise ConfigError(f"{path}: unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: not a model config (a JSON {type(config).__name__})")
    return config


def _copy_model_files(folder: Path, staging: Path, dtype: torch.dtype, config: dict) -> list[str]:
    """The model files, copied; config.json's dtype is set to the exported weights' dtype."""
    copied = []
    for p in _model_files(folder):
        if p.name == "config.json":
            config = dict(config)
            config["dtype"] = HF_DTYPE_NAMES[dtype]
            if "torch_dtype" in config:  # the name before transformers 4.56
                config["torch_dtype"] = HF_DTYPE_NAMES[dtype]
            (staging / p.name).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        else:
            shutil.copyfile(p, staging / p.name)
        copied.append(p.name)
    return copied


# --- writing HF shards from the rank files ------------------------------------------------------

def _write_hf(source: ZeroCheckpoint, staging: Path, dtype: torch.dtype, max_shard_size: str, exclude_frozen: bool,
             progress: bool) -> tuple[int, int, list[str]]:
    from tqdm.auto import tqdm

    entries = [e for e in source.entries if not (exclude_frozen and e.kind == "frozen")]
    by_name = {e.name: e for e in entries}
    buffers: dict = {}  # one reused conversion buffer per dtype
    holders = {e.name: types.SimpleNamespace(t=torch.empty(e.shape, dtype=e.dtype, device="meta")) for e in entries}
    split, meta = plan_shards([(e.name, holders[e.name], "t", e.kind != "buffer") for e in entries],
                              dtype, max_shard_size)
    bar = tqdm(total=split.total_size, unit="B", unit_scale=True, desc="export", disable=not progress,
               file=sys.stderr, mininterval=0.5 if sys.stderr.isatty() else 30)
    with bar:
        for fname, names in split.filename_to_tensors.items():
            fault_point("export.write", step_of(source.folder.name))
            with open(staging / fname, "wb") as f:
                f.write(shard_header(names, meta, {SOURCE_KEY: FROM_MASTER}))  # as a consolidated save records it
                for name in names:
                    bar.update(_write_tensor(source, f, by_name[name], meta[name], buffers))
                f.flush()
                os.fsync(f.fileno())
    files = list(split.filename_to_tensors) + list(split.write_index(staging))
    return len(entries), split.total_size, files

def _write_tensor(source: ZeroCheckpoint, f, entry, out: torch.Tensor, buffers: dict) -> int:
    """Append one tensor's bytes, converted to the planned dtype, chunk by chunk."""
    written = 0
    for piece in source.pieces(entry):
        data = piece
        if piece.dtype != out.dtype:  # converted into one reused buffer: no allocation per chunk
            data = _buffer(buffers, out.dtype, piece.numel())[:piece.numel()]
            data.copy_(piece)
        f.write(data.view(torch.uint8).numpy() if data.numel() else b"")
        written += data.numel() * data.element_size()
    expected = out.numel() * out.element_size()
    if written != expected:
        raise RuntimeError(f"{entry.name}: rebuilt {written} bytes, its shape needs {expected}")
    return written


def _buffer(buffers: dict, dtype: torch.dtype, numel: int) -> torch.Tensor:
    buf = buffers.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = buffers[dtype] = torch.empty(max(numel, CHUNK_BYTES // 4), dtype=dtype)
    return buf
