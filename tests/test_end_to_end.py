"""The everyday end-to-end test (`make test`): the real CLI through DeepSpeed's launcher on 2 ranks,
the way litgpt's tests run a finetune script: one run that asserts exactly the files it wrote, then
a resume that continues the same losses' curve from the committed checkpoint.

Every other multi-rank behaviour (bitwise resume, faults, launchers, SLURM) is in `make check`.
"""

from __future__ import annotations

import json
import math

from conftest import EMBEDDED_TOKENIZER_FILES, checkpoint_files, partitioned_file_set

STEPS, SAVE_STEPS, MORE_STEPS = 6, 3, 9
FLAGS = (
    "--save_checkpoint",
    "--save_steps",
    str(SAVE_STEPS),
    "--logging_steps",
    "1",
    "--eval_steps",
    "1000",
    "--per_device_train_batch_size",
    "4",
)

# What a run writes in OUT besides its checkpoints (docs/CHECKPOINTS.md "Layout").
RUN_FILES = {
    "zero_to_torch.py",
    "metrics.jsonl",
    "events.jsonl",
    "run_config.yaml",
    "exit_status.json",
    "latest",
    "zero_to_fp32.py",
    "plots/training.png",
}


def top_level(out) -> set[str]:
    return {
        str(p.relative_to(out))
        for p in out.rglob("*")
        if p.is_file()
        and not any(part.startswith("global_step") for part in p.relative_to(out).parts)
    }


def test_a_run_writes_exactly_its_files_and_a_resume_continues_its_losses(run_finetune):
    first = run_finetune(*FLAGS, "--max_steps", str(STEPS), launcher="deepspeed")
    assert first.returncode == 0, first.output[-4000:]
    out = first.out_dir

    checkpoints = sorted(p.name for p in out.iterdir() if p.name.startswith("global_step"))
    assert checkpoints == ["global_step3", "global_step6"]
    for tag in checkpoints:
        assert checkpoint_files(out / tag) == partitioned_file_set(2, EMBEDDED_TOKENIZER_FILES), tag
    written = top_level(out)
    assert written == RUN_FILES, sorted(written)
    assert (out / "latest").read_text().strip() == "global_step6"
    state = json.loads((out / "global_step6" / "trainer_state.json").read_text())
    assert (state["global_step"], state["world_size"], state["zero_stage"]) == (6, 2, 3)
    assert json.loads((out / "exit_status.json").read_text())["exit_code"] == 0

    rows = first.train_rows()
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(math.isfinite(r["loss"]) for r in rows)

    resumed = run_finetune(
        *FLAGS,
        "--max_steps",
        str(MORE_STEPS),
        "--resume_from_checkpoint",
        "auto",
        launcher="deepspeed",
    )
    assert resumed.returncode == 0, resumed.output[-4000:]
    rows = resumed.train_rows()
    assert [r["step"] for r in rows] == list(range(1, MORE_STEPS + 1)), (
        "rows of both runs, in order"
    )
    before, after = rows[:STEPS], rows[STEPS:]
    assert after[0]["samples_seen"] == before[-1]["samples_seen"] + 4 * 2
    # The losses continue from where the first run stopped, not from a fresh model's.
    assert max(r["loss"] for r in after) < before[0]["loss"], [r["loss"] for r in rows]
    events = [json.loads(line)["event"] for line in (out / "events.jsonl").read_text().splitlines()]
    assert "resume" in events
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("global_step")) == [
        "global_step3",
        "global_step6",
        "global_step9",
    ]
