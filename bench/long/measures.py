"""The long-row measures of the suite, from long/seq_memory.py's launches: the longest row that
trains within one per-rank peak-RSS budget with --sequence_parallel_size 2 against SP=1 (P11) and
with --tiled_mlp added (P11b), and tokens/s at SP=2 against SP=1 at one length (P12)."""

from __future__ import annotations

import json

from bench.harness import Ctx, Measure, Run

P11 = Measure(
    "P11",
    "longest row that trains within one per-rank peak-RSS budget, --sequence_parallel_size 2 "
    "vs SP=1 (data parallel), 2 ranks each",
    ">= 1.8",
)
P11B = Measure(
    "P11b",
    "longest row within the same budget, --sequence_parallel_size 2 + --tiled_mlp vs SP=1",
    ">= 3.6",
)
P12 = Measure(
    "P12",
    "training tokens/s at one row length, --sequence_parallel_size 2 vs SP=1 (data parallel), "
    "2 ranks each",
    ">= 0.7",
)
MODEL = ("hidden_size", "num_layers", "vocab_size")


def p11(ctx: Ctx) -> tuple[dict, dict]:
    s = ctx.sizes["P11"]
    out = ctx.results / "seq_memory.json"
    args = [
        *("--base_length", s["base_length"], "--lengths", *s["lengths"]),
        *("--sp_from", s["sp_from"], "--tiled_from", s["tiled_from"]),
        *("--steps", s["steps"], "--throughput_steps", s["throughput_steps"]),
        *("--throughput_rounds", s["throughput_rounds"]),
        *("--budget_repeats", s["budget_repeats"], "--sp_repeats", s["sp_repeats"]),
        *(x for k in MODEL if k in s for x in (f"--{k}", s[k])),
        *([] if s["tiled"] else ["--skip_tiled"]),
        *(["--skip_attention_check"] if ctx.smoke else []),
        *("--work", ctx.work / "long", "--out", out),
    ]
    ctx.run("P11", "long/seq_memory.py", args)
    r = json.loads(out.read_text())
    cfg = r["model_config"]
    settings = {
        **s,
        "model": (
            f"Llama from a config: hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, "
            f"MLP {cfg['intermediate_size']}, vocab {cfg['vocab_size']} (untied head), fp32"
        ),
        "budget_mb": r["budget_mb"],
        "budget": r["budget_from"],
        "ranks": 2,
        "per_device_train_batch_size": 1,
        "launcher": "torchrun",
    }
    peaks = {c: {str(p["length"]): p["peak_mb"] for p in ps} for c, ps in r["points"].items()}
    e = longest_entry(P11, r, "sp2", settings, {"budget_mb": r["budget_mb"], **peaks})
    e["attention_kernel"] = r["attention_kernel"] or "not checked"
    if "sp2_tiled" in r["longest"]:
        tiles = {str(p["length"]): p["tiles"] for p in r["points"]["sp2_tiled"]}
        raw = {"budget_mb": r["budget_mb"], "sp1": peaks["sp1"], "sp2_tiled": peaks["sp2_tiled"]}
        raw["tiles"] = tiles
        e["sub"] = {"P11b": longest_entry(P11B, r, "sp2_tiled", settings, raw)}
    else:
        why = "not run: no --tiled_mlp launches in this mode"
        e["sub"] = {"P11b": P11B.error(why, skipped=True)}
    return e, p12(r, settings)


def longest_entry(m: Measure, r: dict, config: str, settings: dict, raw: dict) -> dict:
    """``config``'s longest row within the budget over SP=1's (the budget's own length)."""
    budget = f"{r['budget_mb']:.0f} MB per rank"
    bound = " (at least)" if r["longest"][config]["how"].startswith("a lower bound") else ""
    return m.entry(
        r["longest"][config]["length"],
        r["longest"]["sp1"]["length"],
        f"tokens a row{bound}, within {budget}",
        "SP=1 (2 data-parallel ranks): the budget's own length",
        raw,
        how=r["longest"][config]["how"],
        note=(
            "peak RSS = each rank's VmHWM, read every 50 ms; a launch's figure is its busiest "
            "rank's, a length's the median of its launches' (raw: every launch's ranks', MB, "
            f"by length); budget = {r['budget_from']} ({budget}); the longest row: "
            f"{r['longest'][config]['how']}; {r['settings']['steps']} steps a launch"
        ),
        settings=settings,
    )


def p12(r: dict, settings: dict) -> dict:
    t, a = r["throughput"], r["settings"]
    length = a["base_length"]
    return P12.entry(
        t["sp2"]["tokens_per_s"],
        t["sp1"]["tokens_per_s"],
        "tokens/s (median of steps)",
        f"SP=1 (2 data-parallel ranks, a row each) at the same length, {length} tokens",
        {"sp1_tokens_per_s": t["sp1"]["steps"], "sp2_tokens_per_s": t["sp2"]["steps"]},
        round_ratios=[round(x, 4) for x in t["round_ratios"]],
        note=(
            f"{a['throughput_rounds']} launch(es) each at {length} tokens a row, order "
            f"alternating (SP=1, SP=2, SP=2, SP=1), {a['throughput_steps']} steps a launch; "
            "tokens/s per step from metrics.jsonl (a row's tokens once), each launch's first step "
            "left out, median of a configuration's steps (raw: by launch); SP=1 trains 2 rows a "
            "step, SP=2 one"
        ),
        settings={**settings, "length": length},
    )


RUNS = (
    Run(
        (P11, P12),
        "long/seq_memory.py",
        p11,
        # ~3 min on 2 cores: the budget's 3 launches, SP=2's search from 2048 to its first change
        # (2 lengths, 2 launches each), SP=2 + tiling's from the top of the ladder (1 launch if it
        # fits there: a lower bound), 4 tokens/s launches
        full={
            "base_length": 1024,
            "lengths": [1024, 1536, 2048, 2560, 3072, 4096, 6144, 8192],
            "sp_from": 2048,
            "tiled_from": 8192,
            "budget_repeats": 3,
            "sp_repeats": 2,
            "steps": 2,
            "throughput_steps": 5,
            "throughput_rounds": 2,
            "tiled": True,
        },
        # 2 launches (SP=1, SP=2) at one length, whose 2-step launches give the tokens/s too; no
        # tiled launch (P11b not run)
        smoke={
            "base_length": 64,
            "lengths": [64],
            "sp_from": 64,
            "tiled_from": 64,
            "budget_repeats": 1,
            "sp_repeats": 1,
            "steps": 2,
            "throughput_steps": 2,
            "throughput_rounds": 1,
            "tiled": False,
            "hidden_size": 64,
            "num_layers": 2,
            "vocab_size": 1000,
        },
        subs=(P11B,),
    ),
)
