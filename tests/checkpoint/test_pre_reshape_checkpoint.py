"""A checkpoint written by an earlier layout of the code (commit 5164e7b: one rank, a 27k-parameter
Llama config, saved at step 2 of a 4-step run) still resumes with today's code, and the resumed
steps are the rows that run logged uninterrupted (tests/fixtures/pre_reshape/expected.json):
counters exact, floats to 1e-6 relative. Bit for bit holds on the CPU that wrote the fixture;
another CPU's vector width rounds a reduction differently (an AMD EPYC gave grad_norm 0.9398303396
for 0.9398303361, loss equal), while a resume that lost state (data position, RNG, optimizer
moments) moves the rows by far more than 1e-6.

Real DeepSpeed in one plain process (~20 s): the format on disk is the contract under test.
"""

from __future__ import annotations

import json
import shutil

import pytest

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
        got = {k: rows[step][k] for k in want}
        exact = {k: v for k, v in want.items() if isinstance(v, int)}
        assert {k: got[k] for k in exact} == exact, step
        close = {k: v for k, v in want.items() if k not in exact}
        assert {k: got[k] for k in close} == pytest.approx(close, rel=1e-6, abs=0), step
