"""The world a history happens in: two output dirs (two allocations' disks: ``A`` and ``B``) and
one bucket prefix, and a run in it as the real code runs one, minus the model and the ranks.

A run (``World.run``) opens the prefix (probe, lease, stale uploads), tidies OUT, plans the
checkpoints' side of a start (``finetune.build.plan_checkpoints``: the prefix's history checked,
the resume over OUT and the bucket, a rollback's later commits set aside), builds the real
Checkpointer on a fake DeepSpeed engine (tests/checkpoint/fake_engine.py) with the real copy to the
bucket, and goes through the trainer's step boundaries (``at_step``, ``at_end``) to its last step;
its exit code is the one run.py would return. The bucket is in memory (memory_s3.py); OUT is a
real folder.

What a real job's timing makes random is made fixed, so a history replays the same way: the copy's
upload thread moves only while the main thread waits for it (``settle``), and the copy's and the
start-up's clocks advance only when they sleep.

A fault is ``FINETUNE_FAULT``'s, on rank 0 (the only one). A ``kill`` is modelled at the moment it
happens: OUT and the bucket are snapshotted there, everything the process does afterwards (its
``finally`` blocks, its thread's requests) is discarded, and the next run finds the snapshot; the
dead run's lease on the prefix is then gone, as a dead holder's is taken over
(tests/remote/test_remote_lease.py tests the takeover itself). A ``hang`` stops the thread (or the
run) where it is, for good.
"""

from __future__ import annotations

import itertools
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from history.memory_s3 import COPY_THREAD, Bucket, MemoryS3Client, Process, ProcessGone

from finetune.checkpoint_format.manifest import MANIFEST
from finetune.checkpoint_format.outdir import OutputDir, committed
from finetune.config import ConfigError
from finetune.io import faults
from finetune.remote.lease import LEASE, RemoteLeaseLost
from finetune.remote.prefix import RemoteUnavailable

BUCKET = "history"
URI = f"s3://{BUCKET}/run"
SAVE_STEPS = 2
DEADLINE_S = 5.0  # the copy's: a thread without progress this long (on its clock) is given up
KILLED = "killed"
# The fault sites a start reaches (a fault there fails the site's first call); the others are a
# save's, its commit's, retention's and the copy's, and fail at one step of the run.
START_SITES = (
    "staging.tidy",
    "retention.history",
    "resume.list",
    "resume.verify",
    "resume.read_state",
    "resume.set_aside",
)


class Killed(BaseException):
    """The process was killed here: nothing after this point counts."""


@dataclass(frozen=True)
class Start:
    """One run: on which OUT, from what (``fresh``, ``auto``, ``local:<step>``, ``s3:<step>``),
    for how many steps past where it starts, with which --save_total_limit, a fault
    (``site:at:kind``: at the ``at``-th step of the run; a start-up site at its first call) and a
    bucket outage from the ``outage_at``-th step on; ``restart``: a requeued job's start."""

    out: str
    spec: str
    steps: int = 2
    limit: int | None = None
    fault: str | None = None
    outage_at: int | None = None
    restart: bool = True

    def __str__(self) -> str:
        extra = [f"limit={self.limit}"] if self.limit else []
        extra += [f"fault={self.fault}"] if self.fault else []
        extra += [f"outage_at={self.outage_at}"] if self.outage_at is not None else []
        extra += [] if self.restart else ["first start"]
        return f"run on {self.out} from {self.spec} for {self.steps} steps " + " ".join(extra)


@dataclass
class Outcome:
    code: int | str  # the exit code, or KILLED
    run_id: str
    started: bool = False  # the start-up finished: the run trained from ``started_from``
    started_from: str | None = None  # the save id resumed from (None: a fresh start)
    commits: list[str] = field(default_factory=list)  # save ids committed in OUT, in order
    error: str = ""


class Clock:
    """A monotonic clock that moves when its owner sleeps: a wait of minutes takes none."""

    def __init__(self, on_sleep=lambda: None) -> None:
        self.offset = 0.0
        self.on_sleep = on_sleep

    def monotonic(self) -> float:
        return time.monotonic() + self.offset

    def sleep(self, seconds: float) -> None:
        self.on_sleep()
        self.offset += seconds

    def namespace(self) -> SimpleNamespace:
        return SimpleNamespace(
            monotonic=self.monotonic, sleep=self.sleep, time=time.time, strftime=time.strftime
        )


class World:
    """Two OUTs and a bucket; ``run`` runs one start in them."""

    def __init__(self, root: Path, module: torch.nn.Module, monkeypatch: pytest.MonkeyPatch):
        self.root = root
        self.module = module
        self.outs = {name: root / name for name in ("A", "B")}
        self.bucket = Bucket()
        self.process = Process()
        self.copy = None  # the running process's RemoteCopy
        self.killed: dict | None = None  # the snapshot taken where the process was killed
        self.hung = threading.Event()
        self.run_ids = (f"run{i:03d}" for i in itertools.count(1))
        self.outage_at: int | None = None
        self._patch(monkeypatch)

    # --- what the real code is given -------------------------------------------------------------

    def _patch(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from finetune.io import remote

        monkeypatch.setattr(
            remote, "make_client", lambda: MemoryS3Client(self.bucket, self.process)
        )
        original = faults._inject

        def inject(fault: faults.Fault, step: int | None) -> None:
            if fault.kind == "kill":
                self._kill()
            if fault.kind == faults.HANG:
                self._hang()
            original(fault, step)

        monkeypatch.setattr(faults, "_inject", inject)
        monkeypatch.setattr("finetune.remote.copy.time", Clock(self._settle).namespace())
        monkeypatch.setattr("finetune.remote.prefix.time", Clock().namespace())
        monkeypatch.setattr(
            "finetune.checkpoint.resume.check_checkpoint_model", lambda folder, args: None
        )
        monkeypatch.delenv("RANK", raising=False)
        monkeypatch.delenv("FINETUNE_FAULT", raising=False)
        self.env = monkeypatch
        previous = threading.excepthook

        def quiet(args: threading.ExceptHookArgs) -> None:
            if not issubclass(args.exc_type, (Killed, ProcessGone)):  # a dead process's thread
                previous(args)

        monkeypatch.setattr(threading, "excepthook", quiet)

    def _kill(self) -> None:
        """Where the process dies: what OUT and the bucket hold now is what the next run finds."""
        if self.killed is None:
            self.killed = {
                "objects": self.bucket.snapshot(),
                "out": self._copy_out(),
            }
        self.process.end()
        raise Killed()

    def _hang(self) -> None:
        if threading.current_thread().name == COPY_THREAD:
            self.hung.set()
            while not self.process.gone:
                time.sleep(0.01)
            raise Killed()
        self._kill()  # the main thread hung: the job is killed from outside, at this point

    def _copy_out(self) -> Path | None:
        out = self._out
        if not out.exists():
            return None
        snap = self.root / f".snapshot-{out.name}"
        shutil.rmtree(snap, ignore_errors=True)
        shutil.copytree(out, snap, symlinks=True)
        return snap

    def _settle(self) -> None:
        """Let the copy's thread do what it has queued, until it is idle (or hung, or killed)."""
        copy = self.copy
        if copy is None:
            return
        self.process.turns.set()
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if self.killed is not None:
                    raise Killed()
                if self.hung.is_set():
                    return
                with copy._lock:
                    idle = copy._waiting is None and copy._commit is None
                if idle and copy._doing is None:
                    return
                time.sleep(0.001)
            raise AssertionError(f"the copy's thread did not settle: {copy._doing}")
        finally:
            self.process.turns.clear()

    # --- a run -----------------------------------------------------------------------------------

    def run(self, start: Start) -> Outcome:
        from checkpoint.fake_engine import FakeEngine, FakeSampler, FakeTokenizer, make_cfg

        from finetune.build import plan_checkpoints
        from finetune.checkpoint.checkpointer import Checkpointer
        from finetune.checkpoint.staging import Layout, tidy_storage
        from finetune.checkpoint_format.state import TrainingState
        from finetune.remote.prefix import open_remote

        self.process = Process()
        self.killed = None
        self.hung.clear()
        self.copy = None
        self._out = self.outs[start.out]
        run_id = next(self.run_ids)
        outcome = Outcome(code=1, run_id=run_id)
        site, at, kind = start.fault.split(":") if start.fault else ("", "", "")
        # a start-up site fails at its first call; a save's at the run's ``at``-th step
        self.env.setenv("FINETUNE_FAULT", f"{site}:0:{kind}" if site in START_SITES else "")
        if start.restart:  # a requeued SLURM job
            self.env.setenv("SLURM_RESTART_COUNT", "1")
            self.env.setenv("SLURM_JOB_ID", "7")
        else:
            self.env.delenv("SLURM_RESTART_COUNT", raising=False)
        flags: dict[str, object] = {
            "save_steps": SAVE_STEPS,
            "remote_output_dir": URI,
            "save_total_limit": start.limit,
        }
        spec = self._spec(start)
        if spec is not None:
            flags["resume_from_checkpoint"] = spec
        prefix = None
        try:
            cfg = make_cfg(self._out, **flags)
            self.bucket.outage = start.outage_at == 0  # down from the start
            prefix = open_remote(URI, run_id, self._out)
            storage = OutputDir(self._out)
            layout = Layout([[0]], False)
            tidy_storage(storage, layout)
            cfg, plan, copy, seq = plan_checkpoints(cfg, storage, layout, prefix)
            # the start is decided and done (a rollback's later commits set aside): what follows
            # continues it, even if it is killed before its first step
            outcome.started = True
            outcome.started_from = _save_id(plan.folder) if plan is not None else None
            self.copy = copy
            copy.deadline_s = DEADLINE_S
            progress = TrainingState()
            if plan is not None:
                progress.global_step = plan.saved["global_step"]
            checkpoints = Checkpointer(
                storage,
                cfg.ckpt,
                layout,
                engine=FakeEngine(self.module),
                states={"progress": progress, "sampler": FakeSampler()},
                tokenizer=FakeTokenizer(),
                run_info={"args": {}},
                run_id=run_id,
                plan=plan,
                seen_seq=seq,
                remote=copy,
            )
            self._settle()
            first = progress.global_step
            until = first + start.steps
            if site and site not in START_SITES:
                self.env.setenv("FINETUNE_FAULT", f"{site}:0:{first + int(at)}:{kind}")
            code = None
            for step in range(first + 1, until + 1):
                if start.outage_at is not None and step >= first + start.outage_at:
                    self.bucket.outage = True
                progress.global_step = step
                code = checkpoints.at_step(step, until)
                self._settle()
                self._note_commits(outcome)
                if code:
                    break
            if code is None:
                code = checkpoints.at_end(until)
                self._settle()
                self._note_commits(outcome)
            outcome.code = code
        except (Killed, ProcessGone):
            outcome.code = KILLED
        except ConfigError as e:
            outcome.code, outcome.error = 2, str(e)
        except RemoteUnavailable as e:
            outcome.code, outcome.error = 75, str(e)
        except RemoteLeaseLost as e:
            outcome.code, outcome.error = 3, str(e)
        except Exception as e:  # noqa: BLE001 — a crash: exit 1 with its traceback
            outcome.code, outcome.error = 1, f"{type(e).__name__}: {e}"
        finally:
            self.bucket.outage = False
            if self.killed is not None:
                outcome.code = KILLED
                self._restore()
                if prefix is not None and prefix.lease is not None:
                    prefix.lease._stop.set()  # a dead process's heartbeat is dead
            elif prefix is not None:
                prefix.release()
            self.process.end()
            self._end_thread(self.copy)
            self.process = Process()  # whoever looks at the world next (a check, `finetune ls`)
            self.copy = None
        self._note_commits(outcome)
        return outcome

    def _note_commits(self, outcome: Outcome) -> None:
        """The run's own commits in OUT (a fetched one is an earlier run's), noted at each step
        boundary: retention may delete one at a later step."""
        for c in sorted(committed(OutputDir(self._out)), key=lambda c: c.order_key):
            mine = (c.save_id or "").startswith(f"{outcome.run_id}-")
            if mine and c.save_id not in outcome.commits:
                outcome.commits.append(c.save_id)

    @staticmethod
    def _end_thread(copy) -> None:
        """The dead process's copy thread, woken to make one more request, which ends it."""
        if copy is not None:
            with copy._lock:
                copy._waiting = ("global_step0", {})
                copy._lock.notify_all()
            copy._thread.join(timeout=5)

    def _spec(self, start: Start) -> str | None:
        if start.spec == "fresh":
            return None
        if start.spec == "auto":
            return "auto"
        where, step = start.spec.split(":")
        if where == "local":
            return str(self.outs[start.out] / f"global_step{step}")
        return f"{URI}/global_step{step}"

    def _restore(self) -> None:
        """After a kill: OUT and the bucket as they were when it happened; the dead run's lease
        taken over."""
        assert self.killed is not None
        self.process.end()
        self.bucket.restore(self.killed["objects"])
        shutil.rmtree(self._out, ignore_errors=True)
        if self.killed["out"] is not None:
            shutil.move(self.killed["out"], self._out)
        self.bucket.objects.pop((BUCKET, f"run/{LEASE}"), None)


def _save_id(folder: Path) -> str | None:
    import json

    data = json.loads((folder / MANIFEST).read_text())
    return data.get("save_id")


def disturb(out: Path, how: str, pick: int) -> str | None:
    """What happens to a disk between runs: ``damage`` (16 bytes of a rank file of a committed
    checkpoint flipped), ``delete`` (a checkpoint deleted by hand) or ``replace disk`` (the whole
    OUT gone). What was done, or None when there was nothing to do it to."""
    if how == "replace disk":
        shutil.rmtree(out, ignore_errors=True)
        return f"replace disk {out.name}"
    found = sorted(committed(OutputDir(out)), key=lambda c: c.order_key)
    if not found:
        return None
    tag = found[pick % len(found)].tag
    if how == "delete":
        shutil.rmtree(out / tag)
    else:
        path = sorted((out / tag).glob("*optim_states.pt"))[0]
        data = bytearray(path.read_bytes())
        middle = len(data) // 2
        data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
        path.write_bytes(bytes(data))
    return f"{how} {out.name}/{tag}"
