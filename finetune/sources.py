"""Checks that read the filesystem, before any work: the output dir, data files, the model,
config and tokenizer sources (a folder, or a hub id cached for offline use),
--resume_from_checkpoint PATH and the DeepSpeed JSON. Each failure is a ConfigError naming its
flag (resolve.resolve calls these)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from finetune.config import DATA_EXTENSIONS, WEIGHT_FILES, ConfigError, data_format


def validate_paths(v: Mapping[str, Any]) -> None:
    """Checks that read the filesystem: data files, local model dirs, the output dir,
    the DeepSpeed JSON."""
    for flag in ("output_dir", "dataset_cache_dir"):
        folder = Path(v[flag]) if v[flag] else None
        if folder is not None and folder.exists() and not folder.is_dir():
            raise ConfigError(f"--{flag}: {folder} exists and is not a directory")
    latest = Path(v["output_dir"]) / "latest" if v["output_dir"] else None
    if latest is not None and (latest.is_dir() or latest.is_symlink() and not latest.is_file()):
        # Never rewritable by an atomic replace: every commit would leave `latest` stale.
        raise ConfigError(
            f"--output_dir: {latest} is not a file (remove it; finetune writes the tag of the "
            f"newest checkpoint there)"
        )
    check_data_files(v)
    for i, entry in enumerate(v.get("dataset_mixture") or ()):
        check_data_files(entry, f"--dataset_mixture[{i}] ({entry['name']}): ")
    for i, entry in enumerate(v.get("eval_datasets") or ()):
        check_data_files(entry, f"--eval_datasets[{i}] ({entry['name']}): ")
    for flag in ("model_name_or_path", "config_name", "tokenizer_name"):
        if v[flag]:
            check_model_source(flag, v[flag])
    check_resume_path(v["resume_from_checkpoint"])
    from finetune.ds_config import resolve_config_path

    resolve_config_path(v["deepspeed_config"])


def check_data_files(v: Mapping[str, Any], where: str = "--") -> None:
    """train_file and validation_file exist and are of a type datasets reads, the same one.
    ``where`` prefixes the key in errors: "--" for the flags, a mixture entry for its keys."""
    for flag in ("train_file", "validation_file"):
        path = v.get(flag)
        if path is None:
            continue
        if not Path(path).is_file():
            raise ConfigError(f"{where}{flag}: file not found: {path}")
        if data_format(path) is None:
            raise ConfigError(
                f"{where}{flag}: unsupported file type '{Path(path).suffix}' for {path} "
                f"(use one of {', '.join(sorted(DATA_EXTENSIONS))})"
            )
    if (
        v.get("train_file")
        and v.get("validation_file")
        and data_format(v["train_file"]) != data_format(v["validation_file"])
    ):
        other = "--train_file" if where == "--" else "its train_file"
        raise ConfigError(f"{where}validation_file: must have the same format as {other}")


def check_model_source(flag: str, name: str) -> None:
    """A model, config or tokenizer source that cannot load, named before any process starts work:
    a missing folder, a model folder without config or weights, a hub id that is not cached while
    offline (HF_HUB_OFFLINE)."""
    path = Path(name)
    if path.is_dir():
        if (path / "adapter_config.json").is_file():
            return  # a PEFT adapter: transformers finds its base model through it
        if flag != "tokenizer_name" and not (path / "config.json").is_file():
            raise ConfigError(f"--{flag}: {name} has no config.json (not a model folder)")
        if flag == "model_name_or_path" and not any(next(path.glob(p), None) for p in WEIGHT_FILES):
            raise ConfigError(
                f"--model_name_or_path: {name} has no weights (model.safetensors, "
                "pytorch_model.bin or their shards); to train from scratch with its "
                f"config, use --config_name {name}"
            )
        return
    if path.exists():
        if flag == "config_name":
            return  # a config.json file, which AutoConfig reads too
        raise ConfigError(f"--{flag}: {name} is a file, not a model folder or hub id")
    if looks_local(name):
        raise ConfigError(f"--{flag}: no such directory: {name}")
    _check_hub_id(flag, name)


def _check_hub_id(flag: str, name: str) -> None:
    import huggingface_hub

    # A tokenizer repo may hold only tokenizer_config.json; AutoTokenizer falls back to config.json.
    wanted = (
        ("tokenizer_config.json", "config.json") if flag == "tokenizer_name" else ("config.json",)
    )
    try:
        cached = [huggingface_hub.try_to_load_from_cache(name, f) for f in wanted]
    except ValueError as e:  # HFValidationError: not a well-formed repo id
        raise ConfigError(
            f"--{flag}: {name} is neither a folder nor a hub id ({str(e).splitlines()[0]})"
        ) from None
    if huggingface_hub.is_offline_mode() and not any(isinstance(c, str) for c in cached):
        raise ConfigError(
            f"--{flag}: {name} is not a folder, and the hub is offline (HF_HUB_OFFLINE) with no "
            f"cached copy of it; download it first, or point --{flag} at a local folder"
        )


def check_resume_path(spec: str | None) -> None:
    """--resume_from_checkpoint PATH names a checkpoint, or an output dir holding one (latest and
    auto are resolved later, from what the output dir holds)."""
    if spec is None or spec in ("latest", "auto"):
        return
    from finetune.io.remote import RemoteError, S3Uri, is_remote

    if is_remote(spec):  # read when the run starts (remote/fetch.py)
        try:
            S3Uri.parse(spec)
        except RemoteError as e:
            raise ConfigError(f"--resume_from_checkpoint: {e}") from None
        return
    from finetune.checkpoint_format.manifest import looks_like_checkpoint
    from finetune.checkpoint_format.outdir import find_checkpoint

    folder = find_checkpoint(spec)
    if folder is None or not looks_like_checkpoint(folder):
        why = (
            "no such folder"
            if not Path(spec).exists()
            else "not a checkpoint, nor an output dir holding one"
        )
        raise ConfigError(f"--resume_from_checkpoint: {spec}: {why}")


def looks_local(name: str) -> bool:
    """Hub ids are `name` or `org/name`; anything else is meant as a path."""
    return (
        name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name
    )
