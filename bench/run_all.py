"""The benchmark suite in one command: P1…P13, written to bench/results/latest.json and rendered
into docs/BENCHMARKS.md and README.md (``make bench`` runs exactly this).

    .venv/bin/python bench/run_all.py [--out bench/results/latest.json] [--work DIR] [--no_docs]
        [--keep_work]
    # some measures: bench/results/partial.json, docs untouched
    .venv/bin/python bench/run_all.py --only P3 P9
    # every measure, tiny, ~2.5 min on 2 cores
    .venv/bin/python bench/run_all.py --smoke --out /tmp/x/latest.json

Each measure runs one of the standalone scripts under bench/SUBJECT/ (each keeps working on its
own, with its own defaults) with sizes chosen so that the whole suite takes about 30 minutes on a
2-core machine: fewer repeats, steps and rows than their defaults (the sizes used are in each
entry's ``settings``). A subject's measures, their goals and sizes are defined beside its scripts
(bench/SUBJECT/measures.py); this module gathers them, runs them and writes the results. Every
entry of latest.json has ``ours``, ``baseline``, ``ratio`` (= ours / baseline), ``unit``,
``baseline_name``, ``goal``, ``met``, ``what``, ``raw`` (the repeats' numbers), ``settings`` and
``script``; a measure that could not run has ``error`` instead of numbers, and the suite goes on.
Sub-measures (P2's step time and end-to-end overhead, P5's wall time, P9's restart vs HF
Trainer's: P6b) are entries of their own under ``sub``. The top level says on what machine, with
what versions, when, whether reads were from a warm page cache (this script never drops caches:
they are warm), and how long it all took.

``--smoke`` runs every measure end to end at tiny sizes (a tiny model, tens of rows, one repeat)
to check that the suite works; its numbers mean nothing, and it never touches the docs. It needs
``--out`` outside bench/results/latest.json. Its measures run two at a time (``--jobs``, 2 by
default; P5 then P6 in one lane, as P6 resumes from P5's checkpoint): nearly all of a smoke run is
launch start-up (imports, DeepSpeed's op loading), which leaves one of two cores idle part of the
time. A full run is always one measure at a time.

The per-script JSONs (everything each script recorded) go beside ``--out`` as ``<script>.json``,
and each script's output to ``run_all_logs/<measure>.log`` there.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: bench.*
from bench import table  # noqa: E402
from bench.data import measures as data  # noqa: E402
from bench.harness import (  # noqa: E402
    PY,
    REPO,
    Ctx,
    Run,
    Runner,
    Unavailable,
    child_env,
    machine,
    versions,
)
from bench.long import measures as long  # noqa: E402
from bench.preference import measures as preference  # noqa: E402
from bench.resume import measures as resume  # noqa: E402
from bench.save import measures as save  # noqa: E402
from bench.train import measures as train  # noqa: E402

DEFAULT_OUT = REPO / "bench" / "results" / "latest.json"

# Every run of the suite, in the order a full run takes them.
RUNS: tuple[Run, ...] = tuple(
    sorted(
        (*train.RUNS, *save.RUNS, *resume.RUNS, *data.RUNS, *long.RUNS, *preference.RUNS),
        key=lambda run: int(run.key[1:]),
    )
)
MEASURES = {m.key: m for run in RUNS for m in (*run.measures, *run.subs)}
WHAT = {key: m.what for key, m in MEASURES.items()}
GOALS = {key: m.goal for key, m in MEASURES.items()}
# Sizes per mode, by run. FULL: ~30 min on a 2-vCPU machine.
FULL = {run.key: run.full for run in RUNS}
SMOKE = {run.key: run.smoke for run in RUNS}
TIMEOUT_S = {"full": 1500, "smoke": 240}

# --smoke --jobs N: the measures as N lanes side by side, the longest (in a smoke run on 2 cores)
# first, so that the last to start are the shortest and the lanes end together (seconds on 2
# cores: P9 ~100, P5+P6 ~100, P10 ~60, P1 ~45, P13 ~45, P7 ~40, P8 ~35, P2 ~30, P11 ~25, P3 ~25).
# A chain runs in order in one lane: P6 resumes from the checkpoint P5 creates in work/export.
SMOKE_CHAINS = [
    ("P9",),
    ("P5", "P6"),
    ("P10",),
    ("P1",),
    ("P13",),
    ("P7",),
    ("P8",),
    ("P2",),
    ("P11",),
    ("P3",),
]
SMOKE_JOBS = 2


def failed_subs(run: Run, measures: dict, msg: str, skipped: bool = False) -> None:
    """A run that gave no results: its sub-measures too say why (the tables keep their rows)."""
    if run.subs:
        measures[run.key]["sub"] = {m.key: m.error(msg, skipped=skipped) for m in run.subs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, every measure, a few minutes; numbers mean nothing",
    )
    ap.add_argument(
        "--out",
        default=None,
        help="default bench/results/latest.json; with --only, bench/results/partial.json",
    )
    ap.add_argument(
        "--work",
        default=None,
        help="scratch folder for checkpoints and data (default: a temp dir, removed after)",
    )
    ap.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="run only these measures (P1 … P13; P3 and P4 run together, P11 and P12 too)",
    )
    ap.add_argument(
        "--no_docs", action="store_true", help="don't rewrite docs/BENCHMARKS.md and README.md"
    )
    ap.add_argument("--keep_work", action="store_true")
    ap.add_argument("--quiet", action="store_true", help="don't echo the scripts' output")
    ap.add_argument(
        "--jobs",
        type=int,
        default=None,
        help=f"with --smoke: measures run side by side in this many lanes (default {SMOKE_JOBS}); "
        "a full run is always one at a time (its numbers need the machine to themselves)",
    )
    a = ap.parse_args(argv)
    if a.jobs is not None and a.jobs > 1 and not a.smoke:
        ap.error(
            "--jobs > 1 only with --smoke: measures running side by side skew each other's numbers"
        )
    jobs = max(1, a.jobs or SMOKE_JOBS) if a.smoke else 1
    out = Path(
        a.out or (DEFAULT_OUT.with_name("partial.json") if a.only else DEFAULT_OUT)
    ).resolve()
    if a.smoke and out == DEFAULT_OUT.resolve():
        ap.error(
            "--smoke writes numbers that mean nothing: "
            "give it --out outside bench/results/latest.json"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(a.work).resolve() if a.work else Path(tempfile.mkdtemp(prefix="finetune-bench-"))
    if a.work and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    only = None
    if a.only:  # a run's key, or any measure it gives (P4: P3's run; P6b: P9's)
        asked = {k.upper() for k in a.only}
        only = {r.key for r in RUNS if asked & {m.key.upper() for m in (*r.measures, *r.subs)}}
    os.environ.update(
        {k: v for k, v in child_env().items() if k in ("PATH", "TORCH_EXTENSIONS_DIR")}
    )
    # Side by side, each script gets a share of the machine: its hang guard grows to match.
    runner = Runner(
        out.parent, TIMEOUT_S["smoke" if a.smoke else "full"] * jobs, a.quiet, concurrent=jobs > 1
    )
    ctx = Ctx(a.smoke, SMOKE if a.smoke else FULL, out.parent, work, runner)
    started, t0 = _dt.datetime.now(_dt.timezone.utc), time.monotonic()
    result = {
        "suite": "finetune bench (bench/run_all.py)",
        "mode": "smoke" if a.smoke else "full",
        "date": started.isoformat(timespec="seconds"),
        "machine": machine(work),
        "versions": versions(),
        "reads_cold": False,
        "page_cache": (
            "warm: caches are never dropped; checkpoints, datasets and exports are read back from "
            "the page cache where they were just written or read (cold-disk reads would be slower)"
        ),
        "command": " ".join(
            [Path(PY).name, *(sys.argv if argv is None else ["bench/run_all.py", *argv])]
        ),
        "sizes": ctx.sizes,
    }
    if jobs > 1:
        result["jobs"] = jobs
    measures: dict = {}
    if jobs == 1:
        for run in RUNS:
            if not only or run.key in only:
                measures.update(run_measure(ctx, run))
    else:
        chains = [[k for k in chain if not only or k in only] for chain in SMOKE_CHAINS]
        measures = run_lanes(ctx, runner, chains, jobs)
    result.update({k: measures[k] for k in sorted(measures, key=lambda k: int(k[1:]))})
    result["total_wall_s"] = round(time.monotonic() - t0, 1)
    result["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {out} ({result['total_wall_s'] / 60:.1f} min)")
    if not a.smoke and not a.no_docs and not a.only:  # the docs' table is always a whole run's
        for path in table.update_docs(result):
            print(f"updated {path}")
    if not a.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def run_measure(ctx: Ctx, run: Run) -> dict:
    """One run's entries (P3's gives P3 and P4), each with its wall time and script; a failure is
    recorded."""
    key = run.key
    print(f"=== {key} ===", flush=True)
    measures: dict = {}
    m0 = time.monotonic()
    keys = tuple(m.key for m in run.measures)
    try:
        got = run.fn(ctx)
        got = got if isinstance(got, tuple) else (got,)
        for k, e in zip(keys, got):
            measures[k] = e
    except Unavailable as e:
        for m in run.measures:
            measures[m.key] = m.error(f"not run: {e}", skipped=True)
        failed_subs(run, measures, f"not run: {e}", skipped=True)
    except Exception as e:  # noqa: BLE001 — recorded; the rest of the suite still runs
        msg = f"{type(e).__name__}: {e}"
        print(f"{key} failed: {msg}\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        for m in run.measures:
            measures[m.key] = m.error(msg[-3000:])
        failed_subs(run, measures, msg[-3000:])
    wall = round(time.monotonic() - m0, 1)
    for k in keys:
        measures[k]["wall_s"] = wall if k == keys[0] else 0.0
        measures[k]["script"] = f"bench/{run.script}"
        if k != keys[0]:
            measures[k]["wall_note"] = f"measured in the same run as {keys[0]}"
    print(f"=== {key}: {wall:.0f} s; " + "; ".join(_line(k, measures[k]) for k in keys), flush=True)
    return measures


def run_lanes(ctx: Ctx, runner: Runner, chains: list[list[str]], jobs: int) -> dict:
    """The chains on ``jobs`` threads, each taking the next chain when its last one is done (smoke
    only: side by side, the measures' numbers skew each other)."""
    pending = [c for c in chains if c]
    by_key = {run.key: run for run in RUNS}
    measures: dict = {}
    lock = threading.Lock()

    def lane() -> None:
        while True:
            with lock:
                if not pending:
                    return
                chain = pending.pop(0)
            for key in chain:
                got = run_measure(ctx, by_key[key])
                with lock:
                    measures.update(got)

    threads = [
        threading.Thread(target=lane, name=f"lane{i}", daemon=True)
        for i in range(min(jobs, len(pending)))
    ]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.5)
    except BaseException:  # Ctrl-C: no new script, and the running ones killed
        with lock:
            pending.clear()
        runner.kill_all()
        raise
    finally:
        runner.sweep()
    return measures


def _line(key: str, e: dict) -> str:
    if "error" in e:
        return f"{key} error: {e['error'].splitlines()[0][:200]}"
    return f"{key} ratio {e['ratio']:.3f} (goal {e['goal']}: {'met' if e['met'] else 'NOT met'})"


if __name__ == "__main__":
    sys.exit(main())
