"""Disk full for real: a small tmpfs that runs out of space during a periodic save's write, during
a commit, and during the final save, in real 2-rank runs of independent ranks (harness.py).

No failure is injected: each ENOSPC comes from the filesystem. The tmpfs is sized from a measured
checkpoint so the free-space check before each save passes (room for two checkpoints and the
next); a filler file then takes every free byte at the moment the case needs, *after* the check:
  * during a write: once each rank has written its first file of the save (``FINETUNE_SLOW_SAVE``
    keeps each rank's next file half a second away, so the filler always lands before it);
  * during the commit: once every file is staged (``trainer_state.json`` complete) while the leader
    waits before writing manifest.json (``FINETUNE_SLOW_COMMIT``).
Each case checks that every rank exits with the documented code (README "Exit codes") well within
the hang bound, that the error line names the ENOSPC and reports the space that removing the
failed save's staging freed, the free space left and what a save needs, that the staging is gone,
that every committed checkpoint verifies and `latest` names one (``output_dir_problems``), that
DeepSpeed's recovery scripts beside the checkpoints are whole, and that once the filler is
removed `--resume_from_checkpoint auto` trains to the end.

Needs root (to mount a tmpfs): skipped with the reason otherwise.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest

from finetune.checkpoint_format.manifest import MANIFEST, read_manifest
from finetune.checkpoint_format.outdir import LATEST, STAGING, tag_for
from finetune.checkpoint_format.policy import SPACE_MARGIN
from finetune.io import seams

from harness import (
    BOUND_S,
    RUN_TIMEOUT,
    RankRun,
    assert_resumes_to_the_end,
    output_dir_problems,
    run_ranks,
    train_args,
)

pytestmark = [pytest.mark.distributed, pytest.mark.faults]

PAGE = 4096  # tmpfs allocates whole pages
# FINETUNE_SLOW_SAVE / FINETUNE_SLOW_COMMIT: the filler's window, many times its polling
SLOW_S = "0.5"
SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
MODEL_STATES = "zero_pp_rank_{rank}_mp_rank_00_model_states.pt"  # each rank's first file of a save
FREED = re.compile(
    r"removing its staging freed ([\d.]+) MB; ([\d.]+) MB free now, a save needs ~([\d.]+) MB"
)


# --- a small tmpfs and a filler ------------------------------------------------------------------


def _allocated(path: Path) -> int:
    return path.stat().st_blocks * 512


@pytest.fixture(scope="session")
def checkpoint_bytes(tmp_path_factory) -> dict:
    """A checkpoint of the run under test, measured: its manifest's total (what the free-space check
    asks for, times SPACE_MARGIN) and the space it and DeepSpeed's scripts take on a tmpfs."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    tmp = tmp_path_factory.mktemp("dfull-measure")
    with tmpfs(tmp / "mnt", 64 << 20) as mnt:
        r = run_ranks(tmp, 2, train_args(1), mnt / "out")
        assert r.codes == [0, 0], r.output[-6000:]
        folder = mnt / "out" / tag_for(1)
        return {
            "total": read_manifest(folder)["total_bytes"],
            "allocated": sum(_allocated(p) for p in folder.iterdir()),
            "model_states": {
                p.name: p.stat().st_size for p in folder.glob(MODEL_STATES.format(rank="*"))
            },
            "scripts": sum(_allocated(mnt / "out" / s) for s in SCRIPTS),
            "script_sizes": {s: (mnt / "out" / s).stat().st_size for s in SCRIPTS},
        }


def roomy_size(ckpt: dict) -> int:
    """Room for two checkpoints, and a third by the free-space check (what a run of 3 steps with
    --save_total_limit 2 holds before retention deletes), plus 1 MiB for the rest of OUT."""
    need = int(ckpt["total"] * SPACE_MARGIN)
    return -(-(2 * ckpt["allocated"] + need + 2 * ckpt["scripts"] + (1 << 20)) // PAGE) * PAGE


@contextmanager
def tmpfs(mnt: Path, size: int):
    mnt.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size // 1024}k", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs at {mnt}: {proc.stderr.strip() or proc.returncode}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            # still busy: detach now
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class Filler(threading.Thread):
    """Polls ``ready()``; when it holds, writes one file that takes every free byte of the tmpfs,
    so whatever is written next fails with the filesystem's own ENOSPC. ``remove`` frees it."""

    def __init__(self, mnt: Path, ready):
        super().__init__(daemon=True)
        self.path, self.ready = mnt / f"filler-{uuid.uuid4().hex[:6]}", ready
        self.stop, self.filled_at, self.bytes, self.free_after = threading.Event(), None, 0, None

    def run(self) -> None:
        while not self.stop.is_set():
            if self.ready():
                self.fill()
                return
            time.sleep(0.005)

    def fill(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for chunk in (b"\0" * (1 << 20), b"\0" * PAGE, b"\0"):  # then the last partial page
                while True:
                    try:
                        self.bytes += os.write(fd, chunk)
                    except OSError as e:
                        if e.errno != errno.ENOSPC:
                            raise
                        break
        finally:
            os.close(fd)
        self.filled_at = time.time()
        self.free_after = free_bytes(self.path.parent)

    def remove(self) -> None:
        self.stop.set()
        self.join(5)
        self.path.unlink(missing_ok=True)


def first_files_written(out: Path, step: int, ckpt: dict):
    """Each rank has written its first file of this save (its model states, about as large as the
    measured ones); the next comes after a FINETUNE_SLOW_SAVE pause."""
    folder = out / STAGING / tag_for(step)

    def ready() -> bool:
        try:
            return all(
                (folder / name).stat().st_size >= 0.9 * size
                for name, size in ckpt["model_states"].items()
            )
        except OSError:
            return False

    return ready


def staged_completely(out: Path, step: int):
    """Every file of the save is staged: rank 0 writes trainer_state.json last, after each rank's
    files (which DeepSpeed's barrier and the slow writes have long finished)."""
    state = out / STAGING / tag_for(step) / "trainer_state.json"

    def ready() -> bool:
        try:
            json.loads(state.read_text())
            return True
        except (OSError, ValueError):
            return False  # not there, or still being written

    return ready


# --- one case -------------------------------------------------------------------------------------


def run_full(tmp: Path, mnt: Path, steps: int, ready_for, env: dict, flags: tuple = ()):
    """A run into ``mnt/out`` with a filler armed; its outcome and the filler."""
    out = mnt / "out"
    filler = Filler(mnt, ready_for(out))
    filler.start()
    try:
        run = RankRun(tmp, 2, train_args(steps, *flags), out, env=env)
        r = run.finish(RUN_TIMEOUT)
    except BaseException:
        filler.remove()
        raise
    filler.stop.set()
    filler.join(5)
    return r, filler


def check_outcome(
    r, filler, out: Path, codes: list[int], failed: str, committed: list[str], ckpt: dict
) -> dict:
    """The invariants every case shares; the figures for the summary."""
    log = r.output[-8000:]
    assert filler.filled_at is not None, f"the filler never ran (its moment never came)\n{log}"
    assert filler.free_after < PAGE, f"{filler.free_after} bytes still free after filling"
    assert r.codes == codes, f"exit codes {r.codes}, documented {codes}\n{log}"
    to_exit = r.exited_by() - filler.filled_at
    assert 0 < to_exit <= BOUND_S, (
        f"the last rank exited {to_exit:.1f} s after the disk filled (bound {BOUND_S} s)"
    )
    line = next((ln for ln in r.output.splitlines() if re.search(failed, ln)), None)
    assert line, f"no line says /{failed}/\n{log}"
    assert "No space left on device" in line, line
    m = FREED.search(line)
    assert m, f"the failed save's line does not report the freed space: {line}"
    freed, free_now, need = (float(g) * 1e6 for g in m.groups())
    assert freed > 0, line
    # The disk was full when the staging went: what is free now is what its removal freed.
    assert abs(free_now - freed) <= 3 * PAGE + 0.01e6, line
    assert abs(need - ckpt["total"] * SPACE_MARGIN) <= 0.02 * need, line
    assert not (out / STAGING).exists() or not any((out / STAGING).iterdir()), sorted(
        (out / STAGING).iterdir()
    )
    assert sorted(p.name for p in out.glob("global_step*")) == committed, sorted(
        out.glob("global_step*")
    )
    assert (out / LATEST).read_text().strip() == committed[-1]
    for tag in committed:
        assert (out / tag / MANIFEST).is_file()
    problems = output_dir_problems(out)
    assert not problems, f"{problems}\n{log}"
    # never replaced by a copy a full disk truncated
    for script, size in ckpt["script_sizes"].items():
        assert (out / script).stat().st_size == size, (script, (out / script).stat().st_size, size)
    return {
        "time_to_exit_s": round(to_exit, 2),
        "freed_mb": round(freed / 1e6, 3),
        "free_now_mb": round(free_now / 1e6, 3),
        "need_mb": round(need / 1e6, 3),
    }


def resume_after_freeing(tmp: Path, filler: Filler, out: Path) -> None:
    filler.remove()
    assert_resumes_to_the_end(tmp, 2, out)


# --- the cases ------------------------------------------------------------------------------------


def _policies(sampled: str):
    """--on_save_error values: ``sampled`` in `make check`, the other in `make faults`."""
    return pytest.mark.parametrize(
        "policy",
        [
            pytest.param(p, marks=[] if p == sampled else [pytest.mark.faults_long])
            for p in ("continue", "abort")
        ],
    )


def check_branch(r, out: Path, policy: str, phase: str) -> None:
    """The --on_save_error branch every rank took after step 2's save failed (all exit 1 either way:
    under continue the disk stays full, so the check refuses the final save up front)."""
    said = {"continue": "training on", "abort": "stopping"}[policy]
    assert re.search(
        rf"{said}: {phase} of global_step2 failed on rank .*\(--on_save_error {policy}\)", r.output
    )
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(row["step"] for row in rows if "loss" in row) == (3 if policy == "continue" else 2)
    refused = re.search(
        r"final save failed: not saving global_step3: not enough free space .*MB free, need ~",
        r.output,
    )
    assert bool(refused) == (policy == "continue"), r.output[-6000:]


@_policies("continue")
@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_periodic_save_write_runs_out_of_space(tmp_path, checkpoint_bytes, fault_record, policy):
    """The disk fills after step 2's free-space check, while its files are written: every rank
    learns it and trains on (--on_save_error continue, the default) or stops (abort). Step 1
    stays committed and `latest`."""
    fault_record["tmpfs_bytes"] = roomy_size(checkpoint_bytes)
    with tmpfs(tmp_path / "mnt", fault_record["tmpfs_bytes"]) as mnt:
        r, filler = run_full(
            tmp_path,
            mnt,
            3,
            lambda out: first_files_written(out, 2, checkpoint_bytes),
            {seams.SLOW_SAVE: SLOW_S},
            ("--on_save_error", policy),
        )
        try:
            out = mnt / "out"
            fault_record.update(
                check_outcome(
                    r,
                    filler,
                    out,
                    [1, 1],
                    r"save of global_step2 failed on rank",
                    ["global_step1"],
                    checkpoint_bytes,
                )
            )
            check_branch(r, out, policy, "save")
            resume_after_freeing(tmp_path, filler, out)
        finally:
            filler.remove()


@_policies("abort")
@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_commit_runs_out_of_space(tmp_path, checkpoint_bytes, fault_record, policy):
    """Every file of step 2 is staged; the disk fills before manifest.json is written: the commit
    fails on rank 0, every rank stops (abort) or trains on (continue), step 1 stays `latest`, and
    removing the staging frees a whole checkpoint."""
    fault_record["tmpfs_bytes"] = roomy_size(checkpoint_bytes)
    with tmpfs(tmp_path / "mnt", fault_record["tmpfs_bytes"]) as mnt:
        r, filler = run_full(
            tmp_path,
            mnt,
            3,
            lambda out: staged_completely(out, 2),
            {seams.SLOW_COMMIT: SLOW_S},
            ("--on_save_error", policy),
        )
        try:
            out = mnt / "out"
            fault_record.update(
                check_outcome(
                    r,
                    filler,
                    out,
                    [1, 1],
                    r"commit of global_step2 failed on rank 0",
                    ["global_step1"],
                    checkpoint_bytes,
                )
            )
            check_branch(r, out, policy, "commit")
            # The staged folder held the whole checkpoint but its manifest, and DeepSpeed's scripts.
            whole = checkpoint_bytes["allocated"] - PAGE + checkpoint_bytes["scripts"]
            assert abs(fault_record["freed_mb"] * 1e6 - whole) <= 2 * PAGE + 0.01e6, (
                fault_record,
                whole,
            )
            resume_after_freeing(tmp_path, filler, out)
        finally:
            filler.remove()


@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_final_save_write_runs_out_of_space(tmp_path, checkpoint_bytes, fault_record):
    """The disk fills after the final save's check, while its files are written: every rank exits
    1; steps 1 and 2 stay committed, `latest` names step 2."""
    fault_record["tmpfs_bytes"] = roomy_size(checkpoint_bytes)
    with tmpfs(tmp_path / "mnt", fault_record["tmpfs_bytes"]) as mnt:
        r, filler = run_full(
            tmp_path,
            mnt,
            3,
            lambda out: first_files_written(out, 3, checkpoint_bytes),
            {seams.SLOW_SAVE: SLOW_S},
        )
        try:
            out = mnt / "out"
            fault_record.update(
                check_outcome(
                    r,
                    filler,
                    out,
                    [1, 1],
                    r"final save failed: save of global_step3 failed "
                    r"on rank",
                    ["global_step1", "global_step2"],
                    checkpoint_bytes,
                )
            )
            resume_after_freeing(tmp_path, filler, out)
        finally:
            filler.remove()


def shard_begun(out: Path, step: int):
    """Rank 0 has opened this save's consolidated shard and written its header (it then pauses:
    FINETUNE_SLOW_SAVE), after every rank's files, RNG and the shared files of the save."""
    shard = out / STAGING / tag_for(step) / "model.safetensors"

    def ready() -> bool:
        try:
            return shard.stat().st_size > 0
        except OSError:
            return False

    return ready


@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_consolidated_write_runs_out_of_space_and_the_partitioned_checkpoint_commits(
    tmp_path, checkpoint_bytes, fault_record
):
    """The disk fills, to the last byte, as rank 0 begins step 2's safetensors
    (--save_consolidated). The optional file is written last, after every rank's files, RNG and
    the shared files, so it is the only write that fails: one warning, its partial file removed,
    step 2 committed partitioned (`consolidated: false`, verifies), training goes on (the disk
    freed meanwhile), exit 0. Written first, it would take the space another rank's RNG file
    needs, and the save would fail; a writer whose cleanup raised on rank 0 alone would leave the
    others waiting in the agreement."""
    # and step 3's safetensors
    fault_record["tmpfs_bytes"] = roomy_size(checkpoint_bytes) + (8 << 20)
    with tmpfs(tmp_path / "mnt", fault_record["tmpfs_bytes"]) as mnt:
        out = mnt / "out"
        filler = Filler(mnt, shard_begun(out, 2))
        committed = out / tag_for(2) / MANIFEST
        freer = threading.Thread(
            target=lambda: (wait_for(committed.is_file), filler.remove()), daemon=True
        )
        filler.start()
        freer.start()
        try:
            r = run_ranks(
                tmp_path,
                2,
                train_args(3, "--save_consolidated"),
                out,
                env={seams.SLOW_SAVE: SLOW_S},
            )
        finally:
            filler.remove()
        log = r.output[-8000:]
        assert filler.filled_at is not None and filler.free_after < PAGE, log
        assert r.codes == [0, 0], f"exit codes {r.codes}\n{log}"
        said = [
            line
            for line in r.output.splitlines()
            if "consolidated weights of global_step2 not written" in line
        ]
        assert len(said) == 1 and "No space left on device" in said[0], said or log
        assert "Traceback" not in r.output, log
        manifest = read_manifest(out / tag_for(2))
        assert manifest["consolidated"] is False and not list(
            (out / tag_for(2)).glob("*.safetensors*")
        )
        # the next save, with room again
        assert read_manifest(out / tag_for(3))["consolidated"] is True
        assert (out / LATEST).read_text().strip() == tag_for(3)
        problems = output_dir_problems(out)
        assert not problems, f"{problems}\n{log}"
        fault_record["time_to_exit_s"] = None


def wait_for(predicate, timeout: float = RUN_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.005)


@pytest.mark.faults_long
@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_a_save_that_would_not_fit_is_refused_before_writing(
    tmp_path, checkpoint_bytes, fault_record
):
    """No filler: a tmpfs with room for two checkpoints and half of a third. The final save is
    refused by the free-space check before anything is written (every rank exits 1, no staging);
    once the tmpfs is grown (remount), `auto` resumes from step 2 and finishes."""
    small = (
        -(
            -(
                2 * checkpoint_bytes["allocated"]
                + checkpoint_bytes["total"] // 2
                + 2 * checkpoint_bytes["scripts"]
                + (1 << 20)
            )
            // PAGE
        )
        * PAGE
    )
    fault_record["tmpfs_bytes"] = small
    with tmpfs(tmp_path / "mnt", small) as mnt:
        out = mnt / "out"
        r = run_ranks(tmp_path, 2, train_args(3), out)
        log = r.output[-8000:]
        assert r.codes == [1, 1], f"exit codes {r.codes}\n{log}"
        m = re.search(
            r"final save failed: not saving global_step3: not enough free space in \S+ "
            r"\(rank 0: ([\d.]+) MB free, need ~([\d.]+) MB\)",
            r.output,
        )
        assert m, log
        free, need = (float(g) * 1e6 for g in m.groups())
        assert free < need and abs(need - checkpoint_bytes["total"] * SPACE_MARGIN) <= 0.02 * need
        assert not (out / STAGING).exists(), sorted((out / STAGING).rglob("*"))
        assert sorted(p.name for p in out.glob("global_step*")) == ["global_step1", "global_step2"]
        assert (out / LATEST).read_text().strip() == "global_step2"
        assert not output_dir_problems(out)
        fault_record.update({"free_mb": round(free / 1e6, 3), "need_mb": round(need / 1e6, 3)})
        grown = subprocess.run(
            ["mount", "-o", f"remount,size={roomy_size(checkpoint_bytes) // 1024}k", str(mnt)],
            capture_output=True,
            text=True,
        )
        assert grown.returncode == 0, grown.stderr
        assert_resumes_to_the_end(tmp_path, 2, out)
