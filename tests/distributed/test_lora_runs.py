"""LoRA under ZeRO-3 (--use_peft), real 2-rank runs on a tiny Llama: adapter-sized partitioned
checkpoints that hold no frozen base tensor, a consolidated adapter that PEFT loads and whose logits
are the training model's, the adapter and --merge_lora exports, bitwise resume, resume on 1 rank,
--async_save, and a different base refused at resume."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from finetune.io import seams
from finetune.probe import probe_input
from finetune.weights import safe_load

from conftest import (
    assert_verifies,
    build_tiny_model,
    child_env,
    launcher_cmd,
    run_group,
)

pytestmark = pytest.mark.distributed

TIMEOUT = 420
# fp32 on CPU: the exported models compute the same sums in another order (gathered vs partitioned
# weights, W + BA merged vs the adapter branch added): float32 rounding, ~1e-7 relative here.
LOGITS_ATOL = 1e-5
LORA = (
    "--use_peft",
    "--lora_r",
    "8",
    "--lora_alpha",
    "16",
    "--lora_dropout",
    "0.0",
    "--lora_target_modules",
    "all-linear",
)
COMMON = (
    "--max_steps",
    "8",
    "--logging_steps",
    "1",
    "--learning_rate",
    "1e-2",
    "--save_checkpoint",
    "--save_steps",
    "4",
    "--eval_steps",
    "4",
)


def _run(
    root: Path, *args: str, launcher: str = "forked", nprocs: int = 2, env: dict | None = None
):
    root.mkdir(parents=True, exist_ok=True)
    cmd = launcher_cmd(launcher, nprocs) + [*args, "--output_dir", str(root / "out")]
    output, code = run_group(cmd, cwd=root, env=child_env(env), timeout=TIMEOUT)
    return code, output, root / "out"


def _ok(code, output):
    assert code == 0, output[-4000:]


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _rows(out) if "loss" in r}


@pytest.fixture(scope="module")
def lora(tiny_models, tmp_path_factory):
    """One 8-step LoRA run (saves at 4 and 8, consolidated), with the training model's probe
    logits."""
    root = tmp_path_factory.mktemp("lora")
    probe = root / "probe.pt"
    code, output, out = _run(
        root,
        "--model_name_or_path",
        str(tiny_models["llama"]),
        *LORA,
        *COMMON,
        "--save_consolidated",
        env={seams.PROBE_LOGITS: str(probe)},
    )
    _ok(code, output)
    return {
        "out": out,
        "probe": torch.load(probe),
        "output": output,
        "base": tiny_models["llama"],
        "root": root,
    }


@pytest.fixture(scope="module")
def full(tiny_models, tmp_path_factory):
    """The same run, full fine-tuning: what the LoRA checkpoint's size is compared with."""
    code, output, out = _run(
        tmp_path_factory.mktemp("full"), "--model_name_or_path", str(tiny_models["llama"]), *COMMON
    )
    _ok(code, output)
    return out


def _peft_model(base: Path, adapter: Path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()


def _logits(model, vocab: int) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=probe_input(vocab)).logits.float()


def _expected_adapter(base: Path) -> dict[str, tuple]:
    """The tensors peft itself saves for these flags, from a plain CPU peft model (no DeepSpeed)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base),
        LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
    )
    return {k: tuple(v.shape) for k, v in get_peft_model_state_dict(model).items()}


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    header.pop("__metadata__", None)
    return header


def _export(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "finetune", "export", *map(str, args)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def test_consolidated_adapter_is_complete_and_loads_with_peft_giving_the_training_logits(lora):
    ckpt = lora["out"] / "global_step8"
    header = _header(ckpt / "adapter_model.safetensors")
    expected = _expected_adapter(lora["base"])
    assert len(expected) == 28  # 14 linear layers in 2 blocks, A and B each
    assert {k: tuple(v["shape"]) for k, v in header.items()} == expected
    manifest = json.loads((ckpt / "manifest.json").read_text())
    size = sum(v["data_offsets"][1] - v["data_offsets"][0] for v in header.values())
    assert manifest["adapter"] == {"tensors": 28, "bytes": size} and size == 16_384 * 4  # fp32, r=8
    # sizes, checksums, and the adapters against the shapes rebuilt from the configs
    assert_verifies(ckpt)
    vocab = lora["probe"].shape[-1]
    model = _peft_model(lora["base"], ckpt)
    got = _logits(model, vocab)
    torch.testing.assert_close(got, lora["probe"], atol=LOGITS_ATOL, rtol=0)
    # Trained: the adapters moved the logits away from the base model's.
    from transformers import AutoModelForCausalLM

    base_logits = _logits(AutoModelForCausalLM.from_pretrained(lora["base"]).eval(), vocab)
    assert (got - base_logits).abs().max() > 100 * LOGITS_ATOL
    listed = subprocess.run(
        [sys.executable, "-m", "finetune", "ls", str(lora["out"]), "--json"],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    rows = json.loads(listed.stdout)["checkpoints"]
    assert [(r["tag"], r["lora"], r["consolidated"]) for r in rows] == [
        ("global_step4", True, True),
        ("global_step8", True, True),
    ]


def test_partitioned_checkpoint_holds_no_frozen_base_tensor_and_is_adapter_sized(lora, full):
    ckpt, full_ckpt = lora["out"] / "global_step4", full / "global_step4"
    lora_params = 16_384
    full_params = sum(
        v.numel()
        for v in __import__("safetensors.torch", fromlist=["load_file"])
        .load_file(lora["base"] / "model.safetensors")
        .values()
    )
    for r in range(2):
        states = safe_load.load(
            ckpt / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt", "cpu", inert=True
        )
        assert all(".lora_A." in k or ".lora_B." in k for k in states["module"]), list(
            states["module"]
        )[:5]
        assert not states.get("frozen_param_shapes") and not states.get("frozen_param_fragments")
        assert sum(len(g) for g in states["param_shapes"]) == 28
        optim = safe_load.load(
            ckpt / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt", "cpu", inert=True
        )
        assert (
            sum(t.numel() for t in optim["optimizer_state_dict"]["fp32_flat_groups"])
            == lora_params // 2
        )

    # Optimizer files: fp32 masters + Adam's two moments per trainable parameter, so their sizes are
    # in the ratio of the trainable parameters (pickle overhead aside).
    def optim_bytes(folder):
        return sum(p.stat().st_size for p in folder.glob("*optim_states.pt"))

    ratio = optim_bytes(full_ckpt) / optim_bytes(ckpt)
    assert ratio == pytest.approx(full_params / lora_params, rel=0.1), (
        ratio,
        full_params / lora_params,
    )
    lora_bytes = json.loads((ckpt / "manifest.json").read_text())["total_bytes"]
    full_bytes = json.loads((full_ckpt / "manifest.json").read_text())["total_bytes"]
    # tokenizer, RNG and config files are shared
    assert full_bytes > 2.5 * lora_bytes, (full_bytes, lora_bytes)


def test_adapter_and_merged_exports_give_the_training_logits(lora, tmp_path):
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    done = _export(lora["out"], adapter)
    assert done.returncode == 0, done.stderr
    assert {p.name for p in adapter.iterdir()} >= {
        "adapter_model.safetensors",
        "adapter_config.json",
        "tokenizer.json",
    }
    assert not (adapter / "config.json").exists()  # an adapter folder, not a model folder
    vocab = lora["probe"].shape[-1]
    torch.testing.assert_close(
        _logits(_peft_model(lora["base"], adapter), vocab), lora["probe"], atol=LOGITS_ATOL, rtol=0
    )
    done = _export(lora["out"], merged, "--merge_lora")
    assert done.returncode == 0, done.stderr
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(merged, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not (merged / "adapter_config.json").exists()  # loads without peft
    torch.testing.assert_close(
        _logits(model.eval(), vocab), lora["probe"], atol=LOGITS_ATOL, rtol=0
    )


def test_resume_is_bitwise_at_equal_world_size(lora, tiny_models, tmp_path):
    code, output, out = _run(
        tmp_path,
        "--model_name_or_path",
        str(tiny_models["llama"]),
        *LORA,
        *COMMON,
        "--resume_from_checkpoint",
        str(lora["out"] / "global_step4"),
    )
    _ok(code, output)
    want, got = _losses(lora["out"]), _losses(out)
    assert sorted(got) == [5, 6, 7, 8]
    assert {s: got[s] for s in got} == {s: want[s] for s in got}  # bitwise: the same floats
    assert_verifies(out / "global_step8")


def test_resume_on_one_rank_from_a_two_rank_checkpoint(lora, tiny_models, tmp_path):
    code, output, out = _run(
        tmp_path,
        "--model_name_or_path",
        str(tiny_models["llama"]),
        *LORA,
        *COMMON,
        "--gradient_accumulation_steps",
        "2",
        "--resume_from_checkpoint",
        str(lora["out"] / "global_step4"),
        launcher="python",
        nprocs=1,
    )
    _ok(code, output)
    assert "Resuming a 2-rank checkpoint on 1 ranks" in output
    want, got = _losses(lora["out"]), _losses(out)
    assert sorted(got) == [5, 6, 7, 8]
    assert got[5] == pytest.approx(want[5], rel=0.01)


def test_a_different_base_at_resume_exits_2_naming_both(lora, tmp_path):
    from safetensors.torch import load_file, save_file

    other = build_tiny_model("llama", tmp_path / "other-base")
    # same architecture and shapes, other weights (a fine-tune)
    weights = load_file(other / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    save_file(
        {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in weights.items()},
        other / "model.safetensors",
        metadata={"format": "pt"},
    )
    code, output, out = _run(
        tmp_path,
        "--model_name_or_path",
        str(other),
        *LORA,
        *COMMON,
        "--resume_from_checkpoint",
        str(lora["out"] / "global_step4"),
    )
    assert code == 2, output[-3000:]
    line = next(ln for ln in output.splitlines() if "finetune: error:" in ln)
    assert str(lora["base"]) in line and str(other) in line and "another base model" in line
    assert not (out / "global_step4").exists()


def test_async_save_writes_the_same_files_as_a_sync_save(lora, tiny_models, tmp_path):
    code, output, out = _run(
        tmp_path,
        "--model_name_or_path",
        str(tiny_models["llama"]),
        *LORA,
        *COMMON,
        "--save_consolidated",
        "--async_save",
    )
    _ok(code, output)
    for tag in ("global_step4", "global_step8"):
        a = json.loads((out / tag / "manifest.json").read_text())["files"]
        b = json.loads((lora["out"] / tag / "manifest.json").read_text())["files"]
        for name in b:
            if name.startswith("zero_pp_rank_") or name == "adapter_model.safetensors":
                assert a[name]["checksum"] == b[name]["checksum"], (tag, name)
        assert_verifies(out / tag)
    assert _losses(out) == _losses(lora["out"])


def test_other_launcher_and_data_format(tiny_models, data_files, tmp_path):
    """torchrun and chat messages through the tokenizer's template: LoRA is not tied to one of
    them."""
    code, output, out = _run(
        tmp_path,
        "--model_name_or_path",
        str(tiny_models["llama"]),
        *LORA,
        "--train_file",
        str(data_files["chat_jsonl"]),
        "--messages_column",
        "messages",
        "--max_steps",
        "2",
        "--save_checkpoint",
        launcher="torchrun",
    )
    _ok(code, output)
    assert (out / "global_step2" / "adapter_config.json").is_file()
    assert_verifies(out / "global_step2")
