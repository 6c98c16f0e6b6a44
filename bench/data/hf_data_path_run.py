"""HF ``Trainer`` side of ``bench/data/data_path.py``; run by it under the DeepSpeed launcher.

    deepspeed --num_gpus 2 bench/data/hf_data_path_run.py --train_file F --output_dir O --stamp S \
        --max_steps N [--resume]

What a user of HF Trainer would write for prompt/completion SFT on a JSONL file: ``load_dataset``
("json"), one ``datasets.map`` (batched, ``num_proc`` = cores, datasets' cache on, rank 0 first
via ``main_process_first`` as run_clm.py does), prompt tokens masked from the loss, eos appended,
truncated to ``--max_seq_length``; the embedded model and tokenizer, ZeRO-3 (configs/ds_zero3.json),
a checkpoint every ``--max_steps`` (``--resume`` continues from it). Rank 0 writes the wall-clock
time (``time.time()``) at the end of its first optimizer step into ``S``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--train_file", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--stamp", required=True)
    p.add_argument("--max_steps", type=int, required=True)
    p.add_argument("--max_seq_length", type=int, default=128)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1)
    args = p.parse_args()
    import datasets
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForSeq2Seq,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    ds_config = json.loads((REPO / "configs/ds_zero3.json").read_text())
    ds_config.pop("train_batch_size", None)  # HF's "auto" would use world size 1 on CPU
    targs = TrainingArguments(
        output_dir=args.output_dir,
        deepspeed=ds_config,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        warmup_steps=10,
        max_steps=args.max_steps,
        logging_steps=1,
        eval_strategy="no",
        save_strategy="steps",
        save_steps=args.max_steps,
        report_to="none",
        seed=42,
        bf16=False,
        fp16=False,
        dataloader_drop_last=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(REPO / "finetune/resources/tokenizer")
    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(REPO / "finetune/resources/model"), dtype=torch.float32
    )
    eos, max_len = tokenizer.eos_token_id, args.max_seq_length

    def encode(batch):
        prompts = tokenizer(batch["prompt"], add_special_tokens=True)["input_ids"]
        completions = tokenizer(batch["completion"], add_special_tokens=False)["input_ids"]
        out = {"input_ids": [], "labels": []}
        for p_ids, c_ids in zip(prompts, completions):
            c_ids = c_ids + [eos]
            out["input_ids"].append((p_ids + c_ids)[:max_len])
            out["labels"].append(([-100] * len(p_ids) + c_ids)[:max_len])
        return out

    with targs.main_process_first(desc="tokenizing"):
        raw = datasets.load_dataset("json", data_files={"train": args.train_file})["train"]
        train = raw.map(
            encode, batched=True, num_proc=os.cpu_count(), remove_columns=raw.column_names
        )

    class Stamp(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            stamp = Path(args.stamp)
            if state.is_world_process_zero and not stamp.exists():
                # Renamed into place: the driver polls for the file and reads it at once. On a CPU
                # accelerate reports one process, so every rank is "process zero" and writes it:
                # each its own temporary file.
                tmp = stamp.with_name(f"{stamp.name}.{os.getpid()}.tmp")
                tmp.write_text(repr(time.time()))
                tmp.replace(stamp)

    trainer = Trainer(
        model=model,
        args=targs,
        train_dataset=train,
        callbacks=[Stamp()],
        data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100),
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    # Skip interpreter teardown: with DeepSpeed's and gloo's threads alive it sometimes aborts
    # ("terminate called without an active exception") after the checkpoint is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
