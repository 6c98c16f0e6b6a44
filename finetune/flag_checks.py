"""Every check of the flag values before a file is read, in one call: ``check``.

Each group checks its own flags (``ModelArgs.check`` … ``CheckpointArgs.check``, in config/).
What no group can check alone is here: the rules that read flags of more than one group, and those
that need another module's knowledge, which config (importing nothing of finetune's) cannot ask:

  across groups   --metric_for_best_model / --early_stopping_patience with the data (an eval set)
                  and the checkpoints (--save_steps a multiple of --eval_steps)
  the formats     the format flags, from the formats' registry (data/formats.check_flags), for
                  the top-level flags and each --dataset_mixture source
  the bucket      --remote_output_dir's URI and client package (io/remote.py)
  the signals     --preempt_signals, as preemption parses them
  the objective   a preference --objective with the data format, packing and the model's patches
  the metric      --metric_for_best_model among what the objective and the eval sets write
  the sequence    --sequence_parallel_size with the attention kernel, --packing and the model's
                  patches (sequence_parallel.py checks the model itself once its config is read);
                  --tiled_mlp with the other patches of the model (tiled.py checks the model)

resolve calls ``check`` first, then sources.validate_paths (the files the flags name); each failure
is a ConfigError naming its flag (exit 2 before anything is written).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

from finetune.checkpoint_format.best import explicit
from finetune.config import GROUPS, ConfigError, is_preference, metric_name
from finetune.config.train import PREFERENCE_METRICS
from finetune.data import eval_sets, formats, mixture
from finetune.preemption import parse_signals

# The attention kernels that keep packed examples apart under sequence parallelism.
SEQUENCE_PARALLEL_PACKED_ATTN = ("flash_attention_2", "flash_attention_3")


def check(v: Mapping[str, Any]) -> None:
    """Every group's own rules, in GROUPS' order, then the ones here."""
    for _, group in GROUPS:
        group.check(v)
    formats.check_flags(v)
    if v["dataset_mixture"]:
        mixture.check_source_formats(v)
    if v["eval_datasets"]:
        eval_sets.check_set_formats(v)
    if v["remote_output_dir"]:
        check_remote(v["remote_output_dir"])
    try:
        parse_signals(v["preempt_signals"])
    except ValueError as e:
        raise ConfigError(
            f"`--preempt_signals`: {e} is not a signal that can be caught "
            "(e.g. SIGTERM,SIGUSR1 or none)"
        ) from None
    check_best_across_groups(v)
    check_preference(v)
    check_metric(v)
    check_sequence_parallel(v)
    check_tiled(v)


def check_preference(v: Mapping[str, Any]) -> None:
    """A preference --objective reads pairs (prompt/chosen/rejected) and scores whole completions:
    no other data format, no packing (a pair's two rows are one example), and no patch that
    replaces the model's loss or splits its rows. Its columns' flags need one; and the best metric
    must be one its evaluation writes."""
    objective = v["objective"]
    entries = [*(v["dataset_mixture"] or []), *(v["eval_datasets"] or [])]
    if not is_preference(objective):
        for flag in ("chosen_column", "rejected_column", "max_prompt_length"):
            if v[flag] is not None or any(flag in e for e in entries):
                raise ConfigError(
                    f"`--{flag}` needs a preference `--objective` (dpo, ipo, simpo, orpo)"
                )
        return
    for flag in ("prompt_column", "completion_column", "messages_column", "text_column"):
        named = [e["name"] for e in entries if flag in e]
        if named:
            raise ConfigError(
                f"source or eval set {named[0]}: `{flag}` is not a column of "
                f"`--objective {objective}`'s pairs (a source may name its chosen_column and "
                "rejected_column)"
            )
        if v[flag] and flag != "text_column":
            raise ConfigError(
                f"`--{flag}` is not a column of `--objective {objective}`'s pairs: it reads a "
                "`prompt` column, `--chosen_column` and `--rejected_column`"
            )
    refused = (
        ("packing", "`--packing`", "a pair's chosen and rejected rows are one example"),
        ("tiled_mlp", "`--tiled_mlp`", "it replaces the loss the objective computes"),
        ("use_liger_kernel", "`--use_liger_kernel`", "it replaces the loss the objective computes"),
    )
    for flag, name, why in refused:
        if v[flag]:
            raise ConfigError(f"{name} does not work with `--objective {objective}`: {why}")
    n = v["sequence_parallel_size"]
    if n is not None and n > 1:
        raise ConfigError(
            f"`--sequence_parallel_size {n}` does not work with `--objective {objective}`: each "
            "rank would score one shard of a completion, not the completion"
        )
    if v["max_prompt_length"] is not None and v["max_prompt_length"] < 1:
        raise ConfigError(f"`--max_prompt_length` must be positive, got {v['max_prompt_length']}")


def check_metric(v: Mapping[str, Any]) -> None:
    """--metric_for_best_model names what the evaluation writes: eval_loss and eval_perplexity, or
    under a preference --objective eval_loss and its rewards and log-probs; with --eval_datasets
    also each set's own (eval_<name>_loss, ...)."""
    given = v["metric_for_best_model"]
    if not given:
        return
    metric = metric_name(given)
    own = ("loss", *(m[len("eval_") :] for m in PREFERENCE_METRICS))
    if v["objective"] == "orpo":
        own += ("nll_loss", "log_odds_ratio", "log_odds_chosen")
    if not is_preference(v["objective"]):
        own = ("loss", "perplexity")
    names = [None, *(e["name"] for e in v["eval_datasets"] or ())]
    prefixes = [eval_sets.metric_prefix(name) for name in names]
    if any(metric == p + m for p in prefixes for m in own):
        return
    sets = " (and each --eval_datasets set's, eval_<name>_loss, ...)" if v["eval_datasets"] else ""
    written = ", ".join(f"eval_{m}" for m in own)
    raise ConfigError(
        f"`--metric_for_best_model {given}`: the evaluation writes {written}{sets} "
        f"under `--objective {v['objective']}` (the eval_ prefix may be left out)"
    )


def check_tiled(v: Mapping[str, Any]) -> None:
    """--tiled_mlp replaces the causal LM's forward (the loss from tiles of the hidden states) and
    each MLP's: LoRA's wrapped model and Liger's fused MLP and loss would take those places."""
    if not v["tiled_mlp"]:
        return
    for flag, name in (("use_peft", "--use_peft"), ("use_liger_kernel", "--use_liger_kernel")):
        if v[flag]:
            raise ConfigError(
                f"`--tiled_mlp` does not work with `{name}`: both replace the model's MLP and "
                "loss computation"
            )


def check_sequence_parallel(v: Mapping[str, Any]) -> None:
    """--sequence_parallel_size above 1 with the flags it cannot work with: packed rows need an
    attention that keeps examples apart without a mask (flash attention's varlen path reads their
    boundaries from the position ids; Ulysses drops every mask); Liger's fused loss and NEFTune's
    noise (scaled by the row's length) see one shard of a row, not the row."""
    n = v["sequence_parallel_size"]
    if n is None or n == 1:
        return
    attn = v["attn_implementation"]
    if v["packing"] and attn not in SEQUENCE_PARALLEL_PACKED_ATTN:
        raise ConfigError(
            f"`--packing` with `--sequence_parallel_size {n}` needs `--attn_implementation "
            f"flash_attention_2` or `flash_attention_3` (got {attn or 'the default, sdpa'}): "
            "sequence parallelism drops the attention mask, and only flash attention's varlen "
            "path keeps packed examples from attending to each other without it"
        )
    for flag, name in (
        ("use_liger_kernel", "--use_liger_kernel"),
        ("neftune_noise_alpha", "--neftune_noise_alpha"),
    ):
        if v[flag]:
            raise ConfigError(
                f"`{name}` does not work with `--sequence_parallel_size {n}`: it would see one "
                "shard of each row, not the row"
            )


def check_best_across_groups(v: Mapping[str, Any]) -> None:
    """An explicit --metric_for_best_model or --early_stopping_patience needs an evaluation: an
    eval set (the data's flags), and one at every periodic checkpoint (the checkpoints' flags)."""
    named = explicit(v)
    if not named:
        return
    held_out = eval_sets.has_held_out(v)  # those are the evaluation
    if (
        v["train_file"]
        and not v["validation_file"]
        and not v["validation_split_percentage"]
        and not held_out
    ):
        raise ConfigError(
            f"`{named}` needs an evaluation: `--validation_split_percentage 0` without "
            "`--validation_file` leaves no eval set"
        )
    save_steps, eval_steps = v["save_steps"], v["eval_steps"]
    if v["save_checkpoint"] and save_steps and (not eval_steps or save_steps % eval_steps):
        raise ConfigError(
            f"`{named}`: `--save_steps` ({save_steps}) must be a multiple of `--eval_steps` "
            f"({eval_steps or 'not given'}), so that every checkpoint has its evaluation "
            "(as HF's load_best_model_at_end)"
        )


def check_remote(uri: str) -> None:
    """--remote_output_dir: a URI of a supported scheme, its client installed. (Whether the
    bucket and credentials work is the start-up probe's: remote/copy.py.)"""
    from finetune.io.remote import CLIENT_PACKAGE, RemoteError, S3Uri

    try:
        S3Uri.parse(uri)
    except RemoteError as e:
        raise ConfigError(f"`--remote_output_dir`: {e}") from None
    if importlib.util.find_spec(CLIENT_PACKAGE) is None:
        raise ConfigError(
            f"`--remote_output_dir` {uri} needs the {CLIENT_PACKAGE} package: "
            f"pip install {CLIENT_PACKAGE} (or finetune[s3])"
        )
