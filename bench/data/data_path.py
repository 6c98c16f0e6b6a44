"""The data path at a real dataset size: time to first step, per-step data time, tokens/s and
per-rank memory at 1M rows vs 2k rows, finetune vs HF Trainer + datasets' cache.

    .venv/bin/python bench/data/data_path.py [--rows 1000000] [--repeats 3] [--first_repeats_1m 1]
        [--steps 40] [--skip_hf] [--finetune_src DIR] [--out bench/results/data_path.json]
        [--small_rows 2000] [--sets 1m 2k embedded] [--hf_sets 1m 2k] [--first_repeats N]
        [--skip_microbench]

Data: a deterministic prompt/completion JSONL written by this script (rows built from the embedded
data's sentences, ~110 tokens per row with the embedded tokenizer): ``--rows`` rows, and its first
2,000 rows as the small file. Model, tokenizer, flags: the embedded default (max_seq_length 128,
batch 8 per rank), 2 ranks through the DeepSpeed launcher, no eval split for the generated files,
``--logging_steps 1``.

Measured, each a median over repeats:
* time to first step (s): from launching ``deepspeed`` to the first training row in metrics.jsonl
  (HF: its first ``on_step_end`` on rank 0). *first* = empty datasets cache (``HF_DATASETS_CACHE``
  fresh: the raw JSON→Arrow conversion and tokenization included); *restart* = the same cache and
  ``--resume_from_checkpoint auto`` from the first run's checkpoint (a copy per repeat).
* data_ms: finetune's metrics field, the time per step the loop waited for its batches (steps 2..N).
* next_step without prefetch (ms): in this process, TrainData.next_step on the cached 1M set with
  the thread off: the whole per-step cost of sampler + row fetch + collation; beside it the
  sampler as first written (the permutation rebuilt at every step) on the same number of samples.
* tokens/s: summed over the rows of steps 11..N of each first run; ratio 1M / 2k.
* RSS per rank (MB): VmRSS of each rank process when its first step was seen, and VmHWM (peak).

``--finetune_src DIR`` runs another checkout's finetune package (PYTHONPATH) for before/after.
``--sets``/``--hf_sets`` pick the datasets each tool runs ("1m" is the ``--rows`` file whatever its
size, "2k" the ``--small_rows`` one), ``--first_repeats`` the first runs of the small sets (default
``--repeats``), ``--skip_microbench`` leaves out the in-process next_step and prefetch timings:
what bench/run_all.py uses to fit its time budget.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.*
from bench.harness import BIN, REPO, med  # noqa: E402

SMALL_ROWS = 2000  # --small_rows


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument(
        "--repeats", type=int, default=3, help="repeats of each restart and of small first runs"
    )
    p.add_argument(
        "--first_repeats_1m",
        type=int,
        default=1,
        help="repeats of the large first run (minutes each)",
    )
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--skip_hf", action="store_true")
    p.add_argument(
        "--small_rows", type=int, default=SMALL_ROWS, help='rows of the small file ("2k")'
    )
    p.add_argument(
        "--sets", nargs="+", default=["1m", "2k", "embedded"], choices=["1m", "2k", "embedded"]
    )
    p.add_argument("--hf_sets", nargs="+", default=["1m", "2k"], choices=["1m", "2k"])
    p.add_argument(
        "--first_repeats",
        type=int,
        default=None,
        help="first runs of the small sets (default: --repeats)",
    )
    p.add_argument("--skip_microbench", action="store_true")
    p.add_argument(
        "--finetune_src", default=None, help="run this checkout's finetune instead (before/after)"
    )
    p.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    p.add_argument("--out", default=str(REPO / "bench/results/data_path.json"))
    return p.parse_args()


def make_jsonl(path: Path, rows: int, seed: int = 0) -> Path:
    if path.exists():
        return path
    texts = [
        json.loads(line)["text"]
        for line in (REPO / "finetune/resources/data/train.jsonl").read_text().splitlines()
    ]
    rng = random.Random(seed)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for i in range(rows):
            a, b, c = (texts[rng.randrange(len(texts))] for _ in range(3))
            f.write(json.dumps({"prompt": f"question {i}: {a}", "completion": f"{b} {c}"}) + "\n")
    os.replace(tmp, path)
    return path


def env_for(cache: Path, src: str | None) -> dict:
    env = dict(
        os.environ,
        HF_DATASETS_CACHE=str(cache),
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        PATH=f"{BIN}:{os.environ['PATH']}",
    )
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    if src:
        env["PYTHONPATH"] = f"{src}:{env.get('PYTHONPATH', '')}"
    return env


def rank_memory(pid: int) -> list[dict]:
    import psutil

    out = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if "RANK" not in child.environ() or "LOCAL_RANK" not in child.environ():
                continue
            status = dict(
                line.split(":", 1)
                for line in Path(f"/proc/{child.pid}/status").read_text().splitlines()
            )
            out.append(
                {
                    "rank": int(child.environ()["RANK"]),
                    "rss_mb": int(status["VmRSS"].split()[0]) / 1024,
                    "hwm_mb": int(status["VmHWM"].split()[0]) / 1024,
                }
            )
        except (psutil.Error, OSError, KeyError, ValueError):
            continue
    return sorted(out, key=lambda r: r["rank"])


def launch(
    cmd: list[str], env: dict, log: Path, first_step, timeout: float = 1800, cwd: Path = REPO
) -> dict:
    """Run ``cmd``; ``first_step()`` → wall time of the first step or None. Returns timings and
    memory."""
    start = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd
        )
    seen, memory = None, []
    try:
        while proc.poll() is None and time.time() - start < timeout:
            if seen is None and (seen := first_step()) is not None:
                memory = rank_memory(proc.pid)
            time.sleep(0.02)
        if proc.poll() is None:
            raise RuntimeError(f"timed out: {' '.join(cmd)}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    if proc.returncode != 0 or seen is None:
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(cmd)}\n{log.read_text()[-3000:]}")
    return {"ttfs_s": seen - start, "wall_s": time.time() - start, "memory": memory}


def metrics_rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return [r for r in rows if "loss" in r]


def first_row_after(out: Path, step: int):
    def probe():
        return time.time() if any(r["step"] > step for r in metrics_rows(out)) else None

    return probe


def ours(
    data: Path | None, out: Path, cache: Path, steps: int, src: str | None, log: Path, resume: bool
) -> dict:
    cmd = [
        str(BIN / "deepspeed"),
        "--num_gpus",
        "2",
        "--master_port",
        str(29700 + random.randrange(200)),
        "--module",
        "finetune",
        "--output_dir",
        str(out),
        "--logging_steps",
        "1",
        "--save_checkpoint",
        "--max_steps",
        str(steps + 5 if resume else steps),
    ]
    if data is not None:
        cmd += [
            "--train_file",
            str(data),
            "--prompt_column",
            "prompt",
            "--completion_column",
            "completion",
            "--validation_split_percentage",
            "0",
        ]
    if resume:
        cmd += ["--resume_from_checkpoint", "auto"]
    # `-m finetune` looks in the working directory first: another checkout's runs start there.
    result = launch(
        cmd,
        env_for(cache, src),
        log,
        first_row_after(out, steps if resume else 0),
        cwd=Path(src) if src else REPO,
    )
    rows = metrics_rows(out)
    result["data_ms"] = [
        r["data_ms"] for r in rows if "data_ms" in r and r["step"] > (steps + 1 if resume else 1)
    ]
    # One row per step: (its tokens, its tokens/s); summed over steps 11..N of a first run.
    pairs = [
        (r["tokens_seen"] - prev["tokens_seen"], r["tokens_per_s"])
        for prev, r in zip(rows, rows[1:])
        if 10 < r["step"] <= steps and not resume
    ]
    if pairs:
        result["tokens_per_s"] = sum(t for t, _ in pairs) / sum(t / v for t, v in pairs)
    return result


def hf(data: Path, out: Path, cache: Path, steps: int, log: Path, resume: bool) -> dict:
    stamp = out.parent / f"{out.name}.stamp{'-resume' if resume else ''}"
    stamp.unlink(missing_ok=True)
    cmd = [
        str(BIN / "deepspeed"),
        "--num_gpus",
        "2",
        "--master_port",
        str(29700 + random.randrange(200)),
        str(Path(__file__).resolve().parent / "hf_data_path_run.py"),
        "--train_file",
        str(data),
        "--output_dir",
        str(out),
        "--stamp",
        str(stamp),
        "--max_steps",
        str(steps + 5 if resume else steps),
    ] + (["--resume"] if resume else [])
    return launch(
        cmd, env_for(cache, None), log, lambda: float(stamp.read_text()) if stamp.exists() else None
    )


def microbench(cache: Path, data: Path, rows: int) -> dict:
    """next_step's whole cost without the thread, on the cached 1M set; and the original sampler."""
    os.environ["HF_DATASETS_CACHE"] = str(cache)
    import torch

    from finetune.cli import parse_train_args
    from finetune.data.cache import prepare
    from finetune.data.sampler import ResumableSampler, TrainData
    from finetune.modeling import load_tokenizer

    cfg = parse_train_args(
        [
            "--train_file",
            str(data),
            "--prompt_column",
            "prompt",
            "--completion_column",
            "completion",
            "--validation_split_percentage",
            "0",
        ]
    )
    tok = load_tokenizer(cfg.model)
    train, _ = prepare(cfg, tok)
    data_ = TrainData(
        train, ResumableSampler(len(train), 2, 0, 42), 8, 1, tok.pad_token_id, prefetch=False
    )
    data_.next_step()
    times = []
    for _ in range(300):
        t = time.perf_counter()
        data_.next_step()
        times.append(1000 * (time.perf_counter() - t))
    old = []
    for _ in range(10):
        t = time.perf_counter()
        order = torch.randperm(rows, generator=torch.Generator().manual_seed(42)).tolist()
        order[16:32][0::2]
        old.append(1000 * (time.perf_counter() - t))
    return {
        "next_step_ms": statistics.med(times),
        "original_sampler_take_ms": statistics.med(old),
        "overlap": overlap(train, tok.pad_token_id),
    }


def overlap(train, pad_id: int, steps: int = 150, compute_ms: float = 20.0) -> dict:
    """Per-step data time left exposed next to a compute stand-in (a 1-thread matmul loop, which
    releases the GIL as a forward/backward does): no overlap, our thread, a DataLoader worker."""
    import torch
    from torch.utils.data import DataLoader, Dataset

    from finetune.data.load import collate
    from finetune.data.sampler import ResumableSampler, TrainData

    torch.set_num_threads(1)
    a = torch.randn(256, 256)

    def compute():
        end = time.perf_counter() + compute_ms / 1000
        while time.perf_counter() < end:
            a @ a

    def timed(next_batches) -> float:
        next_batches()
        start = time.perf_counter()
        for _ in range(steps):
            next_batches()
            compute()
        return 1000 * (time.perf_counter() - start) / steps - compute_ms

    out = {"compute_ms": compute_ms}
    for name, prefetch in (("none", False), ("thread", True)):
        data = TrainData(
            train, ResumableSampler(len(train), 2, 0, 42), 8, 4, pad_id, prefetch=prefetch
        )
        data.start()
        out[f"{name}_exposed_ms"] = timed(data.next_step)
        data.close()
    plan = TrainData(train, ResumableSampler(len(train), 2, 0, 42), 8, 4, pad_id, prefetch=False)
    indices = [plan._plan(plan.sampler.state)[1]]
    for _ in range(steps + 1):
        after, idx = plan._plan(plan.sampler.state)
        plan.sampler.state = after
        indices.append(idx)

    class Steps(Dataset):
        def __len__(self):
            return len(indices)

        def __getitem__(self, i):
            rows = train.__getitems__(indices[i])
            return [collate(rows[j : j + 8], pad_id) for j in range(0, len(rows), 8)]

    it = iter(
        DataLoader(
            Steps(), batch_size=None, num_workers=1, prefetch_factor=2, persistent_workers=True
        )
    )
    out["dataloader_worker_exposed_ms"] = timed(lambda: next(it))
    return out


def main() -> None:
    a = parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="finetune-bench-data-"))
    work.mkdir(parents=True, exist_ok=True)
    big = make_jsonl(work / f"pc-{a.rows}.jsonl", a.rows)
    small = make_jsonl(work / f"pc-{a.small_rows}.jsonl", a.small_rows)
    sets = {"1m": big, "2k": small, "embedded": None}
    results: dict = {
        "rows": a.rows,
        "small_rows": a.small_rows,
        "steps": a.steps,
        "finetune_src": a.finetune_src,
        "repeats": a.repeats,
        "runs": {},
    }
    small_firsts = a.repeats if a.first_repeats is None else a.first_repeats
    for name, data in sets.items():
        if name not in a.sets:
            continue
        firsts, restarts = [], []
        for i in range(a.first_repeats_1m if name == "1m" else small_firsts):
            cache, out = work / f"cache-{name}-{i}", work / f"out-{name}-{i}"
            shutil.rmtree(cache, ignore_errors=True)
            shutil.rmtree(out, ignore_errors=True)
            firsts.append(
                ours(
                    data, out, cache, a.steps, a.finetune_src, work / f"{name}-first-{i}.log", False
                )
            )
            print(
                f"finetune {name} first run {i}: {firsts[-1]['ttfs_s']:.1f} s to first step",
                flush=True,
            )
        for i in range(a.repeats):
            out = work / f"out-{name}-restart-{i}"
            shutil.rmtree(out, ignore_errors=True)
            shutil.copytree(work / f"out-{name}-0", out)
            restarts.append(
                ours(
                    data,
                    out,
                    work / f"cache-{name}-0",
                    a.steps,
                    a.finetune_src,
                    work / f"{name}-restart-{i}.log",
                    True,
                )
            )
            print(
                f"finetune {name} restart {i}: {restarts[-1]['ttfs_s']:.1f} s to first step",
                flush=True,
            )
        results["runs"][f"finetune_{name}"] = {"first": firsts, "restart": restarts}
    if not a.skip_hf:
        for name in a.hf_sets:
            cache, out = work / f"hf-cache-{name}", work / f"hf-out-{name}"
            shutil.rmtree(cache, ignore_errors=True)
            shutil.rmtree(out, ignore_errors=True)
            first = [hf(sets[name], out, cache, a.steps, work / f"hf-{name}-first.log", False)]
            print(f"HF {name} first run: {first[-1]['ttfs_s']:.1f} s to first step", flush=True)
            restarts = []
            for i in range(a.repeats):
                copy = work / f"hf-out-{name}-restart-{i}"
                shutil.rmtree(copy, ignore_errors=True)
                shutil.copytree(out, copy)
                restarts.append(
                    hf(sets[name], copy, cache, a.steps, work / f"hf-{name}-restart-{i}.log", True)
                )
                print(
                    f"HF {name} restart {i}: {restarts[-1]['ttfs_s']:.1f} s to first step",
                    flush=True,
                )
            results["runs"][f"hf_{name}"] = {"first": first, "restart": restarts}
    if a.finetune_src is None and not a.skip_microbench and "1m" in a.sets:
        results["microbench_1m"] = microbench(work / "cache-1m-0", big, a.rows)
    results["summary"] = summarize(results["runs"], results.get("microbench_1m"))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results["summary"], indent=2))


def summarize(runs: dict, micro: dict | None) -> dict:
    s: dict = {}
    for key, r in runs.items():
        s[key] = {
            "ttfs_first_s": med([x["ttfs_s"] for x in r["first"]]),
            "ttfs_restart_s": med([x["ttfs_s"] for x in r["restart"]]),
            "tokens_per_s": med([x["tokens_per_s"] for x in r["first"] if "tokens_per_s" in x]),
            "data_ms_median": med(
                [m for x in r["first"] + r["restart"] for m in x.get("data_ms", [])]
            ),
            "data_ms_max": max(
                [m for x in r["first"] + r["restart"] for m in x.get("data_ms", [])], default=None
            ),
            "rss_mb_at_first_step": med([m["rss_mb"] for x in r["restart"] for m in x["memory"]]),
            "hwm_mb_first_run": max(
                [m["hwm_mb"] for x in r["first"] for m in x["memory"]], default=None
            ),
        }
    ours_ = {k: v for k, v in s.items() if k.startswith("finetune_")}
    if "finetune_1m" in ours_ and "finetune_2k" in ours_:
        big, small = ours_["finetune_1m"], ours_["finetune_2k"]
        s["ratio_restart_1m_over_2k"] = big["ttfs_restart_s"] / small["ttfs_restart_s"]
        if "finetune_embedded" in ours_:
            s["ratio_restart_1m_over_embedded"] = (
                big["ttfs_restart_s"] / ours_["finetune_embedded"]["ttfs_restart_s"]
            )
        if big["tokens_per_s"] and small["tokens_per_s"]:
            s["ratio_tokens_per_s_1m_over_2k"] = big["tokens_per_s"] / small["tokens_per_s"]
    if "hf_1m" in s and "finetune_1m" in s:
        s["ratio_first_1m_ours_over_hf"] = (
            s["finetune_1m"]["ttfs_first_s"] / s["hf_1m"]["ttfs_first_s"]
        )
        s["ratio_restart_1m_ours_over_hf"] = (
            s["finetune_1m"]["ttfs_restart_s"] / s["hf_1m"]["ttfs_restart_s"]
        )
    if micro:
        s["microbench_1m"] = micro
    return s


if __name__ == "__main__":
    main()
