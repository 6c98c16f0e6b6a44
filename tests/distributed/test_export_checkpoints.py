"""`finetune export` on real 2-rank ZeRO-3 checkpoints: a plain process (no launcher, no
torch.distributed environment) rebuilds weights identical to the consolidated ones the run
gathered."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from finetune.io import seams

from conftest import BIN, child_env, free_port, launcher_cmd, run_group

pytestmark = pytest.mark.distributed

TIMEOUT = 420
WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


@pytest.fixture(scope="module")
def runs(tiny_models, tmp_path_factory):
    """One short 2-rank run per architecture, saving partitioned + consolidated: {arch: output
    dir}."""
    out = {}
    for arch in ("llama", "qwen2"):  # llama: untied head; qwen2: tied embeddings
        root = tmp_path_factory.mktemp(f"export_{arch}")
        cmd = launcher_cmd("forked", 2) + [
            "--model_name_or_path",
            str(tiny_models[arch]),
            "--max_steps",
            "2",
            "--save_checkpoint",
            "--save_consolidated",
            "--learning_rate",
            "1e-2",
            "--output_dir",
            str(root / "out"),
        ]
        output, code = run_group(cmd, cwd=root, env=child_env(), timeout=TIMEOUT)
        assert code == 0, output[-4000:]
        out[arch] = root / "out"
    return out


def partitioned_only(folder, dest):
    """The checkpoint without its consolidated weights (symlinks): what export must rebuild from."""
    dest.mkdir()
    for p in folder.iterdir():
        if p.name not in WEIGHTS and not p.name.endswith(".safetensors"):
            (dest / p.name).symlink_to(p)
    return dest


def export(*args) -> subprocess.CompletedProcess:
    # no RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT: nothing to init a process group from
    env = child_env()
    return subprocess.run(
        [sys.executable, "-m", "finetune", "export", *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def logits(folder):
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert (
        not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ), info
    x = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model, model.eval()(x).logits


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_rebuilt_weights_equal_the_consolidated_ones(runs, tmp_path, arch):
    import torch
    from safetensors.torch import load_file

    folder = runs[arch] / "global_step2"
    r = export(partitioned_only(folder, tmp_path / "part"), tmp_path / "hf")
    assert r.returncode == 0, r.stderr[-4000:]
    assert "rebuilt from the rank files" in r.stdout and "peak RSS" in r.stdout
    model_files = (
        {p.name for p in folder.iterdir()} - set(WEIGHTS) - {"manifest.json", "trainer_state.json"}
    )
    model_files = {n for n in model_files if not n.endswith(".pt")}
    assert {p.name for p in (tmp_path / "hf").iterdir()} == model_files | {"model.safetensors"}
    ours, gathered = (
        load_file(tmp_path / "hf" / "model.safetensors"),
        load_file(folder / "model.safetensors"),
    )
    assert set(ours) == set(gathered) and all(torch.equal(ours[k], gathered[k]) for k in ours)
    exported, got = logits(tmp_path / "hf")
    _, want = logits(folder)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    if arch == "qwen2":
        assert "lm_head.weight" not in ours  # written once, as save_pretrained does
        assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()


def test_output_dir_bf16_in_shards(runs, tmp_path):
    import torch
    from safetensors.torch import load_file

    # its newest committed checkpoint
    r = export(runs["llama"], tmp_path / "hf", "--dtype", "bf16", "--max_shard_size", "40KB")
    assert r.returncode == 0, r.stderr[-4000:]
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    ours = {k: v for s in shards for k, v in load_file(tmp_path / "hf" / s).items()}
    gathered = load_file(runs["llama"] / "global_step2" / "model.safetensors")
    assert set(ours) == set(gathered)
    assert all(
        v.dtype == torch.bfloat16 and torch.equal(v, gathered[k].to(torch.bfloat16))
        for k, v in ours.items()
    )
    _, got = logits(tmp_path / "hf")
    assert got.dtype == torch.bfloat16


def test_consolidated_checkpoint_is_copied(runs, tmp_path):
    folder = runs["qwen2"] / "global_step2"
    r = export(folder, tmp_path / "hf")
    assert r.returncode == 0 and "copied the consolidated weights" in r.stdout, r.stderr[-4000:]
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (
        folder / "model.safetensors"
    ).read_bytes()


def test_universal(runs, tmp_path):
    part = partitioned_only(runs["llama"] / "global_step2", tmp_path / "part")
    r = export(part, "--universal")
    assert r.returncode == 0, r.stderr[-4000:]
    assert (part / "universal" / "zero").is_dir() and any((part / "universal" / "zero").iterdir())
    from finetune.weights.universal import verify_universal

    source = json.loads((part / "manifest.json").read_text()).get("save_id")
    # a resume on another world size reuses it
    assert verify_universal(part / "universal", source) == []
    again = export(part, "--universal")  # already converted: refused, named, untouched
    assert again.returncode == 2 and str(part / "universal") in again.stderr


FROZEN_SCRIPT = """
import shutil, sys
import deepspeed, torch
from transformers import AutoModelForCausalLM

model_dir, out = sys.argv[1], sys.argv[2]
deepspeed.init_distributed(dist_backend="gloo")
model = AutoModelForCausalLM.from_pretrained(model_dir)
model.get_parameter("model.layers.0.mlp.up_proj.weight").requires_grad_(False)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, \
"steps_per_print": 10**9,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
torch.manual_seed(engine.global_rank)
x = torch.randint(0, 500, (1, 16))
engine.backward(engine(input_ids=x, labels=x).loss)
engine.step()
engine.save_checkpoint(out, tag="global_step1")
# Every rank gathers; rank 0 keeps the trained weights as the reference.
with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
    if engine.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in engine.module.state_dict().items()}, \
out + "/reference.pt")
        shutil.copy(model_dir + "/config.json", out + "/global_step1/config.json")
torch.distributed.barrier()
# Out without interpreter teardown, as finetune's entry does: gloo's threads can abort it
# ("terminate called without an active exception", SIGABRT after the work is done).
sys.stdout.flush(); sys.stderr.flush()
import os; os._exit(0)
"""


def test_frozen_parameter(tiny_models, tmp_path):
    import torch
    from safetensors.torch import load_file

    script = tmp_path / "train_frozen.py"
    script.write_text(FROZEN_SCRIPT)
    cmd = [
        str(BIN / "torchrun"),
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(script),
        str(tiny_models["llama"]),
        str(tmp_path / "ds"),
    ]
    output, code = run_group(cmd, cwd=tmp_path, env=child_env(), timeout=TIMEOUT)
    assert code == 0, output[-4000:]
    meta = torch.load(
        tmp_path / "ds" / "global_step1" / "zero_pp_rank_0_mp_rank_00_model_states.pt",
        weights_only=False,
    )
    # a real frozen parameter
    assert list(meta["frozen_param_shapes"]) == ["model.layers.0.mlp.up_proj.weight"]
    reference = torch.load(tmp_path / "ds" / "reference.pt")
    original = load_file(tiny_models["llama"] / "model.safetensors")

    # DeepSpeed's own: no manifest
    r = export(tmp_path / "ds" / "global_step1", tmp_path / "hf", "--no_verify")
    assert r.returncode == 0, r.stderr[-4000:]
    ours = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(ours) == set(reference)
    assert all(torch.equal(ours[k], reference[k]) for k in reference)
    frozen = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(ours[frozen], original[frozen])  # untouched by training
    assert not torch.equal(
        ours["model.layers.0.mlp.down_proj.weight"], original["model.layers.0.mlp.down_proj.weight"]
    )

    r = export(
        tmp_path / "ds" / "global_step1",
        tmp_path / "hf_trainable",
        "--exclude_frozen_parameters",
        "--no_verify",
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert set(load_file(tmp_path / "hf_trainable" / "model.safetensors")) == set(reference) - {
        frozen
    }


def _same(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if hasattr(a, "__dict__") and not isinstance(a, type):  # DeepSpeed's LossScaler: no __eq__
        return type(a) is type(b) and _same(vars(a), vars(b))
    return a == b


def test_an_interrupted_conversion_keeps_its_pieces_and_ends_equal_to_deepspeeds(
    runs, tmp_path, monkeypatch
):
    """A preemption stops the universal conversion after a few pieces: they are kept (marked done in
    universal.tmp/.pieces), the next attempt skips them, and the result is DeepSpeed's own
    ds_to_universal output, tensor for tensor."""
    import threading

    import torch

    from finetune.weights.universal import PIECES, Interrupted, to_universal

    part = partitioned_only(runs["llama"] / "global_step2", tmp_path / "part")
    target, pieces = part / "universal", part / "universal.tmp" / PIECES
    markers = lambda: (
        [p for p in pieces.iterdir() if p.name != "source.json"] if pieces.is_dir() else []
    )
    cancel = threading.Event()

    def preempt_after_three_pieces():
        while len(markers()) < 3 and not cancel.wait(0.05):
            pass
        cancel.set()

    monkeypatch.setenv(seams.SLOW_UNIVERSAL, "0.3")
    threading.Thread(target=preempt_after_three_pieces, daemon=True).start()
    with pytest.raises(Interrupted, match="piece"):
        to_universal(part, target, cancel)
    kept = len(markers())
    assert kept >= 3 and not target.exists()
    monkeypatch.delenv(seams.SLOW_UNIVERSAL)
    summary = to_universal(part, target)
    ran, total = (int(w) for w in summary.split(": ")[1].split(" pieces")[0].split(" of "))
    assert total - ran == kept, summary  # the kept pieces were not done again
    ref = tmp_path / "ref"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(part),
            "--output_folder",
            str(ref),
            "--num_extract_workers",
            "1",
            "--num_merge_workers",
            "1",
        ],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=TIMEOUT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    want = sorted(str(p.relative_to(ref)) for p in ref.rglob("*") if p.is_file())
    got = sorted(
        str(p.relative_to(target))
        for p in target.rglob("*")
        if p.is_file() and p.name != "manifest.json"
    )
    assert got == want
    for name in want:
        assert _same(
            torch.load(target / name, weights_only=False),
            torch.load(ref / name, weights_only=False),
        ), name
