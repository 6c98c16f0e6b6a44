"""The reference model of dpo and ipo: its log-probabilities of every pair's chosen and rejected
completions, with no second model in memory (--reference precompute) or from a frozen copy
(--reference live).

precompute  Before training, one pass over the train and eval pairs with the initial weights (the
            engine, before any checkpoint loads: a resume recomputes from --model_name_or_path
            what the first launch computed). Rank r scores pairs r, r + W, ... in eval-sized
            batches, every rank the same number of batches (ZeRO-3 gathers in each forward); one
            all-gather gives every rank all of them, and the first rank of each group that shares
            the --dataset_cache_dir publishes them there (a temporary folder renamed into place),
            keyed by the tokenized sets' fingerprints and the reference weights' identity. A later
            launch with that key finds them ("cached"), one whose cache is gone recomputes them,
            bit for bit at the same world size (the same batches in the same order).
live        A second, frozen copy of the initial model, partitioned by ZeRO-3 like the first (so
            each rank holds 1/N of it), scoring each micro-batch in the step; with --use_peft, the
            trained model with its adapters off (no copy).

What a checkpoint records (trainer_state.json, ``REFERENCE_KEY``): the objective's reference mode
and the weights' identity (lora.base_identity: sampled weight files, or config + seed for a model
built from a config). A resume with another objective or reference mode, or whose
--model_name_or_path now holds other weights, is refused (exit 2) before anything is changed.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import xxhash
from tqdm.auto import tqdm

from finetune import distributed as dist
from finetune.config import ConfigError, RunConfig
from finetune.data.cache import INFO, cache_root, publish
from finetune.data.preference import collate_pairs
from finetune.io.storage import LocalStorage
from finetune.lora import describe_base, same_base
from finetune.sharing import leads_storage

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine


REFERENCE_KEY = "reference"  # trainer_state.json's record of the reference
CACHE_FORMAT = 1  # bump when what a reference entry holds changes
REF_COLUMNS = ("ref_chosen", "ref_rejected")


def record(cfg: RunConfig, weights: dict | None) -> dict | None:
    """What a checkpoint records of the objective's reference (None under sft): its mode and, for
    dpo and ipo, the identity of the weights it is (``weights``: lora.base_identity's)."""
    p = cfg.preference
    if p.objective == "sft":
        return None
    if p.reference == "none":
        return {"objective": p.objective, "mode": p.reference, "weights": None}
    return {
        "objective": p.objective,
        "mode": p.reference,
        "weights": weights,
        # what the reference's numbers also depend on (a recompute must use the same)
        "precision": cfg.train.precision,
        "attn_implementation": cfg.model.attn_implementation,
    }


def check_resume(folder: Path, saved: dict, cfg: RunConfig, now: dict | None) -> None:
    """Refuse (ConfigError, exit 2) to resume a checkpoint with another objective, another reference
    mode, or a reference of other weights: the loss would change meaning mid-run. ``saved``: its
    trainer_state.json; ``now``: this run's ``record``. The same facts on every rank."""
    before = saved.get(REFERENCE_KEY)
    was = (before or {}).get("objective", "sft")
    objective = cfg.preference.objective
    if was != objective:
        raise ConfigError(
            f"--objective: {folder} was trained with --objective {was}, this run has "
            f"{objective}; resume with {was} (or start another --output_dir from its export)"
        )
    if before is None or now is None:
        return
    if before.get("mode") != now["mode"]:
        raise ConfigError(
            f"--reference: {folder} was trained with --reference {before.get('mode')}, this run "
            f"has {now['mode']}; resume with the same reference"
        )
    for flag in ("precision", "attn_implementation"):
        if flag in before and before[flag] != now.get(flag):
            raise ConfigError(
                f"--{flag}: {folder}'s reference log-probabilities were computed with --{flag} "
                f"{before[flag]}, this run has {now.get(flag)}: a recompute would give other "
                "numbers mid-run; resume with the same value"
            )
    a, b = before.get("weights"), now.get("weights")
    if a is not None and b is not None and not same_base(a, b):
        raise ConfigError(
            f"--model_name_or_path: {folder}'s reference is {describe_base(a)}, but this run's "
            f"initial weights are {describe_base(b)}: the reference log-probabilities would "
            "change mid-run; resume with the weights the run started from"
        )


# --- precompute -------------------------------------------------------------------------------


def precompute(
    cfg: RunConfig, engine: DeepSpeedEngine, sets: dict, weights: dict | None, pad_id: int
) -> dict:
    """The sets (train, and each eval set, by name) with the reference's log-probabilities as
    columns REF_COLUMNS: cached, or computed now with the engine's (initial) weights and cached.
    Collective."""
    start = time.perf_counter()
    key = dist.share_from(0, lambda: entry_key(cfg, sets, weights))
    root = cache_root(cfg)
    entry = root / f"reference-{key}"
    arrays = _read(entry, sets)
    found = dist.all_reduce_sum([0.0 if arrays is None else 1.0])[0]
    if found == dist.world_size():
        how = "cached"
    else:  # any rank without them: all compute (every forward is collective)
        arrays = {name: _compute(engine, ds, cfg, name, pad_id) for name, ds in sets.items()}
        leader = leads_storage(LocalStorage(root), "dataset_cache_dir")
        dist.run_agreed(lambda: _publish(root, entry, arrays), on=leader)
        how = "computed"
    dist.log_main(
        logging.INFO,
        "reference log-probs: %s (%s pairs) in %.1f s; %s",
        how,
        " + ".join(f"{len(ds):,} {name}" for name, ds in sets.items()),
        time.perf_counter() - start,
        entry,
    )
    return {name: _attach(ds, arrays[name]) for name, ds in sets.items()}


def entry_key(cfg: RunConfig, sets: dict, weights: dict | None) -> str:
    """The reference entry's key: the tokenized sets (their datasets fingerprints, which the
    tokenized-data cache's entry fixes), the weights' identity, the precision and the kernel."""
    inputs = {
        "format": CACHE_FORMAT,
        "data": {name: ds._fingerprint for name, ds in sets.items()},
        "weights": (weights or {}).get("fingerprint"),
        "source": (weights or {}).get("source"),
        "precision": cfg.train.precision,
        "attn_implementation": cfg.model.attn_implementation,
    }
    return xxhash.xxh3_128(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def _read(entry: Path, sets: dict) -> dict[str, np.ndarray] | None:
    """The entry's arrays when it is complete and matches the sets' sizes, else None."""
    try:
        info = json.loads((entry / INFO).read_text())
        arrays = {name: np.load(entry / f"{name}.npy") for name in sets}
    except Exception:  # noqa: BLE001 — missing or damaged (a partial copy): computed again, agreed
        return None
    if info.get("format") != CACHE_FORMAT:
        return None
    if any(arrays[name].shape != (len(ds), 2) for name, ds in sets.items()):
        return None
    return arrays


def _compute(engine: DeepSpeedEngine, ds, cfg: RunConfig, name: str, pad_id: int) -> np.ndarray:
    """Every pair's (chosen, rejected) summed log-probabilities, on every rank. Collective."""
    from finetune.objectives import token_logps

    world, rank = dist.world_size(), dist.rank()
    size = cfg.train.per_device_eval_batch_size
    mine = list(range(rank, len(ds), world))
    per_rank = -(-len(ds) // world)
    batches = -(-per_rank // size)
    local = np.full((per_rank, 2), np.nan)
    was_training = engine.training
    engine.eval()
    bar = tqdm(
        total=batches,
        desc=f"reference log-probs ({name})",
        disable=not dist.is_main(),
        unit="batch",
        mininterval=0.1 if sys.stderr.isatty() else 30,  # a log file: a line twice a minute
    )
    with torch.no_grad():
        for b in range(batches):
            idx = mine[b * size : (b + 1) * size]
            rows = [ds[i] for i in (idx or [0])]  # a filler batch: ZeRO-3's gathers need it
            batch = collate_pairs(rows, pad_id)
            inputs = {k: batch[k].to(engine.device) for k in ("input_ids", "attention_mask")}
            logits = engine(**inputs).logits
            logps, _ = token_logps(logits, batch["labels"].to(engine.device))
            sums = logps.sum(-1).double().cpu().numpy()
            n = len(idx)
            if n:
                local[b * size : b * size + n, 0] = sums[:n]
                local[b * size : b * size + n, 1] = sums[len(rows) : len(rows) + n]
            bar.update(1)
    bar.close()
    if was_training:
        engine.train()
    return _gathered(local, len(ds))


def _gathered(local: np.ndarray, n: int) -> np.ndarray:
    """Each rank's pairs (rank r held r, r + W, ...) in dataset order, on every rank."""
    world = dist.world_size()
    if world == 1:
        return local[:n]
    mine = torch.from_numpy(local).to(dist.device())
    parts = [torch.empty_like(mine) for _ in range(world)]
    torch.distributed.all_gather(parts, mine)
    # row i is rank i % W's (i // W)-th: rank-major parts read position-major
    stacked = torch.stack(parts).transpose(0, 1).reshape(-1, 2)[:n]
    return stacked.cpu().numpy()


def _publish(root: Path, entry: Path, arrays: dict[str, np.ndarray]) -> None:
    """The entry published as the tokenized sets' are (cache.publish: complete or absent)."""

    def fill(tmp: Path) -> dict:
        for name, array in arrays.items():
            np.save(tmp / f"{name}.npy", array)
        return {"format": CACHE_FORMAT, "sets": sorted(arrays)}

    publish(root, entry, fill)


def _attach(ds, array: np.ndarray):
    """The set with the reference's log-probabilities as two float64 columns."""
    for column, values in zip(REF_COLUMNS, array.T, strict=True):
        ds = ds.add_column(column, np.ascontiguousarray(values))
    return ds


# --- live -------------------------------------------------------------------------------------


class LiveReference:
    """The reference scored in the step: a frozen ZeRO-3 engine of the initial model, or (LoRA)
    the trained engine with its adapters off."""

    def __init__(self, engine: DeepSpeedEngine | None, policy: DeepSpeedEngine):
        self.engine, self.policy = engine, policy

    @classmethod
    def build(cls, cfg: RunConfig, ds_config: dict, policy: DeepSpeedEngine) -> LiveReference:
        if cfg.model.use_peft:
            return cls(None, policy)
        import deepspeed

        from finetune.checkpoint_format.state import rng_state, set_rng_state
        from finetune.modeling import load_model

        frozen = _frozen_config(ds_config)
        streams = rng_state()  # building the copy reseeds: training's streams go on untouched
        model = load_model(cfg.model, frozen, cfg.train.precision, cfg.train.seed)
        model.requires_grad_(False)
        engine, *_ = deepspeed.initialize(model=model, config=frozen)
        engine.eval()
        set_rng_state(streams)
        return cls(engine, policy)

    @torch.no_grad()
    def logps(self, inputs: dict, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's (chosen, rejected) summed log-probabilities of a micro-batch."""
        from finetune.objectives import token_logps

        if self.engine is not None:
            logits = self.engine(**inputs).logits
        else:
            with self.policy.module.disable_adapter():
                logits = self.policy(**inputs).logits
        sums = token_logps(logits, labels)[0].sum(-1)
        pairs = sums.shape[0] // 2
        return sums[:pairs], sums[pairs:]


def _frozen_config(ds_config: dict) -> dict[str, Any]:
    """The training DeepSpeed config less what a frozen model has no use for (an optimizer, a
    scheduler, gradient settings): ZeRO-3 partitions it the same way."""
    keep = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
    frozen = {k: ds_config[k] for k in keep if k in ds_config}
    for key in ("bf16", "fp16", "zero_optimization", "sequence_parallel_size"):
        if key in ds_config:
            frozen[key] = ds_config[key]
    zero = dict(frozen.get("zero_optimization", {}))
    for key in ("offload_optimizer",):
        zero.pop(key, None)
    frozen["zero_optimization"] = zero
    return frozen
