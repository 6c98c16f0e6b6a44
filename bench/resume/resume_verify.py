"""Verify throughput and resume time-to-first-step, on bench/resume/export.py's ~134M 2-rank \
checkpoint.

* verify: `finetune verify CKPT` (sizes + xxh3 checksums of every file) → GB/s; `--quick`
  alongside.
* resume: wall time from launching `deepspeed --num_gpus 2 --module finetune …` to the first train
  row in metrics.jsonl, for a fresh start and for `--resume_from_checkpoint CKPT` (which verifies
  with checksums, then loads model, optimizer, scheduler, RNG and data position). Same flags
  otherwise; eval is cut to 8 samples so the fresh run's step-0 eval is negligible. Goal: resume /
  fresh ≤ 1.2. Runs alternate fresh, resume, fresh, resume, … (--repeats each), after one untimed
  warm-up launch.

    .venv/bin/python bench/resume/resume_verify.py [--repeats 3]
                                            [--workdir /tmp/finetune_bench_export]
                                            [--warmup_launches 1] [--model_json '{...}']

``--workdir`` is bench/resume/export.py's (the checkpoint is shared, created there if missing).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.*
from bench.harness import PY, REPO, free_port, rank_env  # noqa: E402
from bench.resume.export import ensure_checkpoint  # noqa: E402

# bench/resume/export.py's default --workdir; --workdir replaces it
WORK = Path("/tmp/finetune_bench_export")


def verify_rate(ckpt: Path, quick: bool) -> dict:
    cmd = [PY, "-m", "finetune", "verify", str(ckpt)] + (["--quick"] if quick else [])
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=rank_env())
    wall = time.perf_counter() - start
    if out.returncode != 0:
        sys.exit(f"verify failed: {out.stdout}{out.stderr}")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    # "OK …: N files, X MB, … (S s, R GB/s)": S is the checking itself, without interpreter
    # start-up.
    inner = float(out.stdout.rsplit("(", 1)[1].split(" s,")[0])
    return {
        "bytes": manifest["total_bytes"],
        "check_s": inner,
        "wall_s": wall,
        "gb_per_s": manifest["total_bytes"] / 1e9 / max(inner, 1e-3),
        "line": out.stdout.strip(),
    }


def time_to_first_step(run: Path, out: Path, resume: Path | None) -> float:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        str(Path(PY).parent / "deepspeed"),
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        "--module",
        "finetune",
        "--config_name",
        str(WORK / "model"),
        "--tokenizer_name",
        str(REPO / "finetune/resources/tokenizer"),
        "--max_steps",
        "2",
        "--output_dir",
        str(out),
        "--per_device_train_batch_size",
        "1",
        "--max_seq_length",
        "32",
        "--logging_steps",
        "1",
        "--max_eval_samples",
        "8",
    ]
    if resume is not None:
        cmd += ["--resume_from_checkpoint", str(resume)]
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=WORK, env=rank_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    metrics, first = out / "metrics.jsonl", None
    while first is None and proc.poll() is None:
        if metrics.exists() and any('"loss"' in line for line in metrics.read_text().splitlines()):
            first = time.perf_counter() - start
        time.sleep(0.05)
    proc.wait()
    if proc.returncode != 0 or first is None:
        sys.exit(f"run failed ({proc.returncode}): {' '.join(cmd)}")
    return first


def main() -> None:
    global WORK
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--workdir",
        default=str(WORK),
        help="bench/resume/export.py's --workdir (holds the checkpoint)",
    )
    ap.add_argument(
        "--warmup_launches", type=int, default=1, help="untimed launches before the timed ones"
    )
    ap.add_argument(
        "--model_json",
        default=None,
        help="config keys replacing the 134M Llama's, if the checkpoint is created",
    )
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "resume_verify.json"))
    a = ap.parse_args()
    WORK = Path(a.workdir)
    WORK.mkdir(parents=True, exist_ok=True)
    run = ensure_checkpoint(WORK, json.loads(a.model_json) if a.model_json else None)
    ckpt = run / "global_step1"
    shutil.rmtree(ckpt / "universal", ignore_errors=True)
    verify = [verify_rate(ckpt, quick=False) for _ in range(a.repeats)]
    quick = verify_rate(ckpt, quick=True)
    for _ in range(a.warmup_launches):
        # warm-up, untimed: DeepSpeed may (re)build its ops
        time_to_first_step(run, WORK / "fresh", None)
    fresh, resumed = [], []
    for _ in range(a.repeats):
        fresh.append(time_to_first_step(run, WORK / "fresh", None))
        resumed.append(time_to_first_step(run, WORK / "resumed", ckpt))
    ratio = statistics.median(resumed) / statistics.median(fresh)
    print(f"checkpoint {ckpt}: {verify[0]['bytes'] / 1e9:.2f} GB")
    print(
        "verify (checksums): " + " ".join(f"{v['gb_per_s']:.2f}" for v in verify) + " GB/s "
        f"(median {statistics.median(v['gb_per_s'] for v in verify):.2f}); "
        f"--quick: {quick['check_s']:.3f} s"
    )
    print(
        "time to first step, fresh:   "
        + " ".join(f"{x:.1f}" for x in fresh)
        + f" s (median {statistics.median(fresh):.1f})"
    )
    print(
        "time to first step, resumed: "
        + " ".join(f"{x:.1f}" for x in resumed)
        + f" s (median {statistics.median(resumed):.1f})"
    )
    print(f"resume / fresh: {ratio:.2f} (goal <= 1.2)")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(
        json.dumps(
            {
                "verify": verify,
                "verify_quick": quick,
                "fresh_s": fresh,
                "resumed_s": resumed,
                "ratio": ratio,
                "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            },
            indent=2,
        )
    )
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
