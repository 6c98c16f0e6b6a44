"""What every export shares: the folder it writes, the checkpoint files it reads besides the rank
files, the manifest check before anything is read, and what it reports.

export.py (a full model) and lora_export.py (an adapter, or the base with it merged) both build on
these; neither imports the other's internals.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from finetune.checkpoint_format.manifest import MANIFEST, check_files, read_manifest
from finetune.checkpoint_format.outdir import LATEST
from finetune.checkpoint_format.state import TRAINER_STATE
from finetune.config import ConfigError
from finetune.modeling import DTYPES
from finetune.weights.adapter import ADAPTER_WEIGHTS
from finetune.weights.shards import INDEX
from finetune.weights.zero_files import CHUNK_BYTES, Entry, ZeroCheckpoint

HF_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


SAFE_TO_TORCH = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


DEFAULT_SHARD_SIZE = "5GB"


WEIGHTS_RE = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")


# What a checkpoint holds that is not part of a HF model folder: DeepSpeed's and our own files.
# (A LoRA checkpoint's consolidated adapter_model.safetensors is weights too: export rebuilds it.)
INTERNAL_NAMES = {MANIFEST, TRAINER_STATE, LATEST, ADAPTER_WEIGHTS}


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
    # (bytes, seconds) checked against the manifest; None: not
    verified: tuple[int, float] | None = None
    # what was written, when not the model's weights (a LoRA checkpoint's export)
    how: str | None = None

    def summary(self) -> str:
        how = self.how or (
            "copied the consolidated weights" if self.copied else "rebuilt from the rank files"
        )
        shards = sum(1 for f in self.files if f.endswith(".safetensors"))
        checked = (
            f"{self.verified[0] / 1e6:.1f} MB verified in {self.verified[1]:.2f} s"
            if self.verified
            else "unverified: --no_verify"
        )
        return (
            f"Exported {self.folder} to {self.out} ({how}): {self.tensors} tensors, "
            f"{self.bytes / 1e6:.1f} MB {HF_DTYPE_NAMES[self.dtype]} in {shards} shard(s), "
            f"{self.seconds:.2f} s, {checked}, peak RSS {self.peak_rss / 1e6:.0f} MB"
        )


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def verify_inputs(folder: Path, names: list[str]) -> tuple[int, float]:
    """Each file is listed in ``folder``'s manifest with its size and checksum, and matches them;
    otherwise ConfigError naming each problem (nothing of the checkpoint has been read yet).
    Returns (bytes checked, seconds)."""
    start = time.perf_counter()
    manifest = read_manifest(folder)
    if manifest is None:
        raise ConfigError(
            f"{folder}: no readable {MANIFEST} to verify it against (not saved by finetune, or "
            f"an incomplete save); pass --no_verify to export it unverified"
        )
    listed = manifest.get("files") if isinstance(manifest.get("files"), dict) else {}
    problems: list[str] = []
    entries = {}
    for name in dict.fromkeys(names):
        meta = listed.get(name)
        if not (
            isinstance(meta, dict) and isinstance(meta.get("size"), int) and "checksum" in meta
        ):
            problems.append(
                f"{name}: not in {MANIFEST}"
                if meta is None
                else f"{name}: unreadable {MANIFEST} entry"
            )
            continue
        entries[name] = meta
    problems += check_files(folder, entries, checksums=True)
    checked = sum(meta["size"] for meta in entries.values())
    if problems:
        shown = "; ".join(problems[:5]) + (
            f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
        )
        raise ConfigError(
            f"{folder}: does not verify against its {MANIFEST} ({shown}); nothing was read. "
            f"Pass --no_verify to export it anyway"
        )
    return checked, time.perf_counter() - start


def check_out(out: str | os.PathLike) -> Path:
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out}: exists and is not an empty directory (won't overwrite it)")
    return out


def plain_inputs(folder: Path) -> list[str]:
    """The files export reads besides the rank files: trainer_state.json, the model files it copies
    (those present, and those the manifest lists: a missing tokenizer is damage too) and, unless
    the manifest says the consolidated save failed, the consolidated weights present."""
    manifest = read_manifest(folder) or {}
    names = [n for n in (TRAINER_STATE,) if (folder / n).exists()]
    listed = {n for n in manifest.get("files") or {} if is_model_file(n)}
    names += sorted({p.name for p in model_files(folder)} | listed)
    if manifest.get("consolidated") is not False:
        names += sorted(
            p.name for p in folder.iterdir() if WEIGHTS_RE.match(p.name) or p.name == INDEX
        )
    return names


def training_dtype(folder: Path) -> torch.dtype:
    """The training precision trainer_state.json records; fp32 when absent or fp32."""
    try:
        saved = json.loads((folder / TRAINER_STATE).read_text()).get("dtype")
    except (OSError, ValueError):
        saved = None
    return DTYPES.get(saved, torch.float32)


def model_files(folder: Path) -> list[Path]:
    """Config, generation config, tokenizer and chat template: every top-level file that is neither
    DeepSpeed's nor ours nor weights."""
    return [p for p in sorted(folder.iterdir()) if p.is_file() and is_model_file(p.name)]


def is_model_file(name: str) -> bool:
    return not (
        name in INTERNAL_NAMES
        or INTERNAL_RE.search(name)
        or WEIGHTS_RE.match(name)
        or name == INDEX
        or "/" in name
    )


def read_config(folder: Path) -> dict:
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


def copy_model_files(folder: Path, staging: Path, dtype: torch.dtype, config: dict) -> list[str]:
    """The model files, copied; config.json's dtype is set to the exported weights' dtype."""
    copied = []
    for p in model_files(folder):
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


def write_tensor(
    source: ZeroCheckpoint,
    f: BinaryIO,
    entry: Entry,
    out: torch.Tensor,
    buffers: dict[torch.dtype, torch.Tensor],
) -> int:
    """Append one tensor's bytes, converted to the planned dtype, chunk by chunk."""
    written = 0
    for piece in source.pieces(entry):
        data = piece
        if piece.dtype != out.dtype:  # converted into one reused buffer: no allocation per chunk
            data = _buffer(buffers, out.dtype, piece.numel())[: piece.numel()]
            data.copy_(piece)
        f.write(data.view(torch.uint8).numpy() if data.numel() else b"")
        written += data.numel() * data.element_size()
    expected = out.numel() * out.element_size()
    if written != expected:
        raise RuntimeError(f"{entry.name}: rebuilt {written} bytes, its shape needs {expected}")
    return written


def _buffer(
    buffers: dict[torch.dtype, torch.Tensor], dtype: torch.dtype, numel: int
) -> torch.Tensor:
    buf = buffers.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(max(numel, CHUNK_BYTES // 4), dtype=dtype)
        buffers[dtype] = buf
    return buf
