"""Worker for bench/save/async_save.py: runs under `deepspeed --num_gpus 2`, prints one JSON line.

Builds the model through finetune itself (``build_trainer`` with ``--save_checkpoint --async_save``:
zero.Init, our DeepSpeed config), trains one step, then measures with its ``Checkpointer``:

(a) stall, ``--repeats`` times, interleaved: the wall time of
    ``manager.save(step, background=True)`` (returns once every rank holds its snapshot in host
    memory; the write goes on in a thread), then (untimed for the stall) ``manager.wait()`` to
    commit it; against the same state saved by ``engine.save_checkpoint`` with DeepSpeed's own
    checkpoint engine (synchronous, no fsync, no commit). finetune's synchronous
    ``manager.save(step)`` is timed alongside.
(b) step time while a background write is in flight vs while none is: ``--bg_saves`` times, start a
    background save, then train steps (``_train_step`` + ``manager.poll()`` at each boundary, as the
    trainer does) until the poll commits it; then as many steps (at least ``--min_idle_steps``) with
    no save in flight. Each step is timed on every rank; rank 0's times are reported.
(c) end to end: ``--e2e_steps`` training steps with a save every ``--every`` steps (at steps
    k, 2k, ... < N, as ``--save_steps`` does; the final save is the same for every mode and not part
    of this), timed between barriers, for: no saves; synchronous ``manager.save(step)``; async
    (``save(step, background=True)`` when due, ``poll()`` at every other boundary, ``wait()`` at
    the end: what ``Checkpointer.at_step`` / ``at_end`` do with --async_save). Order
    none, sync, async, async, sync, none, ... (``--e2e_repeats`` rounds of 3).
Times are rank 0's wall clock; "timed" ones are between barriers, so they include the slowest rank.
Before each measurement every rank calls ``os.sync()`` (untimed): no measurement pays for the
write-back of the save before it.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from checkpoint_save_worker import exit_now, folder_bytes, raw_write, timed  # noqa: E402 — this script's folder is on sys.path

from finetune import distributed as dist

try:  # Checkpointer now; CheckpointManager in older versions
    from finetune.checkpoint.checkpointer import Checkpointer as CheckpointManager
except ImportError:
    from finetune.checkpoint.manager import CheckpointManager
from finetune.cli import parse_train_args

try:  # build_trainer now; Trainer.build in older versions (before/after runs)
    from finetune.build import build_trainer
except ImportError:
    from finetune.trainer import Trainer

    build_trainer = Trainer.build


def async_api_missing() -> str | None:
    """Why this finetune has no background save API (None when it has one)."""
    if not hasattr(CheckpointManager, "poll") or not hasattr(CheckpointManager, "wait"):
        return (
            "CheckpointManager has no poll()/wait() "
            "(the --async_save API is not in this finetune yet)"
        )
    if "background" not in inspect.signature(CheckpointManager.save).parameters:
        return (
            "CheckpointManager.save has no background= parameter "
            "(the --async_save API is not in this finetune yet)"
        )
    return None


def settle() -> None:
    """Flush what earlier saves left dirty in the page cache, untimed, so no measurement pays for
    the write-back of the one before it."""
    os.sync()
    dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config_dir", required=True)
    ap.add_argument("--ds_config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=3, help="(a): stall measurements")
    ap.add_argument(
        "--bg_saves", type=int, default=3, help="(b): background saves to train through"
    )
    ap.add_argument(
        "--min_idle_steps", type=int, default=3, help="(b): at least this many steps with no save"
    )
    ap.add_argument(
        "--max_inflight_steps",
        type=int,
        default=200,
        help="(b): give up waiting for a write after this",
    )
    ap.add_argument("--e2e_steps", type=int, default=40, help="(c): N")
    ap.add_argument("--every", type=int, default=10, help="(c): save every k steps")
    ap.add_argument("--e2e_repeats", type=int, default=2, help="(c): rounds of (none, sync, async)")
    ap.add_argument("--batch_size", type=int, default=1)
    ap.add_argument("--seq_len", type=int, default=32)
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--local_rank", type=int, default=None)
    a = ap.parse_args()
    missing = async_api_missing()
    if missing:
        print("ERROR " + missing, flush=True)
        sys.exit(3)
    out = Path(a.out)
    tokenizer = str(Path(__file__).resolve().parents[2] / "finetune" / "resources" / "tokenizer")
    cfg = parse_train_args(
        [
            "--config_name",
            a.config_dir,
            "--tokenizer_name",
            tokenizer,
            "--deepspeed_config",
            a.ds_config,
            "--output_dir",
            str(out),
            "--max_steps",
            "100000",
            "--per_device_train_batch_size",
            str(a.batch_size),
            "--max_seq_length",
            str(a.seq_len),
            "--validation_split_percentage",
            "0",
            "--save_checkpoint",
            "--async_save",
            "--save_total_limit",
            "1",
            "--precision",
            a.precision,
        ]
    )
    dist.init(cfg.train.ddp_timeout)
    trainer = build_trainer(cfg)
    engine, manager, state = trainer.engine, trainer.checkpoints, trainer.state
    engine.train()
    trainer.data.start()

    def train_step() -> None:
        trainer._train_step()
        state.global_step += 1

    train_step()
    params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())

    # (a) stall. The first async save allocates the host buffers it keeps for the next ones (1x
    # the shard): timed on its own, then the repeats measure the steady state.
    train_step()
    settle()
    first_stall = timed(lambda: manager.save(state.global_step, background=True))
    manager.wait()
    if dist.is_main():
        print(f"first async save (allocates its buffers): stall {first_stall:.3f}s", flush=True)
    stall, profile, snapshot_sizes = [], [], []
    for i in range(a.repeats):
        train_step()
        step = state.global_step
        settle()
        t_save = timed(lambda step=step: manager.save(step, background=True))
        laps = dict(manager.pending.clock.laps) if manager.pending is not None else {}
        snapshot_bytes = manager.writer.snapshot_bytes  # this rank's: a later sync save resets it
        snapshot_sizes.append(snapshot_bytes)
        # The stall is everything training waits for: save() itself, and the next optimizer
        # step's wait for the lazy copy (0 when the copy was done during forward and backward).
        waited0 = getattr(manager, "copy_wait_s", 0.0)
        t_step = timed(train_step)
        copy_wait = getattr(manager, "copy_wait_s", 0.0) - waited0
        t_async = t_save + copy_wait
        record = manager.writer.record
        t_rest = timed(manager.wait)
        profile.append(
            {
                "save_s": t_save,
                "copy_wait_s": copy_wait,
                "next_step_s": t_step,
                "save_laps_s": laps,
                "writer_s": dict(getattr(record, "stats", {})),
            }
        )
        ckpt_bytes = folder_bytes(out / f"global_step{step}") if dist.is_main() else 0
        ds_dir = out / "ds_plain"
        settle()
        engine.checkpoint_engine = manager.writer.inner  # DeepSpeed's own writer for the comparison
        try:
            t_ds = timed(
                lambda ds_dir=ds_dir, step=step: engine.save_checkpoint(
                    str(ds_dir), tag=f"global_step{step}", save_latest=False
                )
            )
        finally:
            engine.checkpoint_engine = manager.writer
        ds_bytes = folder_bytes(ds_dir / f"global_step{step}") if dist.is_main() else 0
        if dist.is_main():
            shutil.rmtree(ds_dir, ignore_errors=True)
        dist.barrier()
        train_step()
        settle()
        t_sync = timed(lambda: manager.save(state.global_step))
        stall.append(
            {
                "step": step,
                "async_stall_s": t_async,
                "async_rest_s": t_rest,
                "deepspeed_sync_s": t_ds,
                "finetune_sync_s": t_sync,
                "save_s": t_save,
                "copy_wait_s": copy_wait,
                "checkpoint_bytes": ckpt_bytes,
                "deepspeed_bytes": ds_bytes,
                "snapshot_bytes_rank0": snapshot_bytes,
            }
        )
        if dist.is_main():
            print(f"profile {i}: {json.dumps(profile[-1])}", flush=True)
            print(
                f"stall {i}: async {t_async:.3f}s (save {t_save:.3f}s + copy wait "
                f"{copy_wait:.3f}s; +{t_rest:.3f}s to finish), "
                f"DeepSpeed sync {t_ds:.3f}s, "
                f"finetune sync {t_sync:.3f}s",
                flush=True,
            )

    # P3b's baseline: each rank writes as many bytes as its snapshot, at once, into the output dir
    # with a plain write + fdatasync (the writer's files went there, with training alongside)
    raw_s = []
    for nbytes in snapshot_sizes:
        settle()
        raw = out / f"raw-{dist.rank()}"
        raw_s.append(timed(lambda raw=raw, nbytes=nbytes: raw_write(raw, nbytes)))
        raw.unlink()
    if dist.is_main():
        print(f"raw write + fdatasync of the snapshot's bytes: {raw_s}", flush=True)

    # (b) step time with a write in flight vs none
    def step_time() -> float:
        t0 = time.perf_counter()
        train_step()
        manager.poll()
        return time.perf_counter() - t0

    inflight, idle, per_save = [], [], []
    for i in range(a.bg_saves):
        settle()
        t0 = time.perf_counter()
        manager.save(state.global_step, background=True)
        stall_s = time.perf_counter() - t0
        these = []
        while manager.pending is not None and len(these) < a.max_inflight_steps:
            these.append(step_time())
        gave_up = manager.pending is not None
        manager.wait()
        settle()
        quiet = [step_time() for _ in range(max(len(these), a.min_idle_steps))]
        inflight += these
        idle += quiet
        per_save.append(
            {
                "stall_s": stall_s,
                "inflight_steps_s": these,
                "idle_steps_s": quiet,
                "gave_up": gave_up,
            }
        )
        if dist.is_main():
            print(
                f"background save {i}: {len(these)} steps in flight, "
                f"median {statistics.median(these) if these else 0:.3f}s; "
                f"idle median {statistics.median(quiet):.3f}s",
                flush=True,
            )

    # (c) end to end
    def e2e(mode: str) -> float:
        def loop():
            for s in range(1, a.e2e_steps + 1):
                train_step()
                due = s % a.every == 0 and s < a.e2e_steps
                if mode == "sync" and due:
                    manager.save(state.global_step)
                elif mode == "async":
                    if due:
                        manager.save(state.global_step, background=True)
                    else:
                        manager.poll()
            if mode == "async":
                manager.wait()

        return timed(loop)

    order = []
    for r in range(a.e2e_repeats):
        order += ["none", "sync", "async"] if r % 2 == 0 else ["async", "sync", "none"]
    e2e_runs = []
    for mode in order:
        settle()
        e2e_runs.append({"mode": mode, "seconds": e2e(mode)})
        if dist.is_main():
            print(f"e2e {mode}: {e2e_runs[-1]['seconds']:.2f}s", flush=True)

    if dist.is_main():
        print(
            "RESULT "
            + json.dumps(
                {
                    "params": params,
                    "model_bytes_fp32": params * 4,
                    "world_size": dist.world_size(),
                    "settings": {k: v for k, v in vars(a).items() if k not in ("local_rank",)},
                    "first_async_stall_s": first_stall,
                    "stall": stall,
                    "profile": profile,
                    "raw_write_s": raw_s,
                    "background": per_save,
                    "inflight_steps_s": inflight,
                    "idle_steps_s": idle,
                    "e2e": e2e_runs,
                }
            ),
            flush=True,
        )
    trainer.data.close()
    dist.barrier()
    dist.shutdown()


if __name__ == "__main__":
    main()
    exit_now()
