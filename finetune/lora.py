"""LoRA under ZeRO-3 (``--use_peft``): peft's adapters around the partitioned base model, and the
identity of that base, which every checkpoint records so that a resume refuses another one.

The base model is built partitioned as for full fine-tuning (zero.Init); ``get_peft_model`` then
freezes it and adds the adapters as ordinary parameters, which ``deepspeed.initialize`` partitions
(broadcasting rank 0's initial values: every rank starts from the same adapters). Only the adapters
(and ``--lora_modules_to_save``) are trainable, so the optimizer, its fp32 masters and the
checkpoint's rank files hold only them; the checkpoint leaves the frozen base out
(``exclude_frozen_parameters``) and a resume re-loads it from where it came from.

The base's identity: where it came from (local folder, or hub id and the commit of the cached
copy), and a fingerprint of its weight files. The fingerprint does not read whole files, which
for a 70B base would be 140 GB per start: per safetensors file it hashes the header (every
tensor's name, dtype, shape and place) and three 4 KiB blocks of every tensor's data (first,
middle, last); other weight files, 16 evenly spaced 64 KiB blocks. Another architecture or size
changes the headers, and another set of weights of the same architecture (a different
fine-tune, another release) changes essentially every tensor, so the sampled blocks too; an edit
of a few values deep inside one tensor would go unseen, which is not what "a different base" is.
A base built from a config (``--config_name``, the embedded model) is random weights from the
seed: its identity is the config's hash and the seed.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import xxhash

from finetune.config import ConfigError, ModelArgs, split_names
from finetune.distributed import log_main, logger

FINGERPRINT_METHOD = "xxh3-sampled-v1"
BLOCK = 4096  # bytes hashed at the start, middle and end of each safetensors tensor
RAW_BLOCKS, RAW_BLOCK = 16, 64 << 10  # other weight files: evenly spaced blocks
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
# trainer_state.json: the base model's identity (None: a full fine-tuning checkpoint).
BASE_KEY = "base_model"


# The LoRA flags whose values decide the adapters' tensors: a resume
# with other values can't load them.
SHAPE_FLAGS = ("lora_r", "lora_target_modules", "lora_modules_to_save")


def lora_config(args: ModelArgs, base_name: str | None = None):
    """peft's LoraConfig for the flags (TRL's meaning: no target modules = peft's default for the
    architecture)."""
    from peft import LoraConfig

    targets = split_names(args.lora_target_modules)
    targets = targets[0] if targets == ["all-linear"] else (targets or None)
    return LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=targets,
        modules_to_save=split_names(args.lora_modules_to_save) or None,
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_name,
    )


def apply_lora(model, args: ModelArgs, base_name: str | None):
    """The base frozen, adapters added (in the base's dtype: DeepSpeed keeps their fp32 masters).
    Raises ConfigError naming the flag when the targets match nothing in the model."""
    from peft import get_peft_model

    try:
        model = get_peft_model(model, lora_config(args, base_name), autocast_adapter_dtype=False)
    except ValueError as e:  # "Target modules {...} not found in the base model"
        flag = "--lora_modules_to_save" if "modules_to_save" in str(e) else "--lora_target_modules"
        raise ConfigError(f"{flag}: {' '.join(str(e).split())[:300]}") from None
    if hasattr(model, "enable_input_require_grads"):
        # Frozen embeddings give no grad to the first layer's input; activation checkpointing
        # needs one to recompute through (a no-op cost otherwise).
        model.enable_input_require_grads()
    return model


def trainable_parameters(model) -> int:
    """Trainable parameters, at full size under ZeRO-3 (a rank's tensor is its partition)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)


# --- the base model's identity --------------------------------------------------------------------


def base_identity(args: ModelArgs, seed: int, embedded_config: Path) -> dict:
    """What trainer_state.json records of the base (``BASE_KEY``); reads only headers and sampled
    blocks of its weight files. Rank 0 computes it, every rank receives it."""
    if not args.model_name_or_path:
        source = args.config_name or str(embedded_config)
        config = Path(source) / "config.json" if Path(source).is_dir() else Path(source)
        digest = _file_digest(config) if config.is_file() else None
        return {
            "source": source,
            "kind": "random init from a config",
            "seed": seed,
            "fingerprint": {"method": "config+seed", "config": digest, "seed": seed},
        }
    folder, revision = weights_folder(args.model_name_or_path)
    source = (
        str(Path(args.model_name_or_path).resolve())
        if Path(args.model_name_or_path).is_dir()
        else args.model_name_or_path
    )  # a local folder as an absolute path: export may run elsewhere
    identity = {"source": source, "kind": "pretrained", "revision": revision}
    identity["fingerprint"] = fingerprint(folder) if folder is not None else None
    return identity


def weights_folder(name: str) -> tuple[Path | None, str | None]:
    """The local folder holding ``name``'s weights and, for a hub id, the commit of that copy (None,
    None when there is none: the fingerprint is then unknown).

    A hub id's safetensors are fetched into the hub cache first, as ``from_pretrained`` would fetch
    them a moment later (on rank 0 while the others wait; nothing is fetched twice): the base is
    fingerprinted before the model is built, so that a resume can refuse another base before
    anything in OUT is touched. Offline (``HF_HUB_OFFLINE``), the cached copy.
    """
    path = Path(name)
    if path.is_dir():
        return path, None
    import huggingface_hub

    try:
        folder = Path(
            huggingface_hub.snapshot_download(name, allow_patterns=["*.safetensors", "*.json"])
        )
    except Exception as e:  # noqa: BLE001
        # not cached offline, gated, no such repo: from_pretrained says which
        logger.warning(
            "could not fetch %s's weights to fingerprint them (%s: %s)",
            name,
            type(e).__name__,
            " ".join(str(e).split())[:200],
        )
        return None, None
    return folder, folder.name  # .../snapshots/<commit>


def fingerprint(folder: Path) -> dict | None:
    """Sampled digests of ``folder``'s weight files (see the module doc) and one over them all; None
    when it has none (nothing to fingerprint)."""
    files = sorted({p for pattern in WEIGHT_PATTERNS for p in folder.glob(pattern) if p.is_file()})
    if not files:
        return None
    per_file = {}
    for path in files:
        digest = _safetensors_digest(path) if path.suffix == ".safetensors" else _raw_digest(path)
        per_file[path.name] = {"size": path.stat().st_size, "digest": digest}
    total = hashlib.sha256(json.dumps(per_file, sort_keys=True).encode()).hexdigest()[:32]
    return {"method": FINGERPRINT_METHOD, "digest": total, "files": per_file}


def _safetensors_digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        raw = f.read(8)
        n = int.from_bytes(raw, "little") if len(raw) == 8 else 0
        header = f.read(n)
        h.update(raw + header)
        try:
            tensors = [v for k, v in json.loads(header).items() if k != "__metadata__"]
        except (ValueError, AttributeError):
            tensors = []  # not a safetensors file after all: its header bytes were hashed
        base = 8 + n
        for start, end in sorted(tuple(t["data_offsets"]) for t in tensors if "data_offsets" in t):
            for offset in dict.fromkeys(
                (start, max(start, (start + end) // 2 - BLOCK // 2), max(start, end - BLOCK))
            ):
                f.seek(base + offset)
                h.update(f.read(min(BLOCK, end - offset)))
    return h.hexdigest()


def _raw_digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    size = path.stat().st_size
    with open(path, "rb") as f:
        for i in range(RAW_BLOCKS):
            f.seek(size * i // RAW_BLOCKS)
            h.update(f.read(RAW_BLOCK))
    return h.hexdigest()


def _file_digest(path: Path) -> str:
    return xxhash.xxh3_128(path.read_bytes()).hexdigest()


# --- resume checks --------------------------------------------------------------------------------


def check_resumable(folder: Path, saved: dict, args: ModelArgs, base: dict | None) -> None:
    """A LoRA checkpoint resumes only with --use_peft, adapters of the same shapes and the same base
    (and a full fine-tuning one only without --use_peft); otherwise ConfigError
    naming both sides."""
    saved_base = saved.get(BASE_KEY)
    if saved_base is None and base is None:
        return
    if saved_base is None:
        raise ConfigError(
            f"--use_peft: {folder} is a full fine-tuning checkpoint, not LoRA adapters; resume it "
            "without --use_peft"
        )
    if base is None:
        raise ConfigError(
            f"--resume_from_checkpoint: {folder} holds LoRA adapters (on "
            f"{describe_base(saved_base)}); resume it with --use_peft and the same --lora_* flags"
        )
    saved_args = saved.get("args", {}).get("model", {})
    for flag in SHAPE_FLAGS:
        before, now = saved_args.get(flag), getattr(args, flag)
        if flag in saved_args and sorted(split_names(before)) != sorted(split_names(now)):
            raise ConfigError(
                f"--{flag}: {folder}'s adapters were trained with --{flag} {before}, this run has "
                f"{now}; resume with the same value"
            )
    if not same_base(saved_base, base):
        raise ConfigError(
            f"--model_name_or_path: {folder}'s adapters were trained on "
            f"{describe_base(saved_base)}, this run loads {describe_base(base)}: another base "
            "model; resume with the base they were trained on"
        )
    if saved_base.get("fingerprint") is None or base.get("fingerprint") is None:
        log_main(
            logging.WARNING,
            "resume: the base model %s was not fingerprinted %s; trusting that it is the one "
            "the adapters were trained on",
            base["source"],
            "when the checkpoint was saved" if saved_base.get("fingerprint") is None else "now",
        )


def same_base(saved: dict, now: dict) -> bool:
    """The same weights: equal fingerprints (the source may have moved); when either side has none
    (weights that could not be found to fingerprint), the same source."""
    a, b = saved.get("fingerprint"), now.get("fingerprint")
    if a is not None and b is not None:
        return _digest(a) == _digest(b)
    return saved.get("source") == now.get("source")


def _digest(fp: dict):
    return fp.get("digest") if fp.get("method") == FINGERPRINT_METHOD else fp


def describe_base(base: dict) -> str:
    """A base model as a message names it: its source, revision and weights fingerprint."""
    fp = base.get("fingerprint") or {}
    what = base["source"] + (f"@{base['revision'][:12]}" if base.get("revision") else "")
    if fp.get("method") == FINGERPRINT_METHOD:
        return f"{what} (weights fingerprint {fp['digest'][:12]})"
    if fp.get("method") == "config+seed":
        return f"{what} (random weights from its config, seed {fp.get('seed')})"
    return f"{what} (weights not fingerprinted)"
