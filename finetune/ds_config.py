"""The DeepSpeed JSON: loading it, reconciling its values with the flags ("auto" filled from the
flag; an explicit value used when the flag is absent; both and different is an error naming
both), and the values only known once the run is built (total steps, warm-up).

Everything that can be wrong with the JSON is found while the flags are resolved, in one process
before any other work: its shape (ZeRO-3; objects where objects go), the types and ranges of the
values the flags also set, an "auto" nothing can fill, and whatever DeepSpeed's own parser
rejects. Each error names the file and the key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from finetune.config import CONFIGS_DIR, ConfigError, report_targets


def resolve_config_path(path: str) -> Path:
    """Paths are relative to the working directory; the default also resolves from the repo."""
    p = Path(path)
    if p.exists():
        return p
    if not p.is_absolute() and p.parts[:1] == ("configs",) and (CONFIGS_DIR / p.name).exists():
        return CONFIGS_DIR / p.name
    raise ConfigError(f"--deepspeed_config: file not found: {path}")


def load_ds_json(path: str) -> dict:
    p = resolve_config_path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"--deepspeed_config: cannot read {p}: {e.strerror}") from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"--deepspeed_config: {p} is not valid JSON: {e.msg} at "
            f"line {e.lineno} column {e.colno}"
        ) from None
    if not isinstance(cfg, dict):
        raise ConfigError(
            f"--deepspeed_config: {p} must hold a JSON object, not {type(cfg).__name__}"
        )
    return cfg


_MISSING = object()
# The "auto" values filled once the dataset's size is known (finalize_ds_config); any other "auto"
# left after reconciling with the flags has nothing to fill it.
FILLED_LATER = tuple(
    f"scheduler.params.{k}"
    for k in ("total_num_steps", "warmup_num_steps", "warmup_max_lr", "warmup_min_lr")
)
# What an explicit JSON value of a flag's setting must be: (an integer, > 0 rather than >= 0).
NUMBERS = {
    "per_device_train_batch_size": (True, True),
    "gradient_accumulation_steps": (True, True),
    "max_grad_norm": (False, False),
    "learning_rate": (False, True),
    "weight_decay": (False, False),
    "adam_epsilon": (False, False),
    "warmup_steps": (True, False),
}


def _get(cfg: dict, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _set(cfg: dict, dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    node = cfg
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def reconcile(
    flag: str, flag_value: Any, cfg: dict, key: str, fallback: Any, path: str, *, write: bool = True
) -> Any:
    """One value set both by a flag and by the DeepSpeed JSON.

    "auto" or absent in the JSON → the flag (or ``fallback``) wins and is written into the JSON;
    an explicit JSON value with no flag → the JSON wins; both explicit and different → error.
    """
    json_value = _get(cfg, key)
    if json_value is _MISSING or json_value == "auto":
        value = fallback if flag_value is None else flag_value
        if write or json_value == "auto":
            _set(cfg, key, value)
        return value
    _check_number(flag, key, json_value, path)
    if flag_value is not None and not _same(flag_value, json_value):
        raise ConfigError(
            f"`--{flag} {flag_value}` contradicts `{key}: {json.dumps(json_value)}` in "
            f"{path}; drop one or make them agree"
        )
    return json_value


def _check_number(flag: str, key: str, value: Any, path: str) -> None:
    """An explicit JSON value of a flag's setting obeys the flag's type and range."""
    integer, positive = NUMBERS.get(flag, (False, False))
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and (not integer or float(value).is_integer())
    )
    if ok and not (value > 0 if positive else value >= 0):
        ok = False
    if not ok:
        want = ("a positive " if positive else "a non-negative ") + (
            "integer" if integer else "number"
        )
        raise ConfigError(
            f'--deepspeed_config: `{key}` in {path} must be {want} or "auto", got '
            f"{json.dumps(value)}"
        )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(b, bool):
        return float(a) == float(b)
    return a == b


def reconcile_ds(
    v: dict[str, Any], ds: dict, world: int, fallbacks: Mapping[str, Any], precision_flag: str
) -> None:
    """Settle every value that both a flag and the DeepSpeed JSON set; updates ``v``
    and ``ds`` in place. ``world``: the data-parallel ranks (the world size /
    --sequence_parallel_size), whose micro-batches make a step's batch.

    ``fallbacks`` fill what neither sets; ``precision_flag`` is how errors name the precision flag.
    """
    path = v["deepspeed_config"]
    if isinstance(ds.get("scheduler"), dict) and v["lr_scheduler_kwargs"]:
        raise ConfigError(
            f"`--lr_scheduler_kwargs` configures --lr_scheduler_type, but {path} has its own "
            "scheduler section, which replaces it: drop one of them"
        )
    _check_shape(ds, path)
    _refuse_nvme_checkpoints(v, ds, path)
    for flag, key in (
        ("per_device_train_batch_size", "train_micro_batch_size_per_gpu"),
        ("gradient_accumulation_steps", "gradient_accumulation_steps"),
        ("max_grad_norm", "gradient_clipping"),
    ):
        v[flag] = reconcile(flag, v[flag], ds, key, fallbacks[flag], path)
    want = v["per_device_train_batch_size"] * v["gradient_accumulation_steps"] * world
    tbs = ds.get("train_batch_size", "auto")
    if tbs != "auto" and tbs != want:
        raise ConfigError(
            f"`train_batch_size: {tbs}` in {path} must equal --per_device_train_batch_size × "
            f"--gradient_accumulation_steps × data-parallel ranks (world size / "
            f"--sequence_parallel_size) = {want}"
        )
    ds["train_batch_size"] = want
    if isinstance(ds.get("optimizer"), dict):
        _reconcile_optimizer(v, ds, path, fallbacks)
    if isinstance(ds.get("scheduler"), dict):
        v["warmup_steps"] = reconcile(
            "warmup_steps",
            v["warmup_steps"],
            ds,
            "scheduler.params.warmup_num_steps",
            fallbacks["warmup_steps"],
            path,
            write=False,
        )
    _reconcile_precision(v, ds, path, precision_flag)
    _reconcile_report_to(v, ds, path)
    leftover = [k for k, value in _walk(ds) if value == "auto" and k not in FILLED_LATER]
    if leftover:
        raise ConfigError(
            f'--deepspeed_config: {path} has "auto" for {", ".join(leftover)}, which no flag sets; '
            'give a value ("auto" works for the values flags set and a scheduler\'s step counts '
            "and learning rates)"
        )
    check_with_deepspeed(ds, path)


def _refuse_nvme_checkpoints(v: Mapping[str, Any], ds: dict, path: str) -> None:
    """NVMe optimizer offload trains, but its state cannot be checkpointed or resumed as promised.

    DeepSpeed 0.19's ``save_checkpoint`` copies the swap folder (the fp32 master weights and Adam's
    moments) into ``<tag>/offloaded_tensors`` with a plain copy beside its checkpoint engine:
    nothing fsyncs, hashes or verifies it, and a rank that fails there skips the collective that
    follows. Its ``load_checkpoint`` then reads the master weights back but not the moments or the
    step count: the resumed run trains with a fresh Adam (seen here: the step after a resume differs
    from the uninterrupted run's; with CPU offload it is equal). A checkpoint that cannot resume is
    not saved at all."""
    offload = (ds.get("zero_optimization") or {}).get("offload_optimizer") or {}
    if str(offload.get("device", "none")).lower() != "nvme":
        return
    flag = (
        "--save_checkpoint"
        if v.get("save_checkpoint")
        else ("--resume_from_checkpoint" if v.get("resume_from_checkpoint") else None)
    )
    if flag:
        raise ConfigError(
            f"`zero_optimization.offload_optimizer.device: nvme` in {path} can't be used with "
            f"{flag}: DeepSpeed copies the NVMe optimizer state outside its checkpoint files "
            "(never fsynced or verified) and does not restore Adam's moments when loading, so a "
            'resume would silently restart the optimizer; use `"device": "cpu"` (exact '
            "resume) or train without checkpoints"
        )


def _reconcile_report_to(v: dict[str, Any], ds: dict, path: str) -> None:
    """--report_to's tensorboard and csv are DeepSpeed's own monitor (rank 0 only), switched on here
    with its files in OUT/tensorboard/finetune and OUT/csv/finetune; wandb is finetune's own tracker
    (finetune/trackers.py), so DeepSpeed's must stay off beside it: both would init a run."""
    from finetune.trackers import check_available

    targets = report_targets(v["report_to"])
    problem = check_available(targets)
    if problem:
        raise ConfigError(problem)
    for target, key in (("tensorboard", "tensorboard"), ("csv", "csv_monitor")):
        if target in targets:
            ds[key] = {
                **ds.get(key, {}),
                "enabled": True,
                "output_path": str(Path(v["output_dir"]) / target),
                "job_name": "finetune",
            }
    if "wandb" in targets and _get(ds, "wandb.enabled") is True:
        raise ConfigError(
            f"`--report_to wandb` and `wandb.enabled: true` in {path} would start "
            "two wandb runs; drop the JSON's (finetune's own wandb run has the run "
            "name, config and checkpoint events)"
        )


def _check_shape(ds: dict, path: str) -> None:
    """Objects where DeepSpeed expects objects, and ZeRO stage 3 (what the checkpoints, resume and
    export are built on)."""
    for key in (
        "zero_optimization",
        "optimizer",
        "scheduler",
        "bf16",
        "fp16",
        "tensorboard",
        "csv_monitor",
        "wandb",
        "optimizer.params",
        "scheduler.params",
    ):
        value = _get(ds, key)
        if value is not _MISSING and not isinstance(value, dict):
            raise ConfigError(
                f"--deepspeed_config: `{key}` in {path} must be an object, got {json.dumps(value)}"
            )
    stage = _get(ds, "zero_optimization.stage")
    if stage is _MISSING or isinstance(stage, bool) or stage != 3:
        got = (
            "no `zero_optimization.stage`"
            if stage is _MISSING
            else f"`zero_optimization.stage: {json.dumps(stage)}`"
        )
        raise ConfigError(
            f"--deepspeed_config: {path} has {got}; finetune trains with ZeRO stage 3 only "
            "(its checkpoints, resume and export are ZeRO-3's): set `zero_optimization.stage: 3`"
        )


def check_with_deepspeed(ds: dict, path: str) -> None:
    """DeepSpeed's own parser (its pydantic models of zero_optimization, fp16, the monitors, …) run
    on the reconciled config now, so a value it rejects is bad input named here, not a traceback
    from deepspeed.initialize after the model is built."""
    import logging

    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
    from pydantic import ValidationError

    trial = json.loads(json.dumps(ds))
    # It checks the batch against the world size it sees: one process, before distributed init.
    trial["train_batch_size"] = (
        trial["train_micro_batch_size_per_gpu"] * trial["gradient_accumulation_steps"]
    )
    ds_logger = logging.getLogger("DeepSpeed")
    level = ds_logger.level
    ds_logger.setLevel(logging.ERROR)  # its warnings come again, once, from deepspeed.initialize
    try:
        DeepSpeedConfig(trial, mpu=_OneProcess())
    except ValidationError as e:
        first = e.errors()[0]
        where = _locate(ds, tuple(str(x) for x in first["loc"])) or ".".join(
            str(x) for x in first["loc"]
        )
        raise ConfigError(
            f"--deepspeed_config: `{where}` in {path}: {first['msg']} "
            f"(got {json.dumps(first.get('input'), default=str)})"
        ) from None
    except (
        DeepSpeedConfigError,
        AssertionError,
        TypeError,
        ValueError,
        AttributeError,
        KeyError,
    ) as e:
        text = str(e).strip().splitlines()
        raise ConfigError(
            f"--deepspeed_config: DeepSpeed rejects {path}: {text[0] if text else type(e).__name__}"
        ) from None
    finally:
        ds_logger.setLevel(level)


class _OneProcess:
    """The data-parallel world DeepSpeedConfig sees in ``check_with_deepspeed``,
    initialized or not."""

    def get_data_parallel_world_size(self) -> int:
        return 1


def _locate(cfg: dict, loc: tuple[str, ...]) -> str | None:
    """The dotted key in ``cfg`` that a pydantic error's location (relative to one of DeepSpeed's
    sub-models, e.g. `stage` inside zero_optimization) points at: the first path ending in it."""
    n = len(loc)
    return (
        next((key for key, _ in _walk(cfg) if tuple(key.split("."))[-n:] == loc), None)
        if n
        else None
    )


def _reconcile_optimizer(
    v: dict[str, Any], ds: dict, path: str, fallbacks: Mapping[str, Any]
) -> None:
    p = "optimizer.params."
    for flag, key in (
        ("learning_rate", "lr"),
        ("weight_decay", "weight_decay"),
        ("adam_epsilon", "eps"),
    ):
        v[flag] = reconcile(flag, v[flag], ds, p + key, fallbacks[flag], path)
    params = ds["optimizer"].setdefault("params", {})
    betas = params.get("betas", "auto")
    if betas != "auto" and not (
        isinstance(betas, list)
        and len(betas) == 2
        and all(
            b == "auto" or isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1
            for b in betas
        )
    ):
        raise ConfigError(
            f'--deepspeed_config: `optimizer.params.betas` in {path} must be "auto" or two numbers '
            f'in [0, 1) (each may be "auto"), got {json.dumps(betas)}'
        )
    betas = ["auto", "auto"] if betas == "auto" else list(betas)
    for i, flag in enumerate(("adam_beta1", "adam_beta2")):
        if betas[i] == "auto":
            betas[i] = fallbacks[flag] if v[flag] is None else v[flag]
        elif v[flag] is not None and float(v[flag]) != float(betas[i]):
            raise ConfigError(
                f"`--{flag} {v[flag]}` contradicts "
                f"`optimizer.params.betas: {params['betas']}` in {path}"
            )
        v[flag] = betas[i]
    params["betas"] = betas


def _reconcile_precision(v: dict[str, Any], ds: dict, path: str, flag: str) -> None:
    enabled = {k: ds.setdefault(k, {}).get("enabled", "auto") for k in ("bf16", "fp16")}
    for k, e in enabled.items():
        if not isinstance(e, bool) and e != "auto":
            raise ConfigError(
                f'--deepspeed_config: `{k}.enabled` in {path} must be true, false or "auto", '
                f"got {json.dumps(e)}"
            )
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
    """bf16 where this rank's device does it natively; fp32 on CPU (bf16 matmuls there
    are slow and lossy).

    Runs while the flags are resolved, before ``distributed.init`` sets the device, so it asks
    about this rank's own device by index (``launchers.local_device_index``: LOCAL_RANK, modulo
    the GPUs this task sees) and only reads its properties: ``torch.cuda.is_bf16_supported()``
    would look at the current device (GPU 0 on every rank at this point) and, by default, also
    accept bf16 emulated in software (pre-Ampere GPUs: V100, T4), allocating a tensor on GPU 0
    from every rank to find out. NVIDIA GPUs do bf16 natively from compute capability 8.0 (A100).
    """
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.device_name() == "cpu":
        return "fp32"
    if acc.device_name() == "cuda":
        import torch

        from finetune.launchers import local_device_index

        if torch.version.hip is not None:
            return "bf16"  # what torch.cuda.is_bf16_supported answers for every ROCm device
        major, _ = torch.cuda.get_device_capability(local_device_index())
        return "bf16" if major >= 8 else "fp32"
    return "bf16" if acc.is_bf16_supported() else "fp32"


def check_precision(precision: str) -> None:
    """The same precision on every rank (--precision auto is decided per rank, from its own GPU: an
    allocation mixing A100s and V100s would otherwise all-gather bf16 with fp32), and one this
    machine can run. Collective."""
    from finetune import distributed as dist

    chosen = dist.all_gather_object(precision)
    if len(set(chosen)) > 1:
        by = ", ".join(f"rank {r}: {p}" for r, p in enumerate(chosen) if p != chosen[0])
        raise ConfigError(
            f"`--precision auto` differs between ranks (rank 0: {chosen[0]}; {by}): their GPUs "
            "differ; give --precision bf16, fp16 or fp32"
        )
    dist.run_agreed(lambda: check_precision_supported(precision))


def check_precision_supported(precision: str) -> None:
    """fp16 where the accelerator can't run it (DeepSpeed's CPU accelerator: only with mkldnn fp16)
    would end in a ValueError traceback from deepspeed.initialize; say it as bad input instead."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if precision == "fp16" and not acc.is_fp16_supported():
        raise ConfigError(
            f"`--precision fp16`: this machine's {acc.device_name()} accelerator can't train in "
            "fp16; use --precision bf16 or fp32"
        )


def zero_stage(cfg: dict) -> int:
    stage = _get(cfg, "zero_optimization.stage")
    return 0 if stage is _MISSING else int(stage)


def finalize_ds_config(
    cfg: dict, total_steps: int, warmup_steps: int, learning_rate: float
) -> dict:
    """Fill the values that need the dataset's size: a DeepSpeed scheduler's step counts."""
    out = json.loads(json.dumps(cfg))
    sched = out.get("scheduler")
    if isinstance(sched, dict):
        params = sched.setdefault("params", {})
        for key, value in (
            ("total_num_steps", total_steps),
            ("warmup_num_steps", warmup_steps),
            ("warmup_max_lr", learning_rate),
            ("warmup_min_lr", 0.0),
        ):
            if params.get(key) == "auto":
                params[key] = value
    leftover = [k for k, v in _walk(out) if v == "auto"]
    if leftover:
        raise ConfigError(f'--deepspeed_config: cannot resolve "auto" for {", ".join(leftover)}')
    return out


def _walk(node: Any, prefix: str = ""):
    if isinstance(node, (dict, list)):
        for k, v in node.items() if isinstance(node, dict) else enumerate(node):
            yield from _walk(v, f"{prefix}{k}.")
    else:
        yield prefix.rstrip("."), node
