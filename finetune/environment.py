"""``finetune env``: what a bug report needs, in one paste.

Versions of finetune and the stack, the accelerator torch sees, DeepSpeed's ops (built in
``$TORCH_EXTENSIONS_DIR`` or not, compatible with this machine or not), the communication backends,
and the environment variables that change how a run behaves. Reads only: it never builds an op,
starts a process group or touches the network. ``--json`` for scripts.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import platform
import sys
from pathlib import Path

from finetune.commands import Parser

PACKAGES = (
    "torch",
    "deepspeed",
    "transformers",
    "datasets",
    "accelerate",
    "safetensors",
    "huggingface_hub",
    "tokenizers",
    "peft",
    "wandb",
    "tensorboard",
    "matplotlib",
    "numpy",
    "xxhash",
    "pyyaml",
)
# The ops finetune can use: the Adam update (FusedAdam on GPU, CPUAdam under offload) and the CPU
# backend's shared-memory all-reduce.
OPS = ("FusedAdamBuilder", "CPUAdamBuilder", "ShareMemCommBuilder", "AsyncIOBuilder")
ENV_VARS = (
    "CUDA_VISIBLE_DEVICES",
    "DS_ACCELERATOR",
    "TORCH_EXTENSIONS_DIR",
    "OMP_NUM_THREADS",
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "HF_DATASETS_CACHE",
    "TRANSFORMERS_OFFLINE",
    "WANDB_MODE",
    "WANDB_PROJECT",
    "NCCL_DEBUG",
    "NCCL_SOCKET_IFNAME",
    "NCCL_IB_DISABLE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_JOB_ID",
    "FINETUNE_DIST_TIMEOUT_MIN",
)


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def accelerator() -> dict:
    import torch

    info: dict = {
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "devices": [],
    }
    if info["cuda_available"]:
        info["devices"] = [
            f"{torch.cuda.get_device_name(i)} "
            f"({torch.cuda.get_device_properties(i).total_memory / 2**30:.0f} GiB)"
            for i in range(torch.cuda.device_count())
        ]
        info["bf16_supported"] = torch.cuda.is_bf16_supported()
        info["cudnn"] = torch.backends.cudnn.version()
    dist = torch.distributed
    info["backends"] = {
        "nccl": dist.is_available() and dist.is_nccl_available(),
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "mpi": dist.is_available() and dist.is_mpi_available(),
    }
    if info["backends"]["nccl"] and info["cuda_available"]:
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    info["cpu_threads"] = torch.get_num_threads()
    return info


def deepspeed_ops() -> dict:
    """Per op: whether this machine can build it (DeepSpeed's own check) and whether it is already
    built into $TORCH_EXTENSIONS_DIR, where finetune's runs load it without compiling."""
    from finetune.ops import use_venv_extensions_dir

    use_venv_extensions_dir()
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError as e:
        return {"error": str(e)}
    acc = get_accelerator()
    out: dict = {"accelerator": acc.device_name()}
    ext = os.environ.get("TORCH_EXTENSIONS_DIR")
    built_dirs = {p.name for p in Path(ext).iterdir()} if ext and Path(ext).is_dir() else set()
    for name in OPS:
        builder = acc.create_op_builder(name)
        if builder is None:
            out[name] = "not on this accelerator"
            continue
        try:
            compatible = bool(builder.is_compatible(verbose=False))
        except Exception:  # noqa: BLE001 - a builder's probe failing is itself the answer
            compatible = False
        built = builder.NAME in built_dirs or any(d.startswith(builder.NAME) for d in built_dirs)
        out[name] = (
            f"{'compatible' if compatible else 'NOT compatible'}, "
            f"{'built' if built else 'not built'}"
        )
    out["torch_extensions_dir"] = ext
    return out


def report() -> dict:
    from finetune import __version__

    return {
        "finetune": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "packages": {p: _version(p) for p in PACKAGES},
        "accelerator": accelerator(),
        "deepspeed_ops": deepspeed_ops(),
        "environment": {k: os.environ[k] for k in ENV_VARS if k in os.environ},
    }


def _lines(facts: dict, indent: str = "") -> list[str]:
    lines = []
    for key, value in facts.items():
        if isinstance(value, dict):
            lines += [f"{indent}{key}:"] + _lines(value, indent + "  ")
        elif isinstance(value, list):
            lines.append(f"{indent}{key}: {', '.join(map(str, value)) or '-'}")
        else:
            lines.append(f"{indent}{key}: {'-' if value is None else value}")
    return lines


def main(argv: list[str]) -> int:
    p = Parser(
        prog="finetune env",
        description="Print the versions, accelerator, DeepSpeed ops and environment "
        "a bug report needs (reads only; builds nothing).",
    )
    p.add_argument("--json", action="store_true", help="One JSON object instead of text.")
    ns = p.parse_args(argv)
    # DeepSpeed logs its accelerator guess to stdout on import; the report says which it chose.
    logging.getLogger("DeepSpeed").addFilter(lambda record: record.levelno >= logging.ERROR)
    facts = report()
    print(json.dumps(facts, indent=2) if ns.json else "\n".join(_lines(facts)))
    return 0
