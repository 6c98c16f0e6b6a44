"""Early stopping and the best checkpoint on 2 real ranks (deepspeed launcher, CPU): a rank killed
with SIGKILL mid-save, the resume stops at the step the counters in the checkpoint say."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.distributed
# A rank killed mid-save: DeepSpeed's launcher, as the product's jobs run it, stops the other.


def test_early_stopping_on_two_ranks_survives_a_killed_rank(run_finetune, tmp_path):
    # Warmup over 100,000 steps: the weights barely move, no evaluation beats step 0's by 0.5, so
    # patience 4 (evaluations at 2, 4, 6, 8) stops at step 8.
    flags = [
        "--max_steps",
        "40",
        "--eval_steps",
        "2",
        "--logging_steps",
        "1",
        "--save_checkpoint",
        "--save_steps",
        "2",
        "--save_total_limit",
        "1",
        "--early_stopping_patience",
        "4",
        "--early_stopping_threshold",
        "0.5",
        "--warmup_steps",
        "100000",
    ]
    killed = run_finetune(
        *flags, env={"FINETUNE_FAULT": "save.snapshot:1:6:kill"}, launcher="deepspeed"
    )
    assert killed.returncode != 0, killed.output[-3000:]
    out = killed.out_dir
    assert (out / "latest").read_text().strip() == "global_step4"
    resumed = run_finetune(*flags, "--resume_from_checkpoint", "auto", launcher="deepspeed")
    assert resumed.returncode == 0, resumed.output[-3000:]
    status = json.loads((out / "exit_status.json").read_text())
    assert (status["reason"], status["exit_code"], status["step"]) == ("early_stopped", 0, 8)
    # Rows the killed run logged after step 4 were logged again by the resumed run: the same.
    seen: dict = {}
    for row in resumed.metrics():
        key = (row["step"], "eval_loss" in row)
        value = row.get("eval_loss", row.get("loss"))
        assert seen.setdefault(key, value) == pytest.approx(value, rel=1e-6), key
    assert max(step for step, _ in seen) == 8
    # The best checkpoint (step 2 or 4: the lowest eval loss of a saved step) is kept besides the
    # newest with --save_total_limit 1, and the final manifest names it.
    final = json.loads((out / "global_step8" / "manifest.json").read_text())
    assert final["eval"]["step"] == 8
    assert (out / final["best"]["tag"]).is_dir()
    evals = {step: v for (step, is_eval), v in seen.items() if is_eval and step in (2, 4, 6, 8)}
    assert final["best"]["value"] == pytest.approx(min(evals.values()))
