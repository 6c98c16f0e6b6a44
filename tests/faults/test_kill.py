"""kill -9 at random moments of a run that saves every step: of the whole job, and of one rank only
(whose survivor must then exit on its own within BOUND_S), with and without --save_consolidated and
--async_save.

Each trial's moment comes from its seed (printed on failure: rerun that one case to replay it).
After each: the output dir's invariants, and `--resume_from_checkpoint auto` trains to the end.
`make check` runs a few trials of each; `make faults` runs KILL_TRIALS of each.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from conftest import last_logged_step, wait_until
from harness import (
    BOUND_S,
    KILLED,
    RUN_TIMEOUT,
    RankRun,
    assert_resumes_to_the_end,
    output_dir_problems,
    train_args,
)

pytestmark = [pytest.mark.distributed, pytest.mark.faults]

KILL_TRIALS = int(os.environ.get("FINETUNE_KILL_TRIALS", "50"))  # of each kind, in `make faults`
SAMPLED_TRIALS = {"job": 1, "rank": 1}  # in `make check`: one trial of each
STEPS = 8
# of the trials kill during start-up (lease, tidy, resume planning, model build)
STARTUP_SHARE = 0.2
STARTUP_S = 12.0  # ... at a moment drawn over this many seconds after the launch
FIRST_STEP_S = 0.3  # a step and its save here, until a second step is logged to measure it


def _seeds(kind: str):
    return [
        pytest.param(s, marks=[] if s < SAMPLED_TRIALS[kind] else [pytest.mark.faults_long])
        for s in range(KILL_TRIALS)
    ]


class Trial:
    """One seeded trial: its moment, its victim, its flags.

    Most trials kill while training: once step ``step`` is logged, after a drawn fraction of one
    step's time (a step and its save; measured on the run itself), so the moments spread over the
    save of every step, the final one included, whatever the machine's speed.
    """

    def __init__(self, seed: int, one_rank: bool):
        rng = random.Random(f"{seed}-{'rank' if one_rank else 'job'}")
        self.seed, self.one_rank = seed, one_rank
        self.consolidated = seed % 2 == 1
        # --async_save: kills land while the writer thread writes, too
        self.background = seed % 4 >= 2
        self.during_startup = rng.random() < STARTUP_SHARE
        self.delay = rng.uniform(0, STARTUP_S)
        self.step, self.fraction = rng.randint(1, STEPS), rng.random()
        self.victim = rng.choice([0, 1])

    def extra(self) -> tuple:
        return (("--save_consolidated",) if self.consolidated else ()) + (
            ("--async_save",) if self.background else ()
        )

    def flags(self) -> tuple:
        return train_args(STEPS, *self.extra())

    def __str__(self) -> str:
        when = (
            f"{self.delay:.2f} s after the launch"
            if self.during_startup
            else f"{self.fraction:.2f} of a step after step {self.step} was logged"
        )
        who = f"rank {self.victim}" if self.one_rank else "the whole job"
        return (
            f"kill trial seed {self.seed}: SIGKILL to {who} {when}, "
            f"{'with' if self.consolidated else 'without'} --save_consolidated"
            f"{', --async_save' if self.background else ''}"
        )

    def moment(self, out) -> dict:
        """Where the run was when the kill came: the last logged step, a save in flight."""
        try:
            saving = any((out / ".staging").iterdir())
        except OSError:  # none, or removed as we looked
            saving = False
        return {"trial": str(self), "killed_after_step": last_logged_step(out), "saving": saving}

    def wait(self, run: RankRun) -> None:
        if self.during_startup:
            time.sleep(self.delay)
            return
        ended = run.running.proc.poll
        wait_until(
            lambda: last_logged_step(run.out) >= 1 or ended() is not None,
            RUN_TIMEOUT,
            "the first step",
        )
        first = time.monotonic()
        wait_until(
            lambda: last_logged_step(run.out) >= self.step or ended() is not None,
            RUN_TIMEOUT,
            f"step {self.step}",
            interval=0.005,
        )
        per_step = (time.monotonic() - first) / (self.step - 1) if self.step > 1 else FIRST_STEP_S
        time.sleep(self.fraction * per_step)


def _resume(trial: Trial, tmp_path, out):
    try:
        assert_resumes_to_the_end(tmp_path, 2, out, STEPS, trial.extra())
    except AssertionError as e:
        raise AssertionError(f"{trial}: {e}") from None


@pytest.mark.timeout(3 * RUN_TIMEOUT)
@pytest.mark.parametrize("seed", _seeds("job"))
def test_kill_whole_job(seed, tmp_path, fault_record):
    trial, out = Trial(seed, one_rank=False), tmp_path / "out"
    run = RankRun(tmp_path, 2, trial.flags(), out)
    trial.wait(run)
    fault_record.update(trial.moment(out))
    run.kill()  # SIGKILL to the process group: every rank at once
    problems = output_dir_problems(out)
    assert not problems, f"{trial}: {problems}\n{run.running.output()[-6000:]}"
    _resume(trial, tmp_path, out)
    fault_record["time_to_exit_s"] = 0.0


@pytest.mark.timeout(3 * RUN_TIMEOUT)
@pytest.mark.parametrize("seed", _seeds("rank"))
def test_kill_one_rank(seed, tmp_path, fault_record):
    trial, out = Trial(seed, one_rank=True), tmp_path / "out"
    run = RankRun(tmp_path, 2, trial.flags(), out)
    pids = wait_until(
        lambda: run.rank_pids() if len(run.rank_pids()) == 2 else None, RUN_TIMEOUT, "both ranks"
    )
    trial.wait(run)
    fault_record.update(trial.moment(out))
    killed_at = time.time()
    try:
        os.kill(pids[trial.victim], signal.SIGKILL)
    except ProcessLookupError:
        pass  # it had exited already: the trial still checks what it left
    result = run.finish(RUN_TIMEOUT)
    survivor = 1 - trial.victim
    to_exit = max(0.0, result.ended[survivor] - killed_at)
    fault_record["time_to_exit_s"] = round(to_exit, 2)
    context = f"{trial}\n{result.output[-6000:]}"
    assert result.codes[trial.victim] in (KILLED, 0), f"{trial}: the victim exited {result.codes}"
    # Killed before it finished: the survivor fails (1); killed after the end, both finished (0).
    allowed = (0, 1) if result.codes[trial.victim] == KILLED else (0,)
    assert result.codes[survivor] in allowed, (
        f"the survivor exited {result.codes[survivor]}: {context}"
    )
    assert to_exit <= BOUND_S, (
        f"the survivor exited {to_exit:.1f} s after the kill (bound {BOUND_S} s): {context}"
    )
    problems = output_dir_problems(out)
    assert not problems, f"{problems}: {context}"
    _resume(trial, tmp_path, out)
