"""Per-rank training-state memory under ZeRO-3 at 2 ranks vs 1 rank (P7): does it shrink with \
the world size?

    .venv/bin/python bench/save/state_memory.py [--worlds 1 2] [--model_json '{...}']
                                           [--out bench/results/state_memory.json]

For each world size, one run of ``bench/save/state_memory_worker.py`` under ``deepspeed --num_gpus
N``: the ~134M-parameter Llama of bench/save/checkpoint_save.py (hidden 768, 12 layers, vocab 32000,
untied head, fp32) built through finetune's ``build_trainer`` with the shipped ZeRO-3 config, one
optimizer step, then each rank sums the bytes of its parameter partitions, fp32 master partitions,
Adam state and gradient partitions, each storage counted once (the worker's docstring has the
details). Reported: the busiest rank's total at each size and the ratio between the last and first
size (goal for 2 vs 1 ranks: <= 0.6; the ideal is 0.5). DeepSpeed's fixed-size buffers (bucket
buffers, prefetch), activations and the framework itself are not training state and are not counted;
the process RSS is recorded beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.*
from bench.harness import REPO, free_port, write_json  # noqa: E402
from bench.save.checkpoint_save import write_inputs  # noqa: E402


def run(world: int, cfg_dir: Path, ds_path: Path, work: Path, timeout: float) -> dict:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
    )
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    cmd = [
        str(Path(sys.executable).parent / "deepspeed"),
        "--num_gpus",
        str(world),
        "--master_port",
        str(free_port()),
        str(Path(__file__).resolve().parent / "state_memory_worker.py"),
        "--config_dir",
        str(cfg_dir),
        "--ds_config",
        str(ds_path),
        "--out",
        str(work / f"out-{world}"),
    ]
    start = time.perf_counter()
    proc = subprocess.run(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stdout.write(proc.stdout[-5000:])
        sys.exit(f"worker ({world} ranks) failed with exit code {proc.returncode}")
    r = json.loads(lines[-1][len("RESULT ") :])
    r["wall_s"] = time.perf_counter() - start
    r["max_rank_total_bytes"] = max(x["total_bytes"] for x in r["ranks"])
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    ap.add_argument(
        "--model_json", default=None, help="JSON object of config keys replacing the 134M Llama's"
    )
    ap.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "state_memory.json"))
    a = ap.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="finetune-bench-mem-"))
    work.mkdir(parents=True, exist_ok=True)
    cfg_dir, ds_path = write_inputs(work, json.loads(a.model_json) if a.model_json else None)
    runs = [run(w, cfg_dir, ds_path, work, a.timeout) for w in a.worlds]
    first, last = runs[0], runs[-1]
    ratio = last["max_rank_total_bytes"] / first["max_rank_total_bytes"]
    print(
        f"{'world':>5} {'rank':>4} {'params MB':>10} {'master MB':>10} {'optim MB':>10} "
        f"{'grads MB':>10} {'total MB':>10} {'RSS MB':>8}"
    )
    for r in runs:
        for x in r["ranks"]:
            c = x["by_category"]
            print(
                f"{r['world_size']:>5} {x['rank']:>4} {c.get('params', 0) / 1e6:>10.1f} "
                f"{c.get('master', 0) / 1e6:>10.1f} {c.get('optimizer', 0) / 1e6:>10.1f} "
                f"{c.get('grads', 0) / 1e6:>10.1f} {x['total_bytes'] / 1e6:>10.1f} "
                f"{x['rss_bytes'] / 1e6:>8.0f}"
            )
    print(
        f"busiest rank at {last['world_size']} / at {first['world_size']} ranks: {ratio:.3f} "
        "(goal <= 0.6 for 2 vs 1)"
    )
    result = {
        "benchmark": "state_memory",
        "worlds": a.worlds,
        "runs": runs,
        "ratio": ratio,
        "params": first["ranks"][0]["params_numel"],
        "model_overrides": a.model_json,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_json(a.out, result)


if __name__ == "__main__":
    main()
