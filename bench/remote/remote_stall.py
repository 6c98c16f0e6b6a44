"""What a copy to object storage costs training: step time while a checkpoint uploads to
--remote_output_dir vs while none does, and the whole run against the same run without a bucket.

    pip install -e '.[test]'     # boto3 and SeaweedFS
    python bench/remote/remote_stall.py [--steps 16] [--every 4] [--out FILE]

bench/save/checkpoint_save.py's ~134M Llama on 2 ranks (DeepSpeed launcher), a partitioned save
every ``--every`` steps (~1.6 GB each), logged every step; the bucket is a SeaweedFS S3 server on
loopback sharing the machine's cores (on this 2-vCPU machine the upload's CPU competes with
training; a GPU node's spare cores would not). Two runs, same flags: with ``--remote_output_dir``
and without. A step's seconds come from its metrics row (tokens / tokens_per_s). In the copying
run, a step is "in flight" when it began after a checkpoint's commit and at or before the boundary
that saw the copy committed (``remote_checkpoint``'s ``seen_at``); the step right after each save
(it carries the synchronous save) and the first two (warm-up) are left out of both sets.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.*
from bench.harness import BIN, REPO  # noqa: E402

sys.path.insert(0, str(REPO / "tests"))

from s3_server import SeaweedS3, free_ports  # noqa: E402

BUCKET = "bench-stall"


def run(work: Path, name: str, steps: int, every: int, extra: list[str], env: dict) -> dict:
    from bench.save.checkpoint_save import write_inputs

    cfg_dir, ds_path = write_inputs(work / "model")
    out = work / name
    cmd = [
        str(BIN / "deepspeed"),
        "--num_gpus",
        "2",
        "--master_port",
        str(free_ports(1)[0]),
        "--module",
        "finetune",
        "--config_name",
        str(cfg_dir),
        "--tokenizer_name",
        str(REPO / "finetune" / "resources" / "tokenizer"),
        "--deepspeed_config",
        str(ds_path),
        "--max_steps",
        str(steps),
        "--max_seq_length",
        "32",
        "--per_device_train_batch_size",
        "1",
        "--max_eval_samples",
        "4",
        "--eval_steps",
        "1000000",
        "--logging_steps",
        "1",
        "--lr_scheduler_type",
        "constant",
        "--save_checkpoint",
        "--save_steps",
        str(every),
        "--save_total_limit",
        "2",
        "--no_plot",
        "--output_dir",
        str(out),
        *extra,
    ]
    start = time.perf_counter()
    proc = subprocess.run(
        cmd,
        cwd=work,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{BIN}:{os.environ['PATH']}", **env},
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"remote_stall: the {name} run failed:\n{proc.stdout[-4000:]}")
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    train = sorted((r for r in rows if "loss" in r), key=lambda r: r["step"])
    seconds, prev = {}, 0
    for r in train:
        seconds[r["step"]] = (r["tokens_seen"] - prev) / r["tokens_per_s"]
        prev = r["tokens_seen"]
    events = [json.loads(ln) for ln in (out / "events.jsonl").read_text().splitlines()]
    return {"wall_s": wall, "step_s": seconds, "events": events}


def classify(r: dict, every: int) -> tuple[list[float], list[float]]:
    """(steps while a copy was in flight, steps while none was) of a copying run."""
    windows = [(e["step"], e["seen_at"]) for e in r["events"] if e["event"] == "remote_checkpoint"]
    inflight, idle = [], []
    for step, s in r["step_s"].items():
        if step <= 2 or (step - 1) % every == 0:
            continue  # warm-up; the step that carries a save
        if any(saved < step <= seen for saved, seen in windows):
            inflight.append(s)
        else:
            idle.append(s)
    return inflight, idle


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--work", type=Path)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "remote_stall.json")
    a = ap.parse_args()
    work = a.work or Path(tempfile.mkdtemp(prefix="remote-stall-"))
    work.mkdir(parents=True, exist_ok=True)
    with SeaweedS3(work / "s3") as s3:
        s3.create_bucket(BUCKET)
        plain = run(work, "plain", a.steps, a.every, [], {})
        copying = run(
            work,
            "copying",
            a.steps,
            a.every,
            ["--remote_output_dir", f"s3://{BUCKET}/run"],
            s3.env(),
        )
    inflight, idle = classify(copying, a.every)
    _, plain_idle = classify({**plain, "events": []}, a.every)
    summary = {
        "step_inflight_s": statistics.median(inflight) if inflight else None,
        "step_idle_s": statistics.median(idle) if idle else None,
        "step_plain_s": statistics.median(plain_idle),
        "steps_inflight": len(inflight),
        "steps_idle": len(idle),
        "wall_copying_s": round(copying["wall_s"], 2),
        "wall_plain_s": round(plain["wall_s"], 2),
    }
    if inflight and idle:
        summary["ratio_inflight_over_idle"] = summary["step_inflight_s"] / summary["step_idle_s"]
    summary["ratio_wall"] = copying["wall_s"] / plain["wall_s"]
    summary["copies"] = [
        {k: e.get(k) for k in ("tag", "step", "seen_at")}
        for e in copying["events"]
        if e["event"] in ("remote_checkpoint", "remote_skipped")
    ]
    result = {
        "settings": vars(a) | {"work": str(work), "out": str(a.out)},
        "summary": summary,
        "copying_step_s": copying["step_s"],
        "plain_step_s": plain["step_s"],
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
