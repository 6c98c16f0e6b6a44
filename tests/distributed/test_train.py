"""Real 2-rank training runs on CPU (gloo/shm): the product's everyday launch, each other launcher,
and model architectures and DeepSpeed configs on the tests' own rank launcher."""

from __future__ import annotations

import json
import math

import pytest

from conftest import EMBEDDED_TOKENIZER_FILES, checkpoint_files, partitioned_file_set

pytestmark = pytest.mark.distributed
# The product's everyday launch (`deepspeed --module finetune`) and a bad input under it keep
# DeepSpeed's launcher, where the fixtures default to ranks forked after the imports.


def _assert_ok(result):
    assert result.returncode == 0, result.output[-4000:]


def test_embedded_default_learns_and_saves(run_finetune):
    """`finetune` with no model/data flags: 2 ranks, eval loss at least halves, a complete
    checkpoint."""
    r = run_finetune("--save_checkpoint", launcher="deepspeed")
    _assert_ok(r)
    evals = r.eval_rows()
    assert [e["step"] for e in evals] == [0, 150]
    assert evals[-1]["eval_loss"] <= 0.5 * evals[0]["eval_loss"], evals
    assert (r.out_dir / "latest").read_text().strip() == "global_step150"
    folder = r.out_dir / "global_step150"
    assert checkpoint_files(folder) == partitioned_file_set(2, EMBEDDED_TOKENIZER_FILES)
    state = json.loads((folder / "trainer_state.json").read_text())
    assert state["global_step"] == 150 and state["world_size"] == 2 and state["zero_stage"] == 3
    assert not (r.out_dir / ".staging").exists()
    rows = r.train_rows()
    assert all(math.isfinite(x["loss"]) and x["tokens_per_s"] > 0 for x in rows)
    assert rows[-1]["samples_seen"] == 150 * 8 * 2
    assert json.loads((r.out_dir / "exit_status.json").read_text())["exit_code"] == 0
    # DeepSpeed's CPU backend never unlinks its 69 MB-per-rank /dev/shm buffers; finetune does.
    assert r.leaked_shm == (), r.leaked_shm


@pytest.mark.parametrize(
    "arch,data,flags",
    [
        ("llama", "pc_csv", ["--prompt_column", "question", "--completion_column", "answer"]),
        ("gpt2", "chat_jsonl", ["--messages_column", "messages", "--tokenizer_name", "{tok}"]),
        ("qwen2", "text_jsonl", ["--packing", "--max_seq_length", "64"]),
    ],
)
def test_local_model_architectures(run_finetune, tiny_models, data_files, arch, data, flags):
    """The issue's command on a local model dir and each data format; checkpoint has the model's
    files."""
    from conftest import TOKENIZER_DIR

    flags = [f.replace("{tok}", str(TOKENIZER_DIR)) for f in flags]
    r = run_finetune(
        "--model_name_or_path",
        str(tiny_models[arch]),
        "--train_file",
        str(data_files[data]),
        *flags,
        "--max_steps",
        "4",
        "--logging_steps",
        "1",
        "--per_device_train_batch_size",
        "4",
        "--save_checkpoint",
    )
    _assert_ok(r)
    rows = r.train_rows()
    assert [x["step"] for x in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(x["loss"]) for x in rows)
    folder = r.out_dir / "global_step4"
    files = checkpoint_files(folder)
    assert {"config.json", "manifest.json", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= files
    assert json.loads((folder / "config.json").read_text())["model_type"] == arch


def test_offload_config(run_finetune):
    """ZeRO-3 with parameters and optimizer offloaded to CPU trains and saves."""
    r = run_finetune(
        "--deepspeed_config",
        "configs/ds_zero3_offload.json",
        "--max_steps",
        "3",
        "--logging_steps",
        "1",
        "--save_checkpoint",
    )
    _assert_ok(r)
    assert [x["step"] for x in r.train_rows()] == [1, 2, 3]
    assert (r.out_dir / "latest").read_text().strip() == "global_step3"


def test_torchrun_with_tensorboard(run_finetune):
    r = run_finetune(
        "--max_steps",
        "3",
        "--logging_steps",
        "1",
        "--report_to",
        "tensorboard",
        launcher="torchrun",
    )
    _assert_ok(r)
    assert [x["step"] for x in r.train_rows()] == [1, 2, 3]
    events = list((r.out_dir / "tensorboard").rglob("events.out.tfevents*"))
    assert events, "DeepSpeed's TensorBoard monitor wrote no event file"


def test_accelerate_launch(run_finetune):
    r = run_finetune("--max_steps", "2", "--logging_steps", "1", launcher="accelerate")
    _assert_ok(r)
    assert [x["step"] for x in r.train_rows()] == [1, 2]


def test_single_process(run_finetune):
    r = run_finetune(
        "--max_steps", "3", "--logging_steps", "1", "--save_checkpoint", launcher="python", nprocs=1
    )
    _assert_ok(r)
    assert checkpoint_files(r.out_dir / "global_step3") == partitioned_file_set(
        1, EMBEDDED_TOKENIZER_FILES
    )


def test_bad_input_under_launcher_exits_2_once(run_finetune, data_files):
    """A bad column found after the ranks start: both ranks exit 2, one error line, nothing
    written."""
    r = run_finetune(
        "--train_file", str(data_files["text_jsonl"]), "--text_column", "body", launcher="deepspeed"
    )
    assert r.returncode == 2, r.output[-3000:]
    errors = [ln for ln in r.output.splitlines() if "finetune: error:" in ln]
    assert len(errors) == 1, errors
    assert "--text_column" in errors[0] and "available: text" in errors[0]
    assert "Traceback" not in r.output
    assert not r.out_dir.exists()
