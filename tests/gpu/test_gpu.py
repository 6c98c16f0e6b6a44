"""The GPU path, run for real: one CUDA device, NCCL, the DeepSpeed launcher, world size 1.

Skipped (with the reason) where there is no CUDA device: everything here passes on CPU by
construction, which is why it needs a GPU to mean anything. What each test proves on a GPU:

* bf16 ZeRO-3: train, save, resume exactly (dropout on, so the CUDA generator must come back),
  export; consolidated weights equal the export's for fp32 (both from the fp32 master weights).
* the offload config with ``--save_consolidated``: CPU Adam (or torch_adam), NCCL gathers of
  offloaded partitions.
* fp16 with overflows forced by a huge initial loss scale: skipped steps are not counted as steps,
  and the metrics show them with the loss scale.
* ``--precision auto`` picks bf16 from the device's compute capability (8.0+), fp32 before.
* without a CUDA toolkit, FusedAdam becomes torch_adam, with one log line; with one, FusedAdam.

Run: ``make test-gpu`` (or ``.venv/bin/python -m pytest -m gpu tests/gpu``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.config import CONFIGS_DIR as CONFIGS

from conftest import BIN, assert_verifies, build_tiny_model, write_ds

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU (torch.cuda.is_available() is False)",
    ),
]

STEPS = 8


def _ok(result):
    assert result.returncode == 0, result.output[-6000:]
    return result


@pytest.fixture(scope="module")
def dropout_model(tmp_path_factory):
    """The tiny Llama with attention dropout: a resume that lost the CUDA generator draws other
    masks."""
    path = build_tiny_model("llama", tmp_path_factory.mktemp("gpu-model") / "llama")
    config = json.loads((path / "config.json").read_text())
    config["attention_dropout"] = 0.2
    (path / "config.json").write_text(json.dumps(config))
    return path


def _train(run_finetune, model, out, *flags, steps=STEPS, env=None):
    return _ok(
        run_finetune(
            "--model_name_or_path",
            str(model),
            "--max_steps",
            str(steps),
            "--logging_steps",
            "1",
            "--per_device_train_batch_size",
            "4",
            "--save_checkpoint",
            *flags,
            nprocs=1,
            out_dir=out,
            timeout=900,
            env=env,
            launcher="deepspeed",  # on a GPU, as the product's jobs launch it
        )
    )


def test_bf16_train_save_resume_export(run_finetune, dropout_model, tmp_path):
    whole = _train(run_finetune, dropout_model, tmp_path / "whole", "--precision", "bf16")
    _train(run_finetune, dropout_model, tmp_path / "split", "--precision", "bf16", steps=STEPS // 2)
    resumed = _train(
        run_finetune,
        dropout_model,
        tmp_path / "split",
        "--precision",
        "bf16",
        "--resume_from_checkpoint",
        "auto",
        "--save_consolidated",
        "--consolidated_dtype",
        "fp32",
    )
    losses = {r["step"]: r["loss"] for r in whole.train_rows()}
    # The resumed run's metrics.jsonl holds the first half's rows and then its own, each step once.
    rows = resumed.train_rows()
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    # same batches, same dropout masks: same losses up to kernel order
    for r in rows:
        assert math.isclose(r["loss"], losses[r["step"]], rel_tol=2e-3), (r, losses[r["step"]])
    folder = tmp_path / "split" / f"global_step{STEPS}"
    assert_verifies(folder)
    rng = torch.load(folder / "rng_state_0.pt", weights_only=True)
    assert rng["device"]["type"] == "cuda" and "cuda" not in rng
    state = json.loads((folder / "trainer_state.json").read_text())
    assert state["dtype"] == "bf16"

    export = tmp_path / "export"
    proc = subprocess.run(
        [sys.executable, "-m", "finetune", "export", str(folder), str(export), "--dtype", "fp32"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    consolidated, exported = (
        load_file(folder / "model.safetensors"),
        load_file(export / "model.safetensors"),
    )
    assert consolidated.keys() == exported.keys()
    assert all(torch.equal(consolidated[k], exported[k]) for k in consolidated)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "float32"
    model = AutoModelForCausalLM.from_pretrained(export).cuda().eval()
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]], device="cuda")).logits
    assert torch.isfinite(logits).all()


def test_offload_with_consolidated_save(run_finetune, dropout_model, tmp_path):
    out = tmp_path / "out"
    r = _train(
        run_finetune,
        dropout_model,
        out,
        "--precision",
        "bf16",
        "--deepspeed_config",
        str(CONFIGS / "ds_zero3_offload.json"),
        "--save_consolidated",
        steps=3,
    )
    folder = out / "global_step3"
    assert_verifies(folder)
    assert (folder / "model.safetensors").exists() and (folder / "config.json").exists()
    assert all(math.isfinite(row["loss"]) for row in r.train_rows())


def test_fp16_overflow_steps_are_not_counted(run_finetune, dropout_model, tmp_path):
    """A loss scale of 2^32 overflows fp16 gradients: DeepSpeed skips those steps and halves the
    scale."""
    ds = json.loads((CONFIGS / "ds_zero3.json").read_text())
    ds["fp16"] = {
        "enabled": True,
        "initial_scale_power": 32,
        "loss_scale_window": 1000,
        "hysteresis": 1,
    }
    ds.pop("bf16", None)
    out = tmp_path / "out"
    r = _train(
        run_finetune, dropout_model, out, "--deepspeed_config", write_ds(tmp_path, ds), steps=4
    )
    rows = r.train_rows()
    assert [row["step"] for row in rows] == [1, 2, 3, 4]  # applied steps, each once
    skipped = sum(row["skipped_steps"] for row in rows)
    assert skipped >= 1, rows
    assert all(row["loss_scale"] is not None and row["loss_scale"] < 2**32 for row in rows)
    state = json.loads((out / "global_step4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and state["skipped_steps"] == skipped


def test_auto_precision_follows_compute_capability(run_finetune, dropout_model, tmp_path):
    out = tmp_path / "out"
    r = _train(run_finetune, dropout_model, out, steps=2)
    major, _ = torch.cuda.get_device_capability(0)
    state = json.loads((out / "global_step2" / "trainer_state.json").read_text())
    assert state["dtype"] == ("bf16" if major >= 8 else "fp32"), r.output[-2000:]


def test_without_a_cuda_toolkit_fused_adam_becomes_torch_adam(
    run_finetune, dropout_model, tmp_path
):
    """No nvcc (a CUDA_HOME without one) and nothing prebuilt: torch_adam, one log line,
    recorded."""
    env = {
        "CUDA_HOME": str(tmp_path / "no-cuda-toolkit"),
        "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"),
        "PATH": f"{BIN}:/usr/bin:/bin",
    }
    out = tmp_path / "out"
    r = _train(run_finetune, dropout_model, out, "--precision", "bf16", steps=2, env=env)
    assert "FusedAdam can't be loaded or built here" in r.output and "torch.optim.AdamW" in r.output
    assert (
        json.loads((out / "global_step2" / "trainer_state.json").read_text())["adam"]
        == "torch_adam"
    )


def test_fused_adam_where_it_can_be_had(run_finetune, dropout_model, tmp_path):
    """With `make gpu-setup`'s build (or nvcc to build it now): DeepSpeed's FusedAdam, recorded."""
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None or not (Path(CUDA_HOME) / "bin" / "nvcc").exists():
        if not list(
            Path(
                os.environ.get("TORCH_EXTENSIONS_DIR", Path(sys.prefix) / "torch_extensions")
            ).glob("fused_adam*/*.so")
        ):
            pytest.skip(
                "no CUDA toolkit (nvcc) and no prebuilt FusedAdam: "
                "see test_without_a_cuda_toolkit_…"
            )
    out = tmp_path / "out"
    r = _train(run_finetune, dropout_model, out, "--precision", "bf16", steps=2)
    assert "FusedAdam can't be loaded" not in r.output
    assert (
        json.loads((out / "global_step2" / "trainer_state.json").read_text())["adam"] == "FusedAdam"
    )


def test_liger_kernel_trains_to_the_same_loss(run_finetune, dropout_model, tmp_path):
    """--use_liger_kernel: Liger's Triton kernels patched in (fused linear cross-entropy: no
    logits materialized) train the first step to the loss of the plain model, and the run saves."""
    pytest.importorskip("liger_kernel", reason="needs `pip install liger-kernel`")
    plain = _train(run_finetune, dropout_model, tmp_path / "plain", "--precision", "bf16", steps=2)
    liger = _train(
        run_finetune,
        dropout_model,
        tmp_path / "liger",
        "--precision",
        "bf16",
        "--use_liger_kernel",
        steps=2,
    )
    first = [r.train_rows()[0]["loss"] for r in (plain, liger)]
    assert math.isclose(first[0], first[1], rel_tol=2e-2), first
    assert_verifies(tmp_path / "liger" / "global_step2")


def test_packing_with_flash_attention_matches_sdpa(run_finetune, dropout_model, tmp_path):
    """--packing with flash_attention_2 (one varlen row per micro-batch) and with sdpa (the
    block-diagonal mask): the same first-step loss."""
    pytest.importorskip("flash_attn", reason="needs `pip install flash-attn`")
    runs = [
        _train(
            run_finetune,
            dropout_model,
            tmp_path / attn,
            "--precision",
            "bf16",
            "--packing",
            "--attn_implementation",
            attn,
            steps=1,
        )
        for attn in ("sdpa", "flash_attention_2")
    ]
    first = [r.train_rows()[0]["loss"] for r in runs]
    assert math.isclose(first[0], first[1], rel_tol=2e-2), first
