"""The save measures of the suite: the --async_save stall and what a background write costs the
steps it overlaps (P2, P2b, P2c: save/async_save.py), partitioned save bandwidth and the
consolidated save's memory (P3, P4: save/checkpoint_save.py), per-rank training state (P7:
save/state_memory.py) and per-rank save I/O (P8: save/save_io.py)."""

from __future__ import annotations

import json

from bench.harness import MB, Ctx, Measure, Run, Unavailable, goal_met, med
from bench.save.checkpoint_save import write_inputs

P2 = Measure(
    "P2",
    "training stall per checkpoint with --async_save vs DeepSpeed's synchronous save_checkpoint "
    "of the same state",
    "<= 0.1",
)
P2B = Measure(
    "P2b", "step time while a background checkpoint write is in flight vs while none is", "<= 1.15"
)
P2C = Measure(
    "P2c",
    "wall time of N steps saving every k steps with --async_save vs no saves "
    "(overhead = ratio - 1)",
    "<= 1.035",
)
P3B = Measure(
    "P3b",
    "--async_save writer throughput on its files (serialize, hash, write, fsync; the waits pacing "
    "it to training excluded) vs raw write + fdatasync of the same bytes, same directory",
    ">= 0.8",
)
P3 = Measure(
    "P3",
    "partitioned save bandwidth (sync, fsync'd, committed) vs raw write + fdatasync of the same "
    "bytes, same directory",
    ">= 0.8",
)
P4 = Measure(
    "P4", "rank-0 peak RSS increase during the consolidated save / fp32 model bytes", "<= 0.3"
)
P7 = Measure(
    "P7",
    "per-rank bytes of params + grads + optimizer state (ZeRO-3), busiest rank at 2 ranks "
    "vs 1 rank",
    "<= 0.6",
)
P8 = Measure(
    "P8",
    "busiest rank's bytes written + read during a partitioned save, 4 ranks vs 2 ranks",
    "<= 0.6",
)


def p2(ctx: Ctx) -> dict:
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
    code, text = ctx.run("P2", "save/async_save.py", args, ok_codes=(0, 3))
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
    e = P2.entry(
        sm["stall_async_s"],
        sm["stall_deepspeed_sync_s"],
        "s stalled per checkpoint",
        "DeepSpeed save_checkpoint (synchronous, its own checkpoint engine, no fsync)",
        stall,
        finetune_sync_save_s=sm["stall_finetune_sync_s"],
        settings=settings,
    )
    subs = {}
    if "step_ratio" in sm:
        subs["P2b"] = P2B.entry(
            sm["step_inflight_s"],
            sm["step_idle_s"],
            "s per step (median)",
            "step time with no write in flight",
            {
                "inflight": [round(x, 4) for x in r["inflight_steps_s"]],
                "idle": [round(x, 4) for x in r["idle_steps_s"]],
            },
            note="a step = _train_step + manager.poll() at its boundary, rank 0's wall time",
        )
    else:
        subs["P2b"] = P2B.error(
            "no step ran while a write was in flight (the write finished first)"
        )
    e2e = sm["e2e_s"]
    runs: dict = {}
    for x in r["e2e"]:
        runs.setdefault(x["mode"], []).append(round(x["seconds"], 3))
    subs["P2c"] = P2C.entry(
        e2e["async"],
        e2e["none"],
        f"s for {s['e2e_steps']} steps",
        "the same steps with no saves",
        runs,
        overhead_async=sm["e2e_overhead_async"],
        overhead_sync=sm["e2e_overhead_sync"],
        sync_s=e2e["sync"],
        note=(
            f"a save every {s['every']} steps at steps < N; ratio = the median over rounds of "
            "async / none within the round (runs adjacent in time: the machine's drift cancels); "
            "ratio_medians: the median async run / the median none run"
        ),
    )
    if sm.get("e2e_round_ratios"):
        rounds = sm["e2e_round_ratios"]
        subs["P2c"].update(
            ratio=med(rounds),
            met=goal_met(P2C.goal, med(rounds)),
            ratio_medians=subs["P2c"]["ratio"],
            round_ratios=[round(x, 4) for x in rounds],
        )
    if "writer_mb_s" in sm:
        subs["P3b"] = P3B.entry(
            sm["writer_mb_s"],
            sm["raw_mb_s"],
            "MB/s (rank 0)",
            "raw write + fdatasync of the snapshot's bytes, every rank at once",
            {
                "writer_s": [x["writer_s"] for x in r["profile"]],
                "raw_write_s": [round(x, 4) for x in r["raw_write_s"]],
            },
            note="the writer's seconds: torch_save (serialization, hashing and writing) + "
            "fsync - paced, from its profile",
        )
    else:
        subs["P3b"] = P3B.error("the run recorded no writer profile or raw write")
    e["sub"] = subs
    return e


def p3_p4(ctx: Ctx) -> tuple[dict, dict]:
    s = ctx.sizes["P3"]
    out = ctx.results / "checkpoint_save.json"
    ctx.run(
        "P3",
        "save/checkpoint_save.py",
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
    e3 = P3.entry(
        med(ours),
        med(raw_bw),
        "MB/s",
        "raw write + fdatasync of the same bytes per rank, same directory",
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
    e4 = P4.entry(
        c["rss_increase"] / MB,
        mb / MB,
        "MB",
        "fp32 model bytes",
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


def p7(ctx: Ctx) -> dict:
    out = ctx.results / "state_memory.json"
    ctx.run(
        "P7",
        "save/state_memory.py",
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
    return P7.entry(
        two["max_rank_total_bytes"] / MB,
        one["max_rank_total_bytes"] / MB,
        "MB per rank",
        "the same model on 1 rank",
        raw,
        params=r["params"],
        note=(
            "ds_tensor of every parameter (+ full data of persistent small ones), "
            "fp32 master partitions, "
            "Adam state, gradient partitions; each storage counted once; after one step"
        ),
        settings={**ctx.model_settings, "worlds": [1, 2]},
    )


def p8(ctx: Ctx) -> dict:
    s = ctx.sizes["P8"]
    out = ctx.results / "save_io.json"
    small_w, big_w = s["worlds"]
    args = ["--worlds", small_w, big_w, "--saves", s["saves"], "--out", out]
    if s["model"] == "134m":
        cfg_dir, _ = write_inputs(ctx.work / "save_io_model")
        args += [
            "--config_name",
            cfg_dir,
            "--extra=--max_seq_length 32 --per_device_train_batch_size 1 --max_eval_samples 4",
        ]
    ctx.run("P8", "save/save_io.py", args)
    r = json.loads(out.read_text())
    by_world = {x["world"]: x for x in r["runs"]["after"]}

    def busiest(world: int) -> tuple[float, dict]:
        rows = by_world[world]["ranks"]
        top = max(rows, key=lambda x: x["wrote_mb"] + x["read_mb"])
        return top["wrote_mb"] + top["read_mb"], top

    b_big, top_big = busiest(big_w)
    b_small, top_small = busiest(small_w)
    raw = {f"world{w}": x["ranks"] for w, x in by_world.items()}
    e = P8.entry(
        b_big,
        b_small,
        "MB per save (busiest rank)",
        f"the same model's save at {small_w} ranks",
        raw,
        busiest_rank={str(big_w): top_big["rank"], str(small_w): top_small["rank"]},
        checkpoint_mb={str(w): x["checkpoint_mb"] for w, x in by_world.items()},
        note=(
            "written = the rank's files in the manifest (+ shared files on rank 0); "
            "read = /proc/self/io rchar (files and collectives' sockets); medians over the saves"
        ),
        settings={
            **s,
            "model": "~134M Llama (bench/save/checkpoint_save.py)"
            if s["model"] == "134m"
            else "embedded (459,520 parameters)",
        },
    )
    if (small_w, big_w) != (2, 4):
        e["what"] = e["what"].replace("4 ranks vs 2 ranks", f"{big_w} ranks vs {small_w} ranks")
    return e


RUNS = (
    Run(
        (P2,),
        "save/async_save.py",
        p2,
        # ~4 s per step of the 134M model on 2 CPU ranks: (c) is 6 runs x 10 steps
        full={"repeats": 3, "bg_saves": 3, "e2e_steps": 10, "every": 5, "e2e_repeats": 4},
        smoke={"repeats": 1, "bg_saves": 1, "e2e_steps": 4, "every": 2, "e2e_repeats": 1},
        subs=(P2B, P2C, P3B),
    ),
    Run((P3, P4), "save/checkpoint_save.py", p3_p4, full={"repeats": 3}, smoke={"repeats": 1}),
    Run((P7,), "save/state_memory.py", p7, full={}, smoke={}),
    Run(
        (P8,),
        "save/save_io.py",
        p8,
        full={"saves": 3, "model": "134m", "worlds": [2, 4]},
        smoke={"saves": 2, "model": "embedded", "worlds": [1, 2]},
    ),
)
