"""Offline export of a LoRA checkpoint (``--use_peft``), in one plain process like ``export.py``.

``finetune export CKPT OUT`` writes the adapter folder that ``PeftModel.from_pretrained(base, OUT)``
loads: adapter_model.safetensors, rebuilt from the rank files' fp32 master weights (the trainable
parameters are exactly the adapters), adapter_config.json and the tokenizer.

``--merge_lora`` writes a whole HuggingFace model instead, loadable without peft: the base model's
safetensors shards streamed tensor by tensor, each adapted weight merged on the way,
``W + scaling * B @ A`` (peft's LoRA delta; transposed for fan-in-fan-out layers such as GPT-2's
Conv1D and for embeddings), ``--lora_modules_to_save`` weights taken from the checkpoint. The
base comes from where trainer_state.json says the run loaded it (a folder, or the hub id's cached
copy), or ``--base_model``; its fingerprint must match the one recorded, or export refuses (exit
2, naming both). Memory stays bounded: base tensors are read and written in slices of rows of at
most ``CHUNK_BYTES`` (safetensors' ``get_slice``), with the matching rows of the delta computed
per slice; only one module's A and B (r rows or columns) are held whole.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
import types
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import torch

from finetune.checkpoint_format.outdir import step_of
from finetune.checkpoint_format.state import TRAINER_STATE
from finetune.config import ConfigError
from finetune.io.durable import fsync_path
from finetune.io.faults import fault_point
from finetune.lora import BASE_KEY, describe_base, fingerprint, same_base, weights_folder
from finetune.modeling import DTYPES
from finetune.offline.model_files import (
    DEFAULT_SHARD_SIZE,
    ExportResult,
    check_out,
    copy_model_files,
    model_files,
    peak_rss_bytes,
    plain_inputs,
    read_config,
    training_dtype,
    verify_inputs,
    write_tensor,
)
from finetune.weights.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, expected_tensors
from finetune.weights.consolidate import FROM_MASTER, SOURCE_KEY
from finetune.weights.shards import INDEX, SAFE_TO_DTYPE, plan_shards, shard_header
from finetune.weights.zero_files import CHUNK_BYTES, Entry, ZeroCheckpoint

if TYPE_CHECKING:
    from safetensors import safe_open

# The base's tensors in file order: (file, key, shape, dtype).
BaseTensors = list[tuple[str, str, torch.Size, torch.dtype]]
# What one file export writes: (tensors, bytes, the files written).
Written = tuple[int, int, list[str]]


def export_lora(
    folder: Path,
    out: str | os.PathLike,
    dtype: str | None,
    max_shard_size: str | None,
    merge: bool,
    base_model: str | None,
    verify: bool,
    progress: bool,
) -> ExportResult:
    """The adapter folder of LoRA checkpoint ``folder`` at ``out`` (or, ``merge``,
    the merged model)."""
    start = time.perf_counter()
    out = check_out(out)
    if not merge and (max_shard_size or base_model):
        raise ConfigError(
            "`--max_shard_size` and `--base_model` go with `--merge_lora` (an adapter is one file)"
        )
    verified = None
    # every file read below, before any of it is read (what export.py checks, and the rank files)
    if verify:
        models, optims = ZeroCheckpoint.check_files(folder)
        verified = verify_inputs(folder, plain_inputs(folder) + [p.name for p in models + optims])
    state = _trainer_state(folder)
    source = ZeroCheckpoint(folder)
    adapters = _adapter_entries(folder, source)
    want = DTYPES[dtype] if dtype else training_dtype(folder)
    base_dir = _base_folder(folder, state, base_model) if merge else None
    staging = out.parent / f".{out.name}.export-tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        if merge:
            tensors, size, files = _write_merged(
                base_dir,
                source,
                adapters,
                _read_adapter_config(folder),
                staging,
                want,
                max_shard_size or DEFAULT_SHARD_SIZE,
                progress,
            )
            files += copy_model_files(folder, staging, want, read_config(folder))
            files = [f for f in files if f != ADAPTER_CONFIG]
            # a plain model: nothing for peft to find
            (staging / ADAPTER_CONFIG).unlink(missing_ok=True)
        else:
            tensors, size, files = _write_adapter(source, adapters, staging, want)
            for p in model_files(folder):
                if p.name not in (
                    "config.json",
                    "generation_config.json",
                    ADAPTER_CONFIG,
                ):  # the base's, or written
                    shutil.copyfile(p, staging / p.name)
                    files.append(p.name)
        fsync_path(staging)
        fault_point("export.publish", step_of(folder.name))
        os.replace(staging, out)
        fsync_path(out.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    how = (
        f"merged the adapters into {base_dir}"
        if merge
        else "the LoRA adapters, rebuilt from the rank files"
    )
    return ExportResult(
        folder,
        out,
        tensors,
        size,
        want,
        sorted(files),
        time.perf_counter() - start,
        peak_rss_bytes(),
        False,
        verified,
        how=how,
    )


def _trainer_state(folder: Path) -> dict:
    try:
        return json.loads((folder / TRAINER_STATE).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{folder / TRAINER_STATE}: unreadable ({type(e).__name__})") from e


def _read_adapter_config(folder: Path) -> dict:
    try:
        return json.loads((folder / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{folder / ADAPTER_CONFIG}: unreadable ({type(e).__name__})") from e


def _adapter_entries(folder: Path, source: ZeroCheckpoint) -> dict[str, Entry]:
    """{adapter file key: the rank files' entry}, for exactly the tensors the adapters must have."""
    try:
        expected = expected_tensors(folder)
    except Exception as e:  # noqa: BLE001 — a damaged or foreign adapter_config.json
        raise ConfigError(
            f"{folder / ADAPTER_CONFIG}: can't tell which tensors the adapters have "
            f"({type(e).__name__}: {' '.join(str(e).split())[:200]})"
        ) from e
    trainable = {e.name: e for e in source.entries if e.kind == "trainable"}
    missing = sorted(set(expected) - set(trainable))
    if missing or not expected:
        raise ConfigError(
            f"{folder}: the rank files lack {len(missing)} of the {len(expected)} adapter tensors "
            f"(e.g. {missing[0] if missing else 'all'}); not exporting an incomplete adapter"
        )
    for name, (_, shape) in expected.items():
        if tuple(trainable[name].shape) != tuple(shape):
            raise ConfigError(
                f"{folder}: {name} has shape {tuple(trainable[name].shape)} in the rank files, the "
                f"adapters' is {tuple(shape)}"
            )
    return {key: trainable[name] for name, (key, _) in expected.items()}


def _write_adapter(
    source: ZeroCheckpoint, adapters: dict[str, Entry], staging: Path, dtype: torch.dtype
) -> Written:
    holders = {
        k: types.SimpleNamespace(t=torch.empty(e.shape, dtype=torch.float32, device="meta"))
        for k, e in adapters.items()
    }
    split, meta = plan_shards(
        [(k, holders[k], "t", True) for k in adapters], dtype, 1 << 62, "adapter_model"
    )
    fault_point("export.write", step_of(source.folder.name))
    buffers: dict[torch.dtype, torch.Tensor] = {}
    with open(staging / ADAPTER_WEIGHTS, "wb") as f:
        f.write(shard_header(list(adapters), meta, {SOURCE_KEY: FROM_MASTER}))
        for key, entry in adapters.items():
            write_tensor(source, f, entry, meta[key], buffers)
        f.flush()
        os.fsync(f.fileno())
    shutil.copyfile(source.folder / ADAPTER_CONFIG, staging / ADAPTER_CONFIG)
    return len(adapters), split.total_size, [ADAPTER_WEIGHTS, ADAPTER_CONFIG]


# --- merging into the base ------------------------------------------------------------------------


def _base_folder(folder: Path, state: dict, override: str | None) -> Path:
    """Where the base model's safetensors are: ``--base_model``, else where the run loaded it;
    checked against the fingerprint the checkpoint recorded."""
    recorded = state.get(BASE_KEY)
    if not recorded:
        raise ConfigError(
            f"{folder}: trainer_state.json records no base model (not a "
            "LoRA checkpoint of finetune's)"
        )
    if recorded.get("kind") != "pretrained":
        raise ConfigError(
            f"--merge_lora: {folder}'s base was {describe_base(recorded)}, weights that were "
            "never saved; export the adapters without --merge_lora"
        )
    name = override or recorded["source"]
    base_dir, revision = weights_folder(name)
    if base_dir is None:
        flag = "--base_model" if override else "the recorded base model"
        raise ConfigError(
            f"{flag}: {name} is neither a folder nor a hub id with a cached copy; download it, or "
            f"give its folder with --base_model"
        )
    if not any(base_dir.glob("*.safetensors")):
        raise ConfigError(
            f"{base_dir}: no safetensors weights (--merge_lora streams "
            "the base's safetensors shards)"
        )
    now = {"source": name, "revision": revision, "fingerprint": fingerprint(base_dir)}
    if not same_base(recorded, now):
        raise ConfigError(
            f"--merge_lora: {folder}'s adapters were trained on {describe_base(recorded)}, "
            f"{base_dir} holds {describe_base(now)}: another base model; give the base they "
            "were trained on with --base_model"
        )
    return base_dir


def _base_files(base_dir: Path) -> list[str]:
    index = base_dir / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{index}: unreadable ({type(e).__name__}: {e})") from e
    files = sorted(p.name for p in base_dir.glob("*.safetensors"))
    if len(files) != 1:
        raise ConfigError(f"{base_dir}: {len(files)} safetensors files and no {INDEX}")
    return files


class _Delta:
    """One adapted module's LoRA factors, read whole from the rank files (r rows
    or columns each)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, scaling: float, transposed: bool):
        self.a = a
        self.b = b
        self.scaling = scaling
        self.transposed = transposed

    @property
    def shape(self) -> tuple[int, int]:
        """The delta's shape, which must be the base weight's."""
        out_in = (self.b.shape[0], self.a.shape[1])
        return out_in[::-1] if self.transposed else out_in

    def rows(self, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) of the delta to add to the base weight, in fp32."""
        # W is (in, out) (Conv1D) or (vocab, dim) (embedding): delta = (B @ A).T
        if self.transposed:
            return (self.b @ self.a[:, lo:hi]).T * self.scaling
        return (self.b[lo:hi] @ self.a) * self.scaling


def _plan_merge(
    base_dir: Path, adapters: dict[str, Entry], config: dict
) -> tuple[dict[str, tuple], BaseTensors]:
    """{base key: _Delta factory or full replacement key} for every adapted tensor, and the base's
    tensors in order with their shapes. Every adapter tensor must land on a base tensor."""
    from safetensors import safe_open

    order: BaseTensors = []
    for fname in _base_files(base_dir):
        with safe_open(base_dir / fname, framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                order.append(
                    (fname, key, torch.Size(sl.get_shape()), _dtype_of(sl.get_dtype(), key, fname))
                )
    keys = {key for _, key, _, _ in order}
    r = config["r"]
    alpha = config["lora_alpha"]
    if config.get("rank_pattern") or config.get("alpha_pattern") or config.get("use_dora"):
        raise ConfigError(
            "--merge_lora: per-module ranks, alphas or DoRA are not supported by this merge"
        )
    scaling = alpha / (math.sqrt(r) if config.get("use_rslora") else r)
    plan: dict[str, tuple] = {}
    prefix = "base_model.model."
    for key in adapters:
        # peft's keys: X.lora_A.weight, X.lora_embedding_A, or X.weight
        rest = key.removeprefix(prefix)
        if ".lora_B." in rest or rest.endswith(".lora_embedding_B"):
            continue  # taken with its A
        if ".lora_A." in rest:
            module = rest.split(".lora_A.")[0]
            b_key = key.replace(".lora_A.", ".lora_B.")
            transposed = bool(config.get("fan_in_fan_out"))
        elif rest.endswith(".lora_embedding_A"):
            module = rest.removesuffix(".lora_embedding_A")
            b_key = key[:-1] + "B"
            transposed = True
        else:  # modules_to_save: the trained copy replaces the base tensor
            plan[_match(rest, keys)] = ("replace", key)
            continue
        if b_key not in adapters:
            raise ConfigError(f"--merge_lora: the checkpoint has {key} but not {b_key}")
        plan[_match(f"{module}.weight", keys)] = ("delta", key, b_key, scaling, transposed)
    return plan, order


def _match(name: str, keys: set[str]) -> str:
    """The base file's key for a module path's tensor (checkpoints may drop the
    base model prefix)."""
    if name in keys:
        return name
    shorter = name.split(".", 1)[1] if "." in name else name
    if shorter in keys:
        return shorter
    raise ConfigError(
        f"--merge_lora: the adapters change {name}, which the base model's files don't hold"
    )


def _dtype_of(name: str, key: str, fname: str) -> torch.dtype:
    # fp8, packed quantized weights: merging into them is not this export's
    if name not in SAFE_TO_DTYPE:
        raise ConfigError(
            f"--merge_lora: {fname}'s {key} is {name}, which this merge "
            "can't write (a quantized base?)"
        )
    return SAFE_TO_DTYPE[name]


def _read_whole(source: ZeroCheckpoint, entry: Entry) -> torch.Tensor:
    return torch.cat([p.to(torch.float32) for p in source.pieces(entry)]).reshape(entry.shape)


def _write_merged(
    base_dir: Path,
    source: ZeroCheckpoint,
    adapters: dict[str, Entry],
    config: dict,
    staging: Path,
    dtype: torch.dtype,
    max_shard_size: str,
    progress: bool,
) -> Written:
    from safetensors import safe_open
    from tqdm.auto import tqdm

    plan, order = _plan_merge(base_dir, adapters, config)
    holders = {
        key: types.SimpleNamespace(t=torch.empty(shape, dtype=dt, device="meta"))
        for _, key, shape, dt in order
    }
    split, meta = plan_shards(
        [(key, holders[key], "t", True) for _, key, _, _ in order], dtype, max_shard_size
    )
    where = {key: fname for fname, key, _, _ in order}
    bar = tqdm(
        total=split.total_size,
        unit="B",
        unit_scale=True,
        desc="merge",
        disable=not progress,
        file=sys.stderr,
        mininterval=0.5 if sys.stderr.isatty() else 30,
    )
    handles: dict[str, safe_open] = {}
    try:
        with bar:
            for fname, names in split.filename_to_tensors.items():
                fault_point("export.write", step_of(source.folder.name))
                with open(staging / fname, "wb") as f:
                    f.write(shard_header(names, meta, {"finetune_merged_lora": "true"}))
                    for key in names:
                        if where[key] not in handles:
                            handles[where[key]] = safe_open(base_dir / where[key], framework="pt")
                        bar.update(
                            _write_merged_tensor(
                                f,
                                handles[where[key]],
                                key,
                                meta[key],
                                plan.get(key),
                                source,
                                adapters,
                            )
                        )
                    f.flush()
                    os.fsync(f.fileno())
    finally:
        handles.clear()
    files = list(split.filename_to_tensors) + list(split.write_index(staging))
    return len(order), split.total_size, files


def _write_merged_tensor(
    f: BinaryIO,
    handle: safe_open,
    key: str,
    out: torch.Tensor,
    how: tuple | None,
    source: ZeroCheckpoint,
    adapters: dict[str, Entry],
) -> int:
    """One output tensor: the base's rows, plus the delta's (or the trained copy),
    cast and appended."""
    # streamed from the rank files, like any exported tensor
    if how is not None and how[0] == "replace":
        entry = adapters[how[1]]
        if tuple(entry.shape) != tuple(out.shape):
            raise ConfigError(
                f"--merge_lora: {key} is {tuple(out.shape)} in the base, {tuple(entry.shape)} in "
                "the checkpoint's modules_to_save"
            )
        return write_tensor(source, f, entry, out, {})
    delta = None
    if how is not None:
        _, a_key, b_key, scaling, transposed = how
        delta = _Delta(
            _read_whole(source, adapters[a_key]),
            _read_whole(source, adapters[b_key]),
            scaling,
            transposed,
        )
        shape = delta.shape
        # a wrong transpose (fan_in_fan_out) or a base other than the adapters'
        if shape != tuple(out.shape):
            raise ConfigError(
                f"--merge_lora: the adapters' delta for {key} is {shape}, the base's weight "
                f"{tuple(out.shape)}"
            )
    sl = handle.get_slice(key)
    rows = out.shape[0] if out.dim() else 1
    row_bytes = max(1, out[0].numel() * 4) if out.dim() else 4
    step = max(1, CHUNK_BYTES // row_bytes)
    written = 0
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        base = sl[lo:hi] if out.dim() else sl[:]
        part = base.to(torch.float32) + delta.rows(lo, hi) if delta is not None else base
        data = part.to(out.dtype).contiguous().reshape(-1)
        f.write(data.view(torch.uint8).numpy() if data.numel() else b"")
        written += data.numel() * data.element_size()
    if written != out.numel() * out.element_size():
        raise RuntimeError(
            f"{key}: merged {written} bytes, its shape needs {out.numel() * out.element_size()}"
        )
    return written
