"""Worker for bench/save/checkpoint_save.py: runs under `deepspeed --num_gpus 2`, prints one JSON
line.

Builds a ~134M-parameter Llama through finetune itself (build_trainer: zero.Init, our DeepSpeed
config), trains one step, then measures, `--repeats` times, interleaved:
  ours      Checkpointer.save: DeepSpeed's rank files + our files + manifest + commit protocol
  raw       each rank writes the same number of bytes as its share of our checkpoint into the same
            directory, in 8 MiB writes, then fdatasync (the bandwidth the directory can give)
  deepspeed engine.save_checkpoint with DeepSpeed's own checkpoint engine (no fsync, no commit)
and once each, with rank 0's RSS sampled every 2 ms:
  consolidated  finetune's streaming save_consolidated (one 5GB shard: the whole model)
  16bit         DeepSpeed's engine.save_16bit_model (stage3_gather_16bit_weights_on_model_save)
Times are rank 0's wall clock between barriers, so they include the slowest rank.
Before each RSS measurement every rank returns the heap memory it has freed to the kernel
(``malloc_trim(0)``): otherwise memory freed by the saves before (glibc keeps it resident) is reused
without raising RSS, and a save would look cheaper than it is.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import threading
import time
from pathlib import Path

import psutil
import torch

from finetune import distributed as dist
from finetune.cli import parse_train_args
from finetune.weights.consolidate import save_consolidated

try:  # build_trainer now; Trainer.build in older versions (before/after runs)
    from finetune.build import build_trainer
except ImportError:
    from finetune.trainer import Trainer

    build_trainer = Trainer.build

CHUNK = 8 << 20


def trim_heap() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc


class PeakRSS:
    """Samples this process's RSS in a thread; ``peak - base`` is the increase during the block."""

    def __init__(self, interval: float = 0.002):
        self.proc, self.interval, self.peak, self._stop = (
            psutil.Process(),
            interval,
            0,
            threading.Event(),
        )

    def __enter__(self):
        trim_heap()
        self.base = self.proc.memory_info().rss
        self.peak = self.base
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.interval)

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def raw_write(path: Path, nbytes: int) -> None:
    buf = os.urandom(CHUNK)
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            n = min(left, CHUNK)
            f.write(buf[:n])
            left -= n
        f.flush()
        os.fdatasync(f.fileno())


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def worker_args() -> argparse.ArgumentParser:
    """The flags a save benchmark's worker takes (the deepspeed launcher adds --local_rank)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--config_dir", required=True)
    ap.add_argument("--ds_config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--local_rank", type=int, default=None)
    return ap


def one_step_config(a: argparse.Namespace, *extra: str):
    """finetune's config for the model in ``a.config_dir``: one step, tiny batches, saving into
    ``a.out``."""
    tokenizer = str(Path(__file__).resolve().parents[2] / "finetune" / "resources" / "tokenizer")
    return parse_train_args(
        [
            "--config_name",
            a.config_dir,
            "--tokenizer_name",
            tokenizer,
            "--deepspeed_config",
            a.ds_config,
            "--output_dir",
            a.out,
            "--max_steps",
            "1",
            "--per_device_train_batch_size",
            "1",
            "--max_seq_length",
            "32",
            "--validation_split_percentage",
            "0",
            "--save_checkpoint",
            *extra,
        ]
    )


def main() -> None:
    a = worker_args().parse_args()
    out = Path(a.out)
    cfg = one_step_config(a)
    dist.init(cfg.train.ddp_timeout)
    trainer = build_trainer(cfg)
    trainer._train_step()
    trainer.state.global_step = 1
    engine, manager = trainer.engine, trainer.checkpoints
    params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    rows = []
    for i in range(a.repeats):
        trainer.state.global_step = 100 + i
        t_ours = timed(lambda: manager.save(trainer.state.global_step))
        ours_dir = out / f"global_step{100 + i}"
        my_bytes = sum(
            p.stat().st_size
            for p in ours_dir.iterdir()
            if p.name.endswith(f"rank_{dist.rank()}_mp_rank_00_optim_states.pt")
            or p.name.endswith(f"rank_{dist.rank()}_mp_rank_00_model_states.pt")
            or p.name == f"rng_state_{dist.rank()}.pt"
        )
        total = folder_bytes(ours_dir) if dist.is_main() else 0
        raw_path = out / f"raw_{i}_rank{dist.rank()}.bin"
        t_raw = timed(lambda raw_path=raw_path, my_bytes=my_bytes: raw_write(raw_path, my_bytes))
        raw_total = dist.all_reduce_sum([my_bytes])[0]
        raw_path.unlink()
        ds_dir = out / "ds_plain"
        inner = manager.writer.inner
        engine.checkpoint_engine = inner  # DeepSpeed's own writer for the comparison
        t_ds = timed(
            lambda ds_dir=ds_dir, i=i: engine.save_checkpoint(
                str(ds_dir), tag=f"global_step{100 + i}"
            )
        )
        engine.checkpoint_engine = manager.writer
        ds_total = folder_bytes(ds_dir / f"global_step{100 + i}") if dist.is_main() else 0
        if dist.is_main():
            shutil.rmtree(ds_dir, ignore_errors=True)
            shutil.rmtree(ours_dir, ignore_errors=True)
        dist.barrier()
        rows.append(
            {
                "ours_s": t_ours,
                "ours_bytes": total,
                "raw_s": t_raw,
                "raw_bytes": raw_total,
                "deepspeed_s": t_ds,
                "deepspeed_bytes": ds_total,
            }
        )
    cons_dir = out / "consolidated"
    if dist.is_main():
        cons_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    with PeakRSS() as ours_rss:
        t_cons = timed(lambda: save_consolidated(engine.module, cons_dir, torch.float32, "5GB"))
    with PeakRSS() as ds_rss:
        t_16 = timed(lambda: engine.save_16bit_model(str(out / "save16"), "model.safetensors"))
    if dist.is_main():
        model_bytes = params * 4
        print(
            "RESULT "
            + json.dumps(
                {
                    "params": params,
                    "model_bytes_fp32": model_bytes,
                    "world_size": dist.world_size(),
                    "saves": rows,
                    "consolidated": {
                        "seconds": t_cons,
                        "rss_increase": ours_rss.peak - ours_rss.base,
                        "bytes": folder_bytes(cons_dir),
                    },
                    "save_16bit_model": {
                        "seconds": t_16,
                        "rss_increase": ds_rss.peak - ds_rss.base,
                        "bytes": folder_bytes(out / "save16"),
                    },
                }
            ),
            flush=True,
        )
    dist.barrier()
    dist.shutdown()


def exit_now() -> None:
    """Everything is recorded: skip interpreter teardown, which with DeepSpeed's and gloo's C++
    threads still alive sometimes aborts a finished rank ("terminate called without an active
    exception", exit -6, pytorch/pytorch#179291; more often on a loaded machine) and fails the
    launch after the fact (what finetune's own entry point and bench/train/hf_trainer_run.py do
    too)."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    exit_now()
