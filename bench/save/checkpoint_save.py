"""Checkpoint save benchmark: one 2-rank run on a ~134M-parameter Llama.

(a) partitioned save throughput of finetune (DeepSpeed rank files + our files + fsync + manifest +
    commit) as a fraction of the raw write bandwidth of the same directory, measured in the same
    run with the same byte count per rank (goal ≥ 0.8); DeepSpeed's plain save_checkpoint alongside.
(b) rank 0's peak RSS increase during finetune's consolidated save, divided by the model's fp32
    bytes (goal ≤ 0.3); DeepSpeed's save_16bit_model alongside.

    .venv/bin/python bench/save/checkpoint_save.py [--repeats 3] [--dir /tmp/finetune-bench-ckpt]
                                              [--model_json '{"hidden_size": 64, ...}']

The directory should be on the disk you care about (default: a temp dir on /tmp's filesystem).
Prints a table and writes bench/results/checkpoint_save.json.
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

MODEL = dict(
    model_type="llama",
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    vocab_size=32000,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=3,
)


def write_inputs(work: Path, overrides: dict | None = None) -> tuple[Path, Path]:
    """The model's config folder and the DeepSpeed JSON; ``overrides`` replace keys of MODEL."""
    from transformers import AutoConfig

    cfg_dir = work / "model_config"
    kw = {**MODEL, **(overrides or {})}
    AutoConfig.for_model(kw.pop("model_type"), **kw).save_pretrained(cfg_dir)
    ds = json.loads((REPO / "configs" / "ds_zero3.json").read_text())
    # for save_16bit_model
    ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    ds_path = work / "ds.json"
    ds_path.write_text(json.dumps(ds))
    return cfg_dir, ds_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--dir", default=None, help="where checkpoints are written (default: a temp dir)"
    )
    ap.add_argument(
        "--model_json",
        default=None,
        help=(
            "JSON object of config keys replacing the 134M Llama's "
            "(e.g. a tiny model for a smoke run)"
        ),
    )
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "checkpoint_save.json"))
    a = ap.parse_args()
    work = Path(a.dir or tempfile.mkdtemp(prefix="finetune-bench-ckpt-"))
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
        "2",
        "--master_port",
        str(free_port()),
        str(Path(__file__).resolve().parent / "checkpoint_save_worker.py"),
        "--config_dir",
        str(cfg_dir),
        "--ds_config",
        str(ds_path),
        "--out",
        str(work / "out"),
        "--repeats",
        str(a.repeats),
    ]
    start = time.time()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout.splitlines():
        if "Finished saving" in line:
            print(line.split("] ")[-1])
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stdout.write(proc.stdout[-5000:])
        sys.exit(f"worker failed with exit code {proc.returncode}")
    r = json.loads(lines[-1][len("RESULT ") :])
    shutil.rmtree(work / "out", ignore_errors=True)
    report(r)
    r.update(
        machine=machine(),
        date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        wall_s=time.time() - start,
        directory=str(work),
        command=" ".join(sys.argv),
    )
    write_json(a.out, r)


def report(r: dict) -> None:
    saves = r["saves"]
    ours = [s["ours_bytes"] / s["ours_s"] for s in saves]
    raw = [s["raw_bytes"] / s["raw_s"] for s in saves]
    ds = [s["deepspeed_bytes"] / s["deepspeed_s"] for s in saves]
    ratio = [o / w for o, w in zip(ours, raw)]
    print(
        f"model: {r['params']:,} parameters, {r['model_bytes_fp32'] / 1e6:.0f} MB fp32, "
        f"{r['world_size']} ranks"
    )
    print(f"{'save':<28}{'MB':>8}{'MB/s (each repeat)':>34}{'median':>10}")
    for name, rates, key in (
        ("finetune partitioned", ours, "ours_bytes"),
        ("raw write + fdatasync", raw, "raw_bytes"),
        ("DeepSpeed save_checkpoint", ds, "deepspeed_bytes"),
    ):
        each = " ".join(f"{x / 1e6:7.0f}" for x in rates)
        print(
            f"{name:<28}{saves[0][key] / 1e6:8.0f}{each:>34}{statistics.median(rates) / 1e6:10.0f}"
        )
    print(
        f"finetune / raw bandwidth: {' '.join(f'{x:.2f}' for x in ratio)} "
        f"(median {statistics.median(ratio):.2f}, goal >= 0.8)"
    )
    mb = r["model_bytes_fp32"]
    for name, key in (
        ("finetune consolidated", "consolidated"),
        ("DeepSpeed save_16bit_model", "save_16bit_model"),
    ):
        c = r[key]
        print(
            f"{name:<28} {c['seconds']:6.2f} s, rank-0 peak RSS +{c['rss_increase'] / 1e6:7.1f} MB "
            f"= {c['rss_increase'] / mb:.2f} x model bytes"
        )


if __name__ == "__main__":
    main()
