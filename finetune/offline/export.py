"""Offline export of a checkpoint, in one plain process: no launcher, no torch.distributed, no GPU.

``export_hf`` turns a partitioned ZeRO-3 checkpoint into a HuggingFace model folder, reading the
rank files through ``zero_files.ZeroCheckpoint`` (memory-mapped, bounded RSS: see that module) and
writing shards planned with ``shards.plan_shards``: trainable parameters are the fp32 master
weights cast to the requested dtype (default: the training dtype). Consolidated weights in the
checkpoint are copied instead only when they are exactly what that rebuild writes (``exact_copy``),
so the same command gives the same weights whether or not the run saved them.

Tied parameters are written once, under the name DeepSpeed stored (the one ``save_pretrained``
keeps, e.g. ``model.embed_tokens.weight``; ``from_pretrained`` re-ties ``lm_head.weight``).

``export_universal`` converts with DeepSpeed's own ZeRO-3 conversion (weights/universal.py,
resumable): the format resume loads on another world size, which reuses a ``universal/`` folder
found inside the checkpoint.

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
import shutil
import sys
import time
import types
from pathlib import Path

import torch

from finetune.checkpoint_format.best import named_best
from finetune.checkpoint_format.manifest import read_manifest
from finetune.checkpoint_format.outdir import OutputDir, find_checkpoint, step_of
from finetune.commands import Parser
from finetune.config import ConfigError, check_size
from finetune.io.durable import Writeback, fsync_path
from finetune.io.faults import fault_point
from finetune.io.remote import is_remote
from finetune.modeling import DTYPES
from finetune.offline.model_files import (
    DEFAULT_SHARD_SIZE,
    SAFE_TO_TORCH,
    WEIGHTS_RE,
    ExportResult,
    check_out,
    copy_model_files,
    peak_rss_bytes,
    plain_inputs,
    read_config,
    training_dtype,
    verify_inputs,
    write_tensor,
)
from finetune.weights.adapter import is_adapter_checkpoint
from finetune.weights.consolidate import FROM_MASTER, SOURCE_KEY
from finetune.weights.shards import INDEX, plan_shards, read_header, shard_header
from finetune.weights.universal import UNIVERSAL, to_universal
from finetune.weights.zero_files import ZeroCheckpoint, rank_model_files

# --- entry points ------------------------------------------------------------------------------


def export_hf(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    dtype: str | None = None,
    max_shard_size: str | None = None,
    exclude_frozen: bool = False,
    progress: bool = True,
    verify: bool = True,
    merge_lora: bool = False,
    base_model: str | None = None,
) -> ExportResult:
    """Write a HF model folder at ``out`` from ``checkpoint`` (a checkpoint
    folder or an output dir).

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
        raise ConfigError(
            f"`--merge_lora`/`--base_model`: {folder} is not a LoRA "
            "checkpoint (no adapter_config.json)"
        )
    if lora:
        if exclude_frozen:
            raise ConfigError(
                "`--exclude_frozen_parameters`: a LoRA checkpoint holds no frozen parameter"
            )
        from finetune.offline.lora_export import (
            export_lora,  # imports peft: only for a LoRA checkpoint
        )

        return export_lora(
            folder, out, dtype, max_shard_size, merge_lora, base_model, verify, progress
        )
    out = check_out(out)
    verified = [0, 0.0] if verify else None
    if verify:  # what decides copy or rebuild, and what is copied: before any of it is read
        _add(verified, verify_inputs(folder, plain_inputs(folder)))
    config = read_config(folder)
    copy, want = _copy_or_rebuild(
        folder, DTYPES[dtype] if dtype else None, max_shard_size is None and not exclude_frozen
    )
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
            tensors, size, files = _write_hf(
                source,
                staging,
                want,
                max_shard_size or DEFAULT_SHARD_SIZE,
                exclude_frozen,
                progress,
            )
        files += copy_model_files(folder, staging, want, config)
        fsync_path(staging)
        fault_point("export.publish", step_of(folder.name))
        os.replace(staging, out)  # over an empty `out` too: rename(2) replaces an empty directory
        fsync_path(out.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ExportResult(
        folder,
        out,
        tensors,
        size,
        want,
        sorted(files),
        time.perf_counter() - start,
        peak_rss_bytes(),
        bool(copy),
        tuple(verified) if verified else None,
    )


def _add(total: list, part: tuple[int, float]) -> None:
    total[0] += part[0]
    total[1] += part[1]


def export_universal(
    checkpoint: str | os.PathLike, out: str | os.PathLike | None = None, verify: bool = True
) -> tuple[Path, str]:
    """Convert ``checkpoint`` to DeepSpeed's universal format in ``out`` (default:
    CHECKPOINT/universal); ``verify``: DeepSpeed's files are checked against the manifest
    first. Returns the folder and the converter's summary (pieces done now and before,
    the longest piece)."""
    folder = resolve_checkpoint(checkpoint)
    ZeroCheckpoint.check_files(folder)
    target = check_out(out if out is not None else folder / UNIVERSAL)
    if verify:  # every rank file ds_to_universal picks up (it globs the folder)
        verify_inputs(folder, sorted(p.name for p in folder.glob("*_states.pt")))
    # resumes what an interrupted export --universal finished
    summary = to_universal(folder, target)
    return target, summary


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint folder ``path`` names (itself, or an output dir's newest);
    ConfigError if none."""
    folder = find_checkpoint(path)
    if (
        folder is not None
        and (folder / "mp_rank_00_model_states.pt").exists()
        and not rank_model_files(folder)
    ):
        raise ConfigError(
            f"{folder}: a ZeRO-1/2 checkpoint; export rebuilds ZeRO-3 ones (for this one use "
            f"DeepSpeed's zero_to_fp32.py)"
        )
    if folder is None or not (
        rank_model_files(folder) or any(WEIGHTS_RE.match(p.name) for p in folder.iterdir())
    ):
        raise ConfigError(
            f"{path}: not a checkpoint (no DeepSpeed rank files or safetensors weights)"
        )
    return folder


def best_checkpoint(location: str) -> str:
    """``--best``: the best checkpoint of an output dir (or s3://BUCKET/PREFIX), as its newest
    commit names it (checkpoint_format/best.py); ConfigError, one line, when none was evaluated."""
    if is_remote(location):
        from finetune.remote.verify import manifests

        found = manifests(location)  # a bucket that cannot be read: one line, exit 2
    elif Path(location).is_dir():
        storage = OutputDir(location)
        found = {tag: storage.read_manifest(tag) for tag in storage.tags()}
    else:
        raise ConfigError(f"{location}: no such output dir")
    record = named_best(found)
    if record is None:
        raise ConfigError(
            f"`--best`: {location} has no evaluated checkpoint (one saved at a step that was "
            "evaluated: every --eval_steps and the last)"
        )
    return f"{location.rstrip('/')}/{record['tag']}"


# --- checks and plain files -----------------------------------------------------------------------


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
    return next((SAFE_TO_TORCH[k] for k in kinds if k in SAFE_TO_TORCH), None), metadata.get(
        SOURCE_KEY
    )


def exact_copy(stored: torch.dtype | None, training: torch.dtype, weights_from: str | None) -> bool:
    """Whether consolidated weights in ``stored`` dtype are bit for bit what a rebuild in that dtype
    writes: the fp32 master weights cast to it. True when they were written from the masters
    (FROM_MASTER); module weights (recorded as such, or unrecorded: older checkpoints) are the
    masters cast to the training dtype, so they are exact only in that dtype, or when training
    ran in fp32. bf16 weights upcast to fp32 are not: the masters carry bits they dropped.
    """
    return weights_from == FROM_MASTER or training in (stored, torch.float32)


def _copy_or_rebuild(
    folder: Path, want: torch.dtype | None, as_saved: bool
) -> tuple[list[str], torch.dtype]:
    """(the consolidated files to copy, or [] to rebuild from the rank files; the dtype to write).

    ``want`` defaults to the training dtype, whether or not the run saved consolidated weights;
    they are copied only when they are exactly what the rebuild would write and ``as_saved``
    (no other sharding, nothing left out). Without rank files they are all there is.
    """
    # What a failed consolidated save left is not listed and not weights to copy: never read.
    files = (
        []
        if (read_manifest(folder) or {}).get("consolidated") is False
        else _consolidated_files(folder)
    )
    stored, weights_from = _stored_weights(folder, files) if files else (None, None)
    training = training_dtype(folder)
    # nothing to rebuild from: copied as they are, or an error later
    if not rank_model_files(folder):
        stored = stored or torch.float32
        want = want or stored
        return (files if as_saved and want == stored else []), want
    want = want or training
    exact = bool(files) and want == stored and exact_copy(stored, training, weights_from)
    return (files if exact and as_saved else []), want


def _copy_weights(folder: Path, staging: Path, files: list[str]) -> tuple[int, int, list[str]]:
    tensors = 0
    size = 0
    for name in files:
        fault_point("export.write", step_of(folder.name))
        shutil.copyfile(folder / name, staging / name)  # kernel-side copy: no RSS growth
        if name != INDEX:
            header = _tensors_in(staging / name)
            tensors += len(header)
            size += sum(v["data_offsets"][1] - v["data_offsets"][0] for v in header.values())
    return tensors, size, files


# --- writing HF shards from the rank files ------------------------------------------------------


def _write_hf(
    source: ZeroCheckpoint,
    staging: Path,
    dtype: torch.dtype,
    max_shard_size: str,
    exclude_frozen: bool,
    progress: bool,
) -> tuple[int, int, list[str]]:
    from tqdm.auto import tqdm

    entries = [e for e in source.entries if not (exclude_frozen and e.kind == "frozen")]
    by_name = {e.name: e for e in entries}
    buffers: dict = {}  # one reused conversion buffer per dtype
    holders = {
        e.name: types.SimpleNamespace(t=torch.empty(e.shape, dtype=e.dtype, device="meta"))
        for e in entries
    }
    split, meta = plan_shards(
        [(e.name, holders[e.name], "t", e.kind != "buffer") for e in entries], dtype, max_shard_size
    )
    bar = tqdm(
        total=split.total_size,
        unit="B",
        unit_scale=True,
        desc="export",
        disable=not progress,
        file=sys.stderr,
        mininterval=0.5 if sys.stderr.isatty() else 30,
    )
    with bar:
        for fname, names in split.filename_to_tensors.items():
            fault_point("export.write", step_of(source.folder.name))
            with open(staging / fname, "wb") as f:
                w = Writeback(f)  # the disk writes while later tensors are rebuilt
                # as a consolidated save records it
                w.write(shard_header(names, meta, {SOURCE_KEY: FROM_MASTER}))
                for name in names:
                    bar.update(write_tensor(source, w, by_name[name], meta[name], buffers))
                f.flush()
                os.fsync(f.fileno())
    files = list(split.filename_to_tensors) + list(split.write_index(staging))
    return len(entries), split.total_size, files


# --- the command ---------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    """``finetune export CKPT OUT``: exit 0 written, 1 failed while writing, 2 bad input."""
    p = Parser(
        prog="finetune export",
        description="Turn a checkpoint into a HuggingFace model folder (safetensors, "
        "config, tokenizer), rebuilt from the rank files in one plain process with bounded memory; "
        "or, with --universal, into DeepSpeed's universal format. Exit 2 on bad input.",
    )
    p.add_argument(
        "checkpoint",
        metavar="CKPT",
        help="A checkpoint folder, or an output dir (its newest committed checkpoint is exported); "
        "or s3://BUCKET/PREFIX[/global_stepN], downloaded beside OUT (checked against its "
        "manifest, removed after the export).",
    )
    p.add_argument(
        "out",
        metavar="OUT",
        nargs="?",
        help="The folder to create (must not exist, or be empty). "
        "With --universal, default CHECKPOINT/universal.",
    )
    p.add_argument(
        "--dtype",
        choices=("bf16", "fp16", "fp32"),
        default=None,
        help="Weights dtype (default: the training dtype in trainer_state.json, else fp32).",
    )
    p.add_argument(
        "--max_shard_size", default=None, help="Largest safetensors shard (default: 5GB)."
    )
    p.add_argument(
        "--exclude_frozen_parameters",
        action="store_true",
        help="Leave out parameters that were frozen.",
    )
    p.add_argument(
        "--universal",
        action="store_true",
        help="Write DeepSpeed's universal checkpoint format instead "
        "(what resume on another world size loads).",
    )
    p.add_argument(
        "--merge_lora",
        action="store_true",
        help="A LoRA checkpoint (--use_peft): write the base model with the adapters merged into "
        "its weights, a model folder that loads without peft (default: the adapter folder, "
        "adapter_model.safetensors + adapter_config.json, for PeftModel.from_pretrained).",
    )
    p.add_argument(
        "--base_model",
        metavar="PATH_OR_HUB_ID",
        default=None,
        help="With --merge_lora: the base model's folder or hub id, if not where the "
        "run loaded it from (its weights must be the same: checked against the "
        "fingerprint the checkpoint recorded).",
    )
    p.add_argument(
        "--best",
        action="store_true",
        help="Export the best checkpoint of the output dir CKPT (--metric_for_best_model: the one "
        "its newest commit names, marked + by `finetune ls`) instead of the newest.",
    )
    p.add_argument(
        "--no_verify",
        action="store_true",
        help="Don't check the files read against the checkpoint's manifest.json first (sizes "
        "and checksums); needed for a checkpoint without one. The rank files are unpickled "
        "with weights_only=True either way.",
    )
    ns = p.parse_args(argv)
    if ns.best:  # then as if that checkpoint were named
        best = best_checkpoint(ns.checkpoint)
        return main([best if a == ns.checkpoint else a for a in argv if a != "--best"])
    if is_remote(ns.checkpoint):  # s3://: downloaded beside OUT, verified, exported, removed
        from finetune.remote.fetch import download_checkpoint

        if ns.out is None:
            p.error("an s3:// CKPT needs OUT")
        check_out(ns.out)  # before a download that may be large
        staging = Path(ns.out).parent / f".{Path(ns.out).name}.download"
        try:
            folder = download_checkpoint(ns.checkpoint, staging)
            return main([str(folder) if a == ns.checkpoint else a for a in argv])
        except OSError as e:  # the download's disk is full or failing: OUT was never created
            print(f"finetune: error: export failed, {ns.out} was not written: {e}", file=sys.stderr)
            return 1
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    if ns.universal:
        if (
            ns.dtype
            or ns.max_shard_size
            or ns.exclude_frozen_parameters
            or ns.merge_lora
            or ns.base_model
        ):
            raise ConfigError(
                "`--universal` takes no `--dtype`, `--max_shard_size`, "
                "`--exclude_frozen_parameters`, `--merge_lora` or `--base_model`"
            )
        start = time.perf_counter()
        target, summary = export_universal(ns.checkpoint, ns.out, verify=not ns.no_verify)
        print(
            f"Converted {ns.checkpoint} to DeepSpeed's universal format in {target} "
            f"({time.perf_counter() - start:.1f} s; {summary.removeprefix('converted ')})"
        )
        return 0
    if ns.out is None:
        p.error("the following arguments are required: OUT")
    if ns.max_shard_size is not None:
        check_size(ns.max_shard_size)
    try:
        result = export_hf(
            ns.checkpoint,
            ns.out,
            ns.dtype,
            ns.max_shard_size,
            ns.exclude_frozen_parameters,
            verify=not ns.no_verify,
            merge_lora=ns.merge_lora,
            base_model=ns.base_model,
        )
    except OSError as e:
        # a full disk, an I/O error: the staging folder is gone, OUT was never created
        print(f"finetune: error: export failed, {ns.out} was not written: {e}", file=sys.stderr)
        return 1
    print(result.summary())
    return 0
