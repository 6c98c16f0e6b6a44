"""Damage at rest, on real 2-rank checkpoints: `finetune verify` names each kind of damage, and
`--resume_from_checkpoint auto` skips it (falls back to the older intact checkpoint) or repairs it,
as docs/CHECKPOINTS.md "Resume" and "Verify" say, and finishes. Nothing hangs: every run has a short
--ddp_timeout and a wall-clock limit. Also: resume unpickles DeepSpeed's files only after they
verified, and the real rank files need nothing beyond the allow-list
(finetune/weights/safe_load.py).

One 2-rank run makes the checkpoints (global_step1 … global_step8); each test damages a copy. The
kinds of damage share one resume: each is put into a checkpoint of its own, newest first, and one
`--resume_from_checkpoint auto` has to walk past all of them to the intact global_step1 (a kind it
failed to detect would be resumed from instead).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.checkpoint_format.manifest import read_manifest
from finetune.io.durable import hash_file
from finetune.weights import safe_load

from conftest import Running, child_env, launcher_cmd

pytestmark = pytest.mark.distributed

WORLD = 2
RUN_TIMEOUT = 300  # seconds of wall clock for one run; --ddp_timeout bounds each collective wait
TRAIN = (
    "--save_steps",
    "1",
    "--save_checkpoint",
    "--logging_steps",
    "1",
    "--max_eval_samples",
    "16",
    "--ddp_timeout",
    "60",
)
RANK_FILE = "zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt"


def train(out: Path, *extra: str, max_steps: int = 2):
    """The CLI on 2 ranks into ``out``; (exit code, output). Never hangs past RUN_TIMEOUT."""
    cmd = launcher_cmd("forked", WORLD) + [
        *TRAIN,
        "--max_steps",
        str(max_steps),
        "--output_dir",
        str(out),
        *extra,
    ]
    r = Running(cmd, out.parent, child_env()).finish(RUN_TIMEOUT)
    return r.returncode, r.output


# The base run's checkpoints: global_step1 stays intact, each later one gets one kind of damage
# (newest first, in DAMAGED's order) in the shared fallback test, so one resume walks past all of
# them.
STEPS = 8


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """An output dir with STEPS committed 2-rank checkpoints: global_step1 … global_step8."""
    out = tmp_path_factory.mktemp("at_rest") / "out"
    code, output = train(out, max_steps=STEPS)
    assert code == 0, output[-4000:]
    assert all(read_manifest(out / f"global_step{s}") for s in range(1, STEPS + 1))
    return out


@pytest.fixture
def out(base, tmp_path) -> Path:
    """A copy of ``base`` to damage."""
    return Path(shutil.copytree(base, tmp_path / "out", symlinks=True))


def verify(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "finetune", "verify", str(path)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=120,
    )


def resume(out: Path) -> str:
    """`--resume_from_checkpoint auto` for one more step than the base run; must finish (exit 0).
    Returns the output."""
    code, output = train(out, "--resume_from_checkpoint", "auto", max_steps=STEPS + 1)
    assert code == 0, output[-4000:]
    return output


def resumed_from(out: Path, base: Path) -> int:
    """The step a finished resume continued from: the newest step whose checkpoint is still the
    base run's own (same save id); every later one was saved again by the resumed run, its parent
    chain leading back to that step."""
    assert read_manifest(out / f"global_step{STEPS + 1}"), (
        "the resumed run did not commit its checkpoints"
    )
    for step in range(STEPS, 0, -1):
        mine = read_manifest(out / f"global_step{step}")
        assert mine, f"global_step{step} has no manifest after the resume"
        if mine["save_id"] == read_manifest(base / f"global_step{step}")["save_id"]:
            return step
        assert mine["parent"] == f"global_step{step - 1}", mine
    raise AssertionError("no checkpoint of the base run is left")


def train_rows(out: Path) -> list[dict]:
    """metrics.jsonl's training rows; every line must be a whole JSON object."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


def set_aside(out: Path) -> list[str]:
    return (
        sorted(p.name.split("-")[0] for p in (out / ".abandoned").iterdir())
        if (out / ".abandoned").exists()
        else []
    )


# --- damage inside a checkpoint: verify names it, auto walks past every damaged one ------------


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def replace_with_directory(path: Path) -> None:
    path.unlink()
    path.mkdir()
    (path / "data").write_text("not a checkpoint file")


PAYLOAD = """
import shutil, sys, torch
path, marker = sys.argv[1], sys.argv[2]

class CopiesAFile:  # unpickling it calls shutil.copyfile: code run by loading the file
    def __reduce__(self):
        return shutil.copyfile, (path, marker)

state = torch.load(path, weights_only=True)
state["extra"] = CopiesAFile()
torch.save(state, path)
"""


def plant(folder: Path, marker: Path, reseal: bool) -> None:
    """Code into every rank's model states of ``folder``; ``reseal``: the manifest updated to
    match, as whoever crafted the checkpoint would do."""
    for r in range(WORLD):
        path = folder / RANK_FILE.format(r=r, kind="model")
        subprocess.run(
            [sys.executable, "-c", PAYLOAD, str(path), str(marker)], check=True, env=child_env()
        )
    if reseal:
        manifest = read_manifest(folder)
        for name in manifest["files"]:
            size, digest = hash_file(folder / name)
            manifest["files"][name] = {"size": size, "checksum": digest}
        (folder / "manifest.json").write_text(json.dumps(manifest))


def _damage_file(name: str, how):
    return lambda folder, marker: how(folder / name)


def _no_manifest(folder: Path, marker: Path) -> None:
    (folder / "manifest.json").unlink()


# One kind of damage per checkpoint, global_step8 first: (name, damage(folder, marker), what
# `finetune verify FOLDER` says about it). Resume unpickles DeepSpeed's files only after they
# verified (the planted code with stale sizes is skipped as damage, never loaded), and a planted
# file whose manifest was updated to match is refused by the allow-list, not run.
DAMAGED = [
    (
        "truncated",
        _damage_file(RANK_FILE.format(r=1, kind="optim"), truncate),
        RANK_FILE.format(r=1, kind="optim") + ": size",
    ),
    (
        "flipped_byte",
        _damage_file(RANK_FILE.format(r=0, kind="model"), flip),
        RANK_FILE.format(r=0, kind="model") + ": checksum mismatch",
    ),
    (
        "missing_rank_file",
        _damage_file(RANK_FILE.format(r=1, kind="model"), Path.unlink),
        RANK_FILE.format(r=1, kind="model") + ": missing",
    ),
    (
        "directory_for_a_file",
        _damage_file(RANK_FILE.format(r=1, kind="optim"), replace_with_directory),
        RANK_FILE.format(r=1, kind="optim") + ": ",
    ),
    ("missing_manifest", _no_manifest, "manifest.json missing"),
    (
        "planted_code",
        lambda folder, marker: plant(folder, marker, reseal=False),
        RANK_FILE.format(r=0, kind="model") + ": size",
    ),
    (
        "planted_code_resealed",
        lambda folder, marker: plant(folder, marker, reseal=True),
        "refused to unpickle shutil.copyfile",
    ),
]
assert len(DAMAGED) == STEPS - 1


def test_auto_resume_walks_past_every_kind_of_damage(base, out, tmp_path):
    marker = tmp_path / "code-ran"
    for i, (case, damage, says) in enumerate(DAMAGED):
        folder = out / f"global_step{STEPS - i}"
        damage(folder, marker)
        r = verify(folder)
        assert r.returncode == 1 and says in r.stdout, (case, r.stdout + r.stderr)
        if case != "missing_manifest":
            assert f"DAMAGED {folder}" in r.stdout, (case, r.stdout)
        if i == 0:  # the output dir checks its newest committed checkpoint
            r = verify(out)
            assert r.returncode == 1 and f"DAMAGED {folder}" in r.stdout, r.stdout + r.stderr
    r = verify(out)  # the newest with a manifest is damaged; the one without one is named
    assert r.returncode == 1 and "note: global_step4: no readable manifest.json" in r.stdout, (
        r.stdout
    )
    assert verify(out / "global_step1").returncode == 0

    output = resume(out)
    assert not marker.exists(), "unpickling a checkpoint ran its code"
    assert resumed_from(out, base) == 1, output[-4000:]
    # every damaged folder is kept as evidence, set aside rather than overwritten
    assert set_aside(out) == sorted(f"global_step{s}" for s in range(2, STEPS + 1))
    assert [r["step"] for r in train_rows(out)] == list(range(1, STEPS + 2))
    assert verify(out).returncode == 0


def test_every_checkpoint_damaged_exits_2_and_changes_nothing(out):
    tags = sorted(p.name for p in out.glob("global_step*"))
    for tag in tags:
        flip(out / tag / RANK_FILE.format(r=1, kind="optim"))
    before = {p.name: read_manifest(p) for p in out.iterdir() if p.is_dir()}
    code, output = train(out, "--resume_from_checkpoint", "auto", max_steps=STEPS + 1)
    assert code == 2 and all(tag in output for tag in tags), output[-4000:]
    # nothing moved or saved
    assert {p.name: read_manifest(p) for p in out.iterdir() if p.is_dir()} == before


def test_resume_never_runs_code_from_a_checkpoint_that_verifies(out, tmp_path):
    """Sizes and checksums match: only the classes it names give it away. An explicit resume
    refuses it (exit 2) without running it; auto skips it like damage (the test above)."""
    marker = tmp_path / "code-ran"
    newest = out / f"global_step{STEPS}"
    plant(newest, marker, reseal=True)
    code, output = train(out, "--resume_from_checkpoint", str(newest), max_steps=STEPS + 1)
    assert not marker.exists(), "unpickling the checkpoint ran its code"
    assert code == 2 and "refused to unpickle shutil.copyfile" in output, output[-4000:]


# --- the output dir around the checkpoints: verify notes it, auto repairs it ----------------------


def test_output_dir_repairs_latest_staging_and_a_torn_metrics_line(base, out):
    """`latest` naming a missing tag (resume follows the commit order, not `latest`), a stale
    staging folder a crashed save left, and a torn last line of metrics.jsonl (a crash mid-append):
    verify notes each, and one resume repairs all three from the newest checkpoint."""
    (out / "latest").write_text("global_step99\n")
    staged = out / ".staging" / f"global_step{STEPS + 1}"
    staged.mkdir(parents=True)
    (staged / RANK_FILE.format(r=0, kind="model")).write_bytes(b"half a save")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "loss": 6.2')
    r = verify(out)
    assert r.returncode == 0, r.stdout + r.stderr
    for note in (
        "note: latest: names global_step99",
        f"note: .staging/global_step{STEPS + 1}: left by a crashed save",
        "note: metrics.jsonl: 1 torn line(s)",
    ):
        assert note in r.stdout, r.stdout
    resume(out)
    assert resumed_from(out, base) == STEPS
    assert (out / "latest").read_text().strip() == f"global_step{STEPS + 1}"
    assert not (out / ".staging").exists()
    assert verify(out / f"global_step{STEPS + 1}").returncode == 0
    # every line whole again
    assert [r["step"] for r in train_rows(out)] == list(range(1, STEPS + 2))


# --- safe loading ---------------------------------------------------------------------------------


def test_real_rank_files_need_nothing_beyond_the_allow_list(base):
    """If a DeepSpeed upgrade pickles a new class, this names it (and export/resume would refuse
    it)."""
    files = sorted(base.glob("global_step*/*_states.pt"))
    assert len(files) == STEPS * 2 * WORLD
    for path in files:
        safe_load.check_globals(path)
        safe_load.load(path, "cpu", inert=True)
