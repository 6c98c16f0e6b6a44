"""The preference-training measures of the suite (``bench/run_all.py --only P13``): finetune's DPO
tokens/s against TRL's DPOTrainer (P13) and the share of finetune's launch its reference pass
takes (P13b), from bench/preference/dpo_throughput.py's launches."""

from __future__ import annotations

import json

from bench.harness import Ctx, Measure, Run, goal_met
from bench.train.measures import launch_row

P13 = Measure(
    "P13",
    "DPO training tokens/s, finetune --objective dpo vs TRL's DPOTrainer + DeepSpeed ZeRO-3, "
    "same model/data/batch, precomputed reference on both sides, 2 ranks",
    ">= 1.0",
)
P13B = Measure(
    "P13b",
    "the reference pass's share of finetune's DPO run: its reference log-probs' seconds over the "
    "launch's wall time",
    "<= 0.25",
)


def p13(ctx: Ctx) -> dict:
    s = ctx.sizes["P13"]
    out = ctx.results / "dpo_throughput.json"
    args = [
        *("--steps", s["steps"], "--warmup", s["warmup"]),
        *("--logging_steps", s["logging_steps"], "--rounds", s["rounds"]),
        *("--per_device_train_batch_size", s["per_device_train_batch_size"]),
        *("--out", out),
    ]
    for k in ("hidden_size", "num_layers", "pairs", "wait_quiet"):
        if k in s:
            args += [f"--{k}", s[k]]
    ctx.run("P13", "preference/dpo_throughput.py", args)
    r = json.loads(out.read_text())
    fs, trl = r["summary"]["finetune"], r["summary"]["trl"]
    raw = [
        {**launch_row(m), "wall_s": m["wall_s"], "reference_s": m["reference_s"]}
        for m in r["launches"]
    ]
    cfg = r["model_config"]
    settings = {
        **s,
        "model": (
            f"Llama from the embedded config: {cfg['num_hidden_layers']} layers x "
            f"{cfg['hidden_size']}, vocab {cfg['vocab_size']}, fp32"
        ),
        "pairs": r["reference"]["pairs"],
        "beta": r["settings"]["beta"],
        "ranks": 2,
    }
    pair_ratios = r["pair_ratios"]
    e = P13.entry(
        fs["tokens_per_s"],
        trl["tokens_per_s"],
        "tokens/s",
        "TRL DPOTrainer (precompute_ref_log_probs) + DeepSpeed ZeRO-3",
        raw,
        note=(
            "ratio = the median of the pairs' ratios (launches 1-2, 3-4, ...: one per tool, "
            "alternating order; ratio_total_tokens: all launches' tokens / seconds); tokens/s = "
            "the chosen and rejected rows' non-pad tokens (prompts included) of the timed steps / "
            "their seconds, total over each tool's launches (as P1: finetune's metrics.jsonl "
            "windows, TRL's rank-0 step times); both reference passes are before the timed steps; "
            "reference_s = each launch's reference pass (TRL's from its progress bar, 1 s steps); "
            "other_load_pct = CPU the rest of the machine used during a launch (share of all "
            "cores), over 5% contended; ratio_quiet_launches uses only the others"
        ),
        settings=settings,
    )
    if pair_ratios:  # the figure that counts: the median of the alternating pairs
        ratio = r["ratio"]
        e.update(
            ratio=ratio,
            met=goal_met(P13.goal, ratio),
            ratio_total_tokens=e["ratio"],
            ratio_quiet_launches=r["ratio_quiet_launches"],
            pair_ratios=[round(x, 4) for x in pair_ratios],
        )
    ref = r["reference"]
    n = len(ref["reference_s"])
    e["sub"] = {
        "P13b": P13B.entry(
            sum(ref["reference_s"]) / n,
            sum(ref["wall_s"]) / n,
            "s, reference pass (ratio: its share of the launch)",
            "finetune's launch wall time (launcher start to exit, mean)",
            {
                "reference_s": ref["reference_s"],
                "wall_s": ref["wall_s"],
                "shares": [round(x, 4) for x in ref["shares"]],
            },
            trl_reference_s=trl["reference_s_per_launch"],
            note=(
                "reference seconds = finetune's own 'reference log-probs: computed (...) in X s' "
                f"over all {ref['pairs']} train pairs, into a fresh --dataset_cache_dir each "
                "launch; ratio = their total over the launches' total wall time; the goal is "
                "this suite's own (none was set), and the share depends on the launch's steps"
            ),
            settings=settings,
        )
    }
    return e


RUNS = (
    Run(
        (P13,),
        "preference/dpo_throughput.py",
        p13,
        # ~3.5 min on 2 cores: three alternating pairs (finetune, TRL), (TRL, finetune), ... of
        # ~30 s launches, each scoring all 1000 pairs before training; each launch first waits up
        # to 30 s for the rest of the machine to go quiet
        full={
            "steps": 30,
            "warmup": 5,
            "logging_steps": 5,
            "rounds": 3,
            "per_device_train_batch_size": 8,
            "hidden_size": 256,
            "num_layers": 4,
            "wait_quiet": 30,
        },
        # one pair of launches on the first 64 pairs
        smoke={
            "steps": 4,
            "warmup": 2,
            "logging_steps": 2,
            "rounds": 1,
            "per_device_train_batch_size": 4,
            "hidden_size": 64,
            "num_layers": 2,
            "pairs": 64,
        },
        subs=(P13B,),
    ),
)
