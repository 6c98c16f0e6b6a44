"""The universal conversion (resume on another world size): finetune's resumable one vs DeepSpeed's
``ds_to_universal``, wall time per GB of rank files, the longest piece, and the time left after an
interruption.

    .venv/bin/python bench/resume/universal_convert.py [--workdir /tmp/finetune_bench_export]
                                                [--repeats 3]
                                                [--out bench/results/universal.json]

The checkpoint is bench/resume/export.py's (a ~134M-parameter Llama after one step on 2 ranks,
1.6 GB of rank files; created once under ``--workdir``). Each round, alternating, as one plain
process each:

* ours:   ``python -m finetune export RUN/global_step1 OUT --universal --no_verify`` (the pieces,
  each fsynced and marked done; the manifest written at the end);
* theirs: ``python -m deepspeed.checkpoint.ds_to_universal --input_folder … --output_folder …``
  with the worker counts finetune itself used before (min(4, cores));
* resumed: ours again, killed (SIGKILL) once half its pieces are marked done, then rerun: the
  rerun's wall time, and how many pieces it found done.

The page cache is dropped (``sync; echo 3 > /proc/sys/vm/drop_caches``, where permitted) before
each timed run. Wall time includes the interpreter's imports (about 5 s here). Prints a table;
writes the medians and every run to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.*
from bench.harness import PY, REPO, rank_env  # noqa: E402
from bench.resume.export import ensure_checkpoint  # noqa: E402 — export.py's 134M checkpoint


def drop_caches() -> None:
    subprocess.run(["sync"])
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass  # not root, or a container without it: warm cache then (the JSON says which)


def timed(cmd: list[str]) -> tuple[float, str]:
    drop_caches()
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=rank_env())
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n"
            f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        )
    return wall, proc.stdout + proc.stderr


def ours(ckpt: Path, out: Path) -> list[str]:
    return [PY, "-m", "finetune", "export", str(ckpt), str(out), "--universal", "--no_verify"]


def theirs(ckpt: Path, out: Path) -> list[str]:
    workers = str(max(1, min(4, os.cpu_count() or 1)))
    return [
        PY,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(ckpt),
        "--output_folder",
        str(out),
        "--num_extract_workers",
        workers,
        "--num_merge_workers",
        workers,
    ]


def interrupted(ckpt: Path, out: Path) -> dict:
    """Ours killed once half its pieces are done, then rerun: the rerun's wall time and pieces."""
    try:  # offline/ now; checkpoint/ in older versions
        from finetune.weights.universal import PIECES
    except ImportError:
        from finetune.checkpoint.universal import PIECES

    pieces = out.with_name(out.name + ".tmp") / PIECES
    drop_caches()
    proc = subprocess.Popen(
        ours(ckpt, out),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=rank_env(),
        start_new_session=True,
    )
    total = None
    while proc.poll() is None:
        done = (
            len([p for p in pieces.iterdir() if p.name != "source.json"]) if pieces.is_dir() else 0
        )
        total = total or _piece_count(ckpt)
        if done >= total // 2:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    proc.wait()
    kept = len([p for p in pieces.iterdir() if p.name != "source.json"])
    wall, log = timed(ours(ckpt, out))
    return {"kept_pieces": kept, "rerun_s": round(wall, 2), "summary": _summary(log)}


def _piece_count(ckpt: Path) -> int:
    import torch

    files = sorted(ckpt.glob("*model_states.pt"))
    shapes = torch.load(files[0], map_location="cpu", weights_only=False)["param_shapes"]
    return len(files) + sum(len(group) for group in shapes) + 1


def _summary(log: str) -> str:
    line = next((line for line in log.splitlines() if "Converted" in line), "")
    return line[line.find("(") + 1 : line.rfind(")")] if "(" in line else line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="/tmp/finetune_bench_export")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "universal.json"))
    args = ap.parse_args()
    ckpt = ensure_checkpoint(Path(args.workdir)) / "global_step1"
    gb = sum(p.stat().st_size for p in ckpt.glob("*_states.pt")) / 1e9
    scratch = Path(args.workdir) / "universal-bench"
    runs: dict[str, list] = {"ours": [], "theirs": [], "resumed": []}
    for i in range(args.repeats):
        for name, make in (("ours", ours), ("theirs", theirs)):
            shutil.rmtree(scratch, ignore_errors=True)
            scratch.mkdir(parents=True)
            wall, log = timed(make(ckpt, scratch / "u"))
            runs[name].append(
                {"wall_s": round(wall, 2), "summary": _summary(log) if name == "ours" else ""}
            )
            print(f"round {i + 1}: {name} {wall:.1f} s {runs[name][-1]['summary']}", flush=True)
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        runs["resumed"].append(interrupted(ckpt, scratch / "u"))
        print(f"round {i + 1}: resumed {runs['resumed'][-1]}", flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    med = {k: statistics.median(r["wall_s"] for r in runs[k]) for k in ("ours", "theirs")}
    med["resumed"] = statistics.median(r["rerun_s"] for r in runs["resumed"])
    result = {
        "rank_files_gb": round(gb, 3),
        "median_s": med,
        "s_per_gb": {k: round(v / gb, 1) for k, v in med.items()},
        "ratio_ours_over_theirs": round(med["ours"] / med["theirs"], 3),
        "runs": runs,
        "cold_cache": os.access("/proc/sys/vm/drop_caches", os.W_OK),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nrank files: {gb:.2f} GB; medians of {args.repeats}:")
    print("| conversion | wall s | s per GB |\n|---|---|---|")
    for k in ("ours", "theirs", "resumed"):
        print(f"| {k} | {med[k]:.1f} | {med[k] / gb:.1f} |")
    print(f"ratio ours / theirs: {result['ratio_ours_over_theirs']}")


if __name__ == "__main__":
    main()
