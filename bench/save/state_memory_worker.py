"""Worker for bench/save/state_memory.py: runs under `deepspeed --num_gpus N`, prints one JSON line.

Builds the model through finetune itself (``build_trainer``: zero.Init, the shipped ZeRO-3 config),
trains one optimizer step (so Adam's state and the gradient partitions exist), then sums, on each
rank, the bytes of what ZeRO-3 keeps of the model's training state:

  params     ``param.ds_tensor`` of every parameter (this rank's partition), plus the full
             ``param.data`` of parameters DeepSpeed keeps whole on every rank (``ds_persist``:
             those under ``stage3_param_persistence_threshold``)
  master     the optimizer's fp32 master partitions (``fp32_partitioned_groups_flat``)
  optimizer  every tensor in the inner optimizer's state (Adam: exp_avg, exp_avg_sq, step)
  grads      the gradient partitions (``grad_partitions_flat_buffer``)

``total`` counts each underlying storage once (the fp32 master partition *is* the parameter
partition when training in fp32, and every ``ds_tensor`` is a view into one flat buffer), so it is
the memory these tensors really hold. Also recorded: the process RSS after the step (everything:
torch, buffers, activations' freed pages), for context only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import psutil
import torch
from checkpoint_save_worker import exit_now  # noqa: E402 — this script's folder is on sys.path

from finetune import distributed as dist
from finetune.cli import parse_train_args

try:  # build_trainer now; Trainer.build in older versions (before/after runs)
    from finetune.build import build_trainer
except ImportError:
    from finetune.trainer import Trainer

    build_trainer = Trainer.build


class Storages:
    """Bytes of tensors by category, and of the distinct storages behind them all."""

    def __init__(self):
        self.by_category: dict[str, int] = {}
        self.seen: dict[int, int] = {}

    def add(self, category: str, t, nbytes: int | None = None) -> None:
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            return
        self.by_category[category] = self.by_category.get(category, 0) + (
            nbytes if nbytes is not None else t.numel() * t.element_size()
        )
        s = t.untyped_storage()
        self.seen[s.data_ptr()] = max(self.seen.get(s.data_ptr(), 0), s.nbytes())

    @property
    def total(self) -> int:
        return sum(self.seen.values())


def measure(engine) -> dict:
    opt = engine.optimizer
    acc = Storages()
    numel = 0
    for p in engine.module.parameters():
        numel += getattr(p, "ds_numel", p.numel())
        ds = getattr(p, "ds_tensor", None)
        if ds is not None:
            acc.add("params", ds)
        if getattr(p, "ds_persist", False) and p.data.numel() > 0:
            acc.add("params_persistent_full", p.data)
    for t in getattr(opt, "fp32_partitioned_groups_flat", []):
        acc.add("master", t)
    inner = getattr(opt, "optimizer", None)
    for state in inner.state.values() if inner is not None else []:
        for v in state.values():
            acc.add("optimizer", v)
    acc.add("grads", getattr(opt, "grad_partitions_flat_buffer", None))
    return {
        "rank": dist.rank(),
        "world_size": dist.world_size(),
        "params_numel": numel,
        "optimizer_class": type(opt).__name__,
        "inner_optimizer_class": type(inner).__name__,
        "by_category": acc.by_category,
        "total_bytes": acc.total,
        "rss_bytes": psutil.Process().memory_info().rss,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config_dir", required=True)
    ap.add_argument("--ds_config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", type=int, default=None)
    a = ap.parse_args()
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
            a.out,
            "--max_steps",
            "1",
            "--per_device_train_batch_size",
            "1",
            "--max_seq_length",
            "32",
            "--validation_split_percentage",
            "0",
        ]
    )
    dist.init(cfg.train.ddp_timeout)
    trainer = build_trainer(cfg)
    trainer._train_step()
    mine = measure(trainer.engine)
    rows = dist.all_gather_object(mine)
    if dist.is_main():
        print("RESULT " + json.dumps({"world_size": dist.world_size(), "ranks": rows}), flush=True)
    dist.barrier()
    dist.shutdown()


if __name__ == "__main__":
    main()
    exit_now()
