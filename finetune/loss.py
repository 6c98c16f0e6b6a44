"""The loss of a training step, weighted by tokens, and the numbers kept about it.

A step's loss is the mean over every label token of the step, across its micro-batches (gradient
accumulation) and its ranks: transformers' ``num_items_in_batch``. DeepSpeed divides each
micro-batch's loss by the accumulation steps and averages gradients over ranks, so each micro-batch
passes the model ``items`` = the step's label tokens / (accumulation steps x ranks): the gradient is
then that of the sum of the step's token losses / its label tokens, however the tokens were split.

Under --sequence_parallel_size N a row's label tokens are split over N ranks, each counting its own
shard's, so summed over all ranks each counts once; and ZeRO-3's gradient reduce-scatter averages
over every rank (the world size), not over the data-parallel ranks (world / N), so the same
``items`` make each rank's shard loss weigh its tokens right. (Without ``reduce_scatter``, which
resolve refuses with sequence parallelism, ZeRO-3 divides some buckets by world / N instead.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from finetune import distributed as dist

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine
    from transformers.utils import ModelOutput


def items_per_micro_batch(
    labels: int, micro_batches: int, device: torch.device, agreed: float | None = None
) -> torch.Tensor | float:
    """This rank's ``labels`` summed over ranks, / (``micro_batches`` x ranks). ``agreed``: that
    sum when the trainer's step-boundary all-reduce carried it already (a float then, no
    collective); else a device tensor, summed without a host sync (the step's forwards queue
    behind the all-reduce). Collective when ``agreed`` is None."""
    if agreed is not None:
        return agreed / (micro_batches * dist.world_size())
    total = torch.tensor(labels, dtype=torch.int64, device=device)
    if dist.world_size() > 1:
        torch.distributed.all_reduce(total)  # queued on the device: nothing reads it back here
    return total.float() / (micro_batches * dist.world_size())


def rescaled(out: ModelOutput, labels: int, items: torch.Tensor | float) -> torch.Tensor:
    """A model without loss kwargs: its mean over this micro-batch's ``labels`` label tokens, as
    the sum over them / ``items``. No label token: a zero loss that still runs the backward (under
    ZeRO-3 every rank must), not the NaN of an empty mean."""
    if labels == 0:
        logits = getattr(out, "logits", None)
        return (logits.sum() if logits is not None else out.loss.nan_to_num()) * 0.0
    return out.loss * (labels / items)


def sum_dtype(device: torch.device) -> torch.dtype:
    """Loss sums kept on the device: float64 like the host sums they replace, where the device has
    it (MPS and HPU do not)."""
    return torch.float64 if device.type in ("cpu", "cuda") else torch.float32


def loss_scale(engine: DeepSpeedEngine) -> float | None:
    """fp16's current loss scale; None in bf16/fp32 (no scaling). Where DeepSpeed's own monitor
    reads it (engine._get_optimizer_loss_scale): the ZeRO optimizers' ``cur_scale`` property, or
    FP16_Optimizer's ``loss_scale_config``. A Python number: no device sync."""
    if not engine.fp16_enabled():
        return None
    optimizer = engine.optimizer
    config = getattr(optimizer, "loss_scale_config", None)
    scale = config.cur_scale if config is not None else getattr(optimizer, "cur_scale", None)
    return float(scale) if scale is not None else None
