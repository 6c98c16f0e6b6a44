"""A checkpoint written before issue 23's reshape (commit 5164e7b: one rank, a 27k-parameter Llama
config, saved at step 2 of a 4-step run) still resumes with today's code, and the resumed steps are
bit for bit the rows that run logged uninterrupted (tests/fixtures/pre_reshape/expected.json).

Real DeepSpeed in one plain process (~20 s): the format on disk is the contract under test.
"""

from __future__ import annotations

import json
import shutil

from conftest import REPO, Running, child_env, launcher_cmd

FIXTURE = REPO / "tests" / "fixtures" / "pre_reshape"
TOKENIZER = REPO / "finetune" / "resources" / "tokenizer"
FLAGS = (
    "--config_name",
    str(FIXTURE / "model"),
    "--tokenizer_name",
    str(TOKENIZER),
    "--max_steps",
    "4",
    "--save_checkpoint",
    "--save_steps",
    "2",
    "--max_seq_length",
    "64",
    "--per_device_train_batch_size",
    "4",
    "--logging_steps",
    "1",
    "--resume_from_checkpoint",
    "auto",
)


def test_a_checkpoint_from_before_the_reshape_resumes_exactly(tmp_path):
    out = tmp_path / "out"
    shutil.copytree(FIXTURE / "out", out)
    cmd = launcher_cmd("python", 1) + [*FLAGS, "--output_dir", str(out)]
    result = Running(cmd, tmp_path, child_env(), out).finish(300)
    assert result.returncode == 0, result.output[-4000:]
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert [e.get("from") for e in events if e["event"] == "resume"] == ["global_step2"]
    expected = json.loads((FIXTURE / "expected.json").read_text())["rows"]
    rows = {str(r["step"]): r for r in result.train_rows()}
    assert sorted(rows) == ["3", "4"], "only the steps after the checkpoint"
    for step, want in expected.items():
        assert {k: rows[step][k] for k in want} == want, step
