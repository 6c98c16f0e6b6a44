"""--async_save's snapshot (host_plan, then run_copies on the writer's thread) and background
queue, in one process."""

from __future__ import annotations

import io
import os
import threading

import numpy as np
import pytest
import torch
from checkpoint.fake_engine import Inner

from finetune.checkpoint import writer
from finetune.checkpoint.writer import GuardedWriter, Pool, Queue, host_plan, run_copies
from finetune.io import direct


def copied_now(obj: object, pool: Pool | None = None, name: str = "") -> tuple[object, int]:
    """The snapshot of ``obj`` as a background save makes it: planned, then its copies run (here,
    at once); returns it and the bytes copied."""
    state, nbytes, copies = host_plan(obj, pool, name)
    run_copies(copies)
    return state, nbytes


def _saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _state():
    flat = torch.arange(12, dtype=torch.float32)
    # DeepSpeed tags its fp32 flat groups; the attribute is pickled with the tensor
    flat.ds_id = "0_24"
    weight = torch.nn.Parameter(torch.randn(3, 2))
    return {
        "flat": flat,
        "views": [flat[:4], flat[4:].view(2, 4)],
        "param": weight,
        "optimizer": {
            "param_groups": [{"lr": 0.1, "params": [0]}],
            "state": {0: {"step": torch.tensor(3.0)}},
        },
        "shape": torch.Size([3, 2]),
        "half": torch.ones(5, dtype=torch.bfloat16),
        "note": "x",
    }


def test_the_copy_serialises_to_the_same_bytes_as_the_original():
    state = _state()
    before = _saved(state)
    copied, nbytes = copied_now(state)
    assert _saved(copied) == before
    assert nbytes == 12 * 4 + 6 * 4 + 4 + 5 * 2  # each storage once: the views add nothing


def test_views_still_share_one_storage_and_types_are_kept():
    copied, _ = copied_now(_state())
    flat, (head, tail) = copied["flat"], copied["views"]
    assert (
        head.untyped_storage().data_ptr()
        == flat.untyped_storage().data_ptr()
        == tail.untyped_storage().data_ptr()
    )
    assert tail.storage_offset() == 4 and tail.shape == (2, 4)
    assert isinstance(copied["param"], torch.nn.Parameter) and copied["param"].requires_grad
    assert isinstance(copied["shape"], torch.Size)
    assert copied["flat"].ds_id == "0_24"


def test_later_changes_to_the_live_state_do_not_reach_the_copy():
    state = _state()
    copied, _ = copied_now(state)
    expected = _saved(copied)
    with torch.no_grad():
        state["flat"].mul_(-1)
        state["param"].add_(1)
    state["optimizer"]["param_groups"][0]["lr"] = 0.5  # the scheduler, one step later
    state["optimizer"]["state"][0]["step"] += 1
    assert _saved(copied) == expected
    assert copied["optimizer"]["param_groups"][0]["lr"] == 0.1


def test_a_second_copy_reuses_the_first_ones_buffers():
    pool: dict = {}
    state = _state()
    first, _ = copied_now(state, pool, "f.pt")
    kept = {slot: buf.data_ptr() for slot, buf in pool.items()}
    with torch.no_grad():
        state["flat"].add_(100)
    second, _ = copied_now(state, pool, "f.pt")
    assert {slot: buf.data_ptr() for slot, buf in pool.items()} == kept
    assert second["flat"].untyped_storage().data_ptr() == kept[("f.pt", 0)]
    assert torch.equal(second["flat"], state["flat"]) and _saved(second) == _saved(state)


def test_the_queue_writes_in_order_on_its_thread_and_reports_done():
    written = []
    q = Queue(lambda state, path: written.append((path, state)))
    q.add({"a": 1}, "first", 10)
    q.add({"b": 2}, "second", 5)
    assert not q.done() and q.bytes == 15
    q.start()
    q.join()
    assert q.done() and written == [("first", {"a": 1}), ("second", {"b": 2})]


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread nice here")
def test_the_writer_copies_at_trainings_priority_and_writes_below_it(monkeypatch):
    """The copy, which the optimizer step waits for, runs at training's priority; the writes after
    it at WRITER_NICE more (a nice value is per thread on Linux)."""

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    seen = {}
    monkeypatch.setattr(writer, "run_copies", lambda *a: seen.setdefault("copy", nice()))
    q = Queue(lambda state, path: seen.setdefault("write", nice()))
    q.add({"a": 1}, "f", 1)
    q.start()
    q.join()
    assert seen == {"copy": nice(), "write": min(19, nice() + writer.WRITER_NICE)}


def test_a_background_write_equals_a_synchronous_one(tmp_path):
    state = _state()
    sync = GuardedWriter(Inner())
    sync.reset(tmp_path / "sync", 4)
    (tmp_path / "sync").mkdir()
    sync.save(state, str(tmp_path / "sync" / "f.pt"))

    background = GuardedWriter(Inner())
    background.reset(tmp_path / "async", 4, background=True)
    (tmp_path / "async").mkdir()
    background.save(state, str(tmp_path / "async" / "f.pt"))
    # lazy: save() planned the snapshot and copied nothing; the thread copies
    assert background.snapshot_bytes > 0 and not background.queue.copied.is_set()
    assert not (tmp_path / "async" / "f.pt").exists()
    live = {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    background.start()
    assert background.wait_copied() >= 0  # what the optimizer step waits for
    # the copy changed nothing it should not: the live state is as it was
    assert all(torch.equal(state[k], v) for k, v in live.items())
    with torch.no_grad():
        state["flat"].zero_()  # the optimizer step, while the thread still writes
    background.join()
    assert background.done() and background.error is None
    assert background.files == sync.files  # same size and checksum
    assert background.record.stats["copy"] >= 0 and background.record.stats["fsync"] >= 0


def test_a_large_storage_is_written_from_the_snapshot_where_it_lies(tmp_path, monkeypatch):
    """The snapshot's long buffers are page-aligned and their storages 4096-aligned in the file:
    O_DIRECT takes them without a copy, and the file is a synchronous save's, byte for byte."""
    try:
        os.close(os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0)))
    except OSError:
        pytest.skip(f"{tmp_path}'s filesystem does not take O_DIRECT")
    state = {"big": torch.randn(3 << 18), "small": torch.arange(5), "step": 7}  # 3 MiB + 40 B
    sync = GuardedWriter(Inner())
    (tmp_path / "sync").mkdir()
    sync.reset(tmp_path / "sync", 4)
    sync.save(state, str(tmp_path / "sync" / "f.pt"))

    sources, real = [], os.pwrite

    def pwrite(fd, data, offset):
        sources.append(np.frombuffer(data, dtype=np.uint8).ctypes.data)
        return real(fd, data, offset)

    monkeypatch.setattr(direct.os, "pwrite", pwrite)
    background = GuardedWriter(Inner())
    (tmp_path / "async").mkdir()
    background.reset(tmp_path / "async", 4, background=True)
    background.save(state, str(tmp_path / "async" / "f.pt"))
    background.start()
    background.join()
    assert background.error is None and background.files == sync.files
    (snapshot,) = [b for b in background.buffers.values() if b.numel() == 3 << 20]
    assert snapshot.data_ptr() % 4096 == 0 and snapshot.data_ptr() in sources
    assert torch.equal(torch.load(tmp_path / "async" / "f.pt")["big"], state["big"])


def _started(folder):
    """A background save of _state() to folder/f.pt at step 4, its thread started."""
    w = GuardedWriter(Inner())
    w.reset(folder, 4, background=True)
    w.save(_state(), str(folder / "f.pt"))
    w.start()
    return w


def test_the_optimizer_step_waits_for_the_copy_not_the_write(tmp_path, monkeypatch):
    """wait_copied returns once the tensors are in host memory, while the file is still being
    written (FINETUNE_SLOW_SAVE holds the write after each file)."""
    monkeypatch.setenv("FINETUNE_SLOW_SAVE", "1.5")
    w = _started(tmp_path)
    w.wait_copied()
    assert w.queue.copied.is_set() and not w.done()
    w.join()
    assert w.done() and w.error is None and "f.pt" in w.files


def test_a_background_failure_is_recorded_not_raised(tmp_path, monkeypatch):
    monkeypatch.setenv("FINETUNE_FAULT", "save.fsync:0:4:enospc")
    w = _started(tmp_path)
    w.join()
    assert w.error is not None and "No space left" in w.error and w.files == {}


def test_a_failed_copy_is_recorded_and_nothing_is_queued(tmp_path, monkeypatch):
    monkeypatch.setenv("FINETUNE_FAULT", "save.host_copy:0:4:error")
    w = GuardedWriter(Inner())
    w.reset(tmp_path, 4, background=True)
    w.save(_state(), str(tmp_path / "f.pt"))
    assert w.error is not None and "injected fault" in w.error and w.snapshot_bytes == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host buffers need CUDA")
def test_device_tensors_go_to_reused_pinned_buffers():
    pool: dict = {}
    state = {"w": torch.randn(1000, device="cuda")}
    first, _ = copied_now(state, pool, "f.pt")
    assert first["w"].device.type == "cpu" and first["w"].is_pinned()
    buffer = next(iter(pool.values())).data_ptr()
    second, _ = copied_now(state, pool, "f.pt")
    assert second["w"].untyped_storage().data_ptr() == buffer
    assert torch.equal(second["w"], state["w"].cpu())


def test_distinct_empty_storages_stay_distinct():
    """ZeRO-3's partitioned parameters are empty tensors, each with a storage of its own: torch.save
    writes one record per storage, and so must the copy's."""
    state = {f"p{i}": torch.empty(0) for i in range(3)}
    copied, nbytes = copied_now(state)
    assert nbytes == 0 and _saved(copied) == _saved(state)


def test_a_writer_thread_that_cannot_start_is_a_recorded_failure(tmp_path, monkeypatch):
    """Raised on one rank, it would leave the others waiting in the next collective."""
    w = GuardedWriter(Inner())
    w.reset(tmp_path, 4, background=True)
    w.save(_state(), str(tmp_path / "f.pt"))

    def refuse(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr("threading.Thread.start", refuse)
    w.start()
    w.join()  # returns: nothing to wait for
    assert w.done() and w.error is not None and "can't start new thread" in w.error


def test_a_background_write_is_paced_over_the_steps_time_until_waited_for(tmp_path):
    """The write is spread over PACE_STEPS x the last step's time (measured between optimizer
    steps, at wait_copied); whoever waits for it (the next save, the end, a preemption) ends the
    pacing."""
    import time

    from finetune.checkpoint import writer as writer_module

    def paced_save(folder, step_s):
        w = GuardedWriter(Inner())
        w.wait_copied()
        time.sleep(step_s)
        w.wait_copied()  # one "step" later: the pace is set from it
        assert w.pace_s == pytest.approx(writer_module.PACE_STEPS * step_s, rel=0.5)
        w.reset(folder, 4, background=True)
        folder.mkdir()
        size = writer_module.PACE_MIN_BYTES + (8 << 20)  # a write big enough to be paced
        w.save({"big": torch.zeros(size, dtype=torch.uint8)}, str(folder / "f.pt"))
        w.start()
        return w

    w = paced_save(tmp_path / "paced", 0.6)
    t0 = time.perf_counter()
    while not w.done():
        time.sleep(0.02)
    assert time.perf_counter() - t0 > 0.6 and w.error is None  # spread over ~1.2 s

    w = paced_save(tmp_path / "waited", 5.0)  # would take ~10 s
    t0 = time.perf_counter()
    w.join()  # waited for: full speed
    assert time.perf_counter() - t0 < 3.0 and w.error is None and "f.pt" in w.files


def test_small_tensors_are_copied_at_the_save_the_large_ones_lazily(tmp_path):
    """A module buffer a forward changes in place (BatchNorm's running mean) must be saved as it
    was at the save, although the copy of the partitions is lazy."""
    from finetune.checkpoint.writer import EAGER_BYTES

    running_mean = torch.arange(8, dtype=torch.float32)
    big = torch.ones(EAGER_BYTES // 4 + 1)  # one storage over EAGER_BYTES
    w = GuardedWriter(Inner())
    w.reset(tmp_path, 4, background=True)
    w.save({"running_mean": running_mean, "big": big}, str(tmp_path / "f.pt"))
    assert [src.nbytes for _, src in w.queue.copies] == [big.nbytes]  # only the big one waits
    running_mean += 100  # the next forward, before the thread copies anything
    w.start()
    w.join()
    saved = torch.load(tmp_path / "f.pt", weights_only=True)
    assert torch.equal(saved["running_mean"], torch.arange(8, dtype=torch.float32))
    assert torch.equal(saved["big"], big)
