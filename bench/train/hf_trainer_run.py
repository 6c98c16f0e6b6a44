"""HF ``Trainer`` side of ``bench/train/train_throughput.py``; run by it under the DeepSpeed
launcher.

    deepspeed --num_gpus 2 bench/train/hf_trainer_run.py --config_dir D --tokenizer_dir T \
        --train_file F \
        --ds_config ds_hf.json --output_dir O --result R --max_steps N ...

Builds the same model (``from_config`` of the bench's config, fp32, same seed, partitioned by
``zero.Init`` because ``TrainingArguments(deepspeed=...)`` exists before the model), the same data
(``text`` column, tokenizer special tokens, eos appended, truncated to ``--max_seq_length``, padded
per batch to the longest row, pad masked from the loss) and trains with ``Trainer``: no eval, no
saves, no reporting integrations. On a CPU accelerate's process state is made on gloo first
(``gloo_state``), so Trainer runs as on GPUs: accelerate sees every rank, each rank trains its own
rows, and the step's token count is gathered across ranks (``average_tokens_across_devices``).

What it records, per rank, into ``R.rank{r}.json``: after every optimizer step
(``TrainerCallback.on_step_end``) the ``time.perf_counter()`` and the cumulative number of non-pad
tokens (``attention_mask.sum()``) this rank has fed to ``training_step``. The driver sums the tokens
over ranks and takes the times from rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--config_dir", required=True)
    p.add_argument("--tokenizer_dir", required=True)
    p.add_argument("--train_file", required=True)
    p.add_argument("--ds_config", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--result", required=True, help="per-rank results go to RESULT.rank{r}.json")
    p.add_argument("--max_seq_length", type=int, required=True)
    p.add_argument("--per_device_train_batch_size", type=int, required=True)
    p.add_argument("--learning_rate", type=float, required=True)
    p.add_argument("--warmup_steps", type=int, required=True)
    p.add_argument("--max_steps", type=int, required=True)
    p.add_argument("--logging_steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (GPU runs)")
    p.add_argument("--liger", action="store_true", help="use_liger_kernel=True (GPU runs)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1)
    return p.parse_args()


def recorder(tokens):
    """A ``TrainerCallback`` recording, after every optimizer step, ``time.perf_counter()``, the
    step and ``tokens()`` (the non-pad tokens fed so far); every logged dict in ``logs``; and when
    training began (also trl_pref_run.py's)."""
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def __init__(self):
            self.logs, self.steps, self.times, self.tokens = [], [], [], []
            self.t_train_begin = None

        def on_log(self, a, state, control, logs=None, **kw):
            self.logs.append({"step": state.global_step, **(logs or {})})

        def on_train_begin(self, a, state, control, **kw):
            self.t_train_begin = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            self.times.append(time.perf_counter())
            self.steps.append(state.global_step)
            self.tokens.append(tokens())

    return Recorder()


def main() -> None:
    t_start = time.perf_counter()
    args = parse_args()
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForLanguageModeling,
        Trainer,
        TrainingArguments,
        set_seed,
    )

    # As on GPUs: one process per rank to accelerate, each rank its own rows.
    configured = gloo_state()
    # Before the model: a live HfDeepSpeedConfig makes from_config build it under zero.Init.
    targs = TrainingArguments(
        output_dir=args.output_dir,
        accelerator_config={"use_configured_state": configured},
        deepspeed=args.ds_config,
        per_device_train_batch_size=args.per_device_train_batch_size,
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
        logging_steps=args.logging_steps,
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        bf16=args.bf16,
        fp16=False,
        use_liger_kernel=args.liger,
        dataloader_num_workers=0,
        dataloader_drop_last=True,  # finetune's sampler also drops the tail of an epoch
    )
    set_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    config = AutoConfig.from_pretrained(args.config_dir)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)

    train = encoded_rows(args.train_file, tokenizer, args.max_seq_length)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)

    class CountingTrainer(Trainer):
        tokens = 0

        def training_step(self, model, inputs, num_items_in_batch=None):
            # Same count as finetune: non-pad tokens of the micro-batch this rank trains on.
            CountingTrainer.tokens += int(inputs["attention_mask"].sum())
            return super().training_step(model, inputs, num_items_in_batch)

    rec = recorder(lambda: CountingTrainer.tokens)
    trainer = CountingTrainer(
        model=model, args=targs, train_dataset=train, data_collator=collator, callbacks=[rec]
    )
    t_ready = time.perf_counter()
    trainer.train()
    t_end = time.perf_counter()

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in trainer.model.parameters())
    out = {
        "rank": rank,
        "hf_view": {
            "args.world_size": targs.world_size,
            "args.process_index": targs.process_index,
            "parallel_mode": str(targs.parallel_mode),
            "accelerator.num_processes": trainer.accelerator.num_processes,
            "distributed_type": str(trainer.accelerator.distributed_type),
            "accelerate_backend": getattr(trainer.accelerator.state, "backend", None),
        },
        "world_size": torch.distributed.get_world_size()
        if torch.distributed.is_initialized()
        else 1,
        "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
        "torch_num_threads": torch.get_num_threads(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "parameters": n_params,
        "train_examples": len(train),
        "ds_train_batch_size": trainer.deepspeed.train_batch_size() if trainer.deepspeed else None,
        "ds_zero_stage": trainer.deepspeed.zero_optimization_stage() if trainer.deepspeed else None,
        "optimizer": type(
            trainer.optimizer.optimizer
            if hasattr(trainer.optimizer, "optimizer")
            else trainer.optimizer
        ).__name__,
        "log_history": trainer.state.log_history,
        "startup_s": t_ready - t_start,
        "train_call_s": t_end - t_ready,
        "t_train_begin": rec.t_train_begin,
        "steps": rec.steps,
        "times": rec.times,
        "tokens_cum": rec.tokens,
    }
    with open(f"{args.result}.rank{rank}.json", "w") as f:
        json.dump(out, f)
    exit_now()


def gloo_state() -> bool:
    """On a machine without GPUs: accelerate's process state for DeepSpeed on gloo, made before
    ``TrainingArguments`` so that Trainer uses it (``use_configured_state``); returns whether it
    made one. Without it accelerate names no backend on a CPU and reports 1 process to every
    rank: the dataloader is not sharded (every rank trains the same rows) and the per-step token
    count is not gathered. Collective (it initializes the process group). Also hf_sp_run's and
    trl_pref_run's."""
    import torch
    from accelerate import PartialState

    if torch.cuda.is_available():
        return False
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # as TrainingArguments sets it for its own
    PartialState(backend="gloo")
    del os.environ["ACCELERATE_USE_DEEPSPEED"]
    return True


def encoded_rows(train_file: str, tokenizer, max_seq_length: int):
    """The ``text`` rows of a jsonl file encoded as finetune encodes plain text: the tokenizer's
    special tokens, eos appended, truncated to ``max_seq_length``."""
    import datasets

    datasets.disable_progress_bars()
    raw = datasets.load_dataset("json", data_files={"train": train_file})["train"]
    eos = tokenizer.eos_token_id

    def encode(row):
        ids = tokenizer(str(row["text"] or ""), add_special_tokens=True)["input_ids"]
        if not ids or ids[-1] != eos:
            ids = ids + [eos]
        return {"input_ids": ids[:max_seq_length]}

    return raw.map(
        encode, remove_columns=raw.column_names, load_from_cache_file=False, keep_in_memory=True
    )


def exit_now() -> None:
    """Everything is recorded: skip interpreter teardown, which with DeepSpeed's and gloo's threads
    still alive sometimes aborts ("terminate called without an active exception", exit -6) and
    would fail the launch after the fact."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
