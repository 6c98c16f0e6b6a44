"""Packing: training tokens/s with --packing (best-fit decreasing blocks) vs unpacked (rows padded
per micro-batch), and the packing efficiency, on the embedded model and data.

    .venv/bin/python bench/data/packing.py [--steps 60] [--rounds 2] [--nprocs 2] [--out FILE.json]

Each round launches both runs (unpacked, then packed; the order alternates between rounds) with
the DeepSpeed launcher, the same flags but --packing, and reads their metrics.jsonl: tokens/s is
the real (non-padding) tokens of the timed rows over their time, the rows after the first
``--warmup_rows`` (start-up, the first steps' allocations). The packing efficiency (real tokens /
block tokens) is the one the run logs at start (finetune/data/cache.py); the unpacked runs' is
real tokens / padded tokens, computed from the same tokenized rows and the run's batch size.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.*
from bench.harness import free_port  # noqa: E402

PY = sys.executable
EFFICIENCY = re.compile(r"packing \(bfd\): .* efficiency ([\d.]+)%")


def launch(out: Path, steps: int, nprocs: int, packing: bool, batch: int, every: int) -> dict:
    cmd = [
        str(Path(PY).parent / "deepspeed"),
        "--num_gpus",
        str(nprocs),
        "--master_port",  # not the launcher's 29500, which another launch may hold
        str(free_port()),
        "--module",
        "finetune",
        "--max_steps",
        str(steps),
        "--logging_steps",
        str(every),
        "--per_device_train_batch_size",
        str(batch),
        "--output_dir",
        str(out),
        "--no_plot",
        "--eval_steps",
        str(10 * steps),
        "--log_level",
        "info",
        *(["--packing"] if packing else []),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    found = EFFICIENCY.search(proc.stdout + proc.stderr)
    return {
        "rows": [r for r in rows if "tokens_per_s" in r],
        "efficiency": float(found.group(1)) / 100 if found else None,
    }


def tokens_per_s(rows: list[dict], warmup_rows: int) -> float:
    """Real tokens over time of the rows after the warm-up: each row's tokens / its tokens_per_s
    is its window's seconds."""
    timed = rows[warmup_rows:]
    if not timed or warmup_rows < 1:
        raise SystemExit(
            f"{len(rows)} metrics rows: more steps (or a smaller --logging_steps) are needed "
            f"to time any after the first {warmup_rows} (at least 1)"
        )
    tokens = [b["tokens_seen"] - a["tokens_seen"] for a, b in zip(rows[warmup_rows - 1 :], timed)]
    seconds = [t / r["tokens_per_s"] for t, r in zip(tokens, timed)]
    return sum(tokens) / sum(seconds)


def padded_efficiency(batch: int, nprocs: int, seed: int = 42) -> float:
    """Real / padded tokens of unpacked micro-batches: the embedded training set, dealt as the
    sampler deals it (one permutation per epoch), padded to each micro-batch's longest row."""
    from finetune.cli import parse_train_args
    from finetune.data import ResumableSampler
    from finetune.data.cache import prepare
    from finetune.modeling import load_tokenizer

    cfg = parse_train_args(["--output_dir", tempfile.mkdtemp()])
    train, _ = prepare(cfg, load_tokenizer(cfg.model))
    lengths = [len(r) for r in train["input_ids"]]
    real = padded = 0
    for rank in range(nprocs):
        order = ResumableSampler(len(lengths), nprocs, rank, seed).epoch_order(0)[rank::nprocs]
        for i in range(0, len(order) - batch + 1, batch):
            mb = [lengths[j] for j in order[i : i + batch]]
            real, padded = real + sum(mb), padded + max(mb) * len(mb)
    return real / padded


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--logging_steps", type=int, default=5)
    ap.add_argument("--warmup_rows", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="finetune-bench-packing-"))
    runs: dict[str, list] = {"unpacked": [], "packed": []}
    efficiency = None
    for r in range(a.rounds):
        for packing in (False, True) if r % 2 == 0 else (True, False):
            name = "packed" if packing else "unpacked"
            got = launch(work / f"{name}-{r}", a.steps, a.nprocs, packing, a.batch, a.logging_steps)
            tps = tokens_per_s(got["rows"], a.warmup_rows)
            runs[name].append(round(tps, 1))
            efficiency = got["efficiency"] if packing else efficiency
            print(f"round {r + 1} {name}: {tps:,.0f} tokens/s", flush=True)
    result = {
        "packed_tokens_per_s": statistics.median(runs["packed"]),
        "unpacked_tokens_per_s": statistics.median(runs["unpacked"]),
        "runs": runs,
        "packing_efficiency": efficiency,
        "padded_efficiency": round(padded_efficiency(a.batch, a.nprocs), 4),
        "settings": vars(a),
    }
    result["ratio"] = result["packed_tokens_per_s"] / result["unpacked_tokens_per_s"]
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
