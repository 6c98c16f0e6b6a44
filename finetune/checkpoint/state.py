"""Training progress as a dataclass (RNG streams: rng.py).

The log window (train metrics since the last logged step) is each rank's own: a checkpoint keeps
every rank's in that rank's file (``rank_state``) and the world's sum in trainer_state.json, so the
first row after a resume from a save between two logged steps is the row the uninterrupted run
logs (bit for bit at the same world size; on another world size rank 0 takes the world's sum).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


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

    def state_dict(self) -> dict:
        sd = {f.name: getattr(self, f.name) for f in fields(self)}
        sd["loss_sum"] = float(self.loss_sum)  # a device sync, once per save
        return sd

    @classmethod
    def from_state_dict(cls, sd: dict) -> LogWindow:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in sd.items() if k in known})  # an older file lacks newer keys

    def summed(self, totals: list[float]) -> LogWindow:
        """This window with the world's ``[loss_sum, micro_batches, tokens]`` (``world_sums``)."""
        loss_sum, micro, tokens = totals
        return LogWindow(
            loss_sum=loss_sum,
            micro_batches=int(micro),
            tokens=int(tokens),
            steps=self.steps,
            data_s=self.data_s,
            skipped_steps=self.skipped_steps,
            lr=self.lr,
            grad_norm=self.grad_norm,
        )

    def world_sums(self) -> list[float]:
        """What the ranks add up, for ``all_reduce_sum`` (one device sync)."""
        return [float(self.loss_sum), self.micro_batches, self.tokens]


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

    def state_dict(self) -> dict:
        sd = {
            f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name != "window"
        }
        sd["window"] = self.window.state_dict()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """Restore in place (the trainer and the manager hold the same object)."""
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
