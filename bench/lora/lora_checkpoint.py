"""LoRA vs full fine-tuning checkpoints: bytes and save seconds of the same ~134M Llama.

Two 2-rank runs of bench/lora/lora_checkpoint_worker.py on bench/save/checkpoint_save.py's model:
full fine-tuning, then LoRA (r 16, alpha 32, every linear layer but the head). Each times
``--repeats`` partitioned saves (sync, fsync'd, committed) and one consolidated save (model
safetensors vs adapter_model.safetensors). Prints both, and LoRA / full for each figure.

    .venv/bin/python bench/lora/lora_checkpoint.py [--repeats 3] [--dir DIR] [--model_json '{...}']

Writes bench/results/lora_checkpoint.json.
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


def run(work: Path, cfg_dir: Path, ds_path: Path, repeats: int, lora: bool) -> dict:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
        PYTHONPATH=str(REPO),  # the worker imports bench.save.checkpoint_save_worker
    )
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    out = work / ("lora" if lora else "full")
    cmd = [
        str(Path(sys.executable).parent / "deepspeed"),
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        str(Path(__file__).resolve().parent / "lora_checkpoint_worker.py"),
        "--config_dir",
        str(cfg_dir),
        "--ds_config",
        str(ds_path),
        "--out",
        str(out),
        "--repeats",
        str(repeats),
        *(["--lora"] if lora else []),
    ]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    shutil.rmtree(out, ignore_errors=True)
    if proc.returncode != 0 or not lines:
        sys.stdout.write(proc.stdout[-5000:])
        sys.exit(f"worker ({'lora' if lora else 'full'}) failed with exit code {proc.returncode}")
    return json.loads(lines[-1][len("RESULT ") :])


def summary(r: dict) -> dict:
    return {
        "checkpoint_bytes": statistics.median(s["bytes"] for s in r["saves"]),
        "save_s": statistics.median(s["seconds"] for s in r["saves"]),
        "consolidated_bytes": r["consolidated"]["bytes"],
        "consolidated_s": r["consolidated"]["seconds"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--dir", default=None, help="where checkpoints are written (default: a temp dir)"
    )
    ap.add_argument(
        "--model_json", default=None, help="JSON object of config keys replacing the 134M Llama's"
    )
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "lora_checkpoint.json"))
    a = ap.parse_args()
    work = Path(a.dir or tempfile.mkdtemp(prefix="finetune-bench-lora-"))
    work.mkdir(parents=True, exist_ok=True)
    cfg_dir, ds_path = write_inputs(work, json.loads(a.model_json) if a.model_json else None)
    start = time.time()
    full, lora = (run(work, cfg_dir, ds_path, a.repeats, flag) for flag in (False, True))
    fsum, lsum = summary(full), summary(lora)
    print(
        f"model: {full['params']:,} parameters; LoRA trains {lora['trainable']:,} "
        f"({100 * lora['trainable'] / full['params']:.2f}%); {full['world_size']} ranks, "
        f"{a.repeats} saves each"
    )
    print(f"{'':<34}{'full':>14}{'LoRA':>14}{'LoRA / full':>14}")
    for key, label, scale, unit in (
        ("checkpoint_bytes", "partitioned checkpoint", 1e6, "MB"),
        ("save_s", "partitioned save (median)", 1, "s"),
        ("consolidated_bytes", "consolidated weights", 1e6, "MB"),
        ("consolidated_s", "consolidated save", 1, "s"),
    ):
        print(
            f"{label + ' (' + unit + ')':<34}{fsum[key] / scale:>14.3f}{lsum[key] / scale:>14.3f}"
            f"{lsum[key] / fsum[key]:>14.4f}"
        )
    result = {
        "full": full,
        "lora": lora,
        "summary": {"full": fsum, "lora": lsum, "ratio": {k: lsum[k] / fsum[k] for k in fsum}},
        "machine": machine(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_s": time.time() - start,
        "directory": str(work),
        "command": " ".join(sys.argv),
    }
    write_json(a.out, result)


if __name__ == "__main__":
    main()
