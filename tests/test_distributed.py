"""finetune.distributed's agreement primitive, in one process with the collectives stubbed: what
runs where. Real multi-rank behaviour is covered by tests/distributed."""

from __future__ import annotations

import threading

import pytest

from finetune import distributed as dist


class ThreadDevices:
    """An accelerator whose current device is per thread, as CUDA's is (a new thread starts on 0)."""

    def __init__(self):
        self._local = threading.local()

    def device_name(self):
        return "cuda"

    def current_device(self):
        return getattr(self._local, "device", 0)

    def set_device(self, index):
        self._local.device = index


@pytest.fixture
def two_ranks(monkeypatch):
    """gather_outcomes as on a rank of two (its work in a thread), every peer answering like this one."""
    monkeypatch.setattr(dist, "world_size", lambda: 2)
    monkeypatch.setattr(dist, "rank", lambda: 1)
    monkeypatch.setattr(dist, "all_gather_object", lambda obj: [obj, obj])


def test_agreed_work_runs_on_the_callers_device(monkeypatch, two_ranks):
    """Restoring a rank's CUDA RNG or loading an op inside gather_outcomes' thread must act on the
    rank's own GPU, not on device 0, where a new CUDA thread starts."""
    acc = ThreadDevices()
    monkeypatch.setattr("deepspeed.accelerator.get_accelerator", lambda: acc)
    acc.set_device(3)
    out = dist.gather_outcomes(acc.current_device, share=True)
    assert out.ok and out.result == 3
    assert acc.current_device() == 3


def test_agreed_work_on_cpu_needs_no_device(monkeypatch, two_ranks):
    out = dist.gather_outcomes(threading.current_thread, share=True)
    assert out.ok and out.result.name == "finetune-agreed"
