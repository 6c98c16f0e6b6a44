"""--tiled_mlp: each MLP and the logits + loss computed in tiles along the sequence (Arctic Long
Sequence Training's tiled compute, with DeepSpeed's ``sequence_tiled_compute``), so a long row's
MLP activations and its logits are never held whole.

Each tile is computed without keeping its activations and computed again in the backward, one tile
at a time: a step costs about one more forward of the MLPs and of lm_head, and the memory they need
falls to one tile's. The loss is the sum of the tiles' token losses divided by the step's label
tokens (``num_items_in_batch``, loss.py), through autograd: every scale applied after it (the
gradient accumulation's, fp16's loss scale) reaches lm_head too. (DeepSpeed's
``TiledFusedLogitsLoss`` runs lm_head's backward inside the forward and scales only the hidden
states' gradient afterwards: a later scale would miss lm_head.)

A tile holds at most hidden size tokens: an MLP tile's activations are then a few times the hidden
size squared, and a logits tile no bigger than lm_head's weight (for Llama-3-8B, 4096 tokens of
its 128k vocabulary: 2.1 GB in fp32, where a 16k row's logits are 8.4 GB). The number of tiles is
fixed when the run starts, from the longest row a rank can be given: the same on every rank, with
no collective. Under ZeRO-3 each tile calls the MLP's (and lm_head's)
layers once, and each call gathers their partitioned weights with every rank: a rank that ran
fewer tiles than another would leave it waiting. ``sequence_tiled_compute`` always runs the number
it is given (a short row's last tiles are empty); DeepSpeed's ``TiledMLP`` cuts with
``torch.chunk``, which makes fewer pieces of some lengths, so it is not used.

ZeRO-3 reduces a weight's gradient when it is accumulated; a tiled layer accumulates it once per
tile, so its weights are marked not ready (``ds_grad_is_ready``) until the last tile. lm_head tied
to the input embedding is marked not ready through every tile and ready again once the tiles are
done: its gradient is then reduced once, with the embedding's part added, when the embedding's
backward accumulates it.

Evaluation computes the loss in the same tiles (no gradient: nothing recomputed) and the MLPs
whole.
"""

from __future__ import annotations

import logging
import math
import types
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from finetune import distributed as dist
from finetune.config import ConfigError, TrainArgs
from finetune.data.formats import IGNORE

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Config attributes that change the logits after lm_head: the tiled loss would skip them.
LOGIT_CHANGES = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier")


def mlps(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The model's per-token MLP blocks: the modules named ``mlp`` in its layers."""
    return [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] == "mlp"]


def check(model: PreTrainedModel) -> None:
    """ConfigError (exit 2) naming --tiled_mlp when ``model`` cannot be tiled right: no MLP blocks,
    mixture-of-experts blocks (their routing loss would be lost), logits changed after lm_head, or
    no lm_head. The same on every rank (it reads the model's structure and config alone)."""
    config = model.config.get_text_config()
    kind = config.model_type
    if not mlps(model):
        raise ConfigError(f"`--tiled_mlp`: this {kind} model has no `mlp` blocks to tile")
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts and experts > 1:
        raise ConfigError(
            f"`--tiled_mlp`: this {kind} model routes its MLPs to {experts} experts, whose routing "
            "loss the tiled loss would drop"
        )
    changes = [a for a in LOGIT_CHANGES if getattr(config, a, None) not in (None, 1, 1.0)]
    if changes:
        raise ConfigError(
            f"`--tiled_mlp`: this {kind} model changes its logits after lm_head "
            f"({', '.join(changes)}), which the tiled loss does not"
        )
    if model.get_output_embeddings() is None or model.base_model is model:
        raise ConfigError(f"`--tiled_mlp`: this {kind} model has no separate lm_head to tile")


def tiles(tokens: int, per_tile: int) -> int:
    """Tiles of at most ``per_tile`` for ``tokens`` (at least 1)."""
    return max(1, math.ceil(tokens / per_tile))


def apply(model: PreTrainedModel, row_tokens: int, forward_tokens: int) -> tuple[int, int]:
    """Tile ``model``'s MLPs and its loss: a training row holds at most ``row_tokens`` tokens on a
    rank, a forward (training or evaluation) at most ``forward_tokens``. Tiles of at most hidden
    size tokens: the MLPs' cut the longest row (ALST's choice), the loss's a forward's tokens, so a
    tile of logits holds no more numbers than lm_head's weight. Returns (MLP tiles, loss tiles).
    Rank-local, the same on every rank."""
    hidden = model.config.get_text_config().hidden_size
    mlp_tiles, loss_tiles = tiles(row_tokens, hidden), tiles(forward_tokens, hidden)
    for mlp in mlps(model):
        weights = [p for p in mlp.parameters() if p.requires_grad]
        mlp.forward = types.MethodType(_tiled_mlp(type(mlp).forward, mlp_tiles, weights), mlp)
    head = [p for p in model.get_output_embeddings().parameters() if p.requires_grad]
    embedding = getattr(model.get_input_embeddings(), "weight", None)
    tied = [p for p in head if p is embedding]
    untied = [p for p in head if p is not embedding]
    model.forward = types.MethodType(
        _tiled_loss(type(model).forward, loss_tiles, tied, untied), model
    )
    return mlp_tiles, loss_tiles


def setup(
    model: PreTrainedModel, max_length: int, n: int, t: TrainArgs, flat: bool, evaluates: bool
) -> None:
    """``check`` then ``apply`` for rows of up to ``max_length`` tokens, 1/``n`` of each on a rank
    in training (--sequence_parallel_size), whole in evaluation (``evaluates``: the run has an eval
    set, the same on every rank); ``flat``: a micro-batch's packed rows are one row."""
    check(model)
    local = math.ceil(max_length / n)
    row = local * (t.per_device_train_batch_size if flat else 1)
    forward = t.per_device_train_batch_size * local
    if evaluates:
        forward = max(forward, t.per_device_eval_batch_size * max_length)
    mlp_tiles, loss_tiles = apply(model, row, forward)
    dist.log_main(
        logging.INFO,
        "--tiled_mlp: each MLP in %d tiles (rows of up to %d tokens on a rank), the logits and "
        "loss in %d",
        mlp_tiles,
        row,
        loss_tiles,
    )


def _tiled_mlp(forward: Any, shards: int, weights: list[torch.nn.Parameter]) -> Any:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import sequence_tiled_compute

    def tiled(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and torch.is_grad_enabled()):
            return forward(self, x)
        return sequence_tiled_compute(
            lambda x: forward(self, x),
            x.shape[1],
            shards,
            {"x": x},
            {},
            "x",
            compute_params=weights,
            output_unshard_dimension=1,
            output_reduction=None,
        )

    return tiled


class _ReadyAfter(torch.autograd.Function):
    """Identity; in the backward, once the tiles behind it are done, ``params`` are ready for
    ZeRO-3 to reduce again (their gradient then reduced at the next accumulation)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, params: list[torch.nn.Parameter]) -> torch.Tensor:
        ctx.params = params
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        for p in ctx.params:
            p.ds_grad_is_ready = True
        return grad, None


def _tiled_loss(
    forward: Any, shards: int, tied: list[torch.nn.Parameter], untied: list[torch.nn.Parameter]
) -> Any:
    """``tied``: lm_head's weights that are the input embedding's too; ``untied``: the others."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import sequence_tiled_compute
    from transformers.modeling_outputs import CausalLMOutputWithPast

    def tiled(
        self: PreTrainedModel,
        input_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | float | None = None,
        **kwargs: Any,
    ) -> Any:
        if labels is None:  # no loss asked for (generation, a probe): the model's own forward
            return forward(self, input_ids=input_ids, **kwargs)
        hidden = self.base_model(input_ids=input_ids, **kwargs).last_hidden_state
        if shift_labels is None:  # each token predicts the next; the row's last predicts nothing
            shift_labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
        head = self.get_output_embeddings()
        if tied and torch.is_grad_enabled():
            hidden = _ReadyAfter.apply(hidden, tied)

        def token_losses(hidden_states: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            if torch.is_grad_enabled():  # recomputed in the backward
                for p in tied:  # the last tile's too: the embedding's backward adds its part
                    p.ds_grad_is_ready = False
            logits = head(hidden_states).float()
            return F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]),
                targets.reshape(-1),
                ignore_index=IGNORE,
                reduction="sum",
            )

        total = sequence_tiled_compute(
            token_losses,
            hidden.shape[1],
            shards,
            {"hidden_states": hidden, "targets": shift_labels},
            {},
            "hidden_states",
            compute_params=untied,
            output_unshard_dimension=0,
            output_reduction="sum",
        )
        if num_items_in_batch is None:  # a mean over this batch's label tokens (evaluation)
            num_items_in_batch = (shift_labels != IGNORE).sum().clamp(min=1)
        return CausalLMOutputWithPast(loss=total / num_items_in_batch)

    return tiled
