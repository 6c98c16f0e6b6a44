"""HF ``Trainer``'s own route to Ulysses sequence parallelism, for comparison with
``finetune --sequence_parallel_size N``: ``TrainingArguments(parallelism_config=
ParallelismConfig(sp_backend="deepspeed", sp_size=N), deepspeed=<ZeRO-3 JSON>)``.

    deepspeed --num_gpus 2 bench/train/hf_sp_run.py --config_dir D --tokenizer_dir T \
        --train_file F --ds_config configs/ds_zero3.json --output_dir O --result R \
        --sp_size 2 --max_seq_length 64 --learning_rate 1e-3 --warmup_steps 0 --max_steps 4

(``accelerate launch --use_deepspeed --num_processes 2 bench/train/hf_sp_run.py ...`` starts it
the same way; tests/e2e/test_hf_sequence_parallel.py uses the DeepSpeed launcher.)

Builds the model as ``bench/train/hf_trainer_run.py`` does (``from_config`` of ``--config_dir``,
fp32, seed 42, partitioned by ``zero.Init``; sdpa attention) and the data as finetune does
(``text`` column, tokenizer special tokens, eos appended, truncated to ``--max_seq_length``, pad
masked from the loss), at batch 1, no accumulation, AdamW (0.9, 0.999, 1e-8, no weight decay),
clipping 1.0, a linear schedule, in finetune's data order: the rows permuted by one
``torch.randperm`` per seed (the first epoch of ``finetune/data/sampler.py``) and read in order.
Accelerate deals the batches round-robin to the ranks and DeepSpeed's
``UlyssesSPDataLoaderAdapter`` trains the group's batches one after the other, so optimizer step k
trains row k of that order, as finetune's does with one data-parallel rank.

What it records, per rank, into ``R.rank{r}.json``: per optimizer step the loss ``training_step``
returned (the same on every rank of the group), Trainer's ``log_history`` (loss, grad_norm and
learning_rate each step), and the shard this rank trained (its ``input_ids`` and the number of
tokens in its loss).

What running it on CPU (2 ranks, gloo) showed:

* Accelerate finds no distributed backend without an accelerator (``PartialState`` names one only
  for GPUs and the like), so under either launcher it reports 1 process to every rank, does not
  shard the dataloader, and both ranks load the same rows; the adapter then trains each row twice
  (steps 1 and 2 trained the same row). ``gloo_state`` makes the state with ``backend="gloo"``
  first, which Trainer then uses (``use_configured_state``): 2 processes, each rank its own rows.
  On GPUs accelerate picks nccl itself, and the script leaves the state to Trainer.
* The adapter all-gathers each rank's whole batch within the group, and gloo refuses tensors of
  different sizes ("ProcessGroupGloo::allgather: invalid tensor size at index 1 (expected (1, 64),
  got (1, 6))"): rows dealt to the ranks of a group must be equally wide, so by default every row
  is padded to ``--max_seq_length``. The width must divide by N (the adapter cuts it into N).
* The adapter requires ``position_ids`` in every batch (``DataCollatorForLanguageModeling`` makes
  none) and drops ``labels`` for ``shift_labels``; ``Collator`` gives position ids and no attention
  mask (Ulysses discards it; right padding with causal attention keeps real tokens off the pad).
* ``DeepSpeedSequenceParallelConfig.sp_attn_implementation`` must be named: left at its default
  (None), DeepSpeed refuses with "core_attn_implementation='None' does not match model config
  attn_implementation='sdpa'".
* The loss (transformers' ``deepspeed_sp_compute_loss``) is each shard's token mean weighted by its
  label tokens across the group: the token mean over the whole row, finetune's definition; a shard
  of padding alone (no label tokens) is left out. ``configs/ds_zero3.json`` works unchanged
  (accelerate sets ``train_batch_size`` to micro-batch x accumulation x data-parallel ranks).
* The ``learning_rate`` Trainer logs at step k is the one step k+1 uses (it is read after the
  scheduler steps); finetune logs the one the step used.
* Batch 1 only: at batch 2 the first step fails in transformers' ``ForCausalLMLoss``
  (``shift_labels.view(-1)``: "view size is not compatible with input tensor's size and
  stride"), because the adapter's shards are column slices of the batch that its ``.cpu()``
  leaves non-contiguous on a CPU.
"""

from __future__ import annotations

import argparse
import json

# (this folder: the script's own, first on sys.path)
from hf_trainer_run import encoded_rows, exit_now, gloo_state


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--config_dir", required=True)
    p.add_argument("--tokenizer_dir", required=True)
    p.add_argument("--train_file", required=True)
    p.add_argument("--ds_config", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--result", required=True, help="per-rank results go to RESULT.rank{r}.json")
    p.add_argument("--sp_size", type=int, required=True, help="ranks sharing each row")
    p.add_argument("--max_seq_length", type=int, required=True)
    p.add_argument(
        "--pad_to_multiple_of",
        type=int,
        default=None,
        help="pad each batch to its longest row rounded up to this (default: --max_seq_length, "
        "i.e. every row that wide); a multiple of --sp_size",
    )
    p.add_argument("--learning_rate", type=float, required=True)
    p.add_argument("--warmup_steps", type=int, required=True)
    p.add_argument("--max_steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1)
    args = p.parse_args()
    if width_multiple(args) % args.sp_size:
        p.error(
            f"--pad_to_multiple_of (or --max_seq_length) {width_multiple(args)} must be a "
            f"multiple of --sp_size {args.sp_size}: the adapter cuts every row into that many"
        )
    return args


def width_multiple(args: argparse.Namespace) -> int:
    """What every batch's width is a multiple of: --pad_to_multiple_of, else --max_seq_length."""
    return args.pad_to_multiple_of or args.max_seq_length


def training_args(args: argparse.Namespace, configured_state: bool):
    """Trainer's settings: finetune's optimizer and schedule defaults, batch 1, no accumulation,
    no eval, saves or integrations, the rows in dataset order (``train_rows`` orders them)."""
    from accelerate import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig
    from transformers import TrainingArguments

    sp = ParallelismConfig(
        sp_backend="deepspeed",
        sp_size=args.sp_size,
        sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa"),
    )
    return TrainingArguments(
        output_dir=args.output_dir,
        accelerator_config={"use_configured_state": configured_state},
        deepspeed=args.ds_config,
        parallelism_config=sp,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=1,
        learning_rate=args.learning_rate,
        warmup_steps=args.warmup_steps,
        lr_scheduler_type="linear",
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        max_steps=args.max_steps,
        logging_steps=1,
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        fp16=False,
        bf16=False,
        dataloader_num_workers=0,
        train_sampling_strategy="sequential",
    )


def train_rows(args: argparse.Namespace, tokenizer):
    """The ``text`` rows encoded as finetune encodes plain text, in the order finetune's sampler
    draws its first epoch."""
    import torch

    rows = encoded_rows(args.train_file, tokenizer, args.max_seq_length)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(args.seed))
    return rows.select(order.tolist())


class Collator:
    """Rows → ``input_ids`` right-padded to the longest row rounded up to ``multiple``,
    ``labels`` (the ids, pad = -100) and ``position_ids`` 0..width-1, which every shard keeps
    (Ulysses gathers them to mask causally over the whole row)."""

    def __init__(self, pad_id: int, multiple: int):
        self.pad_id, self.multiple = pad_id, multiple

    def __call__(self, rows: list[dict]) -> dict:
        import torch

        longest = max(len(r["input_ids"]) for r in rows)
        width = -(-longest // self.multiple) * self.multiple
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), width), -100, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
            labels[i, : len(r["input_ids"])] = torch.tensor(r["input_ids"])
        positions = torch.arange(width, dtype=torch.long).expand(len(rows), width).contiguous()
        return {"input_ids": ids, "labels": labels, "position_ids": positions}


def recording_trainer(**kw):
    """A ``Trainer`` that keeps each optimizer step's loss and the shard this rank trained."""
    from transformers import Trainer

    class RecordingTrainer(Trainer):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.losses: list[float] = []
            self.shards: list[dict] = []

        def training_step(self, model, inputs, num_items_in_batch=None):
            self.shards.append(
                {
                    "input_ids": inputs["input_ids"].tolist(),
                    "loss_tokens": int((inputs["shift_labels"] != -100).sum()),
                }
            )
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.losses.append(float(loss))
            return loss

    return RecordingTrainer(**kw)


def main() -> None:
    args = parse_args()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, set_seed

    configured = gloo_state()
    # Before the model: a live HfDeepSpeedConfig makes from_config build it under zero.Init.
    targs = training_args(args, configured)
    set_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    config = AutoConfig.from_pretrained(args.config_dir)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.config.use_cache = False  # as finetune trains
    trainer = recording_trainer(
        model=model,
        args=targs,
        train_dataset=train_rows(args, tokenizer),
        data_collator=Collator(tokenizer.pad_token_id, width_multiple(args)),
    )
    trainer.train()

    rank = torch.distributed.get_rank()
    out = {
        "rank": rank,
        "world_size": torch.distributed.get_world_size(),
        "backend": torch.distributed.get_backend(),
        "accelerate": {
            "num_processes": trainer.accelerator.num_processes,
            "process_index": trainer.accelerator.process_index,
            "distributed_type": str(trainer.accelerator.distributed_type),
        },
        "ds_train_batch_size": trainer.deepspeed.train_batch_size(),
        "optimizer": type(getattr(trainer.deepspeed.optimizer, "optimizer", None)).__name__,
        "losses": trainer.losses,
        "shards": trainer.shards,
        "log_history": trainer.state.log_history,
    }
    with open(f"{args.result}.rank{rank}.json", "w") as f:
        json.dump(out, f)
    exit_now()


if __name__ == "__main__":
    main()
