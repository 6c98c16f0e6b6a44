"""The export and resume measures of the suite: the offline export's memory and wall time
against DeepSpeed's zero_to_fp32.py (P5, P5b: resume/export.py) and a resume's time to first
step against a fresh start's (P6: resume/resume_verify.py, on P5's checkpoint)."""

from __future__ import annotations

import json

from bench.harness import MB, Ctx, Measure, Run, med

P5 = Measure(
    "P5",
    "offline export: peak RSS over the process's own post-import floor / fp32 model bytes",
    "<= 0.1",
)
P5B = Measure("P5b", "offline export wall time, finetune export vs zero_to_fp32.py", "<= 0.5")
P6 = Measure("P6", "time to first step: resume from a checkpoint vs fresh start", "<= 1.2")


def p5(ctx: Ctx) -> dict:
    s = ctx.sizes["P5"]
    out = ctx.results / "export.json"
    ctx.run(
        "P5",
        "resume/export.py",
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
    e = P5.entry(
        ours["peak_minus_own_floor_bytes"] / MB,
        w / MB,
        "MB",
        "fp32 model bytes",
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
        "P5b": P5B.entry(
            ours["wall_s_median"],
            theirs["wall_s_median"],
            "s (median)",
            "DeepSpeed zero_to_fp32.py",
            {
                "finetune_export_s": [round(x, 3) for x in ours["wall_s"]],
                "zero_to_fp32_s": [round(x, 3) for x in theirs["wall_s"]],
            },
            note="child process wall time, spawn to exit, imports included",
        )
    }
    return e


def p6(ctx: Ctx) -> dict:
    s = ctx.sizes["P6"]
    out = ctx.results / "resume_verify.json"
    ctx.run(
        "P6",
        "resume/resume_verify.py",
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
    return P6.entry(
        med(r["resumed_s"]),
        med(r["fresh_s"]),
        "s to first step (median)",
        "fresh start, same flags",
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


RUNS = (
    Run(
        (P5,),
        "resume/export.py",
        p5,
        full={"repeats": 5, "floor_repeats": 2},
        smoke={"repeats": 1, "floor_repeats": 1},
        subs=(P5B,),
    ),
    # resumes from the checkpoint P5's run creates in work/export (in --smoke lanes: P5 then P6)
    Run(
        (P6,),
        "resume/resume_verify.py",
        p6,
        full={"repeats": 2, "warmup_launches": 0},
        smoke={"repeats": 1, "warmup_launches": 0},
    ),
)
