"""Offline export: ``finetune export`` vs DeepSpeed's ``zero_to_fp32.py``, wall time and peak \
memory.

    .venv/bin/python bench/resume/export.py [--workdir /tmp/finetune_bench_export] [--repeats 3]
                                     [--model_json '{...}'] [--out bench/results/export.json]

The checkpoint: a ~134M-parameter Llama config (hidden 768, 12 layers, 12 heads, intermediate 2048,
vocab 32000, untied head; 536 MB of fp32 weights) trained for one step on 2 ranks through the real
CLI (``deepspeed --num_gpus 2 --module finetune --config_name … --max_steps 1 --save_checkpoint``),
created once under ``--workdir`` and reused (delete the folder to rebuild it; ~2.5 min on 2 cores).
``--model_json`` replaces config keys (a tiny model for a smoke run; used only when creating it).

Both tools turn ``global_step1``'s partitioned rank files into fp32 safetensors, each as one plain
process, alternating (ours, theirs, ours, …) ``--repeats`` times:

* ours:   ``python -m finetune export RUN/global_step1 OUT --dtype fp32``
* theirs: ``python RUN/zero_to_fp32.py RUN OUT --tag global_step1 --safe_serialization``
  (DeepSpeed's recovery script, which finetune copies beside the checkpoints)

Wall time is the child's, from fork to exit, imports included. Peak RSS is the child's own
high-water mark as the kernel reports it at exit (``wait4`` → ``ru_maxrss``, exact, no sampling),
taken by a small wrapper interpreter that forks the tool: Linux keeps the high-water mark across
fork and exec, so a tool started straight from this script would report at least this script's own
peak (hundreds of MB once it has imported transformers to create the checkpoint).
``python -c "import torch"`` is measured the same way: that floor (the interpreter and torch's
libraries) is part of any tool's peak, so the table also shows peak − floor, the memory the
conversion itself needs, and both as a fraction of the fp32 weight bytes. Each tool's own floor
(a process that imports what the tool imports before it starts working: ``finetune.cli`` and
``finetune.offline.export``; torch, numpy, tqdm and DeepSpeed's modules for ``zero_to_fp32.py``)
is in the JSON too (``own_floor_rss_bytes``, ``peak_minus_own_floor_over_weights``): the increase
over the process's own baseline after imports. The rank files are read
through the page cache, warm after the first run (not counted in RSS). Outputs are compared tensor
by tensor after the last round: both tools must produce identical weights.
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
from bench.harness import PY, REPO, free_port, machine, rank_env, versions, write_json  # noqa: E402

MODEL = dict(
    model_type="llama",
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=3,
)


def ensure_checkpoint(work: Path, overrides: dict | None = None) -> Path:
    run = work / "run"
    if (run / "global_step1" / "manifest.json").exists():
        return run
    from transformers import AutoConfig

    kw = {**MODEL, **(overrides or {})}
    AutoConfig.for_model(kw.pop("model_type"), **kw).save_pretrained(work / "model")
    shutil.rmtree(run, ignore_errors=True)
    cmd = [
        str(Path(PY).parent / "deepspeed"),
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        "--module",
        "finetune",
        "--config_name",
        str(work / "model"),
        "--tokenizer_name",
        str(REPO / "finetune/resources/tokenizer"),
        "--max_steps",
        "1",
        "--save_checkpoint",
        "--output_dir",
        str(run),
        "--per_device_train_batch_size",
        "1",
        "--max_seq_length",
        "32",
        "--max_eval_samples",
        "8",
    ]
    print("creating the checkpoint (one 2-rank step):", " ".join(cmd), flush=True)
    with open(work / "create.log", "w") as log:
        subprocess.run(
            cmd, cwd=work, env=rank_env(), stdout=log, stderr=subprocess.STDOUT, check=True
        )
    return run


# Runs argv[2:] as its child and writes [exit code, ru_maxrss KiB, wall s] as JSON to argv[1]. Linux
# carries a process's RSS high-water mark across fork and exec (signal->maxrss), so a child of this
# script, which may have imported torch and transformers (hundreds of MB), would report at least
# this script's peak; a child of a fresh, small interpreter reports its own.
_RUSAGE_WRAPPER = """
import json, os, sys, time
start = time.perf_counter()
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
wall = time.perf_counter() - start
with open(sys.argv[1], "w") as f:
    json.dump([os.waitstatus_to_exitcode(status), usage.ru_maxrss, wall], f)
"""


def measure(cmd: list[str]) -> dict:
    """Run ``cmd``; its wall time and its own peak RSS (exact: the kernel's high-water mark)."""
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as res:
        proc = subprocess.run(
            [PY, "-c", _RUSAGE_WRAPPER, res.name, *cmd],
            env=rank_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        out = proc.stdout
        try:
            code, maxrss_kib, wall = json.loads(Path(res.name).read_text())
        except ValueError:
            raise RuntimeError(
                f"{cmd}: no result from the wrapper ({proc.returncode}):\n{out.decode()[-3000:]}"
            ) from None
    if code != 0:
        raise RuntimeError(f"{cmd} failed ({code}):\n{out.decode()[-3000:]}")
    return {"wall_s": wall, "peak_rss_bytes": maxrss_kib * 1024, "output_tail": out.decode()[-400:]}


OUTS = {"finetune export": "out_finetune", "zero_to_fp32.py": "out_zero_to_fp32"}
# What each tool has imported before it reads the checkpoint: its own RSS floor.
IMPORTS = {
    "finetune export": "import finetune.cli, finetune.offline.export",
    "zero_to_fp32.py": "import torch, numpy, tqdm, deepspeed.utils, deepspeed.checkpoint.constants",
}


def command(name: str, run: Path, out: Path) -> list[str]:
    if name == "finetune export":
        return [
            PY,
            "-m",
            "finetune",
            "export",
            str(run / "global_step1"),
            str(out),
            "--dtype",
            "fp32",
        ]
    return [
        PY,
        str(run / "zero_to_fp32.py"),
        str(run),
        str(out),
        "--tag",
        "global_step1",
        "--safe_serialization",
    ]


def same_weights(a: Path, b: Path) -> bool:
    import torch
    from safetensors import safe_open

    def index(folder: Path) -> dict[str, Path]:
        files = sorted(folder.glob("*.safetensors"))
        out = {}
        for f in files:
            with safe_open(f, "pt") as s:
                out.update({k: f for k in s.keys()})
        return out

    ia, ib = index(a), index(b)
    if set(ia) != set(ib):
        return False
    for k in ia:
        with safe_open(ia[k], "pt") as sa, safe_open(ib[k], "pt") as sb:
            if not torch.equal(sa.get_tensor(k), sb.get_tensor(k)):
                return False
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", default="/tmp/finetune_bench_export")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--floor_repeats",
        type=int,
        default=2,
        help="runs of each import-only floor process (min taken)",
    )
    p.add_argument(
        "--model_json",
        default=None,
        help=(
            "JSON object of config keys replacing the 134M Llama's (when the checkpoint is created)"
        ),
    )
    p.add_argument("--out", default=str(REPO / "bench/results/export.json"))
    args = p.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    run = ensure_checkpoint(work, json.loads(args.model_json) if args.model_json else None)
    config = json.loads((run / "global_step1" / "config.json").read_text())
    floor = min(
        measure([PY, "-c", "import torch"])["peak_rss_bytes"] for _ in range(args.floor_repeats)
    )
    own_floors = {
        name: min(measure([PY, "-c", imports])["peak_rss_bytes"] for _ in range(args.floor_repeats))
        for name, imports in IMPORTS.items()
    }
    samples: dict[str, list[dict]] = {name: [] for name in OUTS}
    for i in range(args.repeats):
        for name, sub in OUTS.items():
            shutil.rmtree(work / sub, ignore_errors=True)
            samples[name].append(measure(command(name, run, work / sub)))
            print(
                f"round {i + 1} {name}: {samples[name][-1]['wall_s']:.2f} s, "
                f"peak RSS {samples[name][-1]['peak_rss_bytes'] / 1e6:.0f} MB",
                flush=True,
            )
    ours, theirs = (work / sub for sub in OUTS.values())
    report(
        samples,
        floor,
        _weight_bytes(ours),
        same_weights(ours, theirs),
        config,
        args.out,
        own_floors,
    )
    for sub in OUTS.values():
        shutil.rmtree(work / sub, ignore_errors=True)


def _weight_bytes(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(f, "pt") as s:
            for k in s.keys():
                sl = s.get_slice(k)
                n = 1
                for d in sl.get_shape():
                    n *= d
                total += n * 4
    return total


def report(
    samples: dict,
    floor: int,
    fp32_bytes: int,
    identical: bool,
    config: dict,
    path: str,
    own_floors: dict | None = None,
) -> None:
    rows = {}
    print(
        f"\nfp32 weights: {fp32_bytes / 1e6:.1f} MB; python+torch floor: {floor / 1e6:.0f} MB; "
        f"outputs identical: {identical}"
    )
    print(
        f"{'tool':<18}{'wall s (median)':>16}{'peak RSS MB':>13}{'/ weights':>11}"
        f"{'peak-floor MB':>15}{'/ weights':>11}"
    )
    for name, runs in samples.items():
        wall = statistics.median(r["wall_s"] for r in runs)
        peak = max(r["peak_rss_bytes"] for r in runs)
        rows[name] = {
            "wall_s_median": wall,
            "wall_s": [r["wall_s"] for r in runs],
            "peak_rss_bytes": peak,
            "peak_rss_bytes_each": [r["peak_rss_bytes"] for r in runs],
            "peak_rss_over_weights": peak / fp32_bytes,
            "peak_minus_floor_bytes": peak - floor,
            "peak_minus_floor_over_weights": (peak - floor) / fp32_bytes,
        }
        if own_floors:
            own = own_floors[name]
            rows[name].update(
                own_floor_rss_bytes=own,
                peak_minus_own_floor_bytes=peak - own,
                peak_minus_own_floor_over_weights=(peak - own) / fp32_bytes,
            )
        print(
            f"{name:<18}{wall:>16.2f}{peak / 1e6:>13.0f}{peak / fp32_bytes:>11.2f}"
            f"{(peak - floor) / 1e6:>15.0f}{(peak - floor) / fp32_bytes:>11.2f}"
        )
    result = {
        "benchmark": "export",
        "fp32_weight_bytes": fp32_bytes,
        "torch_floor_rss_bytes": floor,
        "outputs_identical": identical,
        "world_size": 2,
        "tools": rows,
        "model": {
            k: config.get(k)
            for k in (
                "model_type",
                "hidden_size",
                "num_hidden_layers",
                "vocab_size",
                "intermediate_size",
                "tie_word_embeddings",
            )
        },
        "machine": machine(),
        "versions": versions(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    write_json(path, result)


if __name__ == "__main__":
    main()
