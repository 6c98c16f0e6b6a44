"""--async_save on 2 real ranks: same files as a synchronous save, bitwise resume, kill -9 and
preemption while a background write is in flight, and agreed background failures."""

from __future__ import annotations

import json
import os
import signal

import pytest

from finetune.preemption import EXIT_PREEMPTED

from conftest import assert_verifies, last_logged_step, wait_until

pytestmark = pytest.mark.distributed
# Runs that fail, are killed or are signalled go through DeepSpeed's launcher, which passes
# a rank's exit code on and forwards signals its own way (torchrun reports any failure as 1);
# the others take the fixtures' torchrun.

TIMEOUT = 420
FLAGS = [
    "--max_train_samples",
    "80",
    "--per_device_train_batch_size",
    "4",
    "--gradient_accumulation_steps",
    "2",
    "--max_steps",
    "12",
    "--logging_steps",
    "1",
    "--eval_steps",
    "4",
    "--max_eval_samples",
    "40",
    "--learning_rate",
    "1e-3",
    "--warmup_steps",
    "2",
    "--save_checkpoint",
    "--save_steps",
    "4",
]
LONG = [
    "--max_steps",
    "3000",
    "--logging_steps",
    "1",
    "--save_checkpoint",
    "--save_steps",
    "4",
    "--async_save",
    "--eval_steps",
    "100000",
]


def _ok(r):
    assert r.returncode == 0, r.output[-4000:]


def _checksums(folder) -> dict:
    files = json.loads((folder / "manifest.json").read_text())["files"]
    # trainer_state.json records the flags, which differ by --async_save itself
    return {
        name: (m["size"], m["checksum"])
        for name, m in files.items()
        if name != "trainer_state.json"
    }


def _comparable(rows):
    return [{k: v for k, v in row.items() if k not in ("tokens_per_s", "data_ms")} for row in rows]


def test_async_checkpoints_equal_sync_ones_and_resume_bitwise(run_finetune, tiny_models, tmp_path):
    model = ["--model_name_or_path", str(tiny_models["gpt2"])]
    sync = run_finetune(*model, *FLAGS, out_dir=tmp_path / "sync", timeout=TIMEOUT)
    _ok(sync)
    # The snapshot is copied lazily, while the next step's forward and backward run: a copy held
    # back 1 s must still be waited for by the optimizer step, or it would copy the changed state.
    background = run_finetune(
        *model,
        *FLAGS,
        "--async_save",
        out_dir=tmp_path / "async",
        timeout=TIMEOUT,
        env={"FINETUNE_SLOW_COPY": "1"},
    )
    _ok(background)
    assert "writing it in the background" in background.output
    assert _comparable(background.metrics()) == _comparable(sync.metrics())  # training is untouched
    for tag in ("global_step4", "global_step8"):
        assert _checksums(tmp_path / "async" / tag) == _checksums(tmp_path / "sync" / tag), tag
        assert_verifies(tmp_path / "async" / tag)

    resumed = run_finetune(
        *model,
        *FLAGS,
        "--async_save",
        "--resume_from_checkpoint",
        str(tmp_path / "async" / "global_step8"),
        out_dir=tmp_path / "async",
        timeout=TIMEOUT,
    )
    _ok(resumed)
    assert _comparable(resumed.metrics()) == _comparable(sync.metrics())


def test_kill_during_a_background_write_keeps_latest_on_the_previous_checkpoint(
    start_finetune, run_finetune
):
    # Each file takes >= 1.5 s on the writer thread: a save is in the background for seconds.
    run = start_finetune(*LONG, env={"FINETUNE_SLOW_SAVE": "1.5"})
    out = run.out_dir
    wait_until(
        lambda: (out / "latest").exists() and (out / ".staging" / "global_step8").exists(),
        TIMEOUT,
        "global_step4 committed and global_step8 being written",
    )
    assert (out / "latest").read_text().strip() == "global_step4"
    # Training goes on while the thread writes: steps past 8 are logged before global_step8 commits.
    wait_until(lambda: last_logged_step(out) >= 10, 60, "steps during the background write")
    assert not (out / "global_step8").exists()
    run.kill()
    run.finish(TIMEOUT)
    assert (out / "latest").read_text().strip() == "global_step4"
    assert_verifies(out / "global_step4")

    resumed = run_finetune(
        "--max_steps",
        "6",
        "--logging_steps",
        "1",
        "--save_checkpoint",
        "--async_save",
        "--resume_from_checkpoint",
        "auto",
        timeout=TIMEOUT,
    )
    _ok(resumed)
    assert "Resumed from" in resumed.output and "global_step4" in resumed.output
    # the killed run's tail dropped
    assert [r["step"] for r in resumed.train_rows()] == [1, 2, 3, 4, 5, 6]
    assert (out / "latest").read_text().strip() == "global_step6"
    assert not (out / ".staging").exists() or not any((out / ".staging").iterdir())


@pytest.mark.parametrize(
    "fault,policy,every,code,kept",
    [
        ("save.write_rank_files:1:4", "continue", 2, 0, [2, 6]),
        ("save.fsync:0:4:enospc", "abort", 2, 1, [2]),
        # A save every step: the failure of step 2's background write used to cancel step 3's save
        # (reported under step 3): commits were 1, 4, 5, 6.
        ("save.write_rank_files:0:2", "continue", 1, 0, [1, 3, 4, 5, 6]),
        # the leader's shared files and the lazy copy are written on the writer's thread too
        ("save.shared_files:0:4", "continue", 2, 0, [2, 6]),
        ("save.copy:1:2", "continue", 2, 0, [4, 6]),
    ],
)
def test_a_background_write_failure_is_agreed_and_follows_the_policy(
    run_finetune, fault, policy, every, code, kept
):
    r = run_finetune(
        "--max_steps",
        "6",
        "--save_checkpoint",
        "--save_steps",
        str(every),
        "--async_save",
        "--logging_steps",
        "1",
        "--on_save_error",
        policy,
        env={"FINETUNE_FAULT": fault},
        timeout=TIMEOUT,
    )
    assert r.returncode == code, r.output[-4000:]
    kept = [f"global_step{s}" for s in kept]
    assert sorted(p.name for p in r.out_dir.glob("global_step*")) == sorted(kept)
    assert (r.out_dir / "latest").read_text().strip() == kept[-1]
    assert not (r.out_dir / ".staging").exists() or not any((r.out_dir / ".staging").iterdir())
    failed_rank, failed_step = fault.split(":")[1:3]
    failures = [
        line
        for line in r.output.splitlines()
        if f"save of global_step{failed_step} failed on rank {failed_rank}" in line
    ]
    assert failures and "injected fault" in failures[0]
    events = [json.loads(line) for line in (r.out_dir / "events.jsonl").read_text().splitlines()]
    # under its own step
    assert [e["step"] for e in events if e["event"] == "save_failed"] == [int(failed_step)]
    if policy == "abort":
        # surfaced at the first boundary where every rank's writes are done: the next one, or the
        # end of training when the writer is slower than the last steps; no save after it either way
        assert r.train_rows()[-1]["step"] in (5, 6)
        assert "(--on_save_error abort)" in r.output


def test_a_background_failure_found_at_the_end_stops_an_abort_run_without_the_final_save(
    run_finetune,
):
    # the writer is slower than the last steps (a pause after each file): step 4's failure is
    # first known when training has ended
    r = run_finetune(
        "--max_steps",
        "6",
        "--save_checkpoint",
        "--save_steps",
        "4",
        "--async_save",
        "--logging_steps",
        "1",
        "--on_save_error",
        "abort",
        env={"FINETUNE_FAULT": "save.fsync:0:4:enospc", "FINETUNE_SLOW_SAVE": "1.5"},
        timeout=TIMEOUT,
    )
    assert r.returncode == 1, r.output[-4000:]
    assert r.train_rows()[-1]["step"] == 6
    assert "(--on_save_error abort)" in r.output
    assert not list(r.out_dir.glob("global_step*")) and not (r.out_dir / "latest").exists()
    events = [json.loads(line) for line in (r.out_dir / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "save_failed"] == [4]


def test_preemption_with_a_save_in_flight_commits_it_and_then_the_newest_step(start_finetune):
    run = start_finetune(*LONG, env={"FINETUNE_SLOW_SAVE": "1"})
    out = run.out_dir
    wait_until(
        lambda: (out / ".staging" / "global_step4").exists(), TIMEOUT, "global_step4 being written"
    )
    ranks = run.rank_pids()
    os.kill(ranks[1], signal.SIGTERM)
    result = run.finish(TIMEOUT)
    assert result.returncode == EXIT_PREEMPTED, result.output[-4000:]
    status = json.loads((out / "exit_status.json").read_text())
    tag = (out / "latest").read_text().strip()
    assert status["reason"] == "preempted" and status["checkpoint"] == tag
    step = int(tag.removeprefix("global_step"))
    assert step == last_logged_step(out) and step > 4  # the newest step, nothing lost
    for folder in (out / "global_step4", out / tag):  # the one in flight was committed too
        assert_verifies(folder)
