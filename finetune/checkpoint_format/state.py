"""Training progress as a dataclass, and each rank's RNG streams.

The log window (train metrics since the last logged step) is each rank's own: a checkpoint keeps
every rank's in that rank's file (``rank_state``) and the world's sum in trainer_state.json, so the
first row after a resume from a save between two logged steps is the row the uninterrupted run
logs (bit for bit at the same world size; on another world size rank 0 takes the world's sum).

The Trainer updates ``TrainingState``; the Checkpointer saves and restores it as the "progress"
entry of its states registry (trainer_state.json, checkpoint/contents.py), with each rank's RNG
file; resume and ``finetune ls`` read trainer_state.json.
"""

from __future__ import annotations

import copy
import logging
import random
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator

logger = logging.getLogger("finetune")


TRAINER_STATE = "trainer_state.json"


@dataclass
class LogWindow:
    """Train metrics accumulated since the last logged step (state, so a resume
    logs identically)."""

    # A 0-dim tensor on the device while training (no host sync per micro-batch); a float in JSON.
    loss_sum: float | torch.Tensor = 0.0
    micro_batches: int = 0
    tokens: int = 0
    steps: int = 0  # iterations of the loop, skipped optimizer steps included
    data_s: float = 0.0  # time the loop waited for its batches (what the prefetch did not hide)
    skipped_steps: int = 0  # optimizer steps DeepSpeed skipped (non-finite gradients)
    lr: float | None = None  # the learning rate of the window's last step (its row's "lr")
    # set when saved: the last step's, for a row logged before any new step
    grad_norm: float | None = None
    # --dataset_mixture: tokens per source, in the sources' order ([] = none yet, or no mixture)
    source_tokens: list = field(default_factory=list)
    # A preference --objective's metric sums (objectives.STATS; [] under sft): a device tensor
    # while training, like loss_sum; a list in JSON.
    pair_sums: list | torch.Tensor = field(default_factory=list)

    def state_dict(self) -> dict:
        sd = {f.name: getattr(self, f.name) for f in fields(self)}
        sd["loss_sum"] = float(self.loss_sum)  # a device sync, once per save
        sd["pair_sums"] = self.pair_floats()
        return sd

    def pair_floats(self) -> list[float]:
        sums = self.pair_sums
        return [float(x) for x in (sums.tolist() if hasattr(sums, "tolist") else sums)]

    @classmethod
    def from_state_dict(cls, sd: dict) -> LogWindow:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in sd.items() if k in known})  # an older file lacks newer keys

    def summed(self, totals: list[float]) -> LogWindow:
        """This window with the world's ``[loss_sum, micro_batches, tokens, *source_tokens,
        *pair_sums]`` (``world_sums``)."""
        loss_sum, micro, tokens = totals[:3]
        sources = 3 + len(self.source_tokens)
        return LogWindow(
            loss_sum=loss_sum,
            micro_batches=int(micro),
            tokens=int(tokens),
            steps=self.steps,
            data_s=self.data_s,
            skipped_steps=self.skipped_steps,
            lr=self.lr,
            grad_norm=self.grad_norm,
            source_tokens=[int(n) for n in totals[3:sources]],
            pair_sums=list(totals[sources:]),
        )

    def world_sums(self) -> list[float]:
        """What the ranks add up, for ``all_reduce_sum`` (one device sync). Every rank's
        source_tokens and pair_sums have the same length (the trainer pads a restored window's)."""
        return [
            float(self.loss_sum),
            self.micro_batches,
            self.tokens,
            *self.source_tokens,
            *self.pair_floats(),
        ]


@dataclass
class TrainingState:
    global_step: int = 0  # optimizer steps applied; a step DeepSpeed skipped does not count
    epoch: float = 0.0
    samples_seen: int = 0
    tokens_seen: int = 0
    # optimizer steps DeepSpeed skipped in this run's line (their batches were consumed)
    skipped_steps: int = 0
    sampler: dict = field(default_factory=dict)
    window: LogWindow = field(default_factory=LogWindow)
    last_losses: list = field(default_factory=list)
    # --dataset_mixture: cumulative tokens per source name, summed over ranks (as tokens_seen)
    tokens_seen_by_source: dict = field(default_factory=dict)
    # Early stopping (checkpoint_format/best.py): the best --metric_for_best_model of the
    # evaluations so far, its step, and the evaluations since that did not beat it by the threshold.
    best_metric: float | None = None
    best_metric_step: int | None = None
    evals_without_improvement: int = 0

    def state_dict(self) -> dict:
        sd = {
            f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name != "window"
        }
        sd["window"] = self.window.state_dict()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Restore in place (the Trainer and the Checkpointer's states registry hold the same
        object)."""
        loaded = self.from_state_dict(sd)
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(loaded, name))

    @classmethod
    def from_state_dict(cls, sd: dict) -> TrainingState:
        """Also reads a trainer_state.json written before a key existed (it gets the default)."""
        sd = dict(sd)
        sd["window"] = LogWindow.from_state_dict(sd.get("window", {}))
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in sd.items() if k in known})


# -------------------- RNG streams --------------------


def _device_accelerator() -> DeepSpeedAccelerator | None:
    """DeepSpeed's accelerator when training runs on one (CUDA, XPU, ...); None on CPU."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    return None if acc.device_name() == "cpu" else acc


def rng_state() -> dict:
    """This rank's RNG streams (Python, NumPy, torch's CPU generator, this rank's device), as
    tensors/plain types so `torch.load(weights_only=True)` reads them.

    Only the *current* device's generator is saved (DeepSpeed's accelerator ``get_rng_state()``
    with no index): a rank draws only on its own device. Saving every visible GPU's generator
    (``torch.cuda.get_rng_state_all``) breaks resumes on a different node shape: a rank that sees
    fewer GPUs fails with IndexError in ``set_rng_state_all``, one that sees them in another order
    silently gets another device's stream.
    """
    import numpy as np
    import torch

    py = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": {
            "version": py[0],
            "state": torch.tensor(py[1], dtype=torch.int64),
            "gauss": py[2],
        },
        "numpy": {
            "kind": np_state[0],
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    acc = _device_accelerator()
    if acc is not None:
        state["device"] = {"type": acc.device_name(), "state": acc.get_rng_state()}
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np
    import torch

    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    n = state["numpy"]
    np.random.set_state(
        (
            n["kind"],
            n["keys"].numpy().astype(np.uint32),
            n["pos"],
            n["has_gauss"],
            n["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    acc = _device_accelerator()
    if acc is None:
        return
    saved = state.get("device")
    if saved is not None and saved["type"] == acc.device_name():
        acc.set_rng_state(saved["state"])
    elif "cuda" in state and acc.device_name() == "cuda":
        # Checkpoints that saved every visible GPU's generator, by device index ("cuda"). This
        # rank's own is the one at its current device, when the node still has that many GPUs.
        index = acc.current_device()
        saved_all = state["cuda"]
        if index < len(saved_all):
            acc.set_rng_state(saved_all[index])
        else:
            logger.warning(
                "this checkpoint's RNG state has %d GPU generator(s); "
                "device %d keeps its seeded one",
                len(saved_all),
                index,
            )
    elif saved is not None:
        logger.warning(
            "RNG state saved on %s, resuming on %s: the device generator keeps its seed",
            saved["type"],
            acc.device_name(),
        )
