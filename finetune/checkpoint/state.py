"""Training progress as a dataclass, plus per-rank RNG capture/restore."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

TRAINER_STATE = "trainer_state.json"


@dataclass
class LogWindow:
    """Train metrics accumulated since the last logged step (state, so a resume logs identically)."""

    loss_sum: float = 0.0
    micro_batches: int = 0
    tokens: int = 0
    steps: int = 0
    data_s: float = 0.0  # time the loop waited for its batches (what the prefetch did not hide)


@dataclass
class TrainingState:
    global_step: int = 0
    epoch: float = 0.0
    samples_seen: int = 0
    tokens_seen: int = 0
    sampler: dict = field(default_factory=dict)
    window: LogWindow = field(default_factory=LogWindow)
    last_losses: list = field(default_factory=list)

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, sd: dict) -> None:
        """Restore in place (the trainer and the manager hold the same object)."""
        loaded = self.from_state_dict(sd)
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(loaded, name))

    @classmethod
    def from_state_dict(cls, sd: dict) -> "TrainingState":
        sd = dict(sd)
        sd["window"] = LogWindow(**sd.get("window", {}))
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in sd.items() if k in known})


def rng_state() -> dict:
    """This rank's RNG streams, as tensors/plain types so `torch.load(weights_only=True)` reads them."""
    py = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": {"version": py[0], "state": torch.tensor(py[1], dtype=torch.int64), "gauss": py[2]},
        "numpy": {"kind": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
