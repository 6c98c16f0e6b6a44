"""--async_save benchmark (P2): one 2-rank run on the ~134M-parameter Llama of \
bench/save/checkpoint_save.py.

(a) training stall per checkpoint: ``Checkpointer.save(step, background=True)`` (snapshot into
    host memory, write on a thread) / DeepSpeed's synchronous ``engine.save_checkpoint`` of the same
    state with its own checkpoint engine (goal <= 0.1);
(b) median step time while a background write is in flight / with none (goal <= 1.15);
(c) end-to-end overhead of saving every k steps, (t_with_saves - t_none) / t_none, synchronous
    and async; P2c is the median over rounds of async / none within a round (goal <= 1.035).

    .venv/bin/python bench/save/async_save.py [--repeats 3]
                                         [--e2e_steps 40 --every 10 --e2e_repeats 2]
                                         [--dir DIR] [--model_json '{...}']
                                         [--out bench/results/async_save.json]

bench/save/async_save_worker.py's docstring says exactly what each number times. Exits 3 without
running anything when this finetune has no background save API yet.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.*
from bench.harness import REPO, free_port, machine, write_json  # noqa: E402
from bench.save.checkpoint_save import write_inputs  # noqa: E402

# The Checkpointer's modules (the manager's, in older versions: before/after runs).
CHECKPOINT = REPO / "finetune" / "checkpoint"


def api_missing() -> str | None:
    """Cheap check (no imports) that finetune has the background save API."""
    src = "\n".join(p.read_text() for p in sorted(CHECKPOINT.glob("*.py")))
    if "def poll" not in src or "background" not in src:
        return (
            "the --async_save API (save(background=True), poll, wait) "
            f"is not in {CHECKPOINT.relative_to(REPO)}/ yet"
        )
    return None


def round_ratios(runs: list[dict]) -> list[float]:
    """async / none of each round of three runs (the worker's order: rounds of none, sync and
    async, alternately forwards and backwards)."""
    out = []
    for i in range(0, len(runs) - 2, 3):
        by_mode = {x["mode"]: x["seconds"] for x in runs[i : i + 3]}
        if {"none", "async"} <= set(by_mode):
            out.append(by_mode["async"] / by_mode["none"])
    return out


def summarize(r: dict) -> dict:
    med = statistics.median
    stall = r["stall"]
    a = [s["async_stall_s"] for s in stall]
    ds = [s["deepspeed_sync_s"] for s in stall]
    ours_sync = [s["finetune_sync_s"] for s in stall]
    e2e: dict[str, list[float]] = {}
    for x in r["e2e"]:
        e2e.setdefault(x["mode"], []).append(x["seconds"])
    none = med(e2e["none"])
    s = {
        "first_async_stall_s": r.get("first_async_stall_s"),
        "stall_async_s": med(a),
        "stall_deepspeed_sync_s": med(ds),
        "stall_finetune_sync_s": med(ours_sync),
        "stall_ratio": med(a) / med(ds),
        "stall_ratios_each": [x / y for x, y in zip(a, ds)],
        "e2e_s": {k: med(v) for k, v in e2e.items()},
        "e2e_overhead_sync": (med(e2e["sync"]) - none) / none,
        "e2e_overhead_async": (med(e2e["async"]) - none) / none,
        # each round's (none, sync, async runs, adjacent in time) async / none: the machine's drift
        # over the rounds cancels within a round
        "e2e_round_ratios": round_ratios(r["e2e"]),
    }
    # P3b: the writer's own time on its files (serialization with hashing and writing, fsync),
    # without the waits that pace it to training, against a raw write of the same bytes
    busy = [
        sum(p["writer_s"].get(k, 0.0) for k in ("torch_save", "fsync"))
        - p["writer_s"].get("paced", 0.0)
        for p in r["profile"]
    ]
    if busy and r.get("raw_write_s"):
        snapshot = stall[0]["snapshot_bytes_rank0"]
        s.update(
            writer_busy_s=med(busy),
            raw_write_s=med(r["raw_write_s"]),
            writer_mb_s=snapshot / med(busy) / 1e6,
            raw_mb_s=snapshot / med(r["raw_write_s"]) / 1e6,
        )
    if r["inflight_steps_s"] and r["idle_steps_s"]:
        s.update(
            step_inflight_s=med(r["inflight_steps_s"]),
            step_idle_s=med(r["idle_steps_s"]),
            step_ratio=med(r["inflight_steps_s"]) / med(r["idle_steps_s"]),
            steps_inflight=len(r["inflight_steps_s"]),
            steps_idle=len(r["idle_steps_s"]),
        )
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bg_saves", type=int, default=3)
    ap.add_argument("--e2e_steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--e2e_repeats", type=int, default=2)
    ap.add_argument(
        "--dir", default=None, help="where checkpoints are written (default: a temp dir)"
    )
    ap.add_argument(
        "--model_json", default=None, help="JSON object of config keys replacing the 134M Llama's"
    )
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--num_gpus", type=int, default=2, help="ranks (1 on a one-GPU machine)")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "async_save.json"))
    a = ap.parse_args()
    missing = api_missing()
    if missing:
        print(f"async_save: {missing}", file=sys.stderr)
        sys.exit(3)
    work = Path(a.dir or tempfile.mkdtemp(prefix="finetune-bench-async-"))
    work.mkdir(parents=True, exist_ok=True)
    cfg_dir, ds_path = write_inputs(work, json.loads(a.model_json) if a.model_json else None)
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
    )
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    cmd = [
        str(Path(sys.executable).parent / "deepspeed"),
        "--num_gpus",
        str(a.num_gpus),
        "--master_port",
        str(free_port()),
        str(Path(__file__).resolve().parent / "async_save_worker.py"),
        "--config_dir",
        str(cfg_dir),
        "--ds_config",
        str(ds_path),
        "--out",
        str(work / "out"),
        "--repeats",
        str(a.repeats),
        "--bg_saves",
        str(a.bg_saves),
        "--e2e_steps",
        str(a.e2e_steps),
        "--every",
        str(a.every),
        "--e2e_repeats",
        str(a.e2e_repeats),
        "--precision",
        a.precision,
    ]
    start = time.time()
    proc = subprocess.run(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=a.timeout
    )
    for line in proc.stdout.splitlines():
        shown = ("stall ", "profile ", "background save ", "e2e ")
        if line.startswith(shown) or "] stall " in line:
            print(line.split("] ")[-1] if "] " in line else line, flush=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stdout.write(proc.stdout[-6000:])
        sys.exit(f"worker failed with exit code {proc.returncode}")
    r = json.loads(lines[-1][len("RESULT ") :])
    shutil.rmtree(work / "out", ignore_errors=True)
    r["summary"] = s = summarize(r)
    print(
        f"model: {r['params']:,} parameters, {r['model_bytes_fp32'] / 1e6:.0f} MB fp32, "
        f"{r['world_size']} ranks; "
        f"checkpoint {r['stall'][0]['checkpoint_bytes'] / 1e6:.0f} MB"
    )
    print(
        f"(a) stall: async {s['stall_async_s']:.3f}s "
        f"vs DeepSpeed sync {s['stall_deepspeed_sync_s']:.3f}s "
        f"(finetune sync {s['stall_finetune_sync_s']:.3f}s): "
        f"ratio {s['stall_ratio']:.3f} (goal <= 0.1)"
    )
    if "step_ratio" in s:
        print(
            f"(b) step time, write in flight {s['step_inflight_s']:.3f}s "
            f"({s['steps_inflight']} steps) vs none "
            f"{s['step_idle_s']:.3f}s ({s['steps_idle']}): {s['step_ratio']:.3f} (goal <= 1.15)"
        )
    print(
        f"(c) {a.e2e_steps} steps, a save every {a.every}: "
        + ", ".join(f"{k} {v:.2f}s" for k, v in s["e2e_s"].items())
        + f"; overhead sync {100 * s['e2e_overhead_sync']:.1f}%, "
        f"async {100 * s['e2e_overhead_async']:.1f}%; async / none within each round "
        + ", ".join(f"{x:.3f}" for x in s["e2e_round_ratios"])
        + (
            f": median {statistics.median(s['e2e_round_ratios']):.3f} (goal <= 1.035)"
            if s["e2e_round_ratios"]
            else ""
        )
    )
    if "writer_mb_s" in s:
        print(
            f"(d) the writer: {s['writer_mb_s']:.0f} MB/s on its files ({s['writer_busy_s']:.3f}s "
            f"a save, pacing waits excluded) vs a raw write + fdatasync {s['raw_mb_s']:.0f} MB/s: "
            f"{s['writer_mb_s'] / s['raw_mb_s']:.2f} (goal >= 0.8)"
        )
    r.update(
        machine=machine(),
        date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        wall_s=time.time() - start,
        directory=str(work),
        command=" ".join(sys.argv),
    )
    write_json(a.out, r)


if __name__ == "__main__":
    main()
