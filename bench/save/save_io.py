"""Per-rank save work at 2 and 4 ranks: does any rank's save cost grow with the world \
size?

    .venv/bin/python bench/save/save_io.py [--worlds 2 4] [--saves 4] [--before REF]
                                      [--out bench/results/save_io.json]
                                      [--config_name DIR] [--extra "--max_seq_length 32 ..."]

For each world size, one run of the embedded model through the DeepSpeed launcher saving a
partitioned checkpoint at every step (``--saves`` saves). Each rank records, per save, the seconds
and the deltas of /proc/self/io's ``rchar`` (everything the process read: files, and the sockets of
the gloo collectives) over ``Checkpointer.save`` (bench/save/save_io_probe.py). Reported per rank:
the median over the saves of rchar, the bytes of checkpoint files that rank wrote (from the
manifest), and seconds. ``--config_name DIR`` runs another model config instead of the embedded
model (e.g. bench/save/checkpoint_save.py's 134M Llama); ``--extra`` adds finetune flags to every
run.
``--before REF`` runs the same at a git ref (a worktree in a temp dir) for a
before/after table. The claim checked: rank 0's read bytes ≈ its shared files, not the whole
checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.*
from bench.harness import BIN, REPO, free_port, write_json  # noqa: E402

RANK_FILE = "zero_pp_rank_"


def run(src: Path, world: int, saves: int, work: Path, extra: list[str] = ()) -> dict:
    out, probe = work / f"out-{world}", work / f"probe-{world}"
    env = {
        **os.environ,
        "PYTHONPATH": f"{Path(__file__).resolve().parent}:{src}",
        "SAVE_IO_PROBE_DIR": str(probe),
        "PATH": f"{BIN}:{os.environ['PATH']}",
    }
    cmd = [
        str(BIN / "deepspeed"),
        "--num_gpus",
        str(world),
        "--master_port",
        str(free_port()),
        "--module",
        "save_io_probe",
        "--max_steps",
        str(saves),
        "--save_checkpoint",
        "--save_steps",
        "1",
        "--logging_steps",
        "1",
        "--eval_steps",
        "100000",
        "--per_device_train_batch_size",
        "2",
        "--output_dir",
        str(out),
        *extra,
    ]
    proc = subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"run failed ({world} ranks, {src}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    manifest = json.loads((out / f"global_step{saves}" / "manifest.json").read_text())
    files = manifest["files"]
    total = sum(m["size"] for m in files.values())
    shared = sum(
        m["size"] for n, m in files.items() if RANK_FILE not in n and not n.startswith("rng_state_")
    )
    ranks = []
    for r in range(world):
        rows = [json.loads(line) for line in (probe / f"rank{r}.jsonl").read_text().splitlines()]
        own = sum(
            m["size"]
            for n, m in files.items()
            if n.startswith(f"{RANK_FILE}{r}_")
            or n.startswith(f"bf16_{RANK_FILE}{r}_")
            or n == f"rng_state_{r}.pt"
        )
        ranks.append(
            {
                "rank": r,
                "wrote_mb": round((own + (shared if r == 0 else 0)) / 1e6, 3),
                "read_mb": round(statistics.median(x["rchar"] for x in rows) / 1e6, 3),
                "wchar_mb": round(statistics.median(x.get("wchar", 0) for x in rows) / 1e6, 3),
                "seconds": round(statistics.median(x["seconds"] for x in rows), 4),
                "saves": len(rows),
            }
        )
    return {
        "world": world,
        "checkpoint_mb": round(total / 1e6, 3),
        "shared_mb": round(shared / 1e6, 3),
        "ranks": ranks,
    }


def worktree(ref: str, work: Path) -> Path:
    path = work / f"src-{ref.replace('/', '_')}"
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(path), ref],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--before", help="a git ref to measure too (e.g. a commit before a change)")
    ap.add_argument(
        "--config_name", default=None, help="a model config folder (default: the embedded model)"
    )
    ap.add_argument("--extra", default="", help="more finetune flags for every run (one string)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "save_io.json"))
    args = ap.parse_args()
    extra = shlex.split(args.extra)
    if args.config_name:
        extra = [
            "--config_name",
            str(Path(args.config_name).resolve()),
            "--tokenizer_name",
            str(REPO / "finetune" / "resources" / "tokenizer"),
            *extra,
        ]
    results: dict = {
        "saves": args.saves,
        "config_name": args.config_name,
        "extra": extra,
        "runs": {},
    }
    with tempfile.TemporaryDirectory(prefix="finetune-save-io-") as tmp:
        work = Path(tmp)
        sources = {"after": REPO}
        if args.before:
            sources = {"before": worktree(args.before, work), **sources}
        try:
            for label, src in sources.items():
                results["runs"][label] = [
                    run(src, w, args.saves, work / label, extra) for w in args.worlds
                ]
        finally:
            if args.before:
                subprocess.run(
                    ["git", "worktree", "remove", "--force", str(sources["before"])], cwd=REPO
                )
    print(
        f"{'code':>6} {'world':>5} {'ckpt MB':>8} {'rank':>4} {'wrote MB':>9} {'read MB':>8} "
        f"{'save s':>7}"
    )
    for label, runs in results["runs"].items():
        for res in runs:
            for r in res["ranks"]:
                print(
                    f"{label:>6} {res['world']:>5} {res['checkpoint_mb']:>8.2f} {r['rank']:>4} "
                    f"{r['wrote_mb']:>9.3f} {r['read_mb']:>8.3f} {r['seconds']:>7.3f}"
                )
    write_json(args.out, results)


if __name__ == "__main__":
    main()
