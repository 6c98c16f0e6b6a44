"""A full disk, without processes: what a failed save reports about space, and what its tidy-up
keeps. The real thing (a tmpfs filling up under a 2-rank run) is tests/faults/test_disk_full.py."""

from __future__ import annotations

import errno
import re

import pytest
from checkpoint.fake_engine import make_cfg, make_manager, run_saves, tiny_module

from finetune.checkpoint.contents import fmt_bytes, space_report
from finetune.checkpoint_format.outdir import LATEST, STAGING, OutputDir

FIXTURES = (tiny_module,)  # fake_engine's, found by pytest under this name

FREED = re.compile(
    r"removing its staging freed ([\d.]+) MB; ([\d.]+) MB free now, a save needs ~([\d.]+) MB"
)


def test_sizes_read_in_mb_below_a_gb_and_gb_above():
    assert fmt_bytes(5_600_000) == "5.60 MB"
    assert fmt_bytes(12_000) == "0.01 MB"
    assert fmt_bytes(3_250_000_000) == "3.25 GB"


def test_space_report_says_what_was_freed_what_is_free_and_what_a_save_needs():
    assert (
        space_report({0: (2_000_000, 9_000_000)}, 6_000_000)
        == "removing its staging freed 2.00 MB; 9.00 MB free now, a save needs ~6.00 MB"
    )
    full = space_report({0: (20_000, 21_000)}, 6_000_000)
    assert full.endswith("(the next save is refused until space is freed)")
    assert space_report({0: (1, None)}, 5) == "removing its staging freed 0.00 MB"  # statfs failed
    both = space_report({0: (1_000_000, 7_000_000), 2: (2_000_000, 1_000_000)}, 6_000_000)
    assert (
        both.startswith("rank 0: removing its staging freed 1.00 MB")
        and "; rank 2: removing" in both
    )


def test_remove_returns_the_space_it_freed(tmp_path):
    s = OutputDir(tmp_path)
    folder = tmp_path / STAGING / "global_step2"
    folder.mkdir(parents=True)
    (folder / "a.pt").write_bytes(b"x" * 10_000)
    (folder / "b.pt").write_bytes(b"")
    used = sum(p.stat().st_blocks * 512 for p in folder.iterdir())
    assert s.remove(f"{STAGING}/global_step2") == used >= 10_000
    assert not folder.exists()
    assert s.remove(f"{STAGING}/global_step2") == 0  # already gone


def _stage_scripts(tmp_path):
    (tmp_path / "zero_to_fp32.py").write_text("# the whole script\n")
    (tmp_path / STAGING).mkdir()
    (tmp_path / STAGING / "zero_to_fp32.py").write_text("# trunc")  # a full disk cut the copy short


def test_a_failed_saves_recovery_scripts_are_deleted_not_moved_over_the_good_ones(tmp_path):
    _stage_scripts(tmp_path)
    assert OutputDir(tmp_path).finish_staging(saved=False) > 0
    assert (tmp_path / "zero_to_fp32.py").read_text() == "# the whole script\n"
    assert not (tmp_path / STAGING).exists()


def test_a_committed_saves_recovery_scripts_go_beside_the_checkpoints(tmp_path):
    _stage_scripts(tmp_path)
    assert OutputDir(tmp_path).finish_staging() == 0
    assert (tmp_path / "zero_to_fp32.py").read_text() == "# trunc"
    assert not (tmp_path / STAGING).exists()


class _DiskFull:
    """The writer's file object runs out of space after ``budget`` bytes, as a full disk does."""

    def __init__(self, budget: int):
        self.left = budget

    def write(self, real_write):
        def write(writer, data):
            n = len(memoryview(data).cast("B"))
            if n > self.left:
                e = OSError(errno.ENOSPC, "No space left on device")
                writer.os_error = writer.os_error or e
                raise e
            self.left -= n
            return real_write(writer, data)

        return write


def test_a_write_that_runs_out_of_space_reports_the_space_freed(tmp_path, tiny_module, monkeypatch):
    from finetune.checkpoint.checkpointer import SaveError
    from finetune.io.durable import HashingWriter

    m, progress, _ = make_manager(make_cfg(tmp_path), tiny_module)
    run_saves(m, progress, [1])
    # through the page cache: the 3,000 bytes before the fake full disk land in the file (O_DIRECT
    # would hold them in its aligned buffer), so the removed staging frees something to report
    monkeypatch.setenv("FINETUNE_BUFFERED_WRITES", "1")
    monkeypatch.setattr(HashingWriter, "write", _DiskFull(3_000).write(HashingWriter.write))
    reads = iter([100_000_000, 4_000])  # the check's, then after the staging went
    monkeypatch.setattr(m.storage, "free_bytes", lambda: next(reads))
    (tmp_path / "zero_to_fp32.py").write_text("# the whole script\n")
    with pytest.raises(SaveError) as e:
        run_saves(m, progress, [2])
    message = str(e.value)
    assert (
        message.startswith("save of global_step2 failed on rank 0: OSError writing ")
        and "No space left on device" in message
    ), message
    freed, free, need = (float(g) * 1e6 for g in FREED.search(message).groups())
    assert (
        freed > 0
        and free == pytest.approx(4_000, abs=5_000)
        and need == pytest.approx(m.staging.space_needed(), abs=5_000)
    )
    assert message.endswith("(the next save is refused until space is freed)")
    assert not (tmp_path / STAGING).exists() and OutputDir(tmp_path).tags() == ["global_step1"]
    assert (tmp_path / LATEST).read_text().strip() == "global_step1"
    assert (tmp_path / "zero_to_fp32.py").read_text() == "# the whole script\n"


def test_a_manifest_that_does_not_fit_is_a_commit_error_naming_the_file(
    tmp_path, tiny_module, monkeypatch
):
    from finetune.checkpoint.checkpointer import SaveError

    m, progress, _ = make_manager(make_cfg(tmp_path), tiny_module)
    run_saves(m, progress, [1])
    write = m.storage.storage.write_bytes

    def full(rel, data):  # the storage runs out of space for the manifest alone
        if rel.endswith("/manifest.json"):
            raise OSError(errno.ENOSPC, "No space left on device")
        write(rel, data)

    monkeypatch.setattr(m.storage.storage, "write_bytes", full)
    monkeypatch.setattr(m.storage, "free_bytes", lambda: 100_000_000)  # reported in MB
    with pytest.raises(
        SaveError,
        match=r"commit of global_step2 failed on rank 0: OSError: \[Errno 28\] No space left "
        r"on device: '.*/\.staging/global_step2/manifest\.json'; latest is unchanged; "
        r"removing its staging freed",
    ) as e:
        run_saves(m, progress, [2])
    freed = float(FREED.search(str(e.value)).group(1)) * 1e6
    assert freed == pytest.approx(
        sum(p.stat().st_blocks * 512 for p in (tmp_path / "global_step1").iterdir()), abs=6_000
    )  # the staged checkpoint, less its manifest (2 decimals of MB)
    assert not (tmp_path / STAGING).exists() and OutputDir(tmp_path).tags() == ["global_step1"]


def test_the_space_check_speaks_in_mb_for_small_checkpoints(tmp_path, tiny_module, monkeypatch):
    from finetune.checkpoint.checkpointer import SaveError

    m, progress, _ = make_manager(make_cfg(tmp_path), tiny_module)
    run_saves(m, progress, [1])
    monkeypatch.setattr(m.storage, "free_bytes", lambda: 1_000)
    with pytest.raises(
        SaveError,
        match=r"not saving global_step2: not enough free space in .* "
        r"\(rank 0: 0\.00 MB free, need ~\d+\.\d\d MB\)",
    ):
        run_saves(m, progress, [2])
    assert not (tmp_path / STAGING).exists()


def test_retention_logs_the_space_it_freed(tmp_path, tiny_module, caplog):
    m, progress, _ = make_manager(make_cfg(tmp_path, save_total_limit=1), tiny_module)
    with caplog.at_level("INFO", logger="finetune"):
        run_saves(m, progress, [1, 2])
        assert m.lineage.deleter.wait(10)  # deleted in the background
    assert re.search(
        r"save_total_limit: deleted global_step1 \(\d+\.\d\d MB freed\)", caplog.text
    ), caplog.text
