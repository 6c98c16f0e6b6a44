"""TRL's own preference trainers (trl 1.16), for comparison with finetune's preference objectives.

    python bench/train/trl_pref_run.py --objective dpo --config_dir D --tokenizer_dir T \
        --train_file F.jsonl --output_dir O --result R.json --max_steps 2 \
        --per_device_train_batch_size 2 --gradient_accumulation_steps 2 \
        --learning_rate 1e-3 --beta 0.1
    deepspeed --num_gpus 2 bench/train/trl_pref_run.py ... --ds_config configs/ds_zero3.json

Objectives: dpo = ``DPOTrainer`` with ``loss_type=["sigmoid"]``, ipo = the same with ``["ipo"]``
(``max_length=None``; ``--precompute_ref`` sets ``precompute_ref_log_probs``); simpo =
``trl.experimental.cpo.CPOTrainer`` with ``loss_type="simpo"``, ``cpo_alpha=0``; orpo =
``trl.experimental.orpo.ORPOTrainer``; these two get a ``max_length`` nothing reaches.

Builds the model as ``bench/train/hf_trainer_run.py`` and finetune's ``load_model`` do:
``from_config`` of ``--config_dir``, fp32, ``torch.manual_seed(--seed)`` just before, partitioned
by ``zero.Init`` when ``--ds_config`` is ZeRO-3 (the trainer's config exists before the model);
or ``from_pretrained`` of ``--model_dir`` (the same weights whatever the world size).
dpo/ipo's reference is the initial model: without ``--precompute_ref`` a second model built the
same way (bitwise the same weights) is passed as ``ref_model``, because TRL would otherwise load one
from ``config._name_or_path``, a config directory without weights (it fails); with it, TRL computes
the reference log-probs with the policy before the first step and keeps no reference model.

Data: a JSONL with text columns ``prompt``, ``chosen``, ``rejected``, tokenized by each trainer.
CPOTrainer and ORPOTrainer prepend ``bos_token_id`` to every prompt when the tokenizer has one;
DPOTrainer (and finetune) use the tokenizer's own special tokens only: for simpo and orpo the
tokenizer's bos token is unset, so all four train on the same ids (prompt without bos, completions
ending with eos). ``--data_order finetune`` (default) puts the rows in finetune's first-epoch order
(one ``torch.randperm`` per ``--seed``) and reads them in order, so each optimizer step trains
finetune's rows (accelerate deals the batches round-robin to the ranks); ``trainer`` keeps
Trainer's random sampler. Training: ``max_grad_norm`` 1.0, a constant learning rate with no
warmup (or ``--lr_scheduler_type`` after ``--warmup_steps``), no weight decay, no checkpointing,
fp32 unless ``--bf16``, no saves, reports or evaluation during training; with ``--eval_file``
one ``trainer.evaluate()`` after it (eval batch = train batch).

What it records: every dict Trainer logs (``TrainerCallback.on_log``, with ``step`` =
``state.global_step``; TRL's keys: ``loss``, ``grad_norm``, ``rewards/*``, ``logps/*``,
``nll_loss`` for simpo/orpo), the evaluation's metrics and the first training row's token ids as
the trainer holds them, into ``R.json`` (rank 0). Under a distributed launch every rank also
writes ``R.rank{r}.json`` with the fields of hf_trainer_run's results (after every optimizer step
the ``time.perf_counter()`` and the cumulative non-pad tokens this rank fed to ``training_step``).

What TRL logs: ``loss`` is the mean of the micro-batch losses over the accumulation steps and the
ranks (each a mean over its pairs); every other metric is the plain mean of one value per
micro-batch (each gathered over the ranks), so with equal micro-batches both are means over the
step's pairs. ``grad_norm`` is before clipping. DPO's ``rewards/accuracies`` counts chosen >
rejected strictly (0 at step 1, where policy = reference); CPO/ORPO's ``logps/*`` are per-token
means and their rewards ``beta`` times those. ``zero.Init`` draws other initial weights than a
plain build (finetune's ZeRO-3 build draws the same as this script's).
"""

from __future__ import annotations

import argparse
import json
import os
import time

# (this folder: the script's own, first on sys.path)
from hf_trainer_run import exit_now, gloo_state, recorder

NO_TRUNCATION = 1 << 20  # max_length / max_completion_length of CPO and ORPO


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--objective", required=True, choices=["dpo", "ipo", "simpo", "orpo"])
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--config_dir", help="a model built from this config (finetune's default)")
    model.add_argument("--model_dir", help="a saved model's folder (from_pretrained)")
    p.add_argument("--tokenizer_dir", required=True)
    p.add_argument("--train_file", required=True)
    p.add_argument("--eval_file")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--result", required=True, help="R.json; per-rank results R.rank{r}.json")
    p.add_argument("--max_steps", type=int, required=True)
    p.add_argument("--per_device_train_batch_size", type=int, required=True)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--learning_rate", type=float, required=True)
    p.add_argument("--lr_scheduler_type", default="constant", help="transformers' schedule name")
    p.add_argument("--warmup_steps", type=int, default=0, help="linear warmup steps")
    p.add_argument("--beta", type=float, required=True)
    p.add_argument("--simpo_gamma", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--precompute_ref", action="store_true", help="dpo/ipo only")
    p.add_argument("--ds_config")
    p.add_argument("--logging_steps", type=int, default=1)
    p.add_argument("--data_order", choices=["finetune", "trainer"], default="finetune")
    p.add_argument("--bf16", action="store_true", help="bf16 mixed precision (GPU runs)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1)
    return p.parse_args()


def trainer_config(args: argparse.Namespace, configured_state: bool):
    """The objective's TRL config (a ``TrainingArguments``) with the common settings."""
    import torch

    common = dict(
        output_dir=args.output_dir,
        deepspeed=args.ds_config,
        accelerator_config={"use_configured_state": configured_state},
        use_cpu=not torch.cuda.is_available() and not args.ds_config,
        per_device_train_batch_size=args.per_device_train_batch_size,
        per_device_eval_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate,
        lr_scheduler_type=args.lr_scheduler_type,
        warmup_steps=args.warmup_steps,
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=args.max_steps,
        logging_steps=args.logging_steps,
        eval_strategy="no",
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        data_seed=args.seed,
        bf16=args.bf16,  # TRL's configs default to bf16 and to (gradient) checkpointing
        fp16=False,
        activation_checkpointing=False,
        dataloader_num_workers=0,
        dataloader_drop_last=True,  # finetune's sampler also drops the tail of an epoch
        train_sampling_strategy="sequential" if args.data_order == "finetune" else "random",
    )
    if args.objective in ("dpo", "ipo"):
        from trl import DPOConfig

        return DPOConfig(
            loss_type=["sigmoid" if args.objective == "dpo" else "ipo"],
            beta=args.beta,
            max_length=None,
            precompute_ref_log_probs=args.precompute_ref,
            **common,
        )
    # (remove_unused_columns: their collator reads the tokenized columns)
    common.update(max_length=NO_TRUNCATION, max_completion_length=NO_TRUNCATION)
    common.update(remove_unused_columns=False)
    if args.objective == "simpo":
        from trl.experimental.cpo import CPOConfig

        return CPOConfig(
            loss_type="simpo", cpo_alpha=0.0, simpo_gamma=args.simpo_gamma, beta=args.beta, **common
        )
    from trl.experimental.orpo import ORPOConfig

    return ORPOConfig(beta=args.beta, **common)


def load_rows(path: str, seed: int, finetune_order: bool, cache_dir: str):
    import datasets
    import torch

    datasets.disable_progress_bars()
    rows = datasets.load_dataset("json", data_files={"train": path}, cache_dir=cache_dir)["train"]
    rows = rows.select_columns(["prompt", "chosen", "rejected"])
    if finetune_order:
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))
        rows = rows.select(order.tolist())
    return rows


def first_row(dataset) -> dict:
    """The first training row's token ids: prompt, chosen and rejected completions."""
    r = dataset[0]
    if "prompt_ids" in r:  # DPOTrainer
        return {"prompt": r["prompt_ids"], "chosen": r["chosen_ids"], "rejected": r["rejected_ids"]}

    def completion(side):  # CPO/ORPO: prompt + completion, the prompt labelled -100
        return [t for t, lab in zip(r[f"{side}_input_ids"], r[f"{side}_labels"]) if lab != -100]

    return {"prompt": r["prompt_input_ids"], **{s: completion(s) for s in ("chosen", "rejected")}}


def main() -> None:
    t_start = time.perf_counter()
    args = parse_args()
    import torch
    from accelerate import PartialState
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.trainer_utils import set_seed

    configured = gloo_state() if args.ds_config else False
    # Before the model: a live HfDeepSpeedConfig makes from_config build it under zero.Init.
    targs = trainer_config(args, configured)
    set_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    if args.objective in ("simpo", "orpo"):
        tokenizer.bos_token = None  # else CPO/ORPO prepend it to every prompt
    config = AutoConfig.from_pretrained(args.config_dir) if args.config_dir else None

    def build_model():
        torch.manual_seed(args.seed)
        if args.model_dir:
            model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.config.use_cache = False  # as finetune trains
        return model

    model = build_model()
    extra = {}
    if args.objective in ("dpo", "ipo"):
        from trl import DPOTrainer as Base

        if not args.precompute_ref:
            extra["ref_model"] = build_model()
    elif args.objective == "simpo":
        from trl.experimental.cpo import CPOTrainer as Base
    else:
        from trl.experimental.orpo import ORPOTrainer as Base

    cache = os.path.join(args.output_dir, "datasets_cache")
    finetune_order = args.data_order == "finetune"
    with PartialState().main_process_first():
        train = load_rows(args.train_file, args.seed, finetune_order, cache)
        evalset = load_rows(args.eval_file, args.seed, False, cache) if args.eval_file else None

    class CountingTrainer(Base):
        tokens = 0

        def training_step(self, model, inputs, num_items_in_batch=None):
            # Non-pad tokens of the micro-batch (chosen and rejected rows, prompts included).
            CountingTrainer.tokens += sum(
                int(v.sum())
                for k, v in inputs.items()
                if k.endswith("attention_mask") and not k.startswith("prompt")
            )
            return super().training_step(model, inputs, num_items_in_batch)

    rec = recorder(lambda: CountingTrainer.tokens)
    trainer = CountingTrainer(
        model=model,
        args=targs,
        train_dataset=train,
        eval_dataset=evalset,
        processing_class=tokenizer,
        callbacks=[rec],
        **extra,
    )
    t_ready = time.perf_counter()
    trainer.train()
    t_end = time.perf_counter()
    metrics = trainer.evaluate() if evalset is not None else None

    dist = torch.distributed.is_initialized()
    rank = torch.distributed.get_rank() if dist else 0
    world = torch.distributed.get_world_size() if dist else 1
    result = {
        "objective": args.objective,
        "logs": rec.logs,
        "eval": metrics,
        "train_rows": len(trainer.train_dataset),
        "world_size": world,
        "first_row": first_row(trainer.train_dataset),
    }
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(result, f, indent=1)
    if dist or "LOCAL_RANK" in os.environ:
        engine = trainer.deepspeed
        opt = trainer.optimizer
        per_rank = {
            **result,
            "rank": rank,
            "backend": torch.distributed.get_backend() if dist else None,
            "accelerate": {
                "num_processes": trainer.accelerator.num_processes,
                "process_index": trainer.accelerator.process_index,
                "distributed_type": str(trainer.accelerator.distributed_type),
            },
            "torch_num_threads": torch.get_num_threads(),
            "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
            "parameters": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),
            "ds_train_batch_size": engine.train_batch_size() if engine else None,
            "ds_zero_stage": engine.zero_optimization_stage() if engine else None,
            "optimizer": type(getattr(opt, "optimizer", opt)).__name__,
            "startup_s": t_ready - t_start,
            "train_call_s": t_end - t_ready,
            "t_train_begin": rec.t_train_begin,
            "steps": rec.steps,
            "times": rec.times,
            "tokens_cum": rec.tokens,
        }
        base = args.result[: -len(".json")] if args.result.endswith(".json") else args.result
        with open(f"{base}.rank{rank}.json", "w") as f:
            json.dump(per_rank, f)
    exit_now()


if __name__ == "__main__":
    main()
