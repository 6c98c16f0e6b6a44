"""Named fault sites: every rank-local step of a save, commit, retention, resume, verification or
export that can fail, listed once, so a test can make any of them fail on any rank.

``FINETUNE_FAULT=<site>:<rank>[:<step>][:<kind>]`` (several, comma-separated) makes
``fault_point(site, step)`` fail on that rank (the ``RANK`` the launcher set; 0 in a plain process),
at every call, or only at calls for that step (the save's step; for resume sites the candidate
checkpoint's). Kinds: ``eio`` (the default) and ``enospc`` raise ``OSError`` with that errno,
``error`` raises ``InjectedFault`` (any other exception), ``kill`` sends SIGKILL to this process,
``hang`` never returns (a syscall stuck in D-state on a dead mount: the thread sleeps for good).
A spec that names no site of ``SITES``, or cannot be parsed, raises ``FaultSpecError`` naming the
variable at the first fault point, so a typo never silently tests nothing. Each injected fault is
announced on stderr (``finetune: FINETUNE_FAULT: …``) with its wall-clock time, so a test can tell
that the site was reached and how long the ranks took to exit after it.

Sites are placed only where the code routes a failure through the agreement primitive
(``distributed.gather_outcomes`` and its wrappers) or records it for the save's agree step: a fault
on one rank must end every rank with the same documented exit code, never a hang. ``tests/faults``
sweeps every site on rank 0 and a non-zero rank in every kind; a unit test checks that the names
used in the package and the keys of ``SITES`` are the same set.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from dataclasses import dataclass

from finetune.io import seams

KINDS = ("eio", "enospc", "error", "kill")
HANG = "hang"  # not in KINDS: the sweep uses it only at sites it polls with a deadline

# name → who reaches it and what fails there. "leader": rank 0 on shared storage (each node's first
# rank with node-local checkpoints); "every rank": all of them. (step) = the site takes a step.
SITES: dict[str, str] = {
    # start-up, before training
    "lease.acquire": "rank 0: taking OUT/.lease (agreed: run_agreed in run.run)",
    "sharing.probe": (
        "the ranks that write a marker file to find who shares OUT (agreed: "
        "sharing.sharing_groups / leads_storage)"
    ),
    "staging.tidy": "leader: removing crashed saves' leftovers at start (agreed, then a warning)",
    "retention.history": (
        "leader: listing OUT's committed checkpoints for the commit order (agreed, at start)"
    ),
    # save: check → snapshot → write → agree → commit → retain (step)
    "save.check_space": "leader: the free-space check before a save (step)",
    "save.snapshot": "every rank: capturing its RNG (leader: trainer_state) in memory (step)",
    "save.clear_staging": (
        "leader: removing a crashed save's staging folder of the same step (step)"
    ),
    "save.makedirs": "the ranks DeepSpeed has create the staging folders (step)",
    "save.host_copy": (
        "every rank, --async_save: planning the host copy of one of its state dicts (step)"
    ),
    "save.copy": (
        "every rank, --async_save: the writer thread copying the snapshot's tensors into host "
        "memory while the next step's forward and backward run (step)"
    ),
    "save.write_rank_files": (
        "every rank: opening and writing one of its checkpoint files (rank files, RNG); on the "
        "background thread under --async_save (step)"
    ),
    "save.fsync": (
        "every rank: fsync of a checkpoint file it wrote; on the background "
        "thread under --async_save (step)"
    ),
    "save.recovery_script": (
        "rank 0: DeepSpeed copying zero_to_fp32.py into the staging root (step)"
    ),
    "save.shared_files": "leader: config, tokenizer and trainer_state.json into staging (step)",
    "save.drop_staging": (
        "leader: removing a failed save's staging folder (reached "
        "only after another failure) (step)"
    ),
    # the output dir's lease, re-read by rank 0 before a commit, a publish, retention and cleanups
    "lease.check": (
        "rank 0: re-reading OUT/.lease before a save, commit, publish, retention or cleanup (step)"
    ),
    # commit (leader): manifest into staging, agree, then rename + latest
    "commit.manifest": "leader: writing and fsyncing manifest.json into the staged folder (step)",
    "commit.rename": "leader: renaming the staged folder into place (step)",
    "commit.latest": "leader: replacing OUT/latest after the rename (step)",
    # retention
    "retention.delete": (
        "leader: deleting checkpoints beyond --save_total_limit after a commit (step)"
    ),
    # resume
    "resume.list": (
        "rank 0 (each leader on node-local storage): listing OUT's checkpoints to resume from"
    ),
    "resume.verify": (
        "every rank: verifying its share of a candidate checkpoint (step: the candidate's)"
    ),
    "resume.read_state": "rank 0: reading the chosen checkpoint's trainer_state.json and manifest",
    "resume.set_aside": "leader: moving checkpoints of an abandoned timeline to OUT/.abandoned",
    "resume.universal": (
        "rank 0: converting a checkpoint of another world size to the universal format"
    ),
    "resume.universal_piece": (
        "rank 0's converter (a child process): before each piece of a universal conversion"
    ),
    "resume.load_rng": "every rank: restoring its RNG state after DeepSpeed's load",
    "resume.truncate_metrics": "rank 0: dropping metrics.jsonl rows past the resumed step",
    "resume.finish_commit": (
        "leader: a run resumed at its last step (already saved) pointing `latest` at it (step)"
    ),
    # consolidated weights (--save_consolidated), inside the save's write step
    "save.consolidated_gather": (
        "every rank: its own part of the consolidated save (held until the gathers end) (step)"
    ),
    "save.consolidated_write": (
        "rank 0: a consolidated safetensors shard just opened, its header written (step)"
    ),
    "save.consolidated_append": (
        "rank 0: mid-tensor, half of a piece of a consolidated shard written (step)"
    ),
    "save.consolidated_close": "rank 0: flushing and fsyncing a finished consolidated shard (step)",
    # --remote_output_dir: the copy to object storage, on each rank's upload thread
    "remote.upload": (
        "every rank: uploading one of its files of a committed checkpoint to the bucket (step)"
    ),
    "remote.commit": (
        "rank 0: uploading a copy's manifest (the remote commit), every data object there (step)"
    ),
    # export (`finetune export`, one process)
    "export.read_rank_file": (
        "export: reading one of DeepSpeed's rank files (step: the checkpoint's)"
    ),
    "export.write": (
        "export: writing or copying a weights file into the export's staging folder (step)"
    ),
    "export.publish": "export: renaming the finished staging folder to OUT (step)",
    # verification (resume's and `finetune verify`'s)
    "verify.read_file": (
        "any process verifying a checkpoint: reading one listed file (step: the checkpoint's)"
    ),
}


class FaultSpecError(ValueError):
    """``FINETUNE_FAULT`` cannot be parsed or names no known site."""


class InjectedFault(RuntimeError):
    """The ``error`` kind: an exception that is neither an OSError nor a ConfigError."""


@dataclass(frozen=True)
class Fault:
    site: str
    rank: int
    step: int | None
    kind: str

    def matches(self, site: str, rank: int, step: int | None) -> bool:
        return self.site == site and self.rank == rank and (self.step is None or self.step == step)


# Names a site had before its module was renamed: a FINETUNE_FAULT spec may still use them.
ALIASES: dict[str, str] = {
    "layout.probe": "sharing.probe",
    "layout.tidy": "staging.tidy",
    "manager.history": "retention.history",
}

_cache: dict[str, tuple[Fault, ...]] = {}


def parse(spec: str) -> tuple[Fault, ...]:
    """The faults of a ``FINETUNE_FAULT`` value; raises FaultSpecError naming the variable."""
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        parts = item.split(":")
        try:
            if not 2 <= len(parts) <= 4:
                raise ValueError("expected <site>:<rank>[:<step>][:<kind>]")
            site, rank, rest = ALIASES.get(parts[0], parts[0]), int(parts[1]), parts[2:]
            step = int(rest.pop(0)) if rest and rest[0].lstrip("-").isdigit() else None
            kind = rest.pop(0) if rest else "eio"
            if rest:
                raise ValueError("expected <site>:<rank>[:<step>][:<kind>]")
            if site not in SITES:
                raise ValueError(f"no fault site {site!r} (sites: {', '.join(sorted(SITES))})")
            if kind not in (*KINDS, HANG):
                raise ValueError(f"no fault kind {kind!r} (kinds: {', '.join((*KINDS, HANG))})")
        except ValueError as e:
            raise FaultSpecError(f"{seams.FAULT}={spec!r}: {item!r}: {e}") from None
        faults.append(Fault(site, rank, step, kind))
    return tuple(faults)


def _active() -> tuple[Fault, ...]:
    spec = os.environ.get(seams.FAULT, "")
    if spec not in _cache:
        _cache[spec] = parse(spec)
    return _cache[spec]


def fault_point(site: str, step: int | None = None) -> None:
    """Fail here if ``FINETUNE_FAULT`` names this site, this rank and (if it gives one) this step.

    A no-op costing one environment lookup otherwise. ``site`` must be a key of ``SITES`` (and a
    string literal: the registry test finds the call sites by reading the source).
    """
    faults = _active()
    if not faults:
        return
    if site not in SITES:
        raise FaultSpecError(f"fault_point({site!r}): not a site in finetune.io.faults.SITES")
    rank = int(os.environ.get("RANK", "0"))
    for fault in faults:
        if fault.matches(site, rank, step):
            _inject(fault, step)


def _inject(fault: Fault, step: int | None) -> None:
    where = f"{fault.site} on rank {fault.rank}" + (f" at step {step}" if step is not None else "")
    print(
        f"finetune: {seams.FAULT}: injecting {fault.kind} at {where} (t={time.time():.3f})",
        file=sys.stderr,
        flush=True,
    )
    message = f"injected fault at {where} ({seams.FAULT})"
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # never return into the site while the signal is being delivered
    if fault.kind == HANG:
        while True:  # like a process in D-state: nothing ends it but the end of the process
            time.sleep(3600)
    if fault.kind == "error":
        raise InjectedFault(message)
    code = errno.ENOSPC if fault.kind == "enospc" else errno.EIO
    raise OSError(code, f"{os.strerror(code)} ({message})")
