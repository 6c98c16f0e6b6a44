"""Real multi-rank checkpoint behaviour: file sets, consolidated weights, bitwise resume,
failures."""

from __future__ import annotations

import json
import subprocess
import uuid

import pytest

from finetune.io.durable import hash_file

from conftest import checkpoint_files, partitioned_file_set

pytestmark = pytest.mark.distributed
# Runs that fail, are killed or are signalled go through DeepSpeed's launcher, which passes
# a rank's exit code on and forwards signals its own way (torchrun reports any failure as 1);
# the others take the fixtures' torchrun.

TIMEOUT = 420  # a hang shows up as a timeout, not a stuck CI job


def _ok(r):
    assert r.returncode == 0, r.output[-4000:]


def _manifest_matches(folder) -> bool:
    manifest = json.loads((folder / "manifest.json").read_text())
    listed = set(manifest["files"])
    on_disk = checkpoint_files(folder) - {"manifest.json"}
    return listed == on_disk and all(
        hash_file(folder / name) == (meta["size"], meta["checksum"])
        for name, meta in manifest["files"].items()
    )


# llama: untied head, every parameter streamed partition by partition (threshold lowered to 1 KB);
# qwen2: tied embeddings, gathered a module at a time (the default threshold).
@pytest.mark.parametrize("arch,stream_bytes", [("llama", "1024"), ("qwen2", None)])
def test_consolidated_checkpoint_loads_and_matches_training_weights(
    run_finetune, tiny_models, arch, stream_bytes
):
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoConfig, AutoModelForCausalLM

    r = run_finetune(
        "--model_name_or_path",
        str(tiny_models[arch]),
        "--max_steps",
        "3",
        "--save_checkpoint",
        "--save_consolidated",
        "--max_shard_size",
        "40KB",
        "--learning_rate",
        "1e-3",
        timeout=TIMEOUT,
        env={"FINETUNE_STREAM_BYTES": stream_bytes} if stream_bytes else None,
    )
    _ok(r)
    folder = r.out_dir / "global_step3"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0].endswith(f"-of-{len(shards):05d}.safetensors")
    assert checkpoint_files(folder) == partitioned_file_set(2, set()) | (
        checkpoint_files(folder)
        & {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}
    ) | set(shards) | {"model.safetensors.index.json"}
    assert _manifest_matches(folder)

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert (
        not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ), info
    assert all(p.numel() > 0 for p in model.parameters())
    # The reference: DeepSpeed's own reconstruction of the trained fp32 weights from the rank files.
    ref = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    ref.load_state_dict(
        get_fp32_state_dict_from_zero_checkpoint(str(r.out_dir), tag="global_step3"), strict=False
    )
    ref.tie_weights()
    x = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model.eval()(x).logits, ref.eval()(x).logits)
    if arch == "qwen2":
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_no_rank_reads_more_than_its_own_files_during_a_save(run_finetune, tmp_path):
    """4 ranks: each rank's read bytes over a save (the kernel's rchar for the whole process, and
    the bytes our code read back to hash) stay within its own files + the shared ones; before, rank
    0 read every other rank's files back (3 × its own share here)."""
    io_dir = tmp_path / "save-io"
    r = run_finetune(
        "--max_steps",
        "2",
        "--save_checkpoint",
        "--per_device_train_batch_size",
        "2",
        "--eval_steps",
        "100000",
        # rank 0's plot thread reads matplotlib's modules and fonts (~7 MB of rchar) whenever it
        # happens to render during the save: not checkpoint I/O, and a flaky count
        "--no_plot",
        nprocs=4,
        env={"FINETUNE_SAVE_IO": str(io_dir)},
        timeout=TIMEOUT,
    )
    _ok(r)
    records = [json.loads(p.read_text()) for p in sorted(io_dir.glob("global_step2-rank*.json"))]
    assert sorted(rec["rank"] for rec in records) == [0, 1, 2, 3]
    manifest = json.loads((r.out_dir / "global_step2" / "manifest.json").read_text())["files"]
    shared = sum(
        m["size"] for n, m in manifest.items() if not n.startswith(("zero_pp_rank_", "rng_state_"))
    )
    others = min(
        sum(m["size"] for n, m in manifest.items() if n.startswith(f"zero_pp_rank_{q}_"))
        for q in (1, 2, 3)
    )
    slack = 256 << 10  # collectives' sockets, DeepSpeed copying its recovery scripts (~40 KB)
    assert others > 4 * slack  # reading back any other rank's files would show
    for rec in records:
        allowed = shared if rec["rank"] == 0 else 0
        assert rec["hashed_bytes"] <= allowed, rec
        assert rec["rchar_delta"] <= allowed + slack, rec
        assert rec["own_bytes"] >= others // 2, rec


RESUME_FLAGS = [
    "--max_train_samples",
    "80",
    "--per_device_train_batch_size",
    "4",
    "--gradient_accumulation_steps",
    "2",
    "--max_steps",
    "12",
    "--logging_steps",
    "3",
    "--eval_steps",
    "4",
    "--max_eval_samples",
    "40",
    "--learning_rate",
    "1e-3",
    "--warmup_steps",
    "2",
]


def _comparable(rows):
    # timings
    return [{k: v for k, v in row.items() if k not in ("tokens_per_s", "data_ms")} for row in rows]


@pytest.mark.parametrize(
    "launcher,nprocs,weight_decay,groups",
    [("deepspeed", 2, "0.0", "one"), ("python", 1, "0.1", "decay_split")],
)
def test_resume_is_bitwise_identical(
    run_finetune, tiny_models, tmp_path, launcher, nprocs, weight_decay, groups
):
    """N steps + save + resume + M steps == N+M steps: mid-epoch, GA=2, dropout on (GPT-2), across
    an epoch end. The run saves at step 4, one step into a log window (--logging_steps 3), and is
    killed at its next save (step 8); `auto` resumes from global_step4. Every logged row (the
    window sums of every rank, not only rank 0's; tokens seen; eval losses) equals the
    uninterrupted run's bit for bit. (Only rank 0's window used to be saved and every rank loaded
    it: the first row after a resume counted rank 0's partial sums twice.) Both optimizer layouts:
    one parameter group without weight decay, two (biases and norms apart) with it."""
    model = ["--model_name_or_path", str(tiny_models["gpt2"]), "--weight_decay", weight_decay]
    straight = run_finetune(
        *model,
        *RESUME_FLAGS,
        launcher=launcher,
        nprocs=nprocs,
        out_dir=tmp_path / "a",
        timeout=TIMEOUT,
    )
    _ok(straight)
    save = ("--save_checkpoint", "--save_steps", "4")
    killed = run_finetune(
        *model,
        *RESUME_FLAGS,
        *save,
        launcher=launcher,
        nprocs=nprocs,
        out_dir=tmp_path / "b",
        env={"FINETUNE_FAULT": "save.snapshot:0:8:kill"},
        timeout=TIMEOUT,
    )
    assert killed.returncode != 0, killed.output[-3000:]
    assert (tmp_path / "b" / "latest").read_text().strip() == "global_step4"
    state = json.loads((tmp_path / "b" / "global_step4" / "trainer_state.json").read_text())
    # mid-epoch
    assert state["global_step"] == 4 and 0 < state["sampler"]["consumed"], state["sampler"]
    assert state["optimizer_groups"] == groups
    resumed = run_finetune(
        *model,
        *RESUME_FLAGS,
        *save,
        "--resume_from_checkpoint",
        "auto",
        launcher=launcher,
        nprocs=nprocs,
        out_dir=tmp_path / "b",
        timeout=TIMEOUT,
    )
    _ok(resumed)
    assert "Resumed from" in resumed.output and "global_step4 at step 4" in resumed.output
    assert [r["step"] for r in resumed.train_rows()] == [3, 6, 9, 12]
    assert [r["step"] for r in resumed.eval_rows()] == [0, 4, 8, 12]
    assert _comparable(resumed.metrics()) == _comparable(straight.metrics())


def test_resume_is_bitwise_after_many_steps(run_finetune, tmp_path):
    """DeepSpeed's CPU Adam keeps beta^t as a running product that a resumed process would recompute
    with pow(): a few ulps off, losses drifting from the third step after the resume (seen at step
    23 of 40 here). finetune replays the product on load (ops.replay_adam_steps)."""
    flags = [
        "--max_steps",
        "30",
        "--logging_steps",
        "1",
        "--save_checkpoint",
        "--save_steps",
        "20",
        "--max_train_samples",
        "400",
        "--max_eval_samples",
        "8",
    ]
    straight = run_finetune(
        *flags, launcher="python", nprocs=1, out_dir=tmp_path / "a", timeout=TIMEOUT
    )
    _ok(straight)
    resumed = run_finetune(
        *flags,
        "--resume_from_checkpoint",
        str(tmp_path / "a" / "global_step20"),
        launcher="python",
        nprocs=1,
        out_dir=tmp_path / "b",
        timeout=TIMEOUT,
    )
    _ok(resumed)
    want = {r["step"]: r["loss"] for r in straight.train_rows()}
    got = {r["step"]: r["loss"] for r in resumed.train_rows()}
    assert sorted(got) == list(range(21, 31))
    assert {s: got[s] for s in got} == {s: want[s] for s in got}


def test_auto_resume_starts_fresh_then_resumes(run_finetune, tmp_path):
    out = tmp_path / "o"
    fresh = run_finetune(
        "--max_steps",
        "2",
        "--save_checkpoint",
        "--resume_from_checkpoint",
        "auto",
        launcher="python",
        nprocs=1,
        out_dir=out,
        timeout=TIMEOUT,
    )
    _ok(fresh)
    assert "starting fresh" in fresh.output
    again = run_finetune(
        "--max_steps",
        "4",
        "--save_checkpoint",
        "--resume_from_checkpoint",
        "auto",
        launcher="python",
        nprocs=1,
        out_dir=out,
        timeout=TIMEOUT,
    )
    _ok(again)
    # run 1 flushed at 2; resumed run logs 4
    assert [r["step"] for r in again.train_rows()] == [2, 4]


def test_retention_keeps_the_newest(run_finetune):
    r = run_finetune(
        "--max_steps",
        "8",
        "--save_checkpoint",
        "--save_steps",
        "2",
        "--save_total_limit",
        "2",
        launcher="python",
        nprocs=1,
        timeout=TIMEOUT,
    )
    _ok(r)
    assert sorted(p.name for p in r.out_dir.glob("global_step*")) == [
        "global_step6",
        "global_step8",
    ]
    assert (r.out_dir / "latest").read_text().strip() == "global_step8"


def test_failure_with_abort_stops_with_exit_1(run_finetune):
    r = run_finetune(
        "--max_steps",
        "6",
        "--save_checkpoint",
        "--save_steps",
        "2",
        "--logging_steps",
        "1",
        "--on_save_error",
        "abort",
        env={"FINETUNE_FAULT": "save.write_rank_files:0:4"},
        timeout=TIMEOUT,
    )
    assert r.returncode == 1, r.output[-3000:]
    assert (r.out_dir / "latest").read_text().strip() == "global_step2"
    assert r.train_rows()[-1]["step"] == 4
    assert sorted(p.name for p in r.out_dir.glob("global_step*")) == ["global_step2"]


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 9 MiB tmpfs: room for one checkpoint of the embedded model (~5.6 MB), not two."""
    mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=9m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_enospc_mid_write_keeps_latest_and_final_failure_exits_1(run_finetune, small_tmpfs):
    """Real ENOSPC (pre-check skipped): the failed save leaves no staging, training goes on, final
    save fails."""
    out = small_tmpfs / "out"
    r = run_finetune(
        "--max_steps",
        "6",
        "--save_checkpoint",
        "--save_steps",
        "2",
        "--logging_steps",
        "1",
        out_dir=out,
        env={"FINETUNE_SKIP_SPACE_CHECK": "1"},
        timeout=TIMEOUT,
    )
    assert r.returncode == 1, r.output[-3000:]
    assert "No space left on device" in r.output
    assert (out / "latest").read_text().strip() == "global_step2"
    assert sorted(p.name for p in out.glob("global_step*")) == ["global_step2"]
    assert _manifest_matches(out / "global_step2")
    assert not list((out / ".staging").glob("*")) if (out / ".staging").exists() else True
    # trained on past the failure
    assert [row["step"] for row in r.train_rows()] == [1, 2, 3, 4, 5, 6]


def test_free_space_precheck_fails_fast_without_writing(run_finetune, small_tmpfs):
    out = small_tmpfs / "out"
    r = run_finetune(
        "--max_steps",
        "4",
        "--save_checkpoint",
        "--save_steps",
        "2",
        out_dir=out,
        timeout=TIMEOUT,
    )
    assert r.returncode == 1
    assert "not enough free space" in r.output
    assert (out / "latest").read_text().strip() == "global_step2"
    assert sorted(p.name for p in out.glob("global_step*")) == ["global_step2"]


def test_auto_resume_falls_back_past_a_damaged_checkpoint(run_finetune, tmp_path):
    """The first run's save of step 4 fails on rank 1: the failure is agreed, the save abandoned
    (no staging left) and training continues to the next saves. Then global_step8 is damaged and
    auto falls back to global_step6."""
    out = tmp_path / "fb"
    first = run_finetune(
        "--max_steps",
        "8",
        "--save_checkpoint",
        "--save_steps",
        "2",
        "--logging_steps",
        "1",
        out_dir=out,
        env={"FINETUNE_FAULT": "save.write_rank_files:1:4"},
        timeout=TIMEOUT,
    )
    _ok(first)
    assert sorted(p.name for p in out.glob("global_step*")) == [
        "global_step2",
        "global_step6",
        "global_step8",
    ]
    assert (out / "latest").read_text().strip() == "global_step8"
    assert not (out / ".staging").exists()
    failures = [
        ln for ln in first.output.splitlines() if "save of global_step4 failed on rank 1" in ln
    ]
    assert failures and "injected fault" in failures[0]
    victim = out / "global_step8" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped byte: only the checksum can tell
    victim.write_bytes(bytes(data))
    explicit = run_finetune(
        "--max_steps",
        "8",
        "--resume_from_checkpoint",
        str(out / "global_step8"),
        out_dir=out,
        timeout=TIMEOUT,
    )
    assert explicit.returncode == 2 and "does not verify" in explicit.output
    # An EIO on one rank's read while verifying (bad media): every rank learns it, exit 2, no hang.
    unreadable = run_finetune(
        "--max_steps",
        "8",
        "--resume_from_checkpoint",
        str(out / "global_step6"),
        out_dir=out,
        env={"FINETUNE_FAULT": "verify.read_file:1"},
        timeout=TIMEOUT,
    )
    assert unreadable.returncode == 2, unreadable.output[-3000:]
    assert "does not verify" in unreadable.output and "unreadable (OSError" in unreadable.output
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "loss": 1.2')  # a crash mid-append: rank 0 must not fail alone on it
    resumed = run_finetune(
        "--max_steps",
        "10",
        "--save_checkpoint",
        "--logging_steps",
        "1",
        "--resume_from_checkpoint",
        "auto",
        out_dir=out,
        timeout=TIMEOUT,
    )
    _ok(resumed)
    assert (
        "not resuming from global_step8" in resumed.output and "checksum mismatch" in resumed.output
    )
    assert "Resumed from" in resumed.output and "global_step6 at step 6" in resumed.output
    assert [r["step"] for r in resumed.train_rows()] == list(range(1, 11))
    assert (out / "latest").read_text().strip() == "global_step10"
    # The damaged step 8 was committed after the resume point: set aside as evidence, not
    # overwritten.
    assert [p.name.split("-")[0] for p in (out / ".abandoned").iterdir()] == ["global_step8"]
