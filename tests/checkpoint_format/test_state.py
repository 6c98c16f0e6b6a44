"""TrainingState round trip: through JSON, from an older file, with the loss summed on the
device."""

from __future__ import annotations

import json

import torch

from finetune.checkpoint_format.state import LogWindow, TrainingState


def test_training_state_round_trips_through_json():
    st = TrainingState(
        global_step=7,
        epoch=1.4,
        samples_seen=112,
        tokens_seen=4000,
        skipped_steps=2,
        sampler={"epoch": 1, "consumed": 32, "seed": 42, "num_samples": 80},
        window=LogWindow(loss_sum=3.5, micro_batches=2, tokens=90, steps=1, skipped_steps=1),
        last_losses=[2.0, 1.5],
    )
    again = TrainingState.from_state_dict(json.loads(json.dumps(st.state_dict())))
    assert again == st


def test_a_window_summed_on_the_device_is_saved_as_a_plain_float():
    st = TrainingState(
        global_step=3,
        window=LogWindow(
            loss_sum=torch.tensor(2.25, dtype=torch.float64), micro_batches=2, skipped_steps=1
        ),
    )
    sd = json.loads(json.dumps(st.state_dict()))
    assert sd["window"]["loss_sum"] == 2.25 and sd["window"]["skipped_steps"] == 1
    assert torch.is_tensor(st.window.loss_sum)  # saving does not change the live window


def test_a_trainer_state_from_before_skipped_steps_loads_with_none_skipped():
    old = {
        "global_step": 7,
        "epoch": 1.4,
        "samples_seen": 112,
        "tokens_seen": 4000,
        "sampler": {},
        "last_losses": [],
        "window": {"loss_sum": 3.5, "micro_batches": 2, "tokens": 90, "steps": 1, "data_s": 0.0},
        "zero_stage": 3,
        "world_size": 2,
    }  # plus the run info trainer_state.json also holds
    st = TrainingState.from_state_dict(old)
    assert st.global_step == 7 and st.skipped_steps == 0 and st.window.skipped_steps == 0
