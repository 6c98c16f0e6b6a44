"""The training-throughput measure of the suite (``bench/run_all.py --only P1``): finetune's
tokens/s against HF Trainer's, from bench/train/train_throughput.py's launches."""

from __future__ import annotations

import json

from bench.harness import Ctx, Measure, Run, goal_met, med

P1 = Measure(
    "P1",
    "training tokens/s, finetune vs HF Trainer + DeepSpeed, same model/data/ZeRO-3 config, 2 ranks",
    ">= 1.0",
)


def p1(ctx: Ctx) -> dict:
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
    for k in ("hidden_size", "num_layers", "wait_quiet"):
        if k in s:
            args += [f"--{k}", s[k]]
    ctx.run("P1", "train/train_throughput.py", args)
    r = json.loads(out.read_text())
    fs, hf = r["summary"]["finetune"], r["summary"]["hf"]
    raw = [launch_row(m) for m in r["launches"]]
    quiet = r.get("ratio_finetune_over_hf_quiet_launches")
    # each pair of launches in a row (one per tool, alternating order) gives a ratio: their median
    rate = {m["launch"]: (m["tool"], m["tokens_per_s"]) for m in r["launches"]}
    pairs = [
        dict([rate[i], rate[i + 1]])
        for i in range(0, len(rate) - 1, 2)
        if {rate[i][0], rate[i + 1][0]} == {"finetune", "hf"}
    ]
    pair_ratios = [p["finetune"] / p["hf"] for p in pairs]
    e = P1.entry(
        fs["tokens_per_s"],
        hf["tokens_per_s"],
        "tokens/s",
        "HF Trainer + DeepSpeed ZeRO-3",
        raw,
        ratio_quiet_launches=quiet,
        # each tool's achieved TFLOP/s and its share of the devices' peak (None on CPU)
        mfu={
            tool: {"tflops": round(u["tflops"], 6), "mfu": u["mfu"], "device": u["device"]}
            for tool, u in r["mfu"].items()
        },
        note=(
            "ratio = the median of the pairs' ratios (launches 1-2, 3-4, ...: one per tool, "
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
            met=goal_met(P1.goal, med(pair_ratios)),
            ratio_total_tokens=e["ratio"],
            pair_ratios=[round(x, 4) for x in pair_ratios],
        )
    return e


def launch_row(m: dict) -> dict:
    """One launch of a throughput script as a raw entry (also P13's)."""
    return {
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


RUNS = (
    Run(
        (P1,),
        "train/train_throughput.py",
        p1,
        # seven alternating pairs (finetune, HF), (HF, finetune), ...: the ratio is the median of
        # the pairs' ratios, P1 being noisy on a shared machine (adjacent launches of one tool
        # differ by up to 10%); each launch first waits up to 30 s for the rest of the machine to
        # go quiet
        full={"steps": 40, "warmup": 10, "logging_steps": 5, "rounds": 7, "wait_quiet": 30},
        smoke={
            "steps": 4,
            "warmup": 2,
            "logging_steps": 2,
            "rounds": 1,
            "hidden_size": 64,
            "num_layers": 2,
        },
    ),
)
