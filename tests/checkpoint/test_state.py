"""TrainingState round trip and per-rank RNG capture, loadable with weights_only=True."""

from __future__ import annotations

import json
import random

import numpy as np
import torch

from finetune.checkpoint.state import LogWindow, TrainingState, rng_state, set_rng_state


def test_training_state_round_trips_through_json():
    st = TrainingState(global_step=7, epoch=1.4, samples_seen=112, tokens_seen=4000,
                       sampler={"epoch": 1, "consumed": 32, "seed": 42, "num_samples": 80},
                       window=LogWindow(loss_sum=3.5, micro_batches=2, tokens=90, steps=1), last_losses=[2.0, 1.5])
    again = TrainingState.from_state_dict(json.loads(json.dumps(st.state_dict())))
    assert again == st


def test_rng_state_restores_every_stream_and_loads_weights_only(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    torch.save(rng_state(), tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])
