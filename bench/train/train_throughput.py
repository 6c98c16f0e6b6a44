"""Training throughput: ``finetune`` vs HF ``Trainer --deepspeed``, same model/data/batch/ZeRO-3 \
config.

    .venv/bin/python bench/train/train_throughput.py [--steps 60]
                                               [--out bench/results/train_throughput.json]

One invocation launches, one after the other, each as 2 ranks through the DeepSpeed launcher:

* ``deepspeed --num_gpus 2 --module finetune ...``            (our CLI, unmodified)
* ``deepspeed --num_gpus 2 bench/train/hf_trainer_run.py ...``      (transformers ``Trainer``,
                                                              ``deepspeed=<json>``)

in the order finetune, HF, HF, finetune (``--rounds 2``; ABBA so that a drift in machine load
does not favour one side), and prints a table and the ratio finetune / HF.

Identical on both sides
-----------------------
* Model: ``finetune/resources/model/config.json`` scaled to ``--hidden_size``/``--num_layers``
  (default 256 / 4, ~3.3M parameters, so compute rather than Python overhead dominates), saved to a
  temp dir; finetune gets ``--config_name DIR``, the HF script ``AutoModelForCausalLM.from_config``
  of the same file. fp32, seed 42, built partitioned under ``zero.Init``.
* Tokenizer ``finetune/resources/tokenizer``; data ``finetune/resources/data/train.jsonl``
  (``text``; tokenizer special tokens, eos appended, truncated to ``--max_seq_length``; no packing;
  padded per batch to its longest row; pad masked from loss and attention). finetune gets
  ``--validation_split_percentage 0`` so it trains on all 2000 rows and never evaluates, as HF does
  (``eval_strategy="no"``). No checkpoint saving on either side.
* ``--per_device_train_batch_size`` (16), gradient accumulation 1, lr 1e-3 with 10 linear warmup
  steps then linear decay, AdamW (0.9, 0.999, 1e-8, weight decay 0), clipping 1.0,
  ``--logging_steps`` (5) on both (each tool's own per-log work is part of what is timed).
* DeepSpeed JSON: ``configs/ds_zero3.json`` copied to a temp file for each; for HF
  ``train_batch_size`` is left out (DeepSpeed derives it from micro-batch x accumulation x ranks);
  HF fills the other "auto"s itself, finetune from its flags.
* Environment: the same for both launches; ``OMP_NUM_THREADS`` is set to ``--threads_per_rank``
  (default: cores // 2, so 2 ranks do not oversubscribe the machine; 0 = leave the environment as
  is).
* Each rank trains rows of its own per step (``--per_device_train_batch_size`` of them on average;
  the rows are dealt as below), as on GPUs: on a
  CPU accelerate names no backend under the DeepSpeed launcher and would report one process to
  each rank (every HF rank training the *same* rows, so the ranks' steps are perfectly balanced,
  and no cross-rank token count); ``hf_trainer_run.gloo_state`` makes its state on gloo first, so
  Trainer shards the dataloader and gathers the step's token count as it does on GPUs. The HF
  script records what accelerate believes (``hf_view`` in the JSON); tokens are counted per rank
  as trained (mean tokens per step is in the JSON).
* The same rows per step, not the same rows per rank: finetune deals each step's rows to its ranks
  by length (its default, ``--balance_by_length``, docs/TRAINING.md), Trainer round-robin. Each
  tool's launches count the same tokens over the timed steps.
* ``PATH`` gets this interpreter's bin directory first (as ``make bench`` does), so DeepSpeed's JIT
  op builds use the venv's ``ninja``: a different ninja version hashes build commands differently
  and makes ``~/.cache/torch_extensions`` rebuild (minutes) every time the two alternate.

What is measured
----------------
tokens/s = (non-pad tokens trained on in optimizer steps W+1 .. N, summed over both ranks)
           / (wall time from the end of step W to the end of step N, rank 0's ``time.perf_counter``)

with N = ``--steps`` and W = ``--warmup`` (10): process start-up, imports, model build,
``deepspeed.initialize`` and the first W steps are excluded. The timed part contains everything each
tool does per step: batch collation, forward/backward/step, its logging every ``--logging_steps``
(progress bar, metric reductions, metrics file), and nothing else.

* finetune: from ``OUT/metrics.jsonl``, one row per ``--logging_steps`` window, each with
  ``tokens_seen`` (all ranks, cumulative) and ``tokens_per_s`` (window tokens / window wall time
  between consecutive log points). Window time = window tokens / tokens_per_s; the timed span is the
  sum over the windows after step W, i.e. the time between the log points at steps W and N.
* HF: ``bench/train/hf_trainer_run.py`` records ``perf_counter`` in ``TrainerCallback.on_step_end``
  and counts ``attention_mask.sum()`` of every micro-batch in ``training_step`` on each rank; tokens
  are summed over ranks, times taken from rank 0.

Both spans therefore cover (N - W) optimizer steps and (N - W) / logging_steps log events.

Other load on the machine skews the numbers; each launch records ``foreign_cpu_s``: CPU seconds the
whole machine spent busy during the launch (``/proc/stat``) minus those of the launch's own process
tree (``RUSAGE_CHILDREN``). Near 0 means the launch had the machine to itself. A launch whose
foreign CPU exceeds ``--quiet_threshold`` (5%) of the machine's capacity over the launch is marked
``contended``; the ratio is printed over all launches and, when each tool has a quiet launch, over
quiet launches only (the number to trust on a shared machine). ``--wait_quiet S`` waits up to S
seconds before each launch for the machine to be idle.
Per launch the JSON keeps the raw rows/timestamps; the per-tool figure is total tokens / total time
over that tool's launches, and the ratio is finetune / HF of those figures.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.*
from bench.harness import REPO, free_port, machine, versions  # noqa: E402
from bench.train.mfu import mfu  # noqa: E402
from finetune.ops import parsable_cuda_arch_list  # noqa: E402

RES = REPO / "finetune" / "resources"
MODEL_CONFIG = RES / "model" / "config.json"
TOKENIZER_DIR = RES / "tokenizer"
TRAIN_FILE = RES / "data" / "train.jsonl"
DS_CONFIG = REPO / "configs" / "ds_zero3.json"
HF_SCRIPT = Path(__file__).resolve().parent / "hf_trainer_run.py"
# Real models' shapes, for a GPU's figures (--shape); "scaled" derives one from --hidden_size.
SHAPES = {
    "scaled": None,
    "llama-3.2-1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
    },
}


# What --setting changes, on both tools alike: "default" is finetune's defaults; "liger" adds
# Liger's fused kernels (finetune --use_liger_kernel, Trainer use_liger_kernel=True); "tuned" raises
# ZeRO-3's prefetch and persistence thresholds for one GPU holding the whole model (every
# parameter under 1M elements kept resident, 500M elements prefetched ahead).
TUNED_ZERO3 = {
    "stage3_prefetch_bucket_size": 5e8,
    "stage3_param_persistence_threshold": 1e6,
    "stage3_max_live_parameters": 3e9,
    "stage3_max_reuse_distance": 3e9,
    "reduce_bucket_size": 5e8,
}
SETTINGS = ("default", "liger", "tuned")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per launch (N)")
    p.add_argument("--warmup", type=int, default=10, help="steps excluded from timing (W)")
    p.add_argument("--logging_steps", type=int, default=5)
    p.add_argument("--per_device_train_batch_size", type=int, default=16)
    p.add_argument("--max_seq_length", type=int, default=128)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument(
        "--lr_warmup_steps", type=int, default=10, help="learning-rate warmup (both tools)"
    )
    p.add_argument("--hidden_size", type=int, default=256)
    p.add_argument("--num_layers", type=int, default=4)
    p.add_argument(
        "--long_rows",
        action="store_true",
        help="train on rows that fill --max_seq_length (the embedded texts one after another) "
        "instead of the embedded rows (33-47 tokens each)",
    )
    p.add_argument(
        "--shape",
        choices=tuple(SHAPES),
        default="scaled",
        help="the model: 'scaled' is the embedded config at --hidden_size x --num_layers; "
        "a named shape is that model's (the embedded tokenizer's vocabulary either way)",
    )
    p.add_argument(
        "--setting",
        choices=SETTINGS,
        default="default",
        help="both tools: the defaults, Liger's kernels (GPU), or ZeRO-3's prefetch and "
        "persistence thresholds raised (TUNED_ZERO3)",
    )
    p.add_argument("--num_gpus", type=int, default=2, help="ranks per launch")
    p.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="both tools: fp32, or bf16 mixed precision (GPU runs)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="launches per tool; order alternates finetune,HF,HF,finetune,...",
    )
    add_launch_args(p)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "train_throughput.json"))
    a = p.parse_args(argv)
    check_window(p, a)
    return a


def add_launch_args(p: argparse.ArgumentParser) -> None:
    """How each launch runs, on a machine other work may share (also P13's)."""
    p.add_argument(
        "--threads_per_rank",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 2),
        help="exported as OMP_NUM_THREADS to both launches; 0 = inherit",
    )
    p.add_argument("--timeout", type=int, default=900, help="seconds per launch")
    p.add_argument(
        "--quiet_threshold",
        type=float,
        default=0.05,
        help="a launch is 'contended' when other processes used more than this share of all cores",
    )
    p.add_argument(
        "--wait_quiet",
        type=float,
        default=0,
        help="before each launch wait up to this many seconds for other processes to go idle",
    )


def check_window(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """The timed window: whole logging windows after the warmup (also P13's)."""
    if a.warmup % a.logging_steps or a.steps % a.logging_steps:
        p.error(
            "--warmup and --steps must be multiples of --logging_steps (finetune logs per window)"
        )
    if not 0 <= a.warmup < a.steps:
        p.error("need 0 <= --warmup < --steps")


# --- the launcher --------------------------------------------------------------------------


def deepspeed_launcher() -> str:
    here = Path(sys.executable).parent / "deepspeed"
    found = str(here) if here.exists() else shutil.which("deepspeed")
    if not found:
        sys.exit("bench: no `deepspeed` launcher next to this python or on PATH")
    return found


# --- inputs --------------------------------------------------------------------------------


def write_inputs(a: argparse.Namespace, tmp: Path) -> dict:
    cfg = json.loads(MODEL_CONFIG.read_text())
    head_dim = cfg.get("head_dim", 32)
    kv_ratio = cfg["num_attention_heads"] // cfg["num_key_value_heads"]
    heads = max(1, a.hidden_size // head_dim)
    cfg.update(
        SHAPES[a.shape]
        or dict(
            hidden_size=a.hidden_size,
            intermediate_size=3 * a.hidden_size,
            num_hidden_layers=a.num_layers,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // kv_ratio),
            head_dim=head_dim,
        )
    )
    train_file = long_rows(a, tmp / "train.jsonl") if a.long_rows else TRAIN_FILE
    model_dir = tmp / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    ds = json.loads(DS_CONFIG.read_text())
    if a.setting == "tuned":
        ds["zero_optimization"].update(TUNED_ZERO3)
    (tmp / "ds_finetune.json").write_text(json.dumps(ds, indent=2))
    ds_hf = {k: v for k, v in ds.items() if k != "train_batch_size"}
    (tmp / "ds_hf.json").write_text(json.dumps(ds_hf, indent=2))
    return {
        "model_config": cfg,
        "ds_finetune": ds,
        "ds_hf": ds_hf,
        "model_dir": str(model_dir),
        "train_file": str(train_file),
        "ds_finetune_path": str(tmp / "ds_finetune.json"),
        "ds_hf_path": str(tmp / "ds_hf.json"),
    }


def long_rows(a: argparse.Namespace, path: Path) -> Path:
    """As many rows as the launches train (at least 64), each the embedded texts one after
    another (cycling) up to 8 characters a token of --max_seq_length: more than any tokenizer here
    needs to fill the row, which both tools then truncate alike."""
    texts = [json.loads(line)["text"] for line in TRAIN_FILE.read_text().splitlines() if line]
    cycle = itertools.cycle(texts)
    rows = max(64, a.steps * a.per_device_train_batch_size * a.num_gpus)
    with open(path, "w") as f:
        for _ in range(rows):
            parts, chars = [], 0
            while chars < 8 * a.max_seq_length:
                parts.append(next(cycle))
                chars += len(parts[-1]) + 2
            f.write(json.dumps({"text": "\n\n".join(parts)}) + "\n")
    return path


def common_flags(a: argparse.Namespace) -> list[str]:
    return [
        "--max_seq_length",
        str(a.max_seq_length),
        "--per_device_train_batch_size",
        str(a.per_device_train_batch_size),
        "--learning_rate",
        str(a.learning_rate),
        "--warmup_steps",
        str(a.lr_warmup_steps),
        "--max_steps",
        str(a.steps),
        "--logging_steps",
        str(a.logging_steps),
        "--seed",
        "42",
    ]


def finetune_cmd(a, inputs: dict, out_dir: Path) -> list[str]:
    return [
        deepspeed_launcher(),
        "--num_gpus",
        str(a.num_gpus),
        "--master_port",
        str(free_port()),
        "--module",
        "finetune",
        "--config_name",
        inputs["model_dir"],
        "--tokenizer_name",
        str(TOKENIZER_DIR),
        "--train_file",
        inputs["train_file"],
        "--validation_split_percentage",
        "0",
        "--deepspeed_config",
        inputs["ds_finetune_path"],
        "--output_dir",
        str(out_dir),
        "--gradient_accumulation_steps",
        "1",
        "--weight_decay",
        "0.0",
        "--max_grad_norm",
        "1.0",
        "--lr_scheduler_type",
        "linear",
        "--precision",
        a.precision,
        *(["--use_liger_kernel"] if a.setting == "liger" else []),
        *common_flags(a),
    ]


def hf_cmd(a, inputs: dict, out_dir: Path) -> list[str]:
    return [
        deepspeed_launcher(),
        "--num_gpus",
        str(a.num_gpus),
        "--master_port",
        str(free_port()),
        str(HF_SCRIPT),
        "--config_dir",
        inputs["model_dir"],
        "--tokenizer_dir",
        str(TOKENIZER_DIR),
        "--train_file",
        inputs["train_file"],
        "--ds_config",
        inputs["ds_hf_path"],
        "--output_dir",
        str(out_dir / "trainer_out"),
        "--result",
        str(out_dir / "hf"),
        *(["--bf16"] if a.precision == "bf16" else []),
        *(["--liger"] if a.setting == "liger" else []),
        *common_flags(a),
    ]


# --- running and measuring -----------------------------------------------------------------


def cpu_busy_s() -> float | None:
    """Busy CPU seconds of the whole machine so far (all cores), from /proc/stat."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def wait_quiet(max_wait: float, threshold: float) -> float:
    """Sleep until the machine is idle (busy < threshold of all cores over 3 s) or max_wait
    passes."""
    t0 = time.perf_counter()
    ncpu = os.cpu_count() or 1
    while time.perf_counter() - t0 < max_wait:
        b0 = cpu_busy_s()
        time.sleep(3)
        b1 = cpu_busy_s()
        if b0 is None or b1 is None or (b1 - b0) / (3 * ncpu) < threshold:
            break
    return round(time.perf_counter() - t0, 1)


def launch(cmd: list[str], cwd: Path, env: dict, log: Path, timeout: int) -> dict:
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    busy0, own0 = cpu_busy_s(), children_cpu_s()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            proc = subprocess.run(
                cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout
            )
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - t0
    busy1, own1 = cpu_busy_s(), children_cpu_s()
    foreign = None if busy0 is None or busy1 is None else round((busy1 - busy0) - (own1 - own0), 2)
    if rc != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:])
        sys.exit(
            f"bench: launch failed (rc={rc}): {' '.join(cmd)}\n--- last lines of {log} ---\n{tail}"
        )
    return {
        "cmd": cmd,
        "wall_s": round(wall, 2),
        "own_cpu_s": round(own1 - own0, 2),
        "foreign_cpu_s": foreign,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }


def measure_finetune(out_dir: Path, a) -> dict:
    rows = [
        json.loads(line)
        for line in (out_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    train_rows = [r for r in rows if "tokens_per_s" in r]
    if any("eval_loss" in r for r in rows):
        sys.exit("bench: finetune evaluated during the run; expected no eval set")
    windows, prev = [], 0
    for r in train_rows:
        tok = r["tokens_seen"] - prev
        windows.append({"step": r["step"], "tokens": tok, "seconds": tok / r["tokens_per_s"]})
        prev = r["tokens_seen"]
    timed = [w for w in windows if w["step"] > a.warmup]
    if not timed or timed[-1]["step"] != a.steps:
        sys.exit(
            f"bench: finetune metrics do not reach step {a.steps}: {[w['step'] for w in windows]}"
        )
    tokens = sum(w["tokens"] for w in timed)
    seconds = sum(w["seconds"] for w in timed)
    return {
        "steps_timed": a.steps - a.warmup,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "windows": windows,
        "metrics_rows": train_rows,
        "tokens_cum_by_step": {r["step"]: r["tokens_seen"] for r in train_rows},
    }


def measure_hf(out_dir: Path, a) -> dict:
    ranks = [json.loads(p.read_text()) for p in sorted(out_dir.glob("hf.rank*.json"))]
    if len(ranks) != a.num_gpus:
        sys.exit(f"bench: expected {a.num_gpus} HF rank files in {out_dir}, found {len(ranks)}")
    r0 = next(r for r in ranks if r["rank"] == 0)
    steps = r0["steps"]
    if steps[-1] != a.steps or steps != list(range(1, a.steps + 1)):
        sys.exit(
            f"bench: HF Trainer recorded steps {steps[:3]}..{steps[-3:]}, expected 1..{a.steps}"
        )
    tok_cum = [sum(r["tokens_cum"][i] for r in ranks) for i in range(len(steps))]
    t = r0["times"]
    w = a.warmup
    t_w = t[w - 1] if w else r0["t_train_begin"]
    tok_w = tok_cum[w - 1] if w else 0
    tokens = tok_cum[-1] - tok_w
    seconds = t[-1] - t_w
    per_step = [
        {
            "step": s,
            "tokens": tok_cum[i] - (tok_cum[i - 1] if i else 0),
            "seconds": t[i] - (t[i - 1] if i else r0["t_train_begin"]),
        }
        for i, s in enumerate(steps)
    ]
    meta = {  # (.get: bench/train/trl_pref_run.py's rank files have no hf_view, train_examples)
        k: r0.get(k)
        for k in (
            "hf_view",
            "world_size",
            "backend",
            "torch_num_threads",
            "omp_num_threads_env",
            "parameters",
            "train_examples",
            "ds_train_batch_size",
            "ds_zero_stage",
            "optimizer",
            "startup_s",
            "train_call_s",
        )
    }
    return {
        "steps_timed": a.steps - w,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "per_step": per_step,
        "meta": meta,
        "log_history": r0.get("log_history", r0.get("logs")),
        "tokens_cum_by_step": {s: tok_cum[i] for i, s in enumerate(steps)},
    }


def model_flops(a: argparse.Namespace, cfg: dict, summary: dict) -> dict:
    """Each tool's MFU (bench/train/mfu.py) at its tokens/s, rows as long as its mean row."""
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    rows_per_step = a.per_device_train_batch_size * a.num_gpus
    return {
        tool: mfu(
            s["tokens_per_s"],
            cfg,
            s["mean_tokens_per_step"] / rows_per_step,
            device,
            a.num_gpus,
            a.precision,
        )
        for tool, s in summary.items()
    }


def summarize(launches: list[dict], tools: tuple[str, ...], per_launch: tuple = ()) -> dict:
    """Each tool's total tokens / total timed seconds over ``launches`` ({}: a tool has none),
    with each launch's rate and foreign CPU, and each of ``per_launch``'s fields (also P13's)."""
    out = {}
    for tool in tools:
        ms = [m for m in launches if m["tool"] == tool]
        if not ms:
            return {}
        tokens, seconds = sum(m["tokens"] for m in ms), sum(m["seconds"] for m in ms)
        rates = [m["tokens_per_s"] for m in ms]
        steps = sum(m["steps_timed"] for m in ms)
        out[tool] = {
            "launches": [m["launch"] + 1 for m in ms],
            "steps_timed": steps,
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds,
            "tokens_per_s_per_launch": rates,
            "min": min(rates),
            "max": max(rates),
            "mean_tokens_per_step": tokens / steps,
            "foreign_cpu_s_per_launch": [m["foreign_cpu_s"] for m in ms],
            **{f"{key}_per_launch": [m[key] for m in ms] for key in per_launch},
        }
    return out


def launch_env(a: argparse.Namespace) -> dict:
    """The environment both tools' launches get (also P13's)."""
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    # HF Trainer's FusedAdam needs the arch list DeepSpeed can parse, as finetune makes it itself
    parsable_cuda_arch_list(env)
    if a.threads_per_rank:
        env["OMP_NUM_THREADS"] = str(a.threads_per_rank)
    return env


def timed_launch(a: argparse.Namespace, cmd: list[str], cwd: Path, env: dict, log: Path) -> dict:
    """One launch after waiting for a quiet machine (--wait_quiet), with the share of the
    machine other processes used meanwhile and whether that makes it contended (also P13's)."""
    waited = wait_quiet(a.wait_quiet, a.quiet_threshold) if a.wait_quiet else 0.0
    info = launch(cmd, cwd, env, log, a.timeout)
    info["waited_for_quiet_s"] = waited
    share = (
        None
        if info["foreign_cpu_s"] is None
        else info["foreign_cpu_s"] / (info["wall_s"] * (os.cpu_count() or 1))
    )
    info["foreign_cpu_share"] = None if share is None else round(share, 3)
    info["contended"] = share is not None and share > a.quiet_threshold
    return info


def finetune_meta(log: Path) -> dict:
    meta = {}
    for line in log.read_text(errors="replace").splitlines():
        if "[finetune]" in line and "parameters" in line and "ready in" in line:
            meta["startup_line"] = line.split("] ", 3)[-1]
    return meta


def main(argv=None) -> int:
    a = parse_args(argv)
    out_path = Path(a.out).resolve()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    logs_dir = out_path.with_suffix("")
    logs_dir = logs_dir.parent / (logs_dir.name + "_logs")
    if logs_dir.exists():
        shutil.rmtree(logs_dir)
    logs_dir.mkdir()
    env = launch_env(a)
    started = _dt.datetime.now(_dt.timezone.utc)
    order = []
    for i in range(a.rounds):
        order += [["finetune", "hf"], ["hf", "finetune"]][i % 2]
    launches = []
    with tempfile.TemporaryDirectory(prefix="bench_tp_") as tmp_s:
        tmp = Path(tmp_s)
        inputs = write_inputs(a, tmp)
        for i, tool in enumerate(order):
            run_dir = tmp / f"{i}_{tool}"
            run_dir.mkdir()
            log = logs_dir / f"{i}_{tool}.log"
            cmd = (
                finetune_cmd(a, inputs, run_dir / "out")
                if tool == "finetune"
                else hf_cmd(a, inputs, run_dir)
            )
            print(f"[bench] launch {i + 1}/{len(order)}: {tool} (log: {log})", flush=True)
            info = timed_launch(a, cmd, tmp, env, log)
            if tool == "finetune":
                m = measure_finetune(run_dir / "out", a)
                m["meta"] = finetune_meta(log)
                shutil.copy(
                    run_dir / "out" / "metrics.jsonl", logs_dir / f"{i}_{tool}_metrics.jsonl"
                )
            else:
                m = measure_hf(run_dir, a)
            m.update(tool=tool, launch=i, **info)
            print(
                f"[bench]   {tool}: {m['tokens_per_s']:.1f} tokens/s "
                f"over steps {a.warmup + 1}..{a.steps} "
                f"({m['tokens']} tokens in {m['seconds']:.2f}s; launch wall {info['wall_s']:.1f}s, "
                f"foreign CPU {info['foreign_cpu_s']}s)",
                flush=True,
            )
            launches.append(m)

    summary = summarize(launches, ("finetune", "hf"))
    ratio = summary["finetune"]["tokens_per_s"] / summary["hf"]["tokens_per_s"]
    quiet = summarize([m for m in launches if not m["contended"]], ("finetune", "hf"))
    ratio_quiet = quiet["finetune"]["tokens_per_s"] / quiet["hf"]["tokens_per_s"] if quiet else None

    utilisation = model_flops(a, inputs["model_config"], summary)
    result = {
        "benchmark": "train_throughput",
        "date_utc": started.isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else argv,
        "machine": machine(),
        "versions": versions(),
        "settings": {
            **vars(a),
            "omp_num_threads": env.get("OMP_NUM_THREADS"),
            "order": order,
            "tokenizer": str(TOKENIZER_DIR.relative_to(REPO)),
            "train_file": str(TRAIN_FILE.relative_to(REPO)),  # or its long rows (long_rows)
            "gradient_accumulation_steps": 1,
            "zero_stage": 3,
        },
        "model_config": inputs["model_config"],
        "ds_config_finetune": inputs["ds_finetune"],
        "ds_config_hf": inputs["ds_hf"],
        "measure": (
            f"non-pad tokens (attention_mask.sum(), all ranks) trained in optimizer steps "
            f"{a.warmup + 1}..{a.steps} / rank-0 wall time from end of step {a.warmup} "
            f"to end of step {a.steps}"
        ),
        "summary": summary,
        "ratio_finetune_over_hf": ratio,
        "summary_quiet_launches": quiet,
        "ratio_finetune_over_hf_quiet_launches": ratio_quiet,
        "mfu": utilisation,
        "launches": launches,
        "logs_dir": str(logs_dir),
    }
    out_path.write_text(json.dumps(result, indent=1, default=str))

    print()
    print(
        f"Training throughput, {a.num_gpus} ranks, ZeRO-3, {a.precision}, setting {a.setting}, "
        f"{inputs['model_config']['num_hidden_layers']} layers "
        f"x {inputs['model_config']['hidden_size']}, batch {a.per_device_train_batch_size}/rank, "
        f"OMP_NUM_THREADS={env.get('OMP_NUM_THREADS', 'unset')}"
    )
    names = {"finetune": "finetune", "hf": "HF Trainer"}
    print(
        f"{'launch':>6}  {'tool':<10} {'steps timed':>11} {'tokens':>7} {'seconds':>8} "
        f"{'tokens/s':>9}  other load"
    )
    for m in launches:
        load = (
            "n/a"
            if m["foreign_cpu_share"] is None
            else f"{100 * m['foreign_cpu_share']:.0f}% of CPU"
            + (" (contended)" if m["contended"] else "")
        )
        print(
            f"{m['launch'] + 1:>6}  {names[m['tool']]:<10} {m['steps_timed']:>11} "
            f"{m['tokens']:>7} {m['seconds']:>8.2f} {m['tokens_per_s']:>9.1f}  {load}"
        )
    for label, summ, r in (
        ("all launches", summary, ratio),
        ("quiet launches", quiet, ratio_quiet),
    ):
        if not summ:
            print(f"{label}: none for one of the tools")
            continue
        print(f"{label}:")
        for tool, sm in summ.items():
            print(
                f"{'':>6}  {names[tool]:<10} {sm['steps_timed']:>11} {sm['tokens']:>7} "
                f"{sm['seconds']:>8.2f} {sm['tokens_per_s']:>9.1f}  "
                f"launches {','.join(map(str, sm['launches']))}"
            )
        print(f"        ratio finetune/HF (tokens/s): {r:.3f}")
    for tool, u in utilisation.items():
        share = (
            f"no MFU: {u['why']}"
            if u["mfu"] is None
            else f"MFU {100 * u['mfu']:.1f}% of {u['devices']} x {u['peak_tflops_per_device']} "
            f"TFLOP/s ({u['device']})"
        )
        print(
            f"{names[tool]}: {u['tflops']:.3g} TFLOP/s ({u['flops_per_token'] / 1e9:.3g} GFLOP "
            f"a token, rows of {u['seq_len']:.0f} tokens); {share}"
        )
    if any(m["contended"] for m in launches):
        print(
            "warning: other processes used the CPU during some launches; their numbers are skewed"
        )
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
