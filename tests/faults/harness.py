"""The fault sweep's machinery: independent ranks, each site's documented outcome, and the
invariants every run must leave behind.

Reusable by other tests: ``RankRun`` / ``run_ranks`` (ranks that no launcher kills when a peer dies,
as under srun or mpirun, so a rank left waiting shows as a hang), ``output_dir_problems`` (what a
crash at any instant may never leave) and ``assert_resumes_to_the_end``.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from finetune.checkpoint_format.manifest import MANIFEST, read_manifest
from finetune.checkpoint_format.outdir import ABANDONED, LATEST, TRASH, step_of, tag_for
from finetune.io import seams
from finetune.io.faults import HANG, KINDS

from conftest import SPAWN_RANKS, Running, child_env, free_port, zygote

DDP_TIMEOUT = 20  # every run's --ddp_timeout: a rank stuck in a collective fails after this long
BOUND_S = 2 * DDP_TIMEOUT + 20  # a fault (or a kill) → the last rank exited
RUN_TIMEOUT = 240  # one launch, start-up included: past it the test fails as a hang
MAX_STEPS = 3
KILLED = -9  # a rank's exit code when SIGKILL ended it

# Tiny and quick: the embedded model, a few short sequences, a save every step, retention at step 3.
TRAIN = (
    "--save_checkpoint",
    "--save_steps",
    "1",
    "--save_total_limit",
    "2",
    "--logging_steps",
    "1",
    "--max_train_samples",
    "64",
    "--max_eval_samples",
    "8",
    "--per_device_train_batch_size",
    "4",
    "--max_seq_length",
    "32",
    "--ddp_timeout",
    str(DDP_TIMEOUT),
    "--resume_from_checkpoint",
    "auto",
)


def train_args(max_steps: int = MAX_STEPS, *extra: str) -> tuple[str, ...]:
    return ("--max_steps", str(max_steps), *TRAIN, *extra)


# --- launching ---------------------------------------------------------------------------------


@dataclass
class Ranks:
    """How one launch of independent ranks ended."""

    # each rank's exit code (negative: the signal that killed it); None: no report (all killed)
    codes: list
    ended: list  # wall-clock time each rank exited
    output: str
    out_dir: Path

    def fired(self, site: str = "") -> list[float]:
        """Wall-clock times at which an injected fault (at ``site``, or any) fired: faults.py
        announces each."""
        pattern = (
            rf"{seams.FAULT}: injecting \w+ at {re.escape(site) if site else ''}.*\(t=([0-9.]+)\)"
        )
        return [float(t) for t in re.findall(pattern, self.output)]

    def exited_by(self) -> float | None:
        return max(self.ended) if self.ended and None not in self.ended else None


class RankRun:
    """``nprocs`` ranks started by spawn_ranks.py in one process group (see conftest.Running).

    ``fork``: the ranks are forked from this test process's zygote, which has imported torch,
    transformers, DeepSpeed and datasets once (spawn_ranks.py --fork --zygote, conftest.zygote):
    what every test here looks at starts after the imports, which are ~60 % of a short run's CPU.
    False: each rank is a fresh ``python -m finetune``, for signals that must land while a rank is
    still importing."""

    def __init__(
        self,
        tmp: Path,
        nprocs: int,
        args: tuple,
        out: Path,
        env: dict | None = None,
        fork: bool = True,
    ):
        tmp.mkdir(parents=True, exist_ok=True)
        self.report = tmp / f"ranks-{free_port()}.json"
        self.nprocs = nprocs
        cmd = [
            sys.executable,
            str(SPAWN_RANKS),
            str(nprocs),
            str(self.report),
            str(free_port()),
            *(["--fork", "--zygote", str(zygote())] if fork else []),
            "--",
            *args,
            "--output_dir",
            str(out),
        ]
        self.running = Running(cmd, tmp, child_env(env), out)
        self.out = out

    def rank_pids(self) -> dict[int, int]:
        """{RANK: pid} once every rank is started (spawn_ranks.py writes them), else {}."""
        try:
            pids = json.loads(Path(f"{self.report}.pids").read_text())
        except FileNotFoundError:
            return {}
        return {int(r): pid for r, pid in pids.items()}

    def finish(self, timeout: float = RUN_TIMEOUT) -> Ranks:
        result = self.running.finish(timeout)
        report = (
            json.loads(self.report.read_text())
            if self.report.exists()
            else {"codes": [], "ended": []}
        )
        return Ranks(report["codes"], report["ended"], result.output, self.out)

    def kill(self) -> None:
        self.running.kill()


def run_ranks(tmp: Path, nprocs: int, args: tuple, out: Path, env: dict | None = None) -> Ranks:
    return RankRun(tmp, nprocs, args, out, env).finish()


# --- invariants --------------------------------------------------------------------------------


def verify_code(folder: Path) -> tuple[int, str]:
    """`finetune verify FOLDER`'s exit code and output, run in this process (the CLI's own code
    path: a subprocess per folder would cost seconds of imports)."""
    from finetune.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        code = main(["verify", str(folder)])
    return code, buf.getvalue()


def output_dir_problems(out: Path) -> list[str]:
    """What no crash, failure or kill may ever leave in an output dir: a `latest` naming anything
    but a checkpoint that verifies; a folder with a manifest (committed, set aside, or staged and
    committed but never renamed) that does not verify; a checkpoint's name without a manifest."""
    from finetune.weights.universal import verify_universal

    problems = []
    latest = out / LATEST
    if latest.exists():
        tag = latest.read_text().strip()
        code, text = verify_code(out / tag) if (out / tag).is_dir() else (None, "no such folder")
        if code != 0:
            problems.append(
                f"latest names {tag!r}, which does not verify ({code}): {text.strip()[-500:]}"
            )
    for manifest in sorted(out.rglob(MANIFEST)):
        folder = manifest.parent
        if _being_deleted(folder.relative_to(out)):
            continue
        if folder.name.startswith("universal"):  # a conversion's own manifest (resume.py)
            source = read_manifest(folder.parent) or {}
            found = verify_universal(folder, source.get("save_id"))
            if found:
                problems.append(
                    f"{folder.relative_to(out)}: the conversion does not verify: {found[:3]}"
                )
            continue
        code, text = verify_code(folder)
        if code != 0:
            problems.append(
                f"{folder.relative_to(out)} has a manifest but does not verify ({code}): "
                f"{text.strip()[-500:]}"
            )
    for folder in out.glob("global_step*"):
        if step_of(folder.name) is not None and not (folder / MANIFEST).is_file():
            problems.append(
                f"{folder.name}: a checkpoint's name without a manifest "
                "(an incomplete folder in place)"
            )
    return problems


def _being_deleted(rel: Path) -> bool:
    """Out of the tag namespace on purpose: a retention's trash, the old folder of a same-tag swap,
    a checkpoint set aside because it did not verify. A crash may leave them half-deleted; the next
    start removes the first two (storage.py)."""
    return (
        rel.parts[0].startswith(TRASH)
        or any(p.endswith(".replaced") for p in rel.parts)
        or (rel.parts[0] == ABANDONED and "-unverified-" in rel.parts[1])
    )


def assert_resumes_to_the_end(
    tmp: Path, nprocs: int, out: Path, max_steps: int = MAX_STEPS, extra: tuple = ()
) -> Ranks:
    """`--resume_from_checkpoint auto` to the last step: every rank exits 0, the final checkpoint is
    `latest` and verifies, and the output dir keeps its invariants."""
    r = run_ranks(tmp, nprocs, train_args(max_steps, *extra), out)
    assert r.codes == [0] * nprocs, (
        f"the resume after the fault exited {r.codes}\n{r.output[-6000:]}"
    )
    final = tag_for(max_steps)
    assert (out / LATEST).read_text().strip() == final, (out / LATEST).read_text()
    problems = output_dir_problems(out)
    assert not problems, problems
    return r


# --- each site's documented outcome ---------------------------------------------------------------

LEADER, EVERY = "leader", "every rank"
FRESH, RESUME, RESHAPE = "fresh", "resume", "reshape"


def _codes(code: int) -> dict[str, int]:
    return {"eio": code, "enospc": code, "error": code}


NO_CONSOLIDATED = r"consolidated weights of global_step{step} not written"
CONSOLIDATED = ("--save_consolidated",)
ASYNC = ("--async_save",)
SAVE_FAILED = (
    r"(save|commit) of global_step{step} failed on rank {rank}"
    r"|not saving global_step{step}: .*rank {rank}"
)


@dataclass(frozen=True)
class Site:
    """Where a site is reached in the sweep, and how a failure there ends.

    ``scenario``: FRESH, a 3-step run into an empty OUT, saving every step (periodic saves at
    steps 1 and 2, the final one at 3, retention from step 3); RESUME, the same resumed with
    ``auto`` from an OUT holding global_step1 and global_step2 of a 2-rank run; RESHAPE, that OUT
    resumed on one rank (a universal conversion). ``codes``: by kind, every rank's exit code; with
    ``kill`` the killed rank dies and every other one exits 1. ``says``: what every failure there
    logs (a regex; {step} and {rank} filled in). ``before``: another fault that makes the run reach
    the site. ``steps``: the run's --max_steps. ``flags``: what the run needs to reach the site.
    """

    scenario: str
    reached_by: str
    step: int | None
    codes: dict
    says: str = ""
    before: str = ""
    steps: int = MAX_STEPS
    flags: tuple = ()
    # reached in a child process (the universal conversion): kill ends the child, not the rank
    child: bool = False


# Exit codes (README "Exit codes"): 0 where the failure is agreed and training goes on (a periodic
# save under --on_save_error continue, a tidy-up that only warns, a resume that falls back to an
# older checkpoint); 1 for a runtime failure every rank learns of; 2 for bad input (an output dir
# whose lease or probe file cannot be written).
EXPECTED: dict[str, Site] = {
    "lease.acquire": Site(FRESH, LEADER, None, {"eio": 2, "enospc": 2, "error": 1}),
    "sharing.probe": Site(FRESH, LEADER, None, _codes(2), "cannot write"),
    "staging.tidy": Site(FRESH, LEADER, None, _codes(0), "could not tidy leftovers"),
    "retention.history": Site(FRESH, LEADER, None, _codes(1)),
    "save.check_space": Site(FRESH, LEADER, 2, _codes(0), SAVE_FAILED),
    "save.snapshot": Site(FRESH, EVERY, 2, _codes(0), SAVE_FAILED),
    "save.clear_staging": Site(FRESH, LEADER, 2, _codes(0), SAVE_FAILED),
    "save.makedirs": Site(FRESH, EVERY, 2, _codes(0), SAVE_FAILED),
    "save.host_copy": Site(FRESH, EVERY, 2, _codes(0), SAVE_FAILED, flags=ASYNC),
    "save.copy": Site(FRESH, EVERY, 2, _codes(0), SAVE_FAILED, flags=ASYNC),
    "save.write_rank_files": Site(FRESH, EVERY, 2, _codes(0), SAVE_FAILED),
    "save.fsync": Site(FRESH, EVERY, 2, _codes(0), SAVE_FAILED),
    "save.recovery_script": Site(FRESH, LEADER, 2, _codes(0), SAVE_FAILED),
    "save.shared_files": Site(FRESH, LEADER, 2, _codes(0), SAVE_FAILED),
    "save.drop_staging": Site(
        FRESH,
        LEADER,
        2,
        _codes(0),
        r"could not remove .staging/global_step{step}",
        before="save.write_rank_files:1:{step}",
    ),
    # The consolidated weights alone fail: the partitioned checkpoint commits without them
    # (docs/CHECKPOINTS.md).
    "save.consolidated_gather": Site(
        FRESH, EVERY, 2, _codes(0), NO_CONSOLIDATED, flags=CONSOLIDATED
    ),
    "save.consolidated_write": Site(
        FRESH, LEADER, 2, _codes(0), NO_CONSOLIDATED, flags=CONSOLIDATED
    ),
    "save.consolidated_append": Site(
        FRESH, LEADER, 2, _codes(0), NO_CONSOLIDATED, flags=CONSOLIDATED
    ),
    "save.consolidated_close": Site(
        FRESH, LEADER, 2, _codes(0), NO_CONSOLIDATED, flags=CONSOLIDATED
    ),
    # The lease cannot be re-read before the save: it fails (nothing is written or published).
    "lease.check": Site(
        FRESH, LEADER, 2, _codes(0), r"could not check .*'s lease before saving global_step{step}"
    ),
    "commit.manifest": Site(FRESH, LEADER, 2, _codes(0), SAVE_FAILED),
    "commit.rename": Site(FRESH, LEADER, 2, _codes(0), SAVE_FAILED),
    # Renamed into place: committed (resume follows the commit order), `latest` stale until the next
    # commit.
    "commit.latest": Site(
        FRESH, LEADER, 2, _codes(0), "committed global_step{step}, but `latest` was not updated"
    ),
    "retention.delete": Site(FRESH, LEADER, 3, _codes(0), "could not delete"),
    "resume.list": Site(RESUME, LEADER, None, _codes(1)),
    "resume.verify": Site(RESUME, EVERY, 2, _codes(0), "not resuming from global_step{step}"),
    "verify.read_file": Site(RESUME, EVERY, 2, _codes(0), "not resuming from global_step{step}"),
    "resume.read_state": Site(RESUME, LEADER, None, _codes(1)),
    "resume.set_aside": Site(RESUME, LEADER, None, _codes(1), before="resume.verify:1:2"),
    "resume.universal": Site(RESHAPE, LEADER, None, _codes(1)),
    # In the converter (a child of rank 0): the rank reports its failure (the pieces done are kept).
    "resume.universal_piece": Site(
        RESHAPE, LEADER, None, _codes(1), "ds_to_universal failed", child=True
    ),
    "resume.load_rng": Site(RESUME, EVERY, None, _codes(1)),
    "resume.truncate_metrics": Site(RESUME, LEADER, None, _codes(1)),
    # Resumed at its last step: nothing to save, `latest` (and retention) brought up to date.
    "resume.finish_commit": Site(
        RESUME, LEADER, 2, _codes(0), "could not point `latest` at global_step{step}", steps=2
    ),
}


# `finetune export` (one process, offline): each export site's exit code by kind. An unreadable
# rank file is a damaged input (2, naming the file); a failed write or rename is a runtime failure
# (1); either way OUT is never created and a rerun starts clean.
EXPORT: dict[str, dict[str, int]] = {
    "export.read_rank_file": {"eio": 2, "enospc": 2, "error": 2, "kill": KILLED},
    "export.write": {"eio": 1, "enospc": 1, "error": 1, "kill": KILLED},
    "export.publish": {"eio": 1, "enospc": 1, "error": 1, "kill": KILLED},
}
EXPORT_SAMPLE = {
    "export.read_rank_file": "error",
    "export.write": "enospc",
    "export.publish": "kill",
}


@dataclass(frozen=True)
class Fault:
    """One fault of a case: a site, a rank, a kind, at the site's step (or ``step``)."""

    site: str
    rank: int
    kind: str
    step: int | None = None

    @property
    def at(self) -> int | None:
        return self.step if self.step is not None else EXPECTED[self.site].step

    @property
    def spec(self) -> str:
        site = EXPECTED[self.site]
        own = ":".join(
            [self.site, str(self.rank)]
            + ([str(self.at)] if self.at is not None else [])
            + [self.kind]
        )
        return f"{site.before.format(step=self.at)},{own}" if site.before else own

    def says(self) -> str | None:
        site = EXPECTED[self.site]
        if self.kind == HANG:
            return "made no progress for"
        return (
            site.says.format(step=self.at, rank=self.rank)
            if site.says and self.kind != "kill"
            else None
        )


@dataclass(frozen=True)
class Case:
    """One launch with one or more faults (``FINETUNE_FAULT`` takes a comma-separated list);
    ``steps``: its --max_steps."""

    faults: tuple[Fault, ...]
    nprocs: int = 2
    steps: int = MAX_STEPS
    name: str = ""
    extra: tuple = ()  # flags beyond the sites' own (ASYNC: the writer's sites on its thread)

    @property
    def scenario(self) -> str:
        return EXPECTED[self.faults[0].site].scenario

    @property
    def spec(self) -> str:
        return ",".join(f.spec for f in self.faults)

    @property
    def flags(self) -> tuple:
        return tuple(
            dict.fromkeys(
                [flag for f in self.faults for flag in EXPECTED[f.site].flags] + list(self.extra)
            )
        )

    @property
    def id(self) -> str:
        if self.name:
            return self.name
        f = self.faults[0]
        return (
            f"{f.site}-rank{f.rank}-{f.kind}"
            + (f"-{self.nprocs}ranks" if self.nprocs != 2 else "")
            + ("-async" if self.extra == ASYNC else "")
        )

    def codes(self) -> list[int]:
        kill = next(
            (f for f in self.faults if f.kind == "kill" and not EXPECTED[f.site].child), None
        )
        if kill is not None:
            return [KILLED if r == kill.rank else 1 for r in range(self.nprocs)]
        # A hang is given up after the step's deadline and then agreed like an I/O error there.
        kinds = [("eio" if f.kind in (HANG, "kill") else f.kind) for f in self.faults]
        worst = max(
            (EXPECTED[f.site].codes[k] for f, k in zip(self.faults, kinds)),
            key=lambda c: (c != 0, c),
        )
        return [worst] * self.nprocs


def single(site: str, rank: int, kind: str, nprocs: int | None = None, extra: tuple = ()) -> Case:
    return Case(
        (Fault(site, rank, kind),),
        nprocs or (1 if EXPECTED[site].scenario == RESHAPE else 2),
        EXPECTED[site].steps,
        extra=extra,
    )


# Under --async_save these run on the writer thread; their failure surfaces at a later boundary.
WRITER_THREAD = ("save.write_rank_files", "save.fsync")


def _ranks(site: Site) -> list[int]:
    # A leader's site on rank 1 is never reached with shared storage: no case to run.
    return [0] if site.reached_by == LEADER else [0, 1]


# On the way to --remote_output_dir, on each rank's upload thread: tests/faults/test_remote.py runs
# them against a real S3 server (the sweep's runs have no bucket), on the ranks that reach them.
REMOTE: dict[str, str] = {"remote.upload": EVERY, "remote.commit": LEADER}

# Polled with a deadline (--ddp_timeout): a syscall that never returns there (a dead mount) fails on
# every rank within the deadline, with the site's documented outcome for an I/O error.
HANG_SITES = (
    "staging.tidy",
    "retention.history",
    "save.check_space",
    "save.clear_staging",
    "lease.check",
    "commit.manifest",
    "commit.rename",
    "commit.latest",
    "retention.delete",
    "resume.list",
    "resume.verify",
    "verify.read_file",
    "resume.read_state",
    "resume.load_rng",
    "resume.truncate_metrics",
    "resume.finish_commit",
    "save.shared_files",
)
HANG_SAMPLE = ("commit.manifest",)

# At 4 ranks: a failure and a kill on a rank that is neither the first nor the second.
FOUR_RANKS = [
    single("save.write_rank_files", 3, "eio", 4),
    single("save.fsync", 2, "kill", 4),
    single("save.snapshot", 3, "error", 4),
]


def long_cases() -> list[Case]:
    """Every site × the ranks that reach it (rank 0 and rank 1) × every kind, one launch each;
    a few at 4 ranks; and the sample's 4-rank bundle."""
    return (
        [
            single(name, rank, kind)
            for name, site in EXPECTED.items()
            for rank in _ranks(site)
            for kind in KINDS
        ]
        + [
            single(name, rank, kind, extra=ASYNC)
            for name in WRITER_THREAD
            for rank in (0, 1)
            for kind in KINDS
        ]
        + [single(name, rank, HANG) for name in HANG_SITES for rank in _ranks(EXPECTED[name])]
        + FOUR_RANKS
        + [BUNDLE]
    )


def _bundle() -> Case:
    """The sample's one launch for every site where a failure is agreed and a fresh run goes on:
    4 ranks, each site failing at a step of its own, the ranks and kinds taken in turn."""
    # --async_save would change every other site's save: its own site is sampled alone.
    goes_on = [
        n
        for n, s in EXPECTED.items()
        if s.scenario == FRESH and set(s.codes.values()) == {0} and ASYNC[0] not in s.flags
    ]
    kinds, faults, step = ("eio", "enospc", "error"), [], 0
    for i, name in enumerate(goes_on):
        site = EXPECTED[name]
        rank = 0 if site.reached_by == LEADER else 1 + i % 3
        if site.step is None:
            faults.append(Fault(name, rank, kinds[i % 3]))
            continue
        # Retention deletes only once this run has committed more than --save_total_limit (2).
        step += 3 if name == "retention.delete" else 1
        faults.append(Fault(name, rank, kinds[i % 3], step))
    return Case(tuple(faults), nprocs=4, steps=step + 1, name="every-agreed-site-4ranks")


BUNDLE = _bundle()


def sampled_cases() -> list[Case]:
    """`make check`'s sample: the bundle (every site where training goes on), then every other site
    once, the kinds taken in turn, rank 1 wherever a non-zero rank reaches it; and a kill
    mid-save."""
    bundled = {f.site for f in BUNDLE.faults}
    cases, i = [BUNDLE], 0
    for name, site in EXPECTED.items():
        if name in bundled:
            continue
        cases.append(single(name, 1 if site.reached_by == EVERY else 0, KINDS[i % len(KINDS)]))
        i += 1
    return (
        cases + [single("save.fsync", 1, "kill")] + [single(name, 0, HANG) for name in HANG_SAMPLE]
    )


def _committed_state(out: Path) -> dict:
    """What a resume reads: manifests, `latest`, and whether a lease or staging was left behind
    (the same for an output dir that does not exist and one that holds none of these)."""
    return {
        "manifests": {str(m.relative_to(out)): m.read_bytes() for m in sorted(out.rglob(MANIFEST))},
        "latest": (out / LATEST).read_text() if (out / LATEST).exists() else None,
        "left": sorted(p.name for p in out.glob(".*")),
    }


def run_case(case: Case, tmp: Path, seed_out: Path | None, resume: str = "always") -> dict:
    """One case: a launch with the faults, its outcome and invariants, then a resume to the end.
    ``resume``: "always", or "if_changed" (the sample): skipped when the failed run changed nothing
    a resume reads (manifests, `latest`, a lease or staging left behind), since that resume is one
    other cases run. Returns the figures for the summary."""
    out = tmp / "out"
    if case.scenario in (RESUME, RESHAPE):
        shutil.copytree(seed_out, out)
    before = _committed_state(out)
    first = run_ranks(
        tmp, case.nprocs, train_args(case.steps, *case.flags), out, env={seams.FAULT: case.spec}
    )
    where = f"{seams.FAULT}={case.spec}"
    log = first.output[-8000:]
    fired = []
    for fault in case.faults:
        times = first.fired(fault.site)
        assert times, f"{where}: {fault.site} was never reached\n{log}"
        fired += times
        pattern = fault.says()
        assert pattern is None or re.search(pattern, first.output), (
            f"{where}: no line says /{pattern}/\n{log}"
        )
    assert first.codes == case.codes(), (
        f"{where}: exit codes {first.codes}, documented {case.codes()}\n{log}"
    )
    to_exit = first.exited_by() - min(fired)
    assert to_exit <= BOUND_S, (
        f"{where}: the last rank exited {to_exit:.1f} s after the fault (bound {BOUND_S} s)"
    )
    problems = output_dir_problems(out)
    assert not problems, f"{where}: {problems}\n{log}"
    if resume == "always" or _committed_state(out) != before:
        assert_resumes_to_the_end(tmp, case.nprocs, out, case.steps, case.flags)
    failing = any(c != 0 for c in case.codes())
    return {"time_to_exit_s": round(to_exit, 2) if failing else None}
