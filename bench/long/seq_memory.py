"""Long rows: the longest row that trains within one per-rank memory budget with
--sequence_parallel_size 2 (alone and with --tiled_mlp) against data parallelism (SP=1), and
tokens/s at SP=2 against SP=1 at one length both train.

    .venv/bin/python bench/long/seq_memory.py [--base_length 1024] [--out FILE.json]

Every launch is ``torchrun --nproc_per_node 2 -m finetune``: 2 ranks (gloo on CPU), one row per
rank and micro-batch (``--per_device_train_batch_size 1``), no evaluation
(``--validation_split_percentage 0``), no saves, fp32. The model is a Llama built from a config
(``--hidden_size`` 128, ``--num_layers`` 4, MLP 4 x hidden, heads of 32, half as many key-value
heads, an untied head over ``--vocab_size`` 32000 tokens: at these lengths the logits and MLP
activations are most of a row's memory, as in real long-row training) with the embedded tokenizer.
Its rows are the embedded texts one after another, every row longer than the longest length tried,
so that ``--max_seq_length`` cuts each to exactly that length (no padding).

Configurations: SP=1 (2 data-parallel ranks, each training its own row), SP=2 (both ranks share
each row, each holding half its tokens), SP=2 + --tiled_mlp.

Memory. A rank's peak is its VmHWM (/proc/PID/status: the kernel's RSS high-water mark), read every
50 ms while it runs (the ranks are torchrun's children; the mark only grows, so the last reading is
the peak). A launch's figure is its busiest rank's, a length's the median of its launches' (RSS
differs by a few tens of MB between launches of the same flags). The budget is SP=1's figure at
``--base_length`` over ``--budget_repeats`` launches: SP=1's longest row within it is that length.
For each other configuration a search over the ladder ``--lengths`` starts at ``--sp_from``
(``--tiled_from``), goes up while a length fits and down while one does not, and the longest row is
interpolated linearly in peak RSS between the longest length that fits and the next one, which does
not; a search that still fits at the top of the ladder gives that length as a lower bound. SP=2's
lengths get ``--sp_repeats`` launches each, SP=2 + tiling's one: its peak grows so slowly with the
length that a few tens of MB move its crossing by thousands of tokens, and its launches are the
longest. Memory launches train ``--steps`` optimizer steps (2: the first step's optimizer step
creates the optimizer's state, which the second step's activations then come on top of; later
steps add a few percent more).

Throughput. SP=1 and SP=2 at ``--base_length`` (a length both fit), ``--throughput_rounds``
launches each of ``--throughput_steps`` steps, in alternating order (SP=1, SP=2, SP=2, SP=1, ...:
tokens/s of launches with the same flags differ by 10-20% here); tokens/s per step from
metrics.jsonl (each row's tokens counted once), the first step of each launch left out, the median
of a configuration's steps. A launch of the memory search with the same length and steps is
reused.

Attention. The script records which kernel CPU sdpa runs for such a row (a causal row without
padding, one layer of the same shape, under torch's profiler): torch's flash attention for CPU,
whose memory is linear in the row's length (no length x length score matrix is kept).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: bench.*
from bench.harness import BIN, REPO, free_port, med, rank_env, write_json  # noqa: E402

RES = REPO / "finetune" / "resources"
MODEL_CONFIG = RES / "model" / "config.json"
TOKENIZER_DIR = RES / "tokenizer"
TEXTS = RES / "data" / "train.jsonl"
HEAD_DIM = 32
POLL_S = 0.05
TILES = re.compile(r"--tiled_mlp: each MLP in (\d+) tiles .*the logits and loss in (\d+)")
# The configurations, by name: (--sequence_parallel_size, --tiled_mlp).
CONFIGS = {"sp1": (1, False), "sp2": (2, False), "sp2_tiled": (2, True)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--base_length",
        type=int,
        default=1024,
        help="SP=1's row length: the budget is its busiest rank's peak RSS there; "
        "tokens/s are measured there too",
    )
    p.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=[1024, 1536, 2048, 2560, 3072, 4096, 6144, 8192],
        help="the ladder the searches walk",
    )
    p.add_argument("--sp_from", type=int, default=2048, help="SP=2's search starts here")
    p.add_argument(
        "--tiled_from",
        type=int,
        default=8192,
        help="SP=2 + tiling's search starts here (by default the top of the ladder: a lower "
        "bound if it fits there)",
    )
    p.add_argument(
        "--budget_repeats",
        type=int,
        default=3,
        help="SP=1 launches at --base_length; the budget is the median of their figures",
    )
    p.add_argument(
        "--sp_repeats",
        type=int,
        default=2,
        help="launches at each length of SP=2's search (SP=2 + tiling's: one each)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=2,
        help="optimizer steps per memory launch (the second step's peak has the optimizer's "
        "state beside the activations)",
    )
    p.add_argument(
        "--throughput_steps",
        type=int,
        default=5,
        help="optimizer steps per tokens/s launch (the first is left out)",
    )
    p.add_argument(
        "--throughput_rounds",
        type=int,
        default=2,
        help="tokens/s launches per configuration, the order alternating",
    )
    p.add_argument(
        "--hidden_size", type=int, default=128, help="the model's width (heads of 32; MLP 4x)"
    )
    p.add_argument("--num_layers", type=int, default=4, help="the model's decoder layers")
    p.add_argument(
        "--vocab_size",
        type=int,
        default=32000,
        help="the model's vocabulary (the tokenizer uses its first 513 ids): the logits' width",
    )
    p.add_argument(
        "--skip_tiled", action="store_true", help="no SP=2 + --tiled_mlp launches (its search)"
    )
    p.add_argument(
        "--skip_attention_check",
        action="store_true",
        help="don't profile which attention kernel CPU sdpa runs",
    )
    p.add_argument("--timeout", type=int, default=600, help="seconds per launch")
    p.add_argument("--work", default=None, help="scratch folder (default: a temp dir)")
    p.add_argument("--out", default=None, help="write the results here as JSON")
    a = p.parse_args(argv)
    a.lengths = sorted(set(a.lengths))
    for flag in ("sp_from", "tiled_from"):
        if getattr(a, flag) not in a.lengths:
            p.error(f"--{flag} {getattr(a, flag)} is not one of --lengths {a.lengths}")
    if a.throughput_steps < 2:
        p.error("--throughput_steps must be at least 2 (the first step is left out)")
    if a.hidden_size % (2 * HEAD_DIM):
        p.error(f"--hidden_size must be a multiple of {2 * HEAD_DIM} (heads of {HEAD_DIM}, SP=2)")
    return a


def model_config(a: argparse.Namespace) -> dict:
    """The embedded Llama config at --hidden_size x --num_layers, untied, --vocab_size tokens,
    positions for the longest row tried."""
    heads = a.hidden_size // HEAD_DIM
    cfg = json.loads(MODEL_CONFIG.read_text())
    cfg.update(
        hidden_size=a.hidden_size,
        intermediate_size=4 * a.hidden_size,
        num_hidden_layers=a.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        head_dim=HEAD_DIM,
        vocab_size=a.vocab_size,
        max_position_embeddings=max(a.lengths + [a.base_length]),
        tie_word_embeddings=False,
    )
    return cfg


def write_rows(path: Path, rows: int, tokens: int) -> Path:
    """``rows`` rows, each the embedded texts one after another (cycling) up to 8 characters per
    token of ``tokens``: longer than the tokenizer makes ``tokens`` of (about 3.5 a token)."""
    texts = [json.loads(line)["text"] for line in TEXTS.read_text().splitlines() if line]
    cycle = itertools.cycle(texts)
    with open(path, "w") as f:
        for _ in range(rows):
            parts, chars = [], 0
            while chars < 8 * tokens:
                parts.append(next(cycle))
                chars += len(parts[-1]) + 2
            f.write(json.dumps({"text": "\n\n".join(parts)}) + "\n")
    return path


class Launches:
    """The finetune launches of one invocation, each run once per (configuration, length,
    steps, repeat)."""

    def __init__(self, a: argparse.Namespace, work: Path) -> None:
        self.a, self.work = a, work
        self.model_dir = work / "model"
        self.model_dir.mkdir(parents=True, exist_ok=True)
        (self.model_dir / "config.json").write_text(json.dumps(model_config(a), indent=2))
        longest = max(a.lengths + [a.base_length])
        self.rows = write_rows(work / "rows.jsonl", 2 * max(a.steps, a.throughput_steps), longest)
        self.env = rank_env()
        self.env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
        self.done: dict[tuple, dict] = {}

    def get(self, config: str, length: int, steps: int, repeat: int = 0) -> dict:
        key = (config, length, steps, repeat)
        if key not in self.done:
            self.done[key] = self._launch(config, length, steps, repeat)
            r = self.done[key]
            print(
                f"{config} length {length}, {steps} step(s): peak RSS per rank "
                f"{', '.join(f'{mb:.0f}' for mb in r['peak_mb'])} MB; {r['wall_s']:.1f} s",
                flush=True,
            )
        return self.done[key]

    def _launch(self, config: str, length: int, steps: int, repeat: int) -> dict:
        sp, tiled = CONFIGS[config]
        name = f"{config}_{length}_{steps}_{repeat}"
        out = self.work / name
        cmd = [
            str(BIN / "torchrun"),
            *("--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "finetune"),
            *("--config_name", self.model_dir, "--tokenizer_name", TOKENIZER_DIR),
            *("--train_file", self.rows, "--validation_split_percentage", "0"),
            *("--dataset_cache_dir", self.work / "cache", "--output_dir", out),
            *("--max_seq_length", length, "--per_device_train_batch_size", "1"),
            *("--max_steps", steps, "--logging_steps", "1", "--precision", "fp32", "--no_plot"),
            *("--sequence_parallel_size", sp, *(["--tiled_mlp"] if tiled else [])),
        ]
        cmd = [str(c) for c in cmd]
        log = self.work / f"{name}.log"
        t0 = time.perf_counter()
        with open(log, "w") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            proc = subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=f, stderr=subprocess.STDOUT)
            peaks = watch_ranks(proc, self.a.timeout)
        wall = time.perf_counter() - t0
        text = log.read_text(errors="replace")
        if proc.returncode != 0 or len(peaks) != 2:
            tail = "\n".join(text.splitlines()[-30:])
            raise SystemExit(
                f"{' '.join(cmd)}\nexited {proc.returncode} ({len(peaks)} rank(s) seen); "
                f"last lines of {log}:\n{tail}"
            )
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
        tiles = TILES.search(text)
        return {
            "config": config,
            "sequence_parallel_size": sp,
            "tiled_mlp": tiled,
            "length": length,
            "steps": steps,
            "peak_mb": [round(kib * 1024 / 1e6, 1) for _, kib in sorted(peaks.items())],
            "wall_s": round(wall, 2),
            "tokens_per_s": [r["tokens_per_s"] for r in rows if "tokens_per_s" in r],
            "tiles": {"mlp": int(tiles[1]), "loss": int(tiles[2])} if tiles else None,
            "log": str(log),
        }


def watch_ranks(proc: subprocess.Popen, timeout: float) -> dict[int, int]:
    """Wait for the launcher ``proc``; each rank's (torchrun's children's, by RANK) VmHWM in KiB,
    read every POLL_S while they run. Kills the launch at ``timeout`` seconds."""
    import psutil

    peaks: dict[int, int] = {}
    ranks: dict[int, int] = {}  # pid -> rank
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise SystemExit(f"launch killed after {timeout} s: {' '.join(proc.args)}")
        try:
            children = psutil.Process(proc.pid).children()
        except psutil.NoSuchProcess:
            children = []
        for child in children:
            try:
                if child.pid not in ranks:
                    ranks[child.pid] = int(child.environ()["RANK"])
                hwm = _vm_hwm_kib(child.pid)
            except (psutil.Error, OSError, KeyError, ValueError):
                continue  # not yet a rank (torchrun's own helpers), or gone
            rank = ranks[child.pid]
            peaks[rank] = max(peaks.get(rank, 0), hwm)
        time.sleep(POLL_S)
    return peaks


def _vm_hwm_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise ValueError(f"no VmHWM for {pid}")


def point(launches: Launches, config: str, length: int, repeats: int) -> dict:
    """``config`` at ``length``: ``repeats`` launches of --steps steps, and their figure, the
    median of each launch's busiest rank's peak."""
    runs = [launches.get(config, length, launches.a.steps, i) for i in range(repeats)]
    return {
        "length": length,
        "busiest_mb": med([max(r["peak_mb"]) for r in runs]),
        "peak_mb": [r["peak_mb"] for r in runs],
        "wall_s": [r["wall_s"] for r in runs],
        "tiles": runs[0]["tiles"],
    }


def search(launches: Launches, config: str, start: int, repeats: int, budget_mb: float) -> list:
    """``config``'s points from ``start`` along the ladder: up while one fits in ``budget_mb``,
    down while one does not; stops at the first change or the ladder's end."""
    lengths = launches.a.lengths
    i = lengths.index(start)
    points = [point(launches, config, lengths[i], repeats)]
    fits = points[0]["busiest_mb"] <= budget_mb
    step = 1 if fits else -1
    while 0 <= i + step < len(lengths):
        i += step
        points.append(point(launches, config, lengths[i], repeats))
        if (points[-1]["busiest_mb"] <= budget_mb) != fits:
            break
    return sorted(points, key=lambda p: p["length"])


def reach(points: list[dict], budget_mb: float) -> dict:
    """The longest row within ``budget_mb``: interpolated between the longest length that fits
    and the next length tried (which does not), or the longest tried as a lower bound."""
    busiest = [(p["length"], p["busiest_mb"]) for p in points]
    fit = [(n, mb) for n, mb in busiest if mb <= budget_mb]
    if not fit:
        return {"length": 0, "how": f"none of the lengths tried fits (shortest {busiest[0][0]})"}
    n0, mb0 = max(fit)
    above = [(n, mb) for n, mb in busiest if n > n0]
    if not above:
        return {"length": n0, "how": "a lower bound: the longest length tried fits"}
    n1, mb1 = min(above)
    length = n0 + (budget_mb - mb0) / (mb1 - mb0) * (n1 - n0)
    return {
        "length": int(length),
        "how": f"interpolated between {n0} ({mb0:.0f} MB) and {n1} ({mb1:.0f} MB)",
    }


def throughput(launches: Launches) -> dict:
    """SP=1's and SP=2's tokens/s at --base_length: --throughput_rounds rounds of one launch
    each, the order alternating (SP=1, SP=2, SP=2, SP=1, ...); per configuration the median of
    all its launches' steps, the first step of each left out."""
    a = launches.a
    steps: dict[str, list[list[float]]] = {"sp1": [], "sp2": []}
    for k in range(a.throughput_rounds):
        for config in ("sp1", "sp2") if k % 2 == 0 else ("sp2", "sp1"):
            r = launches.get(config, a.base_length, a.throughput_steps, k)
            steps[config].append(r["tokens_per_s"][1:])
    out = {c: {"tokens_per_s": med(sum(xs, [])), "steps": xs} for c, xs in steps.items()}
    out["round_ratios"] = [med(sp2) / med(sp1) for sp1, sp2 in zip(steps["sp1"], steps["sp2"])]
    return out


def attention_kernel(a: argparse.Namespace) -> list[str]:
    """The aten attention ops CPU sdpa runs for a causal row without padding, one layer of the
    benchmark's shape, forward and backward (the row's attention mask all ones, as the ranks')."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = model_config(a)
    cfg.update(num_hidden_layers=1, vocab_size=1000, max_position_embeddings=512)
    cfg = {k: v for k, v in cfg.items() if k != "model_type"}
    model = AutoModelForCausalLM.from_config(LlamaConfig(**cfg), attn_implementation="sdpa")
    ids = torch.randint(0, 1000, (1, 512))
    with torch.profiler.profile() as prof:
        model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss.backward()
    names = {e.key for e in prof.key_averages() if "attention" in e.key}
    return sorted(names - {"aten::scaled_dot_product_attention"})


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="finetune-bench-long-"))
    launches = Launches(a, work)
    print(f"launch logs in {work}")
    points = {"sp1": [point(launches, "sp1", a.base_length, a.budget_repeats)]}
    budget_mb = points["sp1"][0]["busiest_mb"]
    print(f"budget: {budget_mb:.0f} MB per rank (SP=1's busiest rank at {a.base_length})")
    points["sp2"] = search(launches, "sp2", a.sp_from, a.sp_repeats, budget_mb)
    if not a.skip_tiled:
        points["sp2_tiled"] = search(launches, "sp2_tiled", a.tiled_from, 1, budget_mb)
    longest = {c: reach(ps, budget_mb) for c, ps in points.items() if c != "sp1"}
    longest["sp1"] = {"length": a.base_length, "how": "the budget's own length"}
    speed = throughput(launches)
    result = {
        "budget_mb": budget_mb,
        "budget_from": (
            f"SP=1's busiest rank's peak RSS at {a.base_length} tokens, median of "
            f"{a.budget_repeats} launch(es)"
        ),
        "longest": longest,
        "ratios": {c: r["length"] / a.base_length for c, r in longest.items() if c != "sp1"},
        "points": points,
        "throughput": speed,
        "ratio_tokens_per_s": speed["sp2"]["tokens_per_s"] / speed["sp1"]["tokens_per_s"],
        "attention_kernel": None if a.skip_attention_check else attention_kernel(a),
        "launches": list(launches.done.values()),
        "model_config": model_config(a),
        "settings": {k: v for k, v in vars(a).items() if k not in ("out", "work")},
    }
    print(json.dumps({k: result[k] for k in ("budget_mb", "longest", "throughput")}, indent=1))
    ratios = ", ".join(f"{c} {x:.2f}x" for c, x in result["ratios"].items())
    print(
        f"longest row within {budget_mb:.0f} MB against SP=1's: {ratios}; "
        f"tokens/s SP=2 / SP=1 {result['ratio_tokens_per_s']:.3f}"
    )
    if a.out:
        write_json(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
