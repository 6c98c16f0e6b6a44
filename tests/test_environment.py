"""`finetune env` and `finetune --version`: what a bug report needs, read from this machine."""

from __future__ import annotations

import json
import subprocess
import sys

import deepspeed
import torch

import finetune


def finetune_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "finetune", *argv], capture_output=True, text=True, timeout=120
    )


def test_version_prints_the_package_version():
    r = finetune_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"finetune {finetune.__version__}"


def test_env_json_reports_this_machine():
    r = finetune_cli("env", "--json")
    assert r.returncode == 0, r.stderr
    facts = json.loads(r.stdout)
    assert facts["finetune"] == finetune.__version__
    assert facts["packages"]["torch"] == torch.__version__
    assert facts["packages"]["deepspeed"] == deepspeed.__version__
    assert facts["accelerator"]["cuda_available"] == torch.cuda.is_available()
    assert facts["accelerator"]["backends"]["gloo"] is torch.distributed.is_gloo_available()
    ops = facts["deepspeed_ops"]
    assert set(ops) >= {"accelerator", "FusedAdamBuilder", "CPUAdamBuilder", "ShareMemCommBuilder"}
    # `make setup` prebuilds the CPU ops (scripts/build_ops.py): a run loads them without compiling.
    assert ops["CPUAdamBuilder"] == "compatible, built", ops


def test_env_text_names_each_section():
    r = finetune_cli("env")
    assert r.returncode == 0, r.stderr
    for heading in ("finetune:", "packages:", "accelerator:", "deepspeed_ops:", "  deepspeed: "):
        assert heading in r.stdout
