"""A bf16 run's consolidated weights are what `finetune export` rebuilds from the same checkpoint,
bit for bit, in every dtype: both are the fp32 master weights cast. One real 2-rank run on CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import BIN, base_ds, child_env, free_port, run_group, write_ds

pytestmark = pytest.mark.distributed

TIMEOUT = 420
STEPS = 5
# The CLI, plus two more consolidated saves of the trained engine (bf16, fp16) once the run's own
# final save (fp32, through the checkpoint manager) is done: one run covers every dtype.
SCRIPT = """
import logging, os, sys
from pathlib import Path

import torch

from finetune import cli
from finetune.weights.consolidate import save_consolidated
from finetune.trainer import Trainer

extra, train = Path(sys.argv[1]), Trainer.train


def train_then_consolidate(self):
    code = train(self)  # ends with the final save; the engine still holds what it saved
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        (extra / name).mkdir(parents=True, exist_ok=True)
        save_consolidated(self.engine.module, extra / name, dtype, "5GB")  # collective: every rank
    return code


Trainer.train = train_then_consolidate
code = cli.main(sys.argv[2:])
logging.shutdown()
os._exit(code)
"""


@pytest.fixture(scope="module")
def run(tiny_models, tmp_path_factory):
    """{"checkpoint": the final checkpoint (fp32 consolidated), "bf16"/"fp16": the extra saves}."""
    root = tmp_path_factory.mktemp("consolidated_dtype")
    script = root / "train.py"
    script.write_text(SCRIPT)
    # No persistent parameters, and a streaming threshold the matrices pass while norms and biases
    # don't: the bf16 save takes both the all-gather and the streamed path.
    ds = write_ds(
        root, base_ds(zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0})
    )
    cmd = [
        str(BIN / "torchrun"),
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(script),
        str(root / "extra"),
        "--model_name_or_path",
        str(tiny_models["qwen2"]),
        "--precision",
        "bf16",
        "--deepspeed_config",
        ds,
        "--max_steps",
        str(STEPS),
        "--learning_rate",
        "1e-2",
        "--save_checkpoint",
        "--save_consolidated",
        "--consolidated_dtype",
        "fp32",
        "--output_dir",
        str(root / "out"),
    ]
    output, code = run_group(
        cmd, cwd=root, env=child_env({"FINETUNE_STREAM_BYTES": "4096"}), timeout=TIMEOUT
    )
    assert code == 0, output[-4000:]
    folder = root / "out" / f"global_step{STEPS}"
    # the checkpoint without its consolidated weights: export must rebuild
    part = root / "partitioned"
    part.mkdir()
    for p in folder.iterdir():
        if not p.name.startswith("model"):
            (part / p.name).symlink_to(p)
    return {
        "checkpoint": folder,
        "partitioned": part,
        "bf16": root / "extra" / "bf16",
        "fp16": root / "extra" / "fp16",
    }


def export(*args) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [sys.executable, "-m", "finetune", "export", *map(str, args)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return r


def tensors(folder):
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def assert_equal(ours: dict, theirs: dict) -> None:
    import torch

    assert set(ours) == set(theirs)
    different = sorted(k for k in ours if not torch.equal(ours[k], theirs[k]))
    worst = max(
        (float((ours[k].double() - theirs[k].double()).abs().max()) for k in different), default=0.0
    )
    assert not different, (
        f"{len(different)} of {len(ours)} tensors differ (max abs difference {worst:.3g}): "
        f"{different[:4]}"
    )


def test_fp32_consolidated_weights_are_the_fp32_masters(run, tmp_path):
    import torch

    folder = run["checkpoint"]
    # what the safetensors hold
    assert json.loads((folder / "config.json").read_text())["dtype"] == "float32"
    rebuilt = export(run["partitioned"], tmp_path / "rebuilt", "--dtype", "fp32")
    assert "rebuilt from the rank files" in rebuilt.stdout
    consolidated = tensors(folder)
    assert all(t.dtype == torch.float32 for t in consolidated.values())
    assert_equal(tensors(tmp_path / "rebuilt"), consolidated)
    assert (tmp_path / "rebuilt" / "model.safetensors").read_bytes() == (
        folder / "model.safetensors"
    ).read_bytes()
    # Not the bf16 module weights upcast: those lack bits the masters have after training.
    assert any(not torch.equal(t.to(torch.bfloat16).float(), t) for t in consolidated.values())
    copied = export(folder, tmp_path / "copied", "--dtype", "fp32")  # exactly the rebuild: copied
    assert "copied the consolidated weights" in copied.stdout
    assert (tmp_path / "copied" / "model.safetensors").read_bytes() == (
        folder / "model.safetensors"
    ).read_bytes()


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_16_bit_consolidated_weights_equal_the_export(run, tmp_path, dtype):
    export(run["partitioned"], tmp_path / "hf", "--dtype", dtype)
    assert_equal(tensors(tmp_path / "hf"), tensors(run[dtype]))
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (
        run[dtype] / "model.safetensors"
    ).read_bytes()


def test_the_same_export_command_gives_the_same_weights_with_or_without_consolidated_ones(
    run, tmp_path
):
    with_consolidated = export(
        run["checkpoint"], tmp_path / "a"
    )  # the training dtype: bf16, not the fp32 saved
    export(run["partitioned"], tmp_path / "b")
    assert (
        "rebuilt from the rank files" in with_consolidated.stdout
        and "bfloat16" in with_consolidated.stdout
    )
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (
        tmp_path / "b" / "model.safetensors"
    ).read_bytes()
    assert json.loads((tmp_path / "a" / "config.json").read_text())["dtype"] == "bfloat16"
