"""What a user sees and touches around a real 2-rank run: an example config file adapted on the
command line, the console, OUT/run_config.yaml reproducing the run, OUT/events.jsonl, the plot,
and `finetune ls` / `finetune plot` on the result."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, base_ds, child_env, write_ds

pytestmark = pytest.mark.distributed

EXAMPLE = REPO / "configs" / "examples" / "chat-sft.yaml"


def finetune_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "finetune", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
    )


def _decoded_png(path: Path):
    import matplotlib.image

    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 400 and pixels.shape[1] > 600, pixels.shape
    assert pixels[..., :3].std() > 0.05, "the plot is blank"
    return pixels


def test_an_example_config_runs_on_a_tiny_model_and_its_run_config_reproduces_it(
    run_finetune, tiny_models, data_files, tmp_path
):
    # A real DeepSpeed warning (a deprecated ZeRO key): filtering the known noise must not hide it.
    zero = {**base_ds()["zero_optimization"], "cpu_offload": False}
    ds = write_ds(tmp_path, base_ds(zero_optimization=zero))
    r = run_finetune(
        "--config",
        str(EXAMPLE),
        "--model_name_or_path",
        str(tiny_models["llama"]),
        "--train_file",
        str(data_files["chat_jsonl"]),
        "--max_steps",
        "4",
        "--max_seq_length",
        "64",
        "--per_device_train_batch_size",
        "2",
        "--gradient_accumulation_steps",
        "1",
        "--precision",
        "fp32",
        "--logging_steps",
        "1",
        "--eval_steps",
        "2",
        "--save_steps",
        "2",
        "--deepspeed_config",
        ds,
    )
    assert r.returncode == 0, r.output[-3000:]

    # The console: no per-rank repeats of known noise; finetune's info lines from rank 0 only.
    assert "FutureWarning" not in r.output and "built successfully" not in r.output, r.output[
        -3000:
    ]
    assert "Config parameter cpu_offload is deprecated" in r.output, r.output[-3000:]
    assert "[finetune] [rank1]" not in r.output

    # The example's recipe, with the command line's overrides, is what ran and what was written.
    written = yaml.safe_load((r.out_dir / "run_config.yaml").read_text())
    assert (written["messages_column"], written["packing"], written["async_save"]) == (
        "messages",
        True,
        True,
    )
    assert (written["max_steps"], written["num_train_epochs"], written["lr_scheduler_type"]) == (
        4,
        None,
        "cosine",
    )

    events = [json.loads(line) for line in (r.out_dir / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["step"]) for e in events] == [
        ("start", 0),
        ("checkpoint", 2),
        ("checkpoint", 4),
        ("end", 4),
    ], events
    assert events[-1]["exit_code"] == 0 and events[0]["world_size"] == 2

    _decoded_png(r.out_dir / "plots" / "training.png")
    ls = finetune_cli("ls", str(r.out_dir), "--json")
    assert ls.returncode == 0, ls.stderr
    listed = json.loads(ls.stdout)["checkpoints"]
    assert [(c["step"], c["latest"], c["world_size"]) for c in listed] == [
        (2, False, 2),
        (4, True, 2),
    ]
    assert all(c["train_loss"] is not None and c["eval_loss"] is not None for c in listed)
    plotted = finetune_cli("plot", str(r.out_dir), "-o", str(tmp_path / "again.png"))
    assert plotted.returncode == 0, plotted.stderr
    _decoded_png(tmp_path / "again.png")

    # finetune --config OUT/run_config.yaml runs the same training again.
    again = run_finetune("--config", str(r.out_dir / "run_config.yaml"), out_dir=tmp_path / "again")
    assert again.returncode == 0, again.output[-3000:]
    assert [(x["step"], x["loss"]) for x in again.train_rows()] == [
        (x["step"], x["loss"]) for x in r.train_rows()
    ]
    assert [x["eval_loss"] for x in again.eval_rows()] == [x["eval_loss"] for x in r.eval_rows()]


@pytest.mark.parametrize(
    "example, data, columns",
    [
        (
            "llama-1b-sft.yaml",
            "pc_csv",
            ["--prompt_column", "question", "--completion_column", "answer"],
        ),
        ("slurm.yaml", "pc_csv", ["--prompt_column", "question", "--completion_column", "answer"]),
        # CPU offload and gradient checkpointing, as the example sets
        ("7b-offload.yaml", "text_jsonl", []),
        (
            "llama-8b-lora.yaml",
            "pc_csv",
            ["--prompt_column", "question", "--completion_column", "answer"],
        ),
    ],
)
def test_each_example_runs_a_few_steps_on_a_tiny_model(
    run_finetune, tiny_models, data_files, example, data, columns
):
    """The recipes as shipped, with only the model, data and sizes swapped for tiny ones (one
    process)."""
    r = run_finetune(
        "--config",
        str(REPO / "configs" / "examples" / example),
        "--model_name_or_path",
        str(tiny_models["llama"]),
        "--train_file",
        str(data_files[data]),
        *columns,
        "--max_steps",
        "2",
        "--max_seq_length",
        "64",
        "--per_device_train_batch_size",
        "2",
        "--gradient_accumulation_steps",
        "1",
        "--precision",
        "fp32",
        "--eval_steps",
        "2",
        launcher="python",
        nprocs=1,
    )
    assert r.returncode == 0, r.output[-3000:]
    assert [x["step"] for x in r.eval_rows()] == [0, 2]
    assert (r.out_dir / "latest").read_text().strip() == "global_step2"
