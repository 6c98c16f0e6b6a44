"""What a run builds before its loop, in order: the seed, the tokenizer and the tokenized data,
the sampler, the model (partitioned from the start under ZeRO-3), the DeepSpeed engine, the
resume plan and the Checkpointer over OUT, the metrics and trackers: a ``Trainer``.

Every step that can fail on one rank alone (a bad file on one node) is agreed, so bad input exits
2 on every rank before anything is written into OUT.
"""

from __future__ import annotations

import logging
import math
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from finetune import distributed as dist
from finetune import reference, sequence_parallel, tiled
from finetune.checkpoint.another_layout import ConversionStopped
from finetune.checkpoint.bucket import BucketCopy, NoRemoteCopy
from finetune.checkpoint.checkpointer import Checkpointer
from finetune.checkpoint.resume import ResumePlan, Resumer
from finetune.checkpoint.staging import Layout, tidy_storage
from finetune.checkpoint_format.best import BestPolicy, require_evaluation
from finetune.checkpoint_format.outdir import OutputDir
from finetune.checkpoint_format.state import TrainingState
from finetune.config import RunConfig
from finetune.data import ResumableSampler, TrainData
from finetune.data.balance import token_lengths
from finetune.data.cache import prepare, prepare_eval_sets
from finetune.data.eval_sets import held_out
from finetune.data.mixture_sampler import prepare_mixture
from finetune.data.preference import collate_pairs
from finetune.distributed import logger
from finetune.ds_config import check_precision, finalize_ds_config, zero_stage
from finetune.lease import Lease
from finetune.lora import BASE_KEY, base_identity, trainable_parameters
from finetune.metrics import MetricsWriter
from finetune.modeling import (
    DTYPES,
    EMBEDDED_MODEL_DIR,
    accepts_loss_kwargs,
    count_parameters,
    load_model,
    load_tokenizer,
)
from finetune.objectives import from_config
from finetune.ops import ADAM_KEY, adam_impl, ensure_adam, import_muon_lazily
from finetune.plot import Plotter
from finetune.preemption import Preempted, Preemption
from finetune.remote.copy import RemoteCopy
from finetune.remote.fetch import fetch_for_resume
from finetune.remote.lineage import check_at_start, leave_later
from finetune.remote.prefix import Prefix
from finetune.trackers import open_trackers
from finetune.trainer import Trainer

# trainer_state.json: the optimizer's parameter groups (group_layout)
GROUPS_KEY = "optimizer_groups"
ONE_GROUP, DECAY_SPLIT = "one", "decay_split"


def build_trainer(
    cfg: RunConfig,
    preemption: Preemption | None = None,
    run_id: str | None = None,
    lease: Lease | None = None,
    prefix: Prefix | None = None,
) -> Trainer:
    """Everything a run builds before its loop, in order. Collective. A universal conversion
    stopped for a preemption signal raises Preempted (exit 75)."""
    import deepspeed
    from transformers import get_scheduler

    t = cfg.train
    start = time.perf_counter()
    check_precision(t.precision)
    set_seed(t.seed)
    # Every rank loads its own copy; one that fails (a bad file on one node) fails them all.
    tokenizer = dist.run_agreed(lambda: load_tokenizer(cfg.model))
    # --sequence_parallel_size: the ranks of a group share rows, so rows are dealt by data-parallel
    # rank and each micro-batch is cut into this rank's shard of every row
    sp = t.sequence_parallel_size
    dist.set_sequence_parallel(sp)
    dp, dp_rank = dist.data_parallel_size(), dist.data_parallel_rank()
    if cfg.data.dataset_mixture:  # each source cached on its own, sampled by weight
        train, evalset, sampler = prepare_mixture(cfg, tokenizer, dp, dp_rank)
    else:
        train, evalset = prepare(cfg, tokenizer)
        sampler = ResumableSampler(len(train), dp, dp_rank, t.seed)
    # Held-out sets (data/eval_sets.py): the one eval set given apart from the training data, or
    # the named ones (--eval_datasets), each cached as a dataset of its own.
    named = prepare_eval_sets(cfg, tokenizer, held_out(cfg.data))
    if named:
        evalset = named.pop(None, None)
    evals = {None: evalset} if evalset is not None else {}
    evals |= named
    # early stopping without an eval set: exit 2, on every rank
    require_evaluation(t, next(iter(evals.values()), None))
    flatten = (cfg.model.attn_implementation or "").startswith("flash_attention")
    objective = from_config(cfg.preference)  # a preference --objective's loss (None: sft)
    pairs = {}
    if objective is not None:  # micro-batches of pairs; the boundary sums ORPO's NLL tokens
        pad = tokenizer.pad_token_id
        pairs = {"collate_fn": lambda rows: collate_pairs(rows, pad), "count": objective.nll_tokens}
    # --balance_by_length: every row's tokens (from the Arrow offsets), to deal each micro-step's
    # rows to the ranks by length (data/balance.py); a preference pair's rows are dealt whole.
    # Read by every rank from its own mapping of the cache: agreed, as the load before it.
    lengths = None
    if cfg.data.balance_by_length and objective is None and dp > 1:
        lengths = dist.run_agreed(lambda: token_lengths(train))
        dist.log_main(logging.INFO, "each micro-step's rows dealt to the ranks by length")
    data = TrainData(
        train,
        sampler,
        t.per_device_train_batch_size,
        t.gradient_accumulation_steps,
        tokenizer.pad_token_id,
        pin_memory=dist.device().type == "cuda",
        # A prefetch thread overlaps the next batch with the device's work; where training runs
        # on the host's cores it only competes with it (P1, docs/BENCHMARKS.md: 0.943 with it,
        # 1.014 without, vs HF Trainer on 2 CPU ranks): there the batch is made inline.
        prefetch=dist.device().type != "cpu",
        flatten=flatten,
        sequence=(sp, dist.sequence_parallel_rank()) if sp > 1 else None,
        lengths=lengths,
        **pairs,
    )
    total = t.max_steps or math.ceil(t.num_train_epochs * data.steps_per_epoch)
    warmup = warmup_steps(t.warmup_steps, total)
    ds_config = finalize_ds_config(cfg.ds_config, total, warmup, t.learning_rate)
    storage = OutputDir(cfg.ckpt.output_dir)
    layout = Layout.discover(storage, cfg.ds_config, cfg.ckpt.save_checkpoint)
    tidy_storage(storage, layout)  # leftovers of crashed saves (this run holds OUT's lease)
    # --use_peft: the base model's identity (rank 0 samples its weight files), recorded in every
    # checkpoint; a resume refuses a checkpoint whose adapters were trained on another base.
    # The initial weights' identity: the base of --use_peft, and dpo's and ipo's reference
    # (reference.py), recorded in every checkpoint; a resume refuses other weights.
    weights = (
        dist.share_from(0, lambda: base_identity(cfg.model, t.seed, EMBEDDED_MODEL_DIR))
        if cfg.model.use_peft or (objective is not None and objective.needs_reference)
        else None
    )
    base = weights if cfg.model.use_peft else None
    ref_record = reference.record(cfg, weights)
    signalled = (lambda: bool(preemption.received)) if preemption is not None else (lambda: False)
    run_id = run_id or uuid.uuid4().hex[:12]
    cfg, plan, remote, bucket_seq = plan_checkpoints(
        cfg, storage, layout, prefix, base, signalled, ref_record
    )
    # Collective: FusedAdam / CPU Adam where every rank can load it, else torch_adam
    # (finetune/ops.py); a checkpoint trained with torch_adam resumes with it.
    ds_config = ensure_adam(ds_config, saved=plan.saved.get(ADAM_KEY) if plan is not None else None)
    groups = group_layout(t.weight_decay, plan.saved if plan is not None else None)
    if plan is not None and plan.universal is not None:
        ds_config["checkpoint"] = {**ds_config.get("checkpoint", {}), "load_universal": True}
    # Collective: wandb starts on rank 0, and its failure (not logged in) stops every rank here,
    # before the model loads.
    trackers = open_trackers(cfg, run_id, resumed=plan is not None)
    model = load_model(cfg.model, ds_config, t.precision, t.seed)
    loss_kwargs = accepts_loss_kwargs(model)
    if sp > 1:
        sequence_parallel.check(model, sp, loss_kwargs)  # exit 2, alike on every rank
    if t.tiled_mlp:  # exit 2 (alike on every rank) for a model it cannot tile
        flat = flatten and cfg.data.packing
        tiled.setup(model, cfg.data.max_seq_length, sp, t, flat, bool(evals))
        loss_kwargs = True  # the tiled loss takes num_items_in_batch
    # collective (the groups); flattened packed rows are one row per micro-batch
    mpu = sequence_parallel.setup(
        model, sp, 1 if flatten and cfg.data.packing else t.per_device_train_batch_size
    )

    def lr_schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return get_scheduler(
            t.lr_scheduler_type,
            opt,
            num_warmup_steps=warmup,
            num_training_steps=total,
            scheduler_specific_kwargs=t.lr_scheduler_kwargs,
        )

    # the DeepSpeed JSON's own scheduler, where it names one
    scheduler = lr_schedule if "scheduler" not in ds_config else None
    optimizer = None
    if "optimizer" not in ds_config:
        optimizer = torch.optim.AdamW(
            _param_groups(model, t.weight_decay, groups),
            lr=t.learning_rate,
            betas=(t.adam_beta1, t.adam_beta2),
            eps=t.adam_epsilon,
        )
    import_muon_lazily()
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=ds_config,
        model_parameters=None if optimizer else _param_groups(model, t.weight_decay, groups),
        mpu=mpu,
    )
    live = None
    if objective is not None and cfg.preference.reference == "precompute":
        # with the initial weights: before any checkpoint loads (Trainer.train)
        sets = {"train": train} | {f"eval_{n}" if n else "eval": ds for n, ds in evals.items()}
        sets = reference.precompute(cfg, engine, sets, weights, tokenizer.pad_token_id)
        train, evalset = sets["train"], sets.get("eval")
        named = {n: sets[f"eval_{n}"] for n in named}
        data.dataset = train
    elif objective is not None and cfg.preference.reference == "live":
        live = reference.LiveReference.build(cfg, ds_config, engine)
    lora = (
        f" ({trainable_parameters(engine.module):,} trainable: LoRA r={cfg.model.lora_r})"
        if base
        else ""
    )
    logger.info(
        "model: %s parameters%s, %s; %d train / %s eval examples; %d steps (%d per "
        "epoch), world size %d; ready in %.1fs",
        f"{count_parameters(engine.module):,}",
        lora,
        t.precision,
        len(train),
        sum(len(ds) for ds in evals.values()),
        total,
        data.steps_per_epoch,
        dist.world_size(),
        time.perf_counter() - start,
    )
    monitor = getattr(engine, "monitor", None)
    state = TrainingState()
    # rank 0's heartbeat: has another run taken OUT's lease over?
    taken_over = (lambda: lease.lost) if lease is not None else (lambda: False)
    run_info = {
        "zero_stage": zero_stage(cfg.ds_config),
        "dtype": t.precision,
        ADAM_KEY: adam_impl(ds_config),
        GROUPS_KEY: groups,
        "args": cfg.to_json_dict(),
        "lr_scheduler": "in DeepSpeed's model_states files (lr_scheduler key)",
        BASE_KEY: base,
        reference.REFERENCE_KEY: ref_record,
    }
    checkpoints = Checkpointer(
        storage,
        cfg.ckpt,
        layout,
        engine=engine,
        states={"progress": state, "sampler": sampler},
        tokenizer=tokenizer,
        run_info=run_info,
        run_id=run_id,
        plan=plan,
        seen_seq=bucket_seq,
        adapters=base is not None,
        consolidated_dtype=DTYPES[cfg.ckpt.consolidated_dtype or t.precision],
        still_ours=(lambda: lease.check()) if lease is not None else (lambda: True),
        remote=remote,
        best=BestPolicy.from_args(t),
    )
    # Rank 0 writes nothing more into OUT from the moment its
    # heartbeat learns the lease is lost.
    metrics = MetricsWriter(
        cfg.ckpt.output_dir,
        monitor,
        run_id=checkpoints.run_id,
        trackers=trackers,
        may_write=lambda: not taken_over(),
    )
    checkpoints.on_event = metrics.event
    remote.on_event = metrics.event
    plotter = Plotter(cfg.ckpt.output_dir) if cfg.train.plot and dist.is_main() else None
    return Trainer(
        cfg,
        engine,
        tokenizer,
        data,
        evalset,
        total,
        checkpoints,
        metrics,
        state,
        preemption or Preemption(()),
        plotter,
        lease_taken_over=taken_over,
        loss_kwargs=loss_kwargs,
        objective=objective,
        reference=live,
        named_evals=named,
    )


def plan_checkpoints(
    cfg: RunConfig,
    storage: OutputDir,
    layout: Layout,
    prefix: Prefix | None,
    base: dict | None = None,
    signalled: Callable[[], bool] = lambda: False,
    ref_record: dict | None = None,
) -> tuple[RunConfig, ResumePlan | None, BucketCopy, int]:
    """The checkpoints' side of a start, before the engine exists: the bucket's copy, the prefix's
    history checked (exit 2 if it is another run's), the resume planned over OUT and the bucket
    (a commit an OUT lacks or holds damaged fetched), a rollback's later commits set aside in the
    bucket. Returns the config with the resume spec the plan used, the plan (None: a fresh start),
    the copy and the highest commit number the bucket holds (this run numbers its commits above
    it). A universal conversion stopped for a preemption signal raises Preempted. Collective."""
    remote: BucketCopy = NoRemoteCopy()
    if prefix is not None:  # --remote_output_dir, probed and leased by run()
        groups = layout.groups if layout.node_local else None
        remote = RemoteCopy(prefix, storage.root, dist.is_main(), cfg.ckpt.save_total_limit, groups)
    # The prefix's history: refused (exit 2) if it is another run's; this run's commit numbers
    # go above its highest.
    bucket_seq, continued, later = 0, None, []
    if prefix is not None:
        bucket_seq, continued, later = check_at_start(
            prefix.storage, storage, cfg.ckpt.resume_from_checkpoint
        )
    # The bucket's commits join the resume plan's candidates; one it takes that an OUT lacks or
    # holds damaged is fetched into that OUT, and the resume is then local.
    spec, source = fetch_for_resume(cfg.ckpt, storage, layout)
    if spec != cfg.ckpt.resume_from_checkpoint:
        cfg = replace(cfg, ckpt=replace(cfg.ckpt, resume_from_checkpoint=spec))
    resumer = Resumer(
        cfg,
        storage,
        layout.node_local,
        layout.leader,
        base=base,
        reference=ref_record,
        signalled=signalled,
        group=layout.my_group,
        source=source,
    )
    try:
        plan = resumer.plan_resume()
    except ConversionStopped as e:  # a preemption at start-up: the run exits 75 (run.py)
        raise Preempted(str(e)) from e
    point = (plan.head or continued) if plan is not None else None
    if prefix is not None and later and point is not None:  # a rollback: as in OUT, in the bucket
        leave_later(prefix.storage, point, later)
    return cfg, plan, remote, bucket_seq


def warmup_steps(value: float, total: int) -> int:
    """--warmup_steps (or --warmup_ratio): whole steps, or below 1 a fraction of the run's steps,
    rounded up (transformers' TrainingArguments.get_warmup_steps)."""
    return math.ceil(total * value) if value < 1 else int(value)


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def group_layout(weight_decay: float, saved: dict | None) -> str:
    """The optimizer's parameter groups: ONE_GROUP when nothing decays, else DECAY_SPLIT (matrices
    decay; biases and norm weights do not). ZeRO-3 runs each group as a sub-group of its own, with
    its own gradient-norm all-reduce, optimizer call and copy back every step, so a second group
    that decays nothing costs a collective a step. A resume keeps the layout of the checkpoint
    ``saved`` (its optimizer state holds one flat partition per group); a checkpoint that does not
    record one has two groups."""
    if saved is not None:
        return saved.get(GROUPS_KEY, DECAY_SPLIT)
    return DECAY_SPLIT if weight_decay else ONE_GROUP


def _param_groups(
    model: torch.nn.Module, weight_decay: float, layout: str
) -> list[dict[str, object]]:
    """The groups of ``layout`` (group_layout). No weight decay on biases and norm weights (1-D);
    under ZeRO-3 the full shape is ds_shape."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if len(getattr(p, "ds_shape", p.shape)) >= 2 else no_decay).append(p)
    if layout == ONE_GROUP:
        return [{"params": decay + no_decay, "weight_decay": weight_decay}]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
