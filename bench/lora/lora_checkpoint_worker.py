"""Worker for bench/lora/lora_checkpoint.py: runs under `deepspeed --num_gpus 2`, prints one JSON
line.

Builds bench/save/checkpoint_save.py's ~134M-parameter Llama through finetune itself
(build_trainer), full fine-tuning or, with ``--lora``, LoRA adapters on it (r 16 on every linear
layer but the head, TRL's usual choice), trains one step, then times ``--repeats`` partitioned saves
(Checkpointer.save: DeepSpeed's rank files + ours + fsync + manifest + commit) and one consolidated
save (the model's safetensors, or the adapter's). Times are rank 0's wall clock between barriers
(the slowest rank included); bytes are what the manifest lists.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from bench.save.checkpoint_save_worker import (
    exit_now,
    folder_bytes,
    one_step_config,
    timed,
    worker_args,
)
from finetune import distributed as dist
from finetune.lora import trainable_parameters
from finetune.weights.consolidate import save_consolidated

try:  # offline/ now; checkpoint/ in older versions (before/after runs)
    from finetune.weights.adapter import save_adapter
except ImportError:
    from finetune.checkpoint.adapter import save_adapter

try:  # build_trainer now; Trainer.build in older versions (before/after runs)
    from finetune.build import build_trainer
except ImportError:
    from finetune.trainer import Trainer

    build_trainer = Trainer.build

LORA = ["--use_peft", "--lora_r", "16", "--lora_alpha", "32", "--lora_target_modules", "all-linear"]


def main() -> None:
    ap = worker_args()
    ap.add_argument("--lora", action="store_true")
    a = ap.parse_args()
    out = Path(a.out)
    cfg = one_step_config(a, *(LORA if a.lora else []))
    dist.init(cfg.train.ddp_timeout)
    trainer = build_trainer(cfg)
    trainer._train_step()
    engine, manager = trainer.engine, trainer.checkpoints
    saves = []
    for i in range(a.repeats):
        step = 100 + i
        seconds = timed(lambda step=step: manager.save(step))
        folder = out / f"global_step{step}"
        size = (
            json.loads((folder / "manifest.json").read_text())["total_bytes"]
            if dist.is_main()
            else 0
        )
        dist.barrier()
        if dist.is_main():
            shutil.rmtree(folder, ignore_errors=True)
        saves.append({"seconds": seconds, "bytes": size})
    cons = out / "consolidated"
    if dist.is_main():
        cons.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    if a.lora:
        t_cons = timed(lambda: save_adapter(engine.module, cons, torch.float32))
    else:
        t_cons = timed(lambda: save_consolidated(engine.module, cons, torch.float32, "5GB"))
    if dist.is_main():
        params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
        print(
            "RESULT "
            + json.dumps(
                {
                    "lora": a.lora,
                    "params": params,
                    "trainable": trainable_parameters(engine.module),
                    "world_size": dist.world_size(),
                    "saves": saves,
                    "consolidated": {"seconds": t_cons, "bytes": folder_bytes(cons)},
                }
            ),
            flush=True,
        )
    dist.barrier()
    dist.shutdown()


if __name__ == "__main__":
    main()
    exit_now()
