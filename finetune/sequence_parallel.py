"""Ulysses sequence parallelism (--sequence_parallel_size N): DeepSpeed's attention for long rows
(Arctic Long Sequence Training), fed by finetune's own data path.

N contiguous ranks share each row (ranks g*N .. g*N+N-1, DeepSpeed's groups): each holds 1/N of the
row's tokens through the whole model, and ``UlyssesSPAttentionHF``, registered with transformers
in place of the model's attention kernel, exchanges them all-to-all around attention, so every rank
attends over the whole row for 1/N of the heads. The N ranks of a group train on the same rows (the
sampler is dealt by data-parallel rank, and data/sequence.py cuts each micro-batch into this rank's
shard, with no collective); ZeRO-3 still partitions parameters, gradients and optimizer states over
every rank, so a checkpoint's layout does not depend on N.

Evaluation runs whole rows on every rank, each on its own eval rows (``disable_in_eval``): its loss
is the unsplit model's, and an eval row must fit one rank.

``check`` refuses, before any collective and alike on every rank, what Ulysses cannot run right:
head counts N does not divide, attention kernels it cannot wrap (eager needs a 4D mask), layers
whose attention is not plain causal over the whole row (sliding windows, chunked or linear
attention: Ulysses drops their masks), and models whose forward cannot take the shifted labels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from finetune.config import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# The attention kernels Ulysses wraps here: sdpa and flash attention take no mask for a causal row.
ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3")
# layer_types a model's config may list: only full causal attention survives the dropped mask.
FULL_ATTENTION = "full_attention"


def check(model: PreTrainedModel, n: int, loss_kwargs: bool) -> None:
    """ConfigError (exit 2) naming --sequence_parallel_size when ``model`` cannot be split over
    ``n`` ranks by Ulysses; the same on every rank (it reads the model's config alone)."""
    flag = f"`--sequence_parallel_size {n}`"
    config = model.config.get_text_config()
    attn = getattr(model.config, "_attn_implementation", None)
    if attn not in ATTENTION:
        raise ConfigError(
            f"{flag} needs `--attn_implementation` sdpa, flash_attention_2 or flash_attention_3; "
            f"the model runs {attn}"
        )
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads % n:
        raise ConfigError(f"{flag} must divide the model's {heads} attention heads")
    if kv % n and n % kv:
        raise ConfigError(
            f"{flag} must divide the model's {kv} key-value heads or be a multiple of them"
        )
    kinds = set(getattr(config, "layer_types", None) or ()) - {FULL_ATTENTION}
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        kinds.add(f"sliding window of {window}")
    if kinds:
        raise ConfigError(
            f"{flag}: this {config.model_type} model has layers with "
            f"{', '.join(sorted(kinds))} attention, whose masks Ulysses drops (only full causal "
            "attention over the whole row stays right)"
        )
    if not loss_kwargs:
        raise ConfigError(
            f"{flag}: this model's forward takes no loss kwargs, so it cannot be given a shard's "
            "shifted labels (shift_labels)"
        )


def setup(model: PreTrainedModel, n: int, micro_batch: int) -> object | None:
    """Register DeepSpeed's Ulysses attention with transformers for ``model``'s attention kernel
    and make the sequence-parallel groups; returns the mpu for ``deepspeed.initialize`` (None when
    ``n`` is 1). Collective (the groups). ``micro_batch``: rows per forward (1 for flattened packed
    rows)."""
    if n == 1:
        return None
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation=model.config._attn_implementation,
        sequence_parallel_size=n,
        micro_batch_size=micro_batch,
        seq_length_is_variable=True,
        disable_in_eval=True,
    )
