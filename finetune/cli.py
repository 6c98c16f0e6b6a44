"""Command line → typed config. The only module that sees an argparse Namespace.

``finetune [flags]`` trains; ``finetune COMMAND …`` runs a subcommand. Usage errors exit 2 with
one line naming the flag or file, before any heavy work and before anything is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

from finetune import distributed as dist
from finetune.preemption import parse_signals, release_early
from finetune.config import (
    DATA_EXTENSIONS,
    CheckpointArgs,
    ConfigError,
    DataArgs,
    ModelArgs,
    RunConfig,
    TrainArgs,
    data_format,
    env_world_size,
    load_ds_json,
    reconcile,
    resolve_config_path,
)

GROUPS = (("model", ModelArgs), ("data", DataArgs), ("train", TrainArgs), ("ckpt", CheckpointArgs))

# Fallbacks for unset fields; the embedded tiny model gets values that make it learn in a short run.
FALLBACKS = dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, learning_rate=5e-5,
                 weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
                 max_grad_norm=1.0, warmup_steps=0, logging_steps=10, max_seq_length=512)
EMBEDDED_PRESET = dict(learning_rate=1e-3, warmup_steps=10, logging_steps=5, max_seq_length=128)
EMBEDDED_MAX_STEPS = 150


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors once (rank 0), not once per rank.

    No abbreviated flags: `--output` would silently be --output_dir to training but not to the
    job scripts, which read --output_dir from the same arguments (finetune.exit_status).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):
        if dist.env_rank() == 0:
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def _help(f: dataclasses.Field) -> str:
    text = f.metadata["help"]
    if f.default is not None and f.default is not False:
        text += f" (default: {f.default})"
    return text.replace("%", "%%")


def build_train_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="finetune", description="ZeRO-3 fine-tuning of HuggingFace causal LMs with DeepSpeed. "
                "With no flags: trains the embedded tiny model on bundled data.")
    for title, cls in GROUPS:
        group = p.add_argument_group(f"{title} arguments")
        for f in dataclasses.fields(cls):
            flag = f"--{f.name}"
            if f.type in (bool, "bool"):
                group.add_argument(flag, action="store_true", help=_help(f))
                continue
            kind = _scalar_type(f)
            group.add_argument(flag, type=kind, default=None if f.default is None else f.default,
                               choices=f.metadata.get("choices"), help=_help(f), metavar=f.name.upper())
    p.add_argument("--bf16", action="store_const", const="bf16", dest="precision_alias", help="Shorthand for --precision bf16.")
    p.add_argument("--fp16", action="store_const", const="fp16", dest="precision_alias", help="Shorthand for --precision fp16.")
    # The DeepSpeed launcher appends --local_rank; the environment already carries it.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def _scalar_type(f: dataclasses.Field) -> Callable[[str], Any]:
    t = str(f.type)
    if "int" in t:
        return int
    if "float" in t:
        return float
    return str


def parse_train_args(argv: list[str]) -> RunConfig:
    ns = build_train_parser().parse_args(argv)
    values = {k: v for k, v in vars(ns).items() if k not in ("local_rank", "precision_alias")}
    precision_flag = f"precision {values['precision']}"
    if ns.precision_alias:
        if values["precision"] not in ("auto", ns.precision_alias):
            raise ConfigError(f"Can't give both `--{ns.precision_alias}` and `--precision {values['precision']}`")
        values["precision"] = ns.precision_alias
        precision_flag = ns.precision_alias
    return build_run_config(values, precision_flag)


def build_run_config(values: dict[str, Any], precision_flag: str | None = None) -> RunConfig:
    """Validate flag values, reconcile them with the DeepSpeed JSON, and freeze them."""
    embedded_model = values["model_name_or_path"] is None and values["config_name"] is None
    embedded_data = values["dataset_name"] is None and values["train_file"] is None
    _validate_flags(values)
    _validate_paths(values)
    # The preset is a default, not a flag: an explicit DeepSpeed JSON value must win over it.
    fallbacks = {**FALLBACKS, **EMBEDDED_PRESET} if embedded_model else FALLBACKS
    if embedded_model and values["max_steps"] is None and values["num_train_epochs"] is None and embedded_data:
        values["max_steps"] = EMBEDDED_MAX_STEPS
    if values["max_steps"] is None and values["num_train_epochs"] is None:
        values["num_train_epochs"] = 3.0
    world = env_world_size()
    ds = load_ds_json(values["deepspeed_config"])
    _reconcile_ds(values, ds, world, fallbacks, precision_flag or f"precision {values['precision']}")
    for k, v in fallbacks.items():
        values[k] = v if values[k] is None else values[k]
    fields = {name: cls(**{f.name: values[f.name] for f in dataclasses.fields(cls)}) for name, cls in GROUPS}
    return RunConfig(**fields, ds_config=ds, world_size=world,
                     uses_embedded_model=embedded_model, uses_embedded_data=embedded_data)


def _validate_flags(v: dict[str, Any]) -> None:
    if v["max_steps"] is not None and v["num_train_epochs"] is not None:
        raise ConfigError("Can't give both `--max_steps` and `--num_train_epochs`")
    if v["dataset_name"] and v["train_file"]:
        raise ConfigError("Can't give both `--dataset_name` and `--train_file`")
    if v["config_name"] and v["model_name_or_path"]:
        raise ConfigError("Can't give both `--config_name` (train from scratch) and `--model_name_or_path` (load weights)")
    if bool(v["prompt_column"]) != bool(v["completion_column"]):
        raise ConfigError("`--prompt_column` and `--completion_column` go together: give both or neither")
    if v["messages_column"] and v["prompt_column"]:
        raise ConfigError("Can't give both `--messages_column` and `--prompt_column`/`--completion_column`")
    if v["validation_file"] and not (v["train_file"] or v["dataset_name"]):
        raise ConfigError("`--validation_file` needs `--train_file` or `--dataset_name`")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                 "max_steps", "logging_steps", "eval_steps", "save_steps", "save_total_limit",
                 "max_seq_length", "max_train_samples", "max_eval_samples", "preprocessing_num_workers"):
        if v[name] is not None and v[name] <= 0:
            raise ConfigError(f"`--{name}` must be positive, got {v[name]}")
    for name in ("num_train_epochs", "learning_rate"):
        if v[name] is not None and not v[name] > 0:
            raise ConfigError(f"`--{name}` must be positive, got {v[name]}")
    for name in ("warmup_steps", "weight_decay", "max_grad_norm", "adam_epsilon"):
        if v[name] is not None and v[name] < 0:
            raise ConfigError(f"`--{name}` must not be negative, got {v[name]}")
    if not 0 <= v["validation_split_percentage"] < 100:
        raise ConfigError(f"`--validation_split_percentage` must be in [0, 100), got {v['validation_split_percentage']}")
    if v["max_shard_size"] is not None:
        _check_size(v["max_shard_size"])
    try:
        parse_signals(v["preempt_signals"])
    except ValueError as e:
        raise ConfigError(f"`--preempt_signals`: {e} is not a signal that can be caught (e.g. SIGTERM,SIGUSR1 or none)") from None
    if (v["save_steps"] or v["save_total_limit"] or v["save_consolidated"]) and not v["save_checkpoint"]:
        raise ConfigError("`--save_steps`, `--save_total_limit` and `--save_consolidated` need `--save_checkpoint`")


def _check_size(text: str) -> None:
    # The parser split_torch_state_dict_into_shards itself uses, so what passes here works there.
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        ok = parse_size_to_int(text) > 0
    except ValueError:
        ok = False
    if not ok:
        raise ConfigError(f"`--max_shard_size` must be a positive size like 5GB or 500MB, got {text!r}")


def _validate_paths(v: dict[str, Any]) -> None:
    for flag in ("output_dir", "dataset_cache_dir"):
        folder = Path(v[flag]) if v[flag] else None
        if folder is not None and folder.exists() and not folder.is_dir():
            raise ConfigError(f"--{flag}: {folder} exists and is not a directory")
    for flag in ("train_file", "validation_file"):
        path = v[flag]
        if path is None:
            continue
        if not Path(path).is_file():
            raise ConfigError(f"--{flag}: file not found: {path}")
        if data_format(path) is None:
            raise ConfigError(f"--{flag}: unsupported file type '{Path(path).suffix}' for {path} "
                              f"(use one of {', '.join(sorted(DATA_EXTENSIONS))})")
    if v["train_file"] and v["validation_file"] and data_format(v["train_file"]) != data_format(v["validation_file"]):
        raise ConfigError("--validation_file: must have the same format as --train_file")
    for flag in ("model_name_or_path", "config_name", "tokenizer_name"):
        if v[flag] and _looks_local(v[flag]) and not Path(v[flag]).exists():
            raise ConfigError(f"--{flag}: no such directory: {v[flag]}")
    resolve_config_path(v["deepspeed_config"])


def _looks_local(name: str) -> bool:
    """Hub ids are `name` or `org/name`; anything else is meant as a path."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or os.sep != "/" and os.sep in name


def _reconcile_ds(v: dict[str, Any], ds: dict, world: int, fallbacks: dict[str, Any], precision_flag: str) -> None:
    path = v["deepspeed_config"]
    if not isinstance(ds.get("zero_optimization", {}), dict):
        raise ConfigError(f"--deepspeed_config: `zero_optimization` in {path} must be an object")
    for flag, key in (("per_device_train_batch_size", "train_micro_batch_size_per_gpu"),
                      ("gradient_accumulation_steps", "gradient_accumulation_steps"),
                      ("max_grad_norm", "gradient_clipping")):
        v[flag] = reconcile(flag, v[flag], ds, key, fallbacks[flag], path)
    want = v["per_device_train_batch_size"] * v["gradient_accumulation_steps"] * world
    tbs = ds.get("train_batch_size", "auto")
    if tbs != "auto" and tbs != want:
        raise ConfigError(f"`train_batch_size: {tbs}` in {path} must equal --per_device_train_batch_size × "
                          f"--gradient_accumulation_steps × world size = {want}")
    ds["train_batch_size"] = want
    if isinstance(ds.get("optimizer"), dict):
        _reconcile_optimizer(v, ds, path, fallbacks)
    if isinstance(ds.get("scheduler"), dict):
        v["warmup_steps"] = reconcile("warmup_steps", v["warmup_steps"], ds, "scheduler.params.warmup_num_steps",
                                      fallbacks["warmup_steps"], path, write=False)
    _reconcile_precision(v, ds, path, precision_flag)
    if v["report_to"] == "tensorboard":
        # DeepSpeed's own monitor writes the events (rank 0 only) to OUT/tensorboard/finetune.
        ds["tensorboard"] = {**ds.get("tensorboard", {}), "enabled": True,
                             "output_path": str(Path(v["output_dir"]) / "tensorboard"), "job_name": "finetune"}


def _reconcile_optimizer(v: dict[str, Any], ds: dict, path: str, fallbacks: dict[str, Any]) -> None:
    p = "optimizer.params."
    for flag, key in (("learning_rate", "lr"), ("weight_decay", "weight_decay"), ("adam_epsilon", "eps")):
        v[flag] = reconcile(flag, v[flag], ds, p + key, fallbacks[flag], path)
    params = ds["optimizer"].setdefault("params", {})
    betas = params.get("betas", "auto")
    betas = ["auto", "auto"] if betas == "auto" else list(betas)
    for i, flag in enumerate(("adam_beta1", "adam_beta2")):
        if betas[i] == "auto":
            betas[i] = fallbacks[flag] if v[flag] is None else v[flag]
        elif v[flag] is not None and float(v[flag]) != float(betas[i]):
            raise ConfigError(f"`--{flag} {v[flag]}` contradicts `optimizer.params.betas: {params['betas']}` in {path}")
        v[flag] = betas[i]
    params["betas"] = betas


def _reconcile_precision(v: dict[str, Any], ds: dict, path: str, flag: str) -> None:
    for k in ("bf16", "fp16"):
        if not isinstance(ds.setdefault(k, {}), dict):
            raise ConfigError(f"--deepspeed_config: `{k}` in {path} must be an object")
    enabled = {k: ds[k].get("enabled", "auto") for k in ("bf16", "fp16")}
    explicit = [k for k, e in enabled.items() if e is True]
    if len(explicit) > 1:
        raise ConfigError(f"--deepspeed_config: {path} enables both bf16 and fp16")
    if explicit:
        if v["precision"] not in ("auto", explicit[0]):
            raise ConfigError(f"`--{flag}` contradicts `{explicit[0]}.enabled: true` in {path}")
        v["precision"] = explicit[0]
    elif v["precision"] in enabled and enabled[v["precision"]] is False:
        raise ConfigError(f"`--{flag}` contradicts `{v['precision']}.enabled: false` in {path}")
    elif v["precision"] == "auto":
        v["precision"] = auto_precision()
    for k in ("bf16", "fp16"):
        ds[k]["enabled"] = v["precision"] == k


def auto_precision() -> str:
    """bf16 where the accelerator supports it; fp32 on CPU (bf16 matmuls there are slow and lossy)."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.device_name() != "cpu" and acc.is_bf16_supported():
        return "bf16"
    return "fp32"


# --- subcommands ---------------------------------------------------------------------------

def _train(argv: list[str]) -> int:
    cfg = parse_train_args(argv)
    from finetune.trainer import run

    return run(cfg)


def _verify(argv: list[str]) -> int:
    from finetune.checkpoint.manifest import verify
    from finetune.checkpoint.storage import find_checkpoint

    p = _Parser(prog="finetune verify", description="Check a checkpoint against its manifest.json. "
                "Exit 0 intact, 1 damaged (names the files), 2 not a checkpoint.")
    p.add_argument("checkpoint", help="A checkpoint folder, or an output dir (its `latest` is checked).")
    p.add_argument("--quick", action="store_true", help="Check file sizes only, not checksums.")
    ns = p.parse_args(argv)
    folder = find_checkpoint(ns.checkpoint)
    report = verify(folder, checksums=not ns.quick) if folder else None
    if report is None or not report.is_checkpoint:
        raise ConfigError(f"{ns.checkpoint}: not a checkpoint (no manifest.json or DeepSpeed files)")
    what = "sizes" if ns.quick else "sizes and checksums"
    if report.ok:
        rate = report.bytes_checked / 1e9 / max(report.seconds, 1e-9)
        print(f"OK {folder}: {report.files} files, {report.bytes_checked / 1e6:.1f} MB, {what} match "
              f"({report.seconds:.2f} s, {rate:.2f} GB/s)")
        return 0
    print(f"DAMAGED {folder}: {len(report.problems)} problem(s)")
    for problem in report.problems:
        print(f"  - {problem}")
    return 1


def _export(argv: list[str]) -> int:
    from finetune.checkpoint.export import export_hf, export_universal

    p = _Parser(prog="finetune export", description="Turn a checkpoint into a HuggingFace model folder (safetensors, "
                "config, tokenizer), rebuilt from the rank files in one plain process with bounded memory; "
                "or, with --universal, into DeepSpeed's universal format. Exit 2 on bad input.")
    p.add_argument("checkpoint", metavar="CKPT", help="A checkpoint folder, or an output dir (its `latest` is exported).")
    p.add_argument("out", metavar="OUT", nargs="?", help="The folder to create (must not exist, or be empty). "
                   "With --universal, default CHECKPOINT/universal.")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                   help="Weights dtype (default: the training dtype in trainer_state.json, else fp32).")
    p.add_argument("--max_shard_size", default=None, help="Largest safetensors shard (default: 5GB).")
    p.add_argument("--exclude_frozen_parameters", action="store_true", help="Leave out parameters that were frozen.")
    p.add_argument("--universal", action="store_true", help="Write DeepSpeed's universal checkpoint format instead "
                   "(what resume on another world size loads).")
    ns = p.parse_args(argv)
    if ns.universal:
        if ns.dtype or ns.max_shard_size or ns.exclude_frozen_parameters:
            raise ConfigError("`--universal` takes no `--dtype`, `--max_shard_size` or `--exclude_frozen_parameters`")
        start = time.perf_counter()
        target = export_universal(ns.checkpoint, ns.out)
        print(f"Converted {ns.checkpoint} to DeepSpeed's universal format in {target} "
              f"({time.perf_counter() - start:.1f} s)")
        return 0
    if ns.out is None:
        p.error("the following arguments are required: OUT")
    if ns.max_shard_size is not None:
        _check_size(ns.max_shard_size)
    result = export_hf(ns.checkpoint, ns.out, ns.dtype, ns.max_shard_size, ns.exclude_frozen_parameters)
    print(result.summary())
    return 0


COMMANDS: dict[str, Callable[[list[str]], int]] = {"train": _train, "verify": _verify, "export": _export}


def main(argv: list[str] | None = None) -> int:
    dist.adopt_slurm_env()
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "train"
    if command != "train":
        release_early()  # only training treats SIGTERM/SIGUSR1 as "save and stop"
    try:
        return COMMANDS[command](argv)
    except ConfigError as e:
        if dist.rank() == 0:
            print(f"finetune: error: {e}", file=sys.stderr)
        return 2
