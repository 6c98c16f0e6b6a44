"""`finetune verify` and the manifest check behind it, on a checkpoint folder built by
OutputDir.commit; the notes it adds for an output dir. Real checkpoints damaged at rest:
test_at_rest.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from finetune.checkpoint_format.manifest import verify
from finetune.checkpoint_format.outdir import STAGING, OutputDir
from finetune.io.durable import hash_file

WORLD = 2


@pytest.fixture
def ckpt(tmp_path):
    """A committed 2-rank checkpoint folder with every file a real one has (small contents)."""
    s = OutputDir(tmp_path / "out")
    staged = s.root / STAGING / "global_step4"
    staged.mkdir(parents=True)
    names = ["config.json", "tokenizer.json"]
    for r in range(WORLD):
        names += [
            f"zero_pp_rank_{r}_mp_rank_00_model_states.pt",
            f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
            f"rng_state_{r}.pt",
        ]
    for i, name in enumerate(names):
        # torch files, as DeepSpeed's are: verify also reads their pickles' opcodes
        if name.endswith(".pt"):
            torch.save({"step": 4, "data": torch.arange(64 * (i + 1))}, staged / name)
        else:
            (staged / name).write_bytes(bytes(range(256)) * (i + 1))
    (staged / "trainer_state.json").write_text(json.dumps({"global_step": 4, "world_size": WORLD}))
    files = {p.name: hash_file(p) for p in staged.iterdir()}
    s.commit("global_step4", files, WORLD, {})
    return s.root / "global_step4"


def cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "finetune", "verify", *map(str, args)],
        capture_output=True,
        text=True,
    )


def test_intact_checkpoint_verifies(ckpt):
    report = verify(ckpt)
    assert report.ok and report.files == 9
    r = cli(ckpt)
    assert r.returncode == 0 and r.stdout.startswith("OK ")
    assert cli(ckpt.parent).returncode == 0  # an output dir: its newest committed checkpoint


def test_truncated_file_is_damage(ckpt):
    path = ckpt / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    path.write_bytes(path.read_bytes()[:-10])
    r = cli(ckpt)
    assert r.returncode == 1 and "zero_pp_rank_1_mp_rank_00_optim_states.pt: size" in r.stdout
    assert cli(ckpt, "--quick").returncode == 1  # sizes alone catch truncation


def test_flipped_byte_is_caught_by_checksum_not_by_quick(ckpt):
    path = ckpt / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    data = bytearray(path.read_bytes())
    data[100] ^= 0x01
    path.write_bytes(bytes(data))
    r = cli(ckpt)
    assert (
        r.returncode == 1
        and "zero_pp_rank_0_mp_rank_00_model_states.pt: checksum mismatch" in r.stdout
    )
    assert cli(ckpt, "--quick").returncode == 0


def test_missing_rank_file_is_damage(ckpt):
    (ckpt / "rng_state_1.pt").unlink()
    r = cli(ckpt)
    assert r.returncode == 1 and "rng_state_1.pt: missing" in r.stdout


def test_missing_manifest_is_damage_not_a_non_checkpoint(ckpt):
    (ckpt / "manifest.json").unlink()
    r = cli(ckpt)
    assert r.returncode == 1 and "manifest.json missing" in r.stdout


def test_not_a_checkpoint_exits_2(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    r = cli(tmp_path)
    assert r.returncode == 2 and "not a checkpoint" in r.stderr
    assert cli(tmp_path / "nope").returncode == 2


def test_ranks_split_the_work(ckpt):
    """What the resume path does: each rank checks its own rank files, rank 0 the shared ones
    too."""
    (ckpt / "rng_state_1.pt").write_bytes(b"x")
    assert verify(ckpt, ranks=[0], shared=True).ok
    assert not verify(ckpt, ranks=[1], shared=False).ok
    assert verify(ckpt, ranks=[1], shared=False).files == 3


def test_a_directory_where_a_file_should_be_is_damage_not_a_crash(ckpt):
    path = ckpt / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    path.unlink()
    path.mkdir()
    (ckpt / "trainer_state.json").unlink()
    (ckpt / "trainer_state.json").mkdir()
    r = cli(ckpt)
    assert r.returncode == 1 and not r.stderr.strip(), r.stderr
    assert (
        "zero_pp_rank_1_mp_rank_00_optim_states.pt: " in r.stdout
        and "trainer_state.json: " in r.stdout
    )


# --- an output dir: its newest committed checkpoint, and notes on the rest ------------------------


def notes_of(out) -> list[str]:
    r = cli(out)
    assert r.returncode == 0 and r.stdout.startswith("OK "), r.stdout + r.stderr
    return [line.strip().removeprefix("note: ") for line in r.stdout.splitlines()[1:]]


def test_a_tidy_output_dir_has_no_notes(ckpt):
    assert notes_of(ckpt.parent) == []
    assert cli(ckpt).stdout.count("\n") == 1  # a checkpoint folder: the checkpoint alone


def test_uncommitted_folder_is_noted(ckpt):
    shutil.copytree(ckpt, ckpt.parent / "global_step8")
    (ckpt.parent / "global_step8" / "manifest.json").unlink()
    (notes,) = notes_of(ckpt.parent)
    assert notes.startswith("global_step8: no readable manifest.json")


@pytest.mark.parametrize(
    "latest,says",
    [
        ("global_step9", "names global_step9, which is not a committed"),
        ("", "names nothing"),
        (None, "not a file"),
    ],
)
def test_stale_latest_is_noted(ckpt, latest, says):
    path = ckpt.parent / "latest"
    path.unlink()
    if latest is None:
        path.mkdir()
    else:
        path.write_text(latest + "\n")
    (notes,) = notes_of(ckpt.parent)
    assert notes.startswith(f"latest: {says}")


def test_latest_behind_the_commit_order_is_noted(ckpt):
    s = OutputDir(ckpt.parent)
    staged = s.root / STAGING / "global_step6"
    shutil.copytree(ckpt, staged)
    (staged / "manifest.json").unlink()
    s.commit("global_step6", {p.name: hash_file(p) for p in staged.iterdir()}, WORLD, {})
    s.write_latest("global_step4")  # as a crash between the rename and the update leaves it
    (notes,) = notes_of(ckpt.parent)
    assert "names global_step4, but the newest committed checkpoint is global_step6" in notes


def test_crashed_save_leftovers_and_torn_metrics_are_noted(ckpt):
    out = ckpt.parent
    (out / STAGING / "global_step5").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    notes = notes_of(out)
    assert notes[0].startswith(".staging/global_step5: left by a crashed save")
    assert notes[1].startswith("metrics.jsonl: 1 torn line(s) (line 2;")


class CopiesAFile:
    """Unpickling this calls shutil.copyfile: code run by loading the file."""

    def __reduce__(self):
        return shutil.copyfile, ("/dev/null", "/nonexistent/ran")


def test_intact_but_naming_a_class_off_the_allow_list_is_refused(ckpt):
    """A checkpoint crafted to verify (its manifest updated) still fails: resume and export would
    refuse it."""
    path = ckpt / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"payload": CopiesAFile()}, path)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    size, digest = hash_file(path)
    manifest["files"][path.name] = {"size": size, "checksum": digest}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    assert verify(ckpt).ok  # the manifest check alone: intact
    r = cli(ckpt)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"{path.name}: refused to unpickle shutil.copyfile" in r.stdout
    assert cli(ckpt, "--quick").returncode == 0  # sizes only


def test_a_directory_where_a_listed_file_should_be_is_named_as_such(tmp_path):
    from finetune.checkpoint_format.manifest import check_file

    (tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt").mkdir()
    problems = check_file(
        tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        {"size": 10, "checksum": "x"},
        checksums=True,
    )
    assert problems == ["zero_pp_rank_0_mp_rank_00_optim_states.pt: a directory, not a file"]


def test_metrics_that_cannot_be_trimmed_warn_instead_of_stopping_the_resume(tmp_path, caplog):
    from finetune.metrics import truncate_after

    (tmp_path / "metrics.jsonl").mkdir()  # a directory where the file should be
    with caplog.at_level("WARNING", logger="finetune"):
        truncate_after(tmp_path / "metrics.jsonl", 3)
    assert "could not trim" in caplog.text
