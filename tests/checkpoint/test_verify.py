"""`finetune verify` and the manifest check behind it, on a checkpoint folder built by commit_staged."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from finetune.checkpoint.commit import commit_staged
from finetune.checkpoint.durable import hash_file
from finetune.checkpoint.manifest import verify
from finetune.checkpoint.storage import STAGING, LocalStorage

WORLD = 2


@pytest.fixture
def ckpt(tmp_path):
    """A committed 2-rank checkpoint folder with every file a real one has (small contents)."""
    s = LocalStorage(tmp_path / "out")
    staged = s.root / STAGING / "global_step4"
    staged.mkdir(parents=True)
    names = ["config.json", "tokenizer.json"]
    for r in range(WORLD):
        names += [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt", f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
                  f"rng_state_{r}.pt"]
    for i, name in enumerate(names):
        (staged / name).write_bytes(bytes(range(256)) * (i + 1))
    (staged / "trainer_state.json").write_text(json.dumps({"global_step": 4, "world_size": WORLD}))
    files = {p.name: hash_file(p) for p in staged.iterdir()}
    commit_staged(s, "global_step4", files, WORLD, {})
    return s.root / "global_step4"


def cli(*args):
    return subprocess.run([sys.executable, "-m", "finetune", "verify", *map(str, args)], capture_output=True, text=True)


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
    assert r.returncode == 1 and "zero_pp_rank_0_mp_rank_00_model_states.pt: checksum mismatch" in r.stdout
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
    """What the resume path does: each rank checks its own rank files, rank 0 the shared ones too."""
    (ckpt / "rng_state_1.pt").write_bytes(b"x")
    assert verify(ckpt, ranks=[0], shared=True).ok
    assert not verify(ckpt, ranks=[1], shared=False).ok
    assert verify(ckpt, ranks=[1], shared=False).files == 3
