"""Per-rank RNG capture and restore: every stream, loadable with weights_only=True, and only the
current device's generator, so a resume on a node with another GPU count or order works."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from finetune.checkpoint_format import state as rng
from finetune.checkpoint_format.state import rng_state, set_rng_state


class FakeCuda:
    """A CUDA node seen through DeepSpeed's accelerator API: ``count`` GPUs, one generator each."""

    def __init__(self, count: int, current: int):
        self.generators = {i: torch.tensor([i], dtype=torch.uint8) for i in range(count)}
        self.current = current

    def device_name(self):
        return "cuda"

    def current_device(self):
        return self.current

    def get_rng_state(self, device_index=None):
        return self.generators[self.current if device_index is None else device_index].clone()

    def set_rng_state(self, new_state, device_index=None):
        index = self.current if device_index is None else device_index
        if index not in self.generators:
            raise IndexError(f"device {index} of {len(self.generators)}")
        self.generators[index] = new_state.clone()


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


@pytest.mark.parametrize("resume_count,resume_current", [(1, 0), (8, 5), (2, 1)])
def test_only_the_current_devices_generator_is_saved_and_restored(
    monkeypatch, tmp_path, resume_count, resume_current
):
    """Saved by local rank 3 of an 8-GPU node; resumed where that rank sees 1 GPU
    (--gpus-per-task=1), a different device of 8, or 2 GPUs: its own stream comes back on its
    current device, and no other device's generator is touched."""
    saving = FakeCuda(8, current=3)
    saving.generators[3] = torch.tensor([42], dtype=torch.uint8)
    monkeypatch.setattr(rng, "_device_accelerator", lambda: saving)
    torch.save(rng_state(), tmp_path / "rng.pt")
    state = torch.load(tmp_path / "rng.pt", weights_only=True)
    assert torch.equal(state["device"]["state"], torch.tensor([42], dtype=torch.uint8))
    assert "cuda" not in state  # not every visible GPU's

    resuming = FakeCuda(resume_count, current=resume_current)
    before = {i: g.clone() for i, g in resuming.generators.items()}
    monkeypatch.setattr(rng, "_device_accelerator", lambda: resuming)
    set_rng_state(state)
    assert torch.equal(resuming.generators[resume_current], torch.tensor([42], dtype=torch.uint8))
    for i, g in resuming.generators.items():
        if i != resume_current:
            assert torch.equal(g, before[i])


def test_a_checkpoint_with_every_gpus_generator_resumes_on_fewer_gpus(monkeypatch, caplog):
    """The format that saved every visible GPU's generator (``cuda``): restores the current
    device's entry where there is one, and warns instead of raising IndexError where there is
    not."""
    old = {**rng_state(), "cuda": [torch.tensor([i], dtype=torch.uint8) for i in range(4)]}
    two = FakeCuda(2, current=1)
    monkeypatch.setattr(rng, "_device_accelerator", lambda: two)
    set_rng_state(old)
    assert torch.equal(two.generators[1], torch.tensor([1], dtype=torch.uint8))

    few = FakeCuda(8, current=6)
    monkeypatch.setattr(rng, "_device_accelerator", lambda: few)
    with caplog.at_level("WARNING", logger="finetune"):
        set_rng_state(old)
    assert torch.equal(few.generators[6], torch.tensor([6], dtype=torch.uint8))  # kept its own
    assert "4 GPU generator(s)" in caplog.text
