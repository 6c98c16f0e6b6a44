"""The data-path measures of the suite: a restart's time to first step on 1M rows against 2k rows
(P9) and against HF Trainer's restart on the same files (P6b), both from data/data_path.py's
launches, and tokens/s with --packing against unpacked (P10: data/packing.py)."""

from __future__ import annotations

import json

from bench.harness import Ctx, Measure, Run

P9 = Measure("P9", "restart (resume) time to first step, 1M rows vs 2k rows", "<= 1.1")
P6B = Measure(
    "P6b",
    "restart time to first step, finetune vs HF Trainer's restart on the same data and model",
    "<= 1.0",
)
P10 = Measure(
    "P10",
    "training tokens/s (real tokens) with --packing (best-fit decreasing) vs unpacked, "
    "embedded model and data, 2 ranks",
    ">= 1.0",
)


def p9(ctx: Ctx) -> dict:
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
    ctx.run("P9", "data/data_path.py", args)
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
    e = P9.entry(
        big["ttfs_restart_s"],
        small["ttfs_restart_s"],
        "s to first step (median)",
        f"finetune's restart on {s['small_rows']:,} rows",
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
        return P6B.error(
            "not run: P9 ran no HF Trainer restarts (hf_sets is empty in this mode)", skipped=True
        )
    e = P6B.entry(
        big["ttfs_restart_s"],
        hf["large_restart_s"],
        "s to first step (median)",
        "HF Trainer + DeepSpeed restart, same data and model",
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


def p10(ctx: Ctx) -> dict:
    s = ctx.sizes["P10"]
    out = ctx.results / "packing.json"
    every = ["--logging_steps", s["logging_steps"]] if "logging_steps" in s else []
    ctx.run(
        "P10",
        "data/packing.py",
        ["--steps", s["steps"], "--rounds", s["rounds"], *every, "--out", out],
    )
    r = json.loads(out.read_text())
    return P10.entry(
        r["packed_tokens_per_s"],
        r["unpacked_tokens_per_s"],
        "tokens/s",
        "the same run unpacked (rows padded per micro-batch)",
        r["runs"],
        packing_efficiency=r["packing_efficiency"],
        padded_efficiency=r["padded_efficiency"],
        note=(
            "packing_efficiency = real tokens / block tokens (logged at start); "
            "padded_efficiency = real tokens / padded tokens of the unpacked micro-batches"
        ),
        settings={**s, **r["settings"], "ranks": r["settings"]["nprocs"]},
    )


RUNS = (
    Run(
        (P9,),
        "data/data_path.py",
        p9,
        full={
            "rows": 1_000_000,
            "small_rows": 2000,
            "repeats": 2,
            "steps": 20,
            "hf_sets": ["1m", "2k"],
        },
        smoke={"rows": 160, "small_rows": 40, "repeats": 1, "steps": 3, "hf_sets": []},
        subs=(P6B,),
    ),
    Run(
        (P10,),
        "data/packing.py",
        p10,
        full={"steps": 60, "rounds": 2},
        # 4 steps logged each: 2 rows timed after the 2 warm-up rows
        smoke={"steps": 4, "rounds": 1, "logging_steps": 1},
    ),
)
