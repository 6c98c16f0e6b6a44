"""Preemption: how long from a signal to a committed checkpoint and exit, and what the per-step \
check costs.

    .venv/bin/python bench/resume/preemption.py [--repeats 3] [--out bench/results/preemption.json]

1. Latency: the embedded default on 2 ranks through the DeepSpeed launcher with
   ``--max_steps 100000 --save_checkpoint --logging_steps 1``; once 20 steps are logged, SIGTERM
   goes to rank 1 only. Measured from the signal: until ``OUT/latest`` names the new checkpoint
   (commit), and until the launcher exits (with 75). Steps lost = last step logged before the
   signal − the checkpoint's step (negative or zero: nothing lost; the step in flight is finished
   and saved).
2. Cost: the step-boundary check is one all-reduce of two float64 (a signal arrived, the next batch
   failed: ``Trainer._boundary``); a 2-rank torchrun job times 2000 of them after 200 warm-up calls,
   on the gloo CPU backend used here.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.*
from bench.harness import PY, REPO, free_port, rank_env  # noqa: E402

BIN = Path(PY).parent

CHECK = """
import time, torch
from finetune import distributed as dist
from finetune.preemption import Preemption, parse_signals
dist.init()
p = Preemption(parse_signals("SIGTERM,SIGUSR1"))
for _ in range(200):
    dist.all_reduce_sum([1.0 if p.received else 0.0, 0.0])
t = time.perf_counter()
for _ in range(2000):
    dist.all_reduce_sum([1.0 if p.received else 0.0, 0.0])
if dist.rank() == 0:
    print("PER_CALL_US", (time.perf_counter() - t) / 2000 * 1e6, flush=True)
dist.shutdown()
"""


def last_step(out: Path) -> int:
    path = out / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return max((r["step"] for r in rows if "loss" in r), default=0)


def rank_pid(launcher_pid: int, rank: int) -> int:
    import psutil

    for child in psutil.Process(launcher_pid).children(recursive=True):
        e = child.environ()
        if e.get("RANK") == str(rank) and "LOCAL_RANK" in e:
            return child.pid
    raise RuntimeError(f"rank {rank} not found")


def latency_once(work: Path) -> dict:
    out = work / "out"
    cmd = [
        str(BIN / "deepspeed"),
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        "--module",
        "finetune",
        "--max_steps",
        "100000",
        "--logging_steps",
        "1",
        "--eval_steps",
        "1000000",
        "--save_checkpoint",
        "--output_dir",
        str(out),
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=work,
        env=rank_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    while last_step(out) < 20:
        time.sleep(0.05)
    before = last_step(out)
    pid = rank_pid(proc.pid, 1)
    t0 = time.perf_counter()
    os.kill(pid, signal.SIGTERM)
    committed = None
    while proc.poll() is None:
        if committed is None and (out / "latest").exists():
            committed = time.perf_counter() - t0
        time.sleep(0.005)
    exited = time.perf_counter() - t0
    tag = (out / "latest").read_text().strip()
    step = int(tag.removeprefix("global_step"))
    return {
        "exit_code": proc.returncode,
        "signal_to_commit_s": round(committed or exited, 3),
        "signal_to_exit_s": round(exited, 3),
        "last_step_logged_before_signal": before,
        "checkpoint_step": step,
        "steps_lost": max(before - step, 0),
    }


def check_cost() -> float:
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "check.py"
        script.write_text(CHECK)
        cmd = [
            str(BIN / "torchrun"),
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            str(script),
        ]
        proc = subprocess.run(
            cmd, env=rank_env(), capture_output=True, text=True, timeout=300, cwd=d
        )
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("PER_CALL_US"))
        return float(line.split()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "preemption.json"))
    args = ap.parse_args()
    runs = []
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory() as d:
            runs.append(latency_once(Path(d)))
            print(f"run {i + 1}: {runs[-1]}", flush=True)
    cost = [check_cost() for _ in range(args.repeats)]
    result = {
        "runs": runs,
        "median_signal_to_commit_s": statistics.median(r["signal_to_commit_s"] for r in runs),
        "median_signal_to_exit_s": statistics.median(r["signal_to_exit_s"] for r in runs),
        "max_steps_lost": max(r["steps_lost"] for r in runs),
        "check_per_step_us": [round(c, 1) for c in cost],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
