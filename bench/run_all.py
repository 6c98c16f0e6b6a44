"""The benchmark suite in one command: P1…P10, written to bench/results/latest.json and rendered
into docs/BENCHMARKS.md and README.md (``make bench`` runs exactly this).

    .venv/bin/python bench/run_all.py [--out bench/results/latest.json] [--work DIR] [--no_docs]
        [--keep_work]
    # some measures: bench/results/partial.json, docs untouched
    .venv/bin/python bench/run_all.py --only P3 P9
    # every measure, tiny, ~2.5 min on 2 cores
    .venv/bin/python bench/run_all.py --smoke --out /tmp/x/latest.json

Each measure runs one of the standalone scripts under bench/ (each keeps working on its own, with
its own defaults) with sizes chosen so that the whole suite takes about 30 minutes on a 2-core
machine: fewer repeats, steps and rows than their defaults (the sizes used are in each entry's
``settings``). Every entry of latest.json has ``ours``, ``baseline``, ``ratio`` (= ours / baseline),
``unit``, ``baseline_name``, ``goal``, ``met``, ``what``, ``raw`` (the repeats' numbers) and
``settings``; a measure that could not run has ``error`` instead of numbers, and the suite goes on.
Sub-measures (P2's step time and end-to-end overhead, P5's wall time, P9's restart vs HF
Trainer's: P6b) are entries of their own under ``sub``. The top level says on what machine, with
what versions, when, whether reads were from a warm page cache (this script never drops caches:
they are warm), and how long it all took.

``--smoke`` runs every measure end to end at tiny sizes (a tiny model, tens of rows, one repeat)
to check that the suite works; its numbers mean nothing, and it never touches the docs. It needs
``--out`` outside bench/results/latest.json. Its measures run two at a time (``--jobs``, 2 by
default; P5 then P6 in one lane, as P6 resumes from P5's checkpoint): nearly all of a smoke run is
launch start-up (imports, DeepSpeed's op loading), which leaves one of two cores idle part of the
time. A full run is always one measure at a time.

The per-script JSONs (everything each script recorded) go beside ``--out`` as ``<script>.json``,
and each script's output to ``run_all_logs/<measure>.log`` there.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
DEFAULT_OUT = REPO / "bench" / "results" / "latest.json"
PY = sys.executable
MB = 1e6

# The ~134M Llama of bench/checkpoint_save.py and bench/export.py is every checkpoint measure's
# model in the full run; --smoke replaces it with this.
TINY_MODEL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
}

# Sizes per mode. FULL: ~30 min on a 2-vCPU machine (estimates per measure in docs/BENCHMARKS.md).
FULL = {
    # rounds 3: three alternating pairs (finetune, HF), (HF, finetune), (finetune, HF); the ratio is
    # the median of the pairs' ratios (issue 26: P1 is noisy here)
    "P1": {"steps": 40, "warmup": 10, "logging_steps": 5, "rounds": 3},
    # ~4 s per step of the 134M model on 2 CPU ranks: (c) is 6 runs x 10 steps.
    "P2": {"repeats": 3, "bg_saves": 3, "e2e_steps": 10, "every": 5, "e2e_repeats": 2},
    "P3": {"repeats": 3},
    "P5": {"repeats": 3, "floor_repeats": 2},
    # P5's launch that creates the checkpoint comes just before
    "P6": {"repeats": 2, "warmup_launches": 0},
    "P7": {},
    "P8": {"saves": 3, "model": "134m", "worlds": [2, 4]},
    "P9": {
        "rows": 1_000_000,
        "small_rows": 2000,
        "repeats": 2,
        "steps": 20,
        "hf_sets": ["1m", "2k"],
    },
    "P10": {"steps": 60, "rounds": 2},
}
SMOKE = {
    "P1": {
        "steps": 4,
        "warmup": 2,
        "logging_steps": 2,
        "rounds": 1,
        "hidden_size": 64,
        "num_layers": 2,
    },
    "P2": {"repeats": 1, "bg_saves": 1, "e2e_steps": 4, "every": 2, "e2e_repeats": 1},
    "P3": {"repeats": 1},
    "P5": {"repeats": 1, "floor_repeats": 1},
    "P6": {"repeats": 1, "warmup_launches": 0},
    "P7": {},
    "P8": {"saves": 2, "model": "embedded", "worlds": [1, 2]},
    "P9": {"rows": 160, "small_rows": 40, "repeats": 1, "steps": 3, "hf_sets": []},
    "P10": {"steps": 12, "rounds": 1, "logging_steps": 2},
}
TIMEOUT_S = {"full": 1500, "smoke": 240}

WHAT = {
    "P1": (
        "training tokens/s, finetune vs HF Trainer + DeepSpeed, same model/data/ZeRO-3 config, "
        "2 ranks"
    ),
    "P2": (
        "training stall per checkpoint with --async_save vs DeepSpeed's synchronous "
        "save_checkpoint of the same state"
    ),
    "P2b": "step time while a background checkpoint write is in flight vs while none is",
    "P2c": (
        "wall time of N steps saving every k steps with --async_save vs no saves "
        "(overhead = ratio - 1)"
    ),
    "P3": (
        "partitioned save bandwidth (sync, fsync'd, committed) vs raw write + fdatasync of the "
        "same bytes, same directory"
    ),
    "P4": "rank-0 peak RSS increase during the consolidated save / fp32 model bytes",
    "P5": "offline export: peak RSS over the process's own post-import floor / fp32 model bytes",
    "P5b": "offline export wall time, finetune export vs zero_to_fp32.py",
    "P6": "time to first step: resume from a checkpoint vs fresh start",
    "P6b": (
        "restart time to first step, finetune vs HF Trainer's restart on the same data and model"
    ),
    "P7": (
        "per-rank bytes of params + grads + optimizer state (ZeRO-3), busiest rank at 2 ranks "
        "vs 1 rank"
    ),
    "P8": "busiest rank's bytes written + read during a partitioned save, 4 ranks vs 2 ranks",
    "P9": "restart (resume) time to first step, 1M rows vs 2k rows",
    "P10": (
        "training tokens/s (real tokens) with --packing (best-fit decreasing) vs unpacked, "
        "embedded model and data, 2 ranks"
    ),
}


GOALS = {
    "P1": ">= 1.0",
    "P2": "<= 0.1",
    "P3": ">= 0.8",
    "P4": "<= 0.3",
    "P5": "<= 0.1",
    "P6": "<= 1.2",
    "P7": "<= 0.6",
    "P8": "<= 0.6",
    "P9": "<= 1.1",
    "P10": ">= 1.0",
    # sub-measures
    "P5b": "<= 0.5",
    "P6b": "<= 1.0",
}


# --- environment --------------------------------------------------------------------------------


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def disk_of(path: Path) -> dict:
    """The mount, filesystem type, device and size of the filesystem holding ``path``."""
    path = path.resolve()
    best = None
    for line in _read("/proc/mounts").splitlines():
        dev, mnt, fstype, *_ = line.split()
        mnt = mnt.replace("\\040", " ")
        if (str(path) == mnt or str(path).startswith(mnt.rstrip("/") + "/")) and (
            best is None or len(mnt) > len(best[1])
        ):
            best = (dev, mnt, fstype)
    out: dict = {"path": str(path)}
    if best:
        dev, mnt, fstype = best
        out.update(device=dev, mount=mnt, fstype=fstype)
        name = Path(dev).name
        for cand in (
            name,
            name.rstrip("0123456789"),
            name.split("p")[0] if name.startswith("nvme") else name,
        ):
            rot = _read(f"/sys/block/{cand}/queue/rotational").strip()
            if rot:
                out["rotational"] = rot == "1"
                model = _read(f"/sys/block/{cand}/device/model").strip()
                if model:
                    out["model"] = model
                break
    try:
        st = os.statvfs(path)
        out.update(
            size_gb=round(st.f_blocks * st.f_frsize / 1e9, 1),
            free_gb=round(st.f_bavail * st.f_frsize / 1e9, 1),
        )
    except OSError:
        pass
    return out


def machine(work: Path) -> dict:
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in _read("/proc/cpuinfo").splitlines()
            if ln.startswith("model name")
        ),
        platform.processor(),
    )
    mem = next(
        (
            int(ln.split()[1]) * 1024
            for ln in _read("/proc/meminfo").splitlines()
            if ln.startswith("MemTotal")
        ),
        0,
    )
    virt = None
    try:
        virt = (
            subprocess.run(
                ["systemd-detect-virt"], capture_output=True, text=True, timeout=5
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        if "hypervisor" in _read("/proc/cpuinfo"):
            virt = "a hypervisor (cpuinfo flag)"
    return {
        "cpu_model": cpu,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "ram_gib": round(mem / 2**30, 1),
        "kernel": platform.release(),
        "virtualization": virt,
        "accelerator": "none (CPU, gloo)",
        "bench_dir_disk": disk_of(work),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in (
        "torch",
        "deepspeed",
        "transformers",
        "accelerate",
        "datasets",
        "tokenizers",
        "safetensors",
    ):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None

    def git(*args):
        try:
            return subprocess.run(
                ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain")
    out["finetune_commit"] = git("rev-parse", "HEAD")
    out["finetune_dirty"] = bool(status) if status is not None else None
    if status:
        out["finetune_changed_files"] = [ln[3:] for ln in status.splitlines()]
    return out


# --- running the scripts ------------------------------------------------------------------------


class Runner:
    """Runs one bench script as a child in its own process group, its output into a log (and,
    line by line, to this process's stdout), killed as a group at the timeout."""

    def __init__(self, results: Path, timeout: float, quiet: bool, concurrent: bool = False):
        self.results, self.timeout, self.quiet = results, timeout, quiet
        self.logs = results / "run_all_logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        # With scripts running side by side (--jobs > 1), a buffer that appeared during one script
        # may be another's, just created: stale buffers are then removed once, by sweep(), at the
        # end.
        self.concurrent = concurrent
        self.shm_at_start = set(_shm_buffers())
        self.live: set[subprocess.Popen] = set()
        self._lock = threading.Lock()

    def __call__(self, name: str, script: str, args: list[str], ok_codes=(0,)) -> tuple[int, str]:
        cmd = [PY, str(BENCH / script), *[str(a) for a in args]]
        log = self.logs / f"{name}.log"
        shm_before = set(_shm_buffers())
        with open(log, "w") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            proc = subprocess.Popen(
                cmd,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
                env=child_env(),
            )
            with self._lock:
                self.live.add(proc)
            timer = threading.Timer(self.timeout, _kill_group, (proc, False))  # a silent hang too
            timer.start()
            try:
                for line in proc.stdout:
                    f.write(line)
                    f.flush()
                    if not self.quiet:
                        print(f"[{name}] {line.rstrip()}", flush=True)
                proc.wait()
            finally:
                timer.cancel()
                _kill_group(proc)  # ranks that outlived their launcher
                with self._lock:
                    self.live.discard(proc)
                if not self.concurrent:
                    _remove_stale_shm(set(_shm_buffers()) - shm_before)
        text = log.read_text(errors="replace")
        if proc.returncode not in ok_codes:
            why = (
                f"killed after {self.timeout:.0f} s"
                if proc.returncode == -signal.SIGKILL
                else f"exited {proc.returncode}"
            )
            raise RuntimeError(
                f"{script} {why}; last lines of {log}:\n" + "\n".join(text.splitlines()[-25:])
            )
        return proc.returncode, text

    def sweep(self) -> None:
        """After concurrent scripts: the stale buffers any of them left."""
        if self.concurrent:
            _remove_stale_shm(set(_shm_buffers()) - self.shm_at_start)

    def kill_all(self) -> None:
        with self._lock:
            live = list(self.live)
        for proc in live:
            _kill_group(proc, False)


def _shm_buffers() -> list[Path]:
    return list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*"))


def _remove_stale_shm(new: set[Path]) -> None:
    """DeepSpeed's shared-memory all-reduce buffers (~69 MB of RAM each) that appeared during a
    script and no live process maps: HF Trainer's runs (bare DeepSpeed) leave two per launch."""
    if not new:
        return
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(
                line.split()[-1] for line in maps.read_text().splitlines() if "/dev/shm/" in line
            )
        except OSError:
            continue
    for buf in new:
        if str(buf) not in mapped:
            buf.unlink(missing_ok=True)


def _kill_group(proc: subprocess.Popen, wait: bool = True) -> None:
    """Kill the script's process group and every descendant (data_path.py starts its launches in
    sessions of their own); a no-op for what already exited."""
    import psutil

    stray = []
    if proc.poll() is None:  # once reaped, its pid may be another process's
        try:
            stray = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for p in stray:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    if wait:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def child_env() -> dict:
    env = dict(os.environ)
    # The venv's ninja first, and one DeepSpeed op cache per venv (see the Makefile): otherwise
    # DeepSpeed rebuilds its CPU ops (minutes) inside a timed launch.
    env["PATH"] = f"{Path(PY).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    env.update(
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


# --- entries ------------------------------------------------------------------------------------


def goal_met(goal: str, value: float | None) -> bool | None:
    if value is None:
        return None
    op, bound = goal.split()
    return value >= float(bound) if op == ">=" else value <= float(bound)


def entry(
    key: str, ours: float, baseline: float, unit: str, baseline_name: str, goal: str, raw, **extra
) -> dict:
    ratio = ours / baseline if baseline else None
    return {
        "what": WHAT[key],
        "ours": ours,
        "baseline": baseline,
        "ratio": ratio,
        "unit": unit,
        "baseline_name": baseline_name,
        "goal": goal,
        "met": goal_met(goal, ratio),
        "raw": raw,
        **extra,
    }


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def p1(ctx) -> dict:
    s = ctx.sizes["P1"]
    out = ctx.results / "train_throughput.json"
    args = [
        "--steps",
        s["steps"],
        "--warmup",
        s["warmup"],
        "--logging_steps",
        s["logging_steps"],
        "--rounds",
        s["rounds"],
        "--out",
        out,
    ]
    for k in ("hidden_size", "num_layers"):
        if k in s:
            args += [f"--{k}", s[k]]
    ctx.run("P1", "train_throughput.py", args)
    r = json.loads(out.read_text())
    fs, hf = r["summary"]["finetune"], r["summary"]["hf"]
    raw = [
        {
            "launch": m["launch"] + 1,
            "tool": m["tool"],
            "tokens_per_s": round(m["tokens_per_s"], 1),
            "seconds": round(m["seconds"], 2),
            "tokens": m["tokens"],
            "other_load_pct": None
            if m.get("foreign_cpu_share") is None
            else round(100 * m["foreign_cpu_share"], 1),
            "contended": m.get("contended"),
        }
        for m in r["launches"]
    ]
    quiet = r.get("ratio_finetune_over_hf_quiet_launches")
    # each pair of launches in a row (one per tool, alternating order) gives a ratio: their median
    rate = {m["launch"]: (m["tool"], m["tokens_per_s"]) for m in r["launches"]}
    pairs = [
        dict([rate[i], rate[i + 1]])
        for i in range(0, len(rate) - 1, 2)
        if {rate[i][0], rate[i + 1][0]} == {"finetune", "hf"}
    ]
    pair_ratios = [p["finetune"] / p["hf"] for p in pairs]
    e = entry(
        "P1",
        fs["tokens_per_s"],
        hf["tokens_per_s"],
        "tokens/s",
        "HF Trainer + DeepSpeed ZeRO-3",
        ">= 1.0",
        raw,
        ratio_quiet_launches=quiet,
        note=(
            "ratio = the median of the pairs' ratios (launches 1-2, 3-4, 5-6: one per tool, "
            "alternating order; ratio_total_tokens: all launches' tokens / seconds); "
            "tokens/s = total tokens / total timed seconds of each tool's launches (order ABBA…); "
            "other_load_pct = CPU the rest of the machine used during a launch "
            "(share of all cores); "
            "launches over 5% are contended; ratio_quiet_launches uses only the others"
        ),
        settings={
            **s,
            "model": (
                f"{r['model_config']['num_hidden_layers']} layers x "
                f"{r['model_config']['hidden_size']}"
            ),
            "per_device_train_batch_size": r["settings"]["per_device_train_batch_size"],
            "ranks": 2,
        },
    )
    if pair_ratios:  # the figure that counts: the median of the alternating pairs
        e.update(
            ratio=med(pair_ratios),
            met=goal_met(">= 1.0", med(pair_ratios)),
            ratio_total_tokens=e["ratio"],
            pair_ratios=[round(x, 4) for x in pair_ratios],
        )
    return e


def p2(ctx) -> dict:
    s = ctx.sizes["P2"]
    out = ctx.results / "async_save.json"
    args = [
        "--repeats",
        s["repeats"],
        "--bg_saves",
        s["bg_saves"],
        "--e2e_steps",
        s["e2e_steps"],
        "--every",
        s["every"],
        "--e2e_repeats",
        s["e2e_repeats"],
        "--dir",
        ctx.work / "async_save",
        "--out",
        out,
        *ctx.model_args,
    ]
    code, text = ctx.run("P2", "async_save.py", args, ok_codes=(0, 3))
    if code == 3:
        reason = next(
            (ln.split("async_save: ", 1)[1] for ln in text.splitlines() if "async_save: " in ln),
            "the --async_save API is not in finetune yet",
        )
        raise Unavailable(reason)
    r = json.loads(out.read_text())
    sm = r["summary"]
    settings = {
        **s,
        **ctx.model_settings,
        "ranks": 2,
        "checkpoint_mb": round(r["stall"][0]["checkpoint_bytes"] / MB, 1),
    }
    stall = [
        {k: round(v, 4) if isinstance(v, float) else v for k, v in x.items()} for x in r["stall"]
    ]
    e = entry(
        "P2",
        sm["stall_async_s"],
        sm["stall_deepspeed_sync_s"],
        "s stalled per checkpoint",
        "DeepSpeed save_checkpoint (synchronous, its own checkpoint engine, no fsync)",
        "<= 0.1",
        stall,
        finetune_sync_save_s=sm["stall_finetune_sync_s"],
        settings=settings,
    )
    subs = {}
    if "step_ratio" in sm:
        subs["P2b"] = entry(
            "P2b",
            sm["step_inflight_s"],
            sm["step_idle_s"],
            "s per step (median)",
            "step time with no write in flight",
            "<= 1.15",
            {
                "inflight": [round(x, 4) for x in r["inflight_steps_s"]],
                "idle": [round(x, 4) for x in r["idle_steps_s"]],
            },
            note="a step = _train_step + manager.poll() at its boundary, rank 0's wall time",
        )
    else:
        subs["P2b"] = {
            "what": WHAT["P2b"],
            "error": "no step ran while a write was in flight (the write finished first)",
        }
    e2e = sm["e2e_s"]
    runs: dict = {}
    for x in r["e2e"]:
        runs.setdefault(x["mode"], []).append(round(x["seconds"], 3))
    subs["P2c"] = entry(
        "P2c",
        e2e["async"],
        e2e["none"],
        f"s for {s['e2e_steps']} steps",
        "the same steps with no saves",
        "<= 1.035",
        runs,
        overhead_async=sm["e2e_overhead_async"],
        overhead_sync=sm["e2e_overhead_sync"],
        sync_s=e2e["sync"],
        note=f"a save every {s['every']} steps at steps < N; goal: async overhead <= 3.5%",
    )
    e["sub"] = subs
    return e


def p3_p4(ctx) -> tuple[dict, dict]:
    s = ctx.sizes["P3"]
    out = ctx.results / "checkpoint_save.json"
    ctx.run(
        "P3",
        "checkpoint_save.py",
        [
            "--repeats",
            s["repeats"],
            "--dir",
            ctx.work / "checkpoint_save",
            "--out",
            out,
            *ctx.model_args,
        ],
    )
    r = json.loads(out.read_text())
    saves = r["saves"]
    ours = [x["ours_bytes"] / x["ours_s"] / MB for x in saves]
    raw_bw = [x["raw_bytes"] / x["raw_s"] / MB for x in saves]
    ds = [x["deepspeed_bytes"] / x["deepspeed_s"] / MB for x in saves]
    settings = {
        **s,
        **ctx.model_settings,
        "ranks": 2,
        "checkpoint_mb": round(saves[0]["ours_bytes"] / MB, 1),
    }
    e3 = entry(
        "P3",
        med(ours),
        med(raw_bw),
        "MB/s",
        "raw write + fdatasync of the same bytes per rank, same directory",
        ">= 0.8",
        {
            "finetune_mb_s": [round(x, 1) for x in ours],
            "raw_mb_s": [round(x, 1) for x in raw_bw],
            "ratio_each": [round(o / w, 3) for o, w in zip(ours, raw_bw)],
        },
        deepspeed_save_checkpoint_mb_s=med(ds),
        deepspeed_note="DeepSpeed save_checkpoint: no fsync, no commit",
        settings=settings,
    )
    mb = r["model_bytes_fp32"]
    c, d = r["consolidated"], r["save_16bit_model"]
    e4 = entry(
        "P4",
        c["rss_increase"] / MB,
        mb / MB,
        "MB",
        "fp32 model bytes",
        "<= 0.3",
        {"rss_increase_mb": round(c["rss_increase"] / MB, 1), "seconds": round(c["seconds"], 3)},
        alongside={
            "name": "DeepSpeed save_16bit_model",
            "rss_increase_mb": d["rss_increase"] / MB,
            "ratio": d["rss_increase"] / mb,
            "seconds": d["seconds"],
        },
        note="one consolidated save, rank 0's RSS sampled every 2 ms",
        settings={**settings, "repeats": 1},
    )
    return e3, e4


def p5(ctx) -> dict:
    s = ctx.sizes["P5"]
    out = ctx.results / "export.json"
    ctx.run(
        "P5",
        "export.py",
        [
            "--workdir",
            ctx.work / "export",
            "--repeats",
            s["repeats"],
            "--floor_repeats",
            s["floor_repeats"],
            "--out",
            out,
            *ctx.model_args,
        ],
    )
    r = json.loads(out.read_text())
    ours, theirs = r["tools"]["finetune export"], r["tools"]["zero_to_fp32.py"]
    w = r["fp32_weight_bytes"]
    settings = {**s, **ctx.model_settings, "checkpoint_ranks": 2}
    e = entry(
        "P5",
        ours["peak_minus_own_floor_bytes"] / MB,
        w / MB,
        "MB",
        "fp32 model bytes",
        "<= 0.1",
        {
            "peak_rss_mb_each": [round(x / MB, 1) for x in ours["peak_rss_bytes_each"]],
            "own_floor_mb": round(ours["own_floor_rss_bytes"] / MB, 1),
        },
        whole_process_peak_over_weights=ours["peak_rss_over_weights"],
        alongside={
            "name": "zero_to_fp32.py",
            "peak_minus_own_floor_mb": theirs["peak_minus_own_floor_bytes"] / MB,
            "ratio": theirs["peak_minus_own_floor_over_weights"],
            "whole_process_peak_over_weights": theirs["peak_rss_over_weights"],
        },
        outputs_identical=r["outputs_identical"],
        note=(
            "own floor = peak RSS of a process importing what the tool imports before it reads "
            "the checkpoint"
        ),
        settings=settings,
    )
    e["sub"] = {
        "P5b": entry(
            "P5b",
            ours["wall_s_median"],
            theirs["wall_s_median"],
            "s (median)",
            "DeepSpeed zero_to_fp32.py",
            GOALS["P5b"],
            {
                "finetune_export_s": [round(x, 3) for x in ours["wall_s"]],
                "zero_to_fp32_s": [round(x, 3) for x in theirs["wall_s"]],
            },
            note="child process wall time, spawn to exit, imports included",
        )
    }
    return e


def p6(ctx) -> dict:
    s = ctx.sizes["P6"]
    out = ctx.results / "resume_verify.json"
    ctx.run(
        "P6",
        "resume_verify.py",
        [
            "--workdir",
            ctx.work / "export",
            "--repeats",
            s["repeats"],
            "--warmup_launches",
            s["warmup_launches"],
            "--out",
            out,
            *ctx.model_args,
        ],
    )
    r = json.loads(out.read_text())
    return entry(
        "P6",
        med(r["resumed_s"]),
        med(r["fresh_s"]),
        "s to first step (median)",
        "fresh start, same flags",
        "<= 1.2",
        {
            "resumed_s": [round(x, 2) for x in r["resumed_s"]],
            "fresh_s": [round(x, 2) for x in r["fresh_s"]],
        },
        verify_gb_s=med([v["gb_per_s"] for v in r["verify"]]),
        checkpoint_gb=round(r["verify"][0]["bytes"] / 1e9, 3),
        note=(
            "launch of deepspeed (2 ranks) to the first train row in metrics.jsonl; "
            "resume verifies checksums then loads"
        ),
        settings={**s, **ctx.model_settings, "ranks": 2},
    )


def p7(ctx) -> dict:
    out = ctx.results / "state_memory.json"
    ctx.run(
        "P7",
        "state_memory.py",
        ["--worlds", "1", "2", "--work", ctx.work / "state_memory", "--out", out, *ctx.model_args],
    )
    r = json.loads(out.read_text())
    one, two = r["runs"][0], r["runs"][-1]
    raw = {
        f"world{x['world_size']}": [
            {
                "rank": y["rank"],
                "total_mb": round(y["total_bytes"] / MB, 2),
                **{k: round(v / MB, 2) for k, v in y["by_category"].items()},
                "rss_mb": round(y["rss_bytes"] / MB, 1),
            }
            for y in x["ranks"]
        ]
        for x in r["runs"]
    }
    return entry(
        "P7",
        two["max_rank_total_bytes"] / MB,
        one["max_rank_total_bytes"] / MB,
        "MB per rank",
        "the same model on 1 rank",
        "<= 0.6",
        raw,
        params=r["params"],
        note=(
            "ds_tensor of every parameter (+ full data of persistent small ones), "
            "fp32 master partitions, "
            "Adam state, gradient partitions; each storage counted once; after one step"
        ),
        settings={**ctx.model_settings, "worlds": [1, 2]},
    )


def p8(ctx) -> dict:
    s = ctx.sizes["P8"]
    out = ctx.results / "save_io.json"
    small_w, big_w = s["worlds"]
    args = ["--worlds", small_w, big_w, "--saves", s["saves"], "--out", out]
    if s["model"] == "134m":
        from checkpoint_save import write_inputs

        cfg_dir, _ = write_inputs(ctx.work / "save_io_model")
        args += [
            "--config_name",
            cfg_dir,
            "--extra=--max_seq_length 32 --per_device_train_batch_size 1 --max_eval_samples 4",
        ]
    ctx.run("P8", "save_io.py", args)
    r = json.loads(out.read_text())
    by_world = {x["world"]: x for x in r["runs"]["after"]}

    def busiest(world: int) -> tuple[float, dict]:
        rows = by_world[world]["ranks"]
        top = max(rows, key=lambda x: x["wrote_mb"] + x["read_mb"])
        return top["wrote_mb"] + top["read_mb"], top

    b_big, top_big = busiest(big_w)
    b_small, top_small = busiest(small_w)
    raw = {f"world{w}": x["ranks"] for w, x in by_world.items()}
    e = entry(
        "P8",
        b_big,
        b_small,
        "MB per save (busiest rank)",
        f"the same model's save at {small_w} ranks",
        "<= 0.6",
        raw,
        busiest_rank={str(big_w): top_big["rank"], str(small_w): top_small["rank"]},
        checkpoint_mb={str(w): x["checkpoint_mb"] for w, x in by_world.items()},
        note=(
            "written = the rank's files in the manifest (+ shared files on rank 0); "
            "read = /proc/self/io rchar (files and collectives' sockets); medians over the saves"
        ),
        settings={
            **s,
            "model": "~134M Llama (bench/checkpoint_save.py)"
            if s["model"] == "134m"
            else "embedded (459,520 parameters)",
        },
    )
    if (small_w, big_w) != (2, 4):
        e["what"] = e["what"].replace("4 ranks vs 2 ranks", f"{big_w} ranks vs {small_w} ranks")
    return e


def p9(ctx) -> dict:
    s = ctx.sizes["P9"]
    out = ctx.results / "data_path.json"
    args = [
        "--rows",
        s["rows"],
        "--small_rows",
        s["small_rows"],
        "--repeats",
        s["repeats"],
        "--first_repeats",
        1,
        "--steps",
        s["steps"],
        "--sets",
        "1m",
        "2k",
        "--skip_microbench",
        "--work",
        ctx.work / "data_path",
        "--out",
        out,
    ]
    if s["hf_sets"]:
        args += ["--hf_sets", *s["hf_sets"]]
    else:
        args += ["--skip_hf"]
    ctx.run("P9", "data_path.py", args)
    r = json.loads(out.read_text())
    sm = r["summary"]
    big, small = sm["finetune_1m"], sm["finetune_2k"]
    runs = r["runs"]
    raw = {
        "finetune_large_restart_s": [round(x["ttfs_s"], 2) for x in runs["finetune_1m"]["restart"]],
        "finetune_small_restart_s": [round(x["ttfs_s"], 2) for x in runs["finetune_2k"]["restart"]],
        "finetune_large_first_s": [round(x["ttfs_s"], 2) for x in runs["finetune_1m"]["first"]],
        "finetune_small_first_s": [round(x["ttfs_s"], 2) for x in runs["finetune_2k"]["first"]],
    }
    hf = {}
    for name, label in (("1m", "large"), ("2k", "small")):
        if f"hf_{name}" in sm:
            raw[f"hf_{label}_restart_s"] = [
                round(x["ttfs_s"], 2) for x in runs[f"hf_{name}"]["restart"]
            ]
            raw[f"hf_{label}_first_s"] = [
                round(x["ttfs_s"], 2) for x in runs[f"hf_{name}"]["first"]
            ]
            hf[f"{label}_restart_s"] = sm[f"hf_{name}"]["ttfs_restart_s"]
            hf[f"{label}_first_s"] = sm[f"hf_{name}"]["ttfs_first_s"]
    if "large_restart_s" in hf and "small_restart_s" in hf:
        hf["restart_ratio_large_over_small"] = hf["large_restart_s"] / hf["small_restart_s"]
    if "large_restart_s" in hf:
        hf["ours_over_hf_large_restart"] = big["ttfs_restart_s"] / hf["large_restart_s"]
    note = (
        "time from launching deepspeed (2 ranks, embedded model) to the first train row; "
        "restart = --resume_from_checkpoint auto with a warm datasets cache"
    )
    if s["rows"] < 1_000_000:
        note += f"; {s['rows']:,} rows, not 1M (smaller to fit the time budget)"
    e = entry(
        "P9",
        big["ttfs_restart_s"],
        small["ttfs_restart_s"],
        "s to first step (median)",
        f"finetune's restart on {s['small_rows']:,} rows",
        GOALS["P9"],
        raw,
        hf_trainer=hf or "not run",
        first_run_large_s=big["ttfs_first_s"],
        rss_mb_at_first_step_large=big.get("rss_mb_at_first_step"),
        note=note,
        settings={**s, "large_rows": s["rows"], "ranks": 2},
    )
    e["what"] = (
        f"restart (resume) time to first step, {s['rows']:,} rows vs {s['small_rows']:,} rows"
    )
    e["sub"] = {"P6b": p6b(s, big, hf, raw)}
    return e


def p6b(s: dict, big: dict, hf: dict, raw: dict) -> dict:
    """P6b from P9's run: finetune's restart on the large set over HF Trainer's on the same files
    (not run when P9 ran no HF restarts, as in --smoke)."""
    if "large_restart_s" not in hf:
        return {
            "what": WHAT["P6b"],
            "goal": GOALS["P6b"],
            "error": "not run: P9 ran no HF Trainer restarts (hf_sets is empty in this mode)",
            "skipped": True,
        }
    e = entry(
        "P6b",
        big["ttfs_restart_s"],
        hf["large_restart_s"],
        "s to first step (median)",
        "HF Trainer + DeepSpeed restart, same data and model",
        GOALS["P6b"],
        {
            "finetune_restart_s": raw["finetune_large_restart_s"],
            "hf_restart_s": raw["hf_large_restart_s"],
        },
        note=(
            "P9's restarts on the large set: launch of deepspeed (2 ranks, embedded model) to the "
            "first train row, --resume_from_checkpoint auto, warm datasets cache, both sides"
        ),
        settings={"rows": s["rows"], "repeats": s["repeats"], "ranks": 2},
    )
    e["what"] = f"{e['what']}, {s['rows']:,} rows"
    return e


class Unavailable(Exception):
    """The measure cannot run in this checkout (recorded as its error, not a failure of the
    suite)."""


class Ctx:
    def __init__(self, smoke: bool, results: Path, work: Path, quiet: bool, jobs: int = 1):
        self.smoke, self.results, self.work = smoke, results, work
        self.sizes = SMOKE if smoke else FULL
        # Side by side, each script gets a share of the machine: its hang guard grows to match.
        self.run = Runner(
            results, TIMEOUT_S["smoke" if smoke else "full"] * jobs, quiet, concurrent=jobs > 1
        )
        self.model_args = ["--model_json", json.dumps(TINY_MODEL)] if smoke else []
        self.model_settings = {
            "model": ("tiny Llama " + json.dumps(TINY_MODEL))
            if smoke
            else "~134M Llama (hidden 768, 12 layers, vocab 32000, untied head), fp32"
        }


def p10(ctx) -> dict:
    s = ctx.sizes["P10"]
    out = ctx.results / "packing.json"
    every = ["--logging_steps", s["logging_steps"]] if "logging_steps" in s else []
    ctx.run(
        "P10", "packing.py", ["--steps", s["steps"], "--rounds", s["rounds"], *every, "--out", out]
    )
    r = json.loads(out.read_text())
    return entry(
        "P10",
        r["packed_tokens_per_s"],
        r["unpacked_tokens_per_s"],
        "tokens/s",
        "the same run unpacked (rows padded per micro-batch)",
        ">= 1.0",
        r["runs"],
        packing_efficiency=r["packing_efficiency"],
        padded_efficiency=r["padded_efficiency"],
        note=(
            "packing_efficiency = real tokens / block tokens (logged at start); "
            "padded_efficiency = real tokens / padded tokens of the unpacked micro-batches"
        ),
        settings={**s, **r["settings"], "ranks": r["settings"]["nprocs"]},
    )


MEASURES = [
    ("P1", p1),
    ("P2", p2),
    ("P3", p3_p4),
    ("P5", p5),
    ("P6", p6),
    ("P7", p7),
    ("P8", p8),
    ("P9", p9),
    ("P10", p10),
]

# --smoke --jobs N: the measures as N lanes side by side, the longest (in a smoke run on 2 cores)
# first. A chain runs in order in one lane: P6 resumes from the checkpoint P5 creates in
# work/export.
SMOKE_CHAINS = [("P9",), ("P5", "P6"), ("P1",), ("P7",), ("P8",), ("P3",), ("P2",), ("P10",)]
SMOKE_JOBS = 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, every measure, a few minutes; numbers mean nothing",
    )
    ap.add_argument(
        "--out",
        default=None,
        help="default bench/results/latest.json; with --only, bench/results/partial.json",
    )
    ap.add_argument(
        "--work",
        default=None,
        help="scratch folder for checkpoints and data (default: a temp dir, removed after)",
    )
    ap.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="run only these measures (P1 … P10; P3 and P4 run together)",
    )
    ap.add_argument(
        "--no_docs", action="store_true", help="don't rewrite docs/BENCHMARKS.md and README.md"
    )
    ap.add_argument("--keep_work", action="store_true")
    ap.add_argument("--quiet", action="store_true", help="don't echo the scripts' output")
    ap.add_argument(
        "--jobs",
        type=int,
        default=None,
        help=f"with --smoke: measures run side by side in this many lanes (default {SMOKE_JOBS}); "
        "a full run is always one at a time (its numbers need the machine to themselves)",
    )
    a = ap.parse_args(argv)
    if a.jobs is not None and a.jobs > 1 and not a.smoke:
        ap.error(
            "--jobs > 1 only with --smoke: measures running side by side skew each other's numbers"
        )
    jobs = max(1, a.jobs or SMOKE_JOBS) if a.smoke else 1
    out = Path(
        a.out or (DEFAULT_OUT.with_name("partial.json") if a.only else DEFAULT_OUT)
    ).resolve()
    if a.smoke and out == DEFAULT_OUT.resolve():
        ap.error(
            "--smoke writes numbers that mean nothing: "
            "give it --out outside bench/results/latest.json"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(a.work).resolve() if a.work else Path(tempfile.mkdtemp(prefix="finetune-bench-"))
    if a.work and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    only = None
    if a.only:
        only = {k.upper() for k in a.only} | (
            {"P3"} if {"P4"} & {k.upper() for k in a.only} else set()
        )
    os.environ.update(
        {k: v for k, v in child_env().items() if k in ("PATH", "TORCH_EXTENSIONS_DIR")}
    )
    ctx = Ctx(a.smoke, out.parent, work, a.quiet, jobs)
    started, t0 = _dt.datetime.now(_dt.timezone.utc), time.monotonic()
    result = {
        "suite": "finetune bench (bench/run_all.py)",
        "mode": "smoke" if a.smoke else "full",
        "date": started.isoformat(timespec="seconds"),
        "machine": machine(work),
        "versions": versions(),
        "reads_cold": False,
        "page_cache": (
            "warm: caches are never dropped; checkpoints, datasets and exports are read back from "
            "the page cache where they were just written or read (cold-disk reads would be slower)"
        ),
        "command": " ".join(
            [Path(PY).name, *(sys.argv if argv is None else ["bench/run_all.py", *argv])]
        ),
        "sizes": ctx.sizes,
    }
    if jobs > 1:
        result["jobs"] = jobs
    measures: dict = {}
    fns = dict(MEASURES)
    if jobs == 1:
        for key, _ in MEASURES:
            if not only or key in only:
                measures.update(run_measure(ctx, key, fns[key]))
    else:
        measures = run_lanes(
            ctx, [[k for k in chain if not only or k in only] for chain in SMOKE_CHAINS], fns, jobs
        )
    result.update({k: measures[k] for k in sorted(measures, key=lambda k: int(k[1:]))})
    result["total_wall_s"] = round(time.monotonic() - t0, 1)
    result["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {out} ({result['total_wall_s'] / 60:.1f} min)")
    if not a.smoke and not a.no_docs and not a.only:  # the docs' table is always a whole run's
        import table

        for path in table.update_docs(result):
            print(f"updated {path}")
    if not a.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def run_measure(ctx: Ctx, key: str, fn) -> dict:
    """One measure's entries (P3 gives P3 and P4), each with its wall time; a failure is
    recorded."""
    print(f"=== {key} ===", flush=True)
    measures: dict = {}
    m0 = time.monotonic()
    keys = ("P3", "P4") if key == "P3" else (key,)
    try:
        got = fn(ctx)
        got = got if isinstance(got, tuple) else (got,)
        for k, e in zip(keys, got):
            measures[k] = e
    except Unavailable as e:
        for k in keys:
            measures[k] = {
                "what": WHAT[k],
                "goal": GOALS[k],
                "error": f"not run: {e}",
                "skipped": True,
            }
    except Exception as e:  # noqa: BLE001 — recorded; the rest of the suite still runs
        msg = f"{type(e).__name__}: {e}"
        print(f"{key} failed: {msg}\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        for k in keys:
            measures[k] = {"what": WHAT[k], "goal": GOALS[k], "error": msg[-3000:]}
    wall = round(time.monotonic() - m0, 1)
    for k in keys:
        measures[k]["wall_s"] = wall if k == keys[0] else 0.0
        if k != keys[0]:
            measures[k]["wall_note"] = f"measured in the same run as {keys[0]}"
    print(f"=== {key}: {wall:.0f} s; " + "; ".join(_line(k, measures[k]) for k in keys), flush=True)
    return measures


def run_lanes(ctx: Ctx, chains: list[list[str]], fns: dict, jobs: int) -> dict:
    """The chains on ``jobs`` threads, each taking the next chain when its last one is done (smoke
    only: side by side, the measures' numbers skew each other)."""
    pending = [c for c in chains if c]
    measures: dict = {}
    lock = threading.Lock()

    def lane() -> None:
        while True:
            with lock:
                if not pending:
                    return
                chain = pending.pop(0)
            for key in chain:
                got = run_measure(ctx, key, fns[key])
                with lock:
                    measures.update(got)

    threads = [
        threading.Thread(target=lane, name=f"lane{i}", daemon=True)
        for i in range(min(jobs, len(pending)))
    ]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.5)
    except BaseException:  # Ctrl-C: no new script, and the running ones killed
        with lock:
            pending.clear()
        ctx.run.kill_all()
        raise
    finally:
        ctx.run.sweep()
    return measures


def _line(key: str, e: dict) -> str:
    if "error" in e:
        return f"{key} error: {e['error'].splitlines()[0][:200]}"
    return f"{key} ratio {e['ratio']:.3f} (goal {e['goal']}: {'met' if e['met'] else 'NOT met'})"


if __name__ == "__main__":
    sys.exit(main())
