"""Damage at rest, on real 2-rank checkpoints: `finetune verify` names each kind of damage, and
`--resume_from_checkpoint auto` skips it (falls back to the older intact checkpoint) or repairs it,
as docs/CHECKPOINTS.md "Resume" and "Verify" say, and finishes. Nothing hangs: every run has a short
--ddp_timeout and a wall-clock limit. Also: resume unpickles DeepSpeed's files only after they
verified, and the real rank files need nothing beyond the allow-list
(finetune/offline/safe_load.py).

One 2-rank run makes the checkpoints (global_step1, global_step2); each case damages a copy.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from finetune.checkpoint.manifest import read_manifest
from finetune.io.durable import hash_file
from finetune.offline import safe_load

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
    cmd = launcher_cmd("deepspeed", WORLD) + [
        *TRAIN,
        "--max_steps",
        str(max_steps),
        "--output_dir",
        str(out),
        *extra,
    ]
    r = Running(cmd, out.parent, child_env()).finish(RUN_TIMEOUT)
    return r.returncode, r.output


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """An output dir with two committed 2-rank checkpoints: global_step1, global_step2."""
    out = tmp_path_factory.mktemp("at_rest") / "out"
    code, output = train(out)
    assert code == 0, output[-4000:]
    assert read_manifest(out / "global_step1") and read_manifest(out / "global_step2")
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
    code, output = train(out, "--resume_from_checkpoint", "auto", max_steps=3)
    assert code == 0, output[-4000:]
    return output


def resumed_from(out: Path, base: Path) -> int:
    """The step a finished resume continued from: 2 if global_step2 is still the base run's own
    (same save id), else 1 (the damaged global_step2 was set aside and saved again from step 1)."""
    mine = read_manifest(out / "global_step2")
    assert mine and read_manifest(out / "global_step3"), (
        "the resumed run did not commit its checkpoints"
    )
    if mine["save_id"] == read_manifest(base / "global_step2")["save_id"]:
        return 2
    assert mine["parent"] == "global_step1"
    return 1


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


# --- damage inside the newest checkpoint: verify names it, auto falls back to global_step1 --------


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


DAMAGE = {  # name: (file of global_step2, what is done to it, what verify says about it)
    "truncated": (RANK_FILE.format(r=1, kind="optim"), truncate, "size"),
    "flipped_byte": (RANK_FILE.format(r=0, kind="model"), flip, "checksum mismatch"),
    "missing_rank_file": (RANK_FILE.format(r=1, kind="model"), Path.unlink, "missing"),
    "directory_for_a_file": (RANK_FILE.format(r=1, kind="optim"), replace_with_directory, ""),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_newest_checkpoint(base, out, case):
    name, damage, says = DAMAGE[case]
    damage(out / "global_step2" / name)
    # the output dir checks its newest committed checkpoint
    for target in (out, out / "global_step2"):
        r = verify(target)
        assert r.returncode == 1 and f"DAMAGED {out / 'global_step2'}" in r.stdout, (
            r.stdout + r.stderr
        )
        assert f"{name}: {says}" in r.stdout, r.stdout
    assert verify(out / "global_step1").returncode == 0

    resume(out)
    assert resumed_from(out, base) == 1 and set_aside(out) == ["global_step2"]  # kept as evidence
    assert [r["step"] for r in train_rows(out)] == [1, 2, 3]
    assert verify(out).returncode == 0


def test_missing_manifest(base, out):
    """A folder without its manifest was never committed (or lost it): verify names it, auto ignores
    it."""
    (out / "global_step2" / "manifest.json").unlink()
    r = verify(out / "global_step2")
    assert r.returncode == 1 and "manifest.json missing" in r.stdout, r.stdout
    r = verify(out)  # its newest committed checkpoint is intact; the folder is named
    assert r.returncode == 0 and f"OK {out / 'global_step1'}" in r.stdout, r.stdout
    assert "note: global_step2: no readable manifest.json" in r.stdout, r.stdout

    resume(out)
    assert resumed_from(out, base) == 1
    assert verify(out).returncode == 0


def test_every_checkpoint_damaged_exits_2_and_changes_nothing(out):
    for tag in ("global_step1", "global_step2"):
        flip(out / tag / RANK_FILE.format(r=1, kind="optim"))
    before = {p.name: read_manifest(p) for p in out.iterdir() if p.is_dir()}
    code, output = train(out, "--resume_from_checkpoint", "auto", max_steps=3)
    assert code == 2 and "global_step1" in output and "global_step2" in output, output[-4000:]
    # nothing moved or saved
    assert {p.name: read_manifest(p) for p in out.iterdir() if p.is_dir()} == before


# --- the output dir around the checkpoints: verify notes it, auto repairs it ----------------------


def test_latest_naming_a_missing_tag(base, out):
    (out / "latest").write_text("global_step9\n")
    r = verify(out)
    assert r.returncode == 0 and "note: latest: names global_step9" in r.stdout, r.stdout
    resume(out)
    assert resumed_from(out, base) == 2  # the commit order, not `latest`
    assert (out / "latest").read_text().strip() == "global_step3"


def test_stale_staging_folder(base, out):
    staged = out / ".staging" / "global_step3"
    staged.mkdir(parents=True)
    (staged / RANK_FILE.format(r=0, kind="model")).write_bytes(b"half a save")
    r = verify(out)
    assert (
        r.returncode == 0 and "note: .staging/global_step3: left by a crashed save" in r.stdout
    ), r.stdout
    resume(out)
    assert resumed_from(out, base) == 2
    assert not (out / ".staging").exists() and verify(out / "global_step3").returncode == 0


def test_torn_last_line_of_metrics(base, out):
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 6.2')  # a crash mid-append
    r = verify(out)
    assert r.returncode == 0 and "note: metrics.jsonl: 1 torn line(s)" in r.stdout, r.stdout
    resume(out)
    assert resumed_from(out, base) == 2
    assert [r["step"] for r in train_rows(out)] == [1, 2, 3]  # every line whole again


# --- safe loading on resume ---------------------------------------------------------------------

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


def plant(out: Path, marker: Path, reseal: bool) -> None:
    """Code into every rank's model states of global_step2; ``reseal``: the manifest updated to
    match, as whoever crafted the checkpoint would do."""
    folder = out / "global_step2"
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


def test_resume_unpickles_only_after_verification(base, out, tmp_path):
    marker = tmp_path / "code-ran"
    plant(out, marker, reseal=False)
    r = verify(out)
    assert r.returncode == 1 and f"{RANK_FILE.format(r=0, kind='model')}: size" in r.stdout, (
        r.stdout
    )
    resume(out)  # skipped as damaged: never loaded
    assert resumed_from(out, base) == 1 and not marker.exists()


def test_resume_never_runs_code_from_a_checkpoint_that_verifies(base, out, tmp_path):
    marker = tmp_path / "code-ran"
    # sizes and checksums match: only the classes it names give it away
    plant(out, marker, reseal=True)
    r = verify(out)
    assert r.returncode == 1 and "refused to unpickle shutil.copyfile" in r.stdout, r.stdout
    code, output = train(out, "--resume_from_checkpoint", str(out / "global_step2"), max_steps=3)
    assert not marker.exists(), "unpickling the checkpoint ran its code"
    assert code == 2 and "refused to unpickle shutil.copyfile" in output, output[-4000:]
    resume(out)  # auto: skipped like damage
    assert resumed_from(out, base) == 1 and not marker.exists()


def test_real_rank_files_need_nothing_beyond_the_allow_list(base):
    """If a DeepSpeed upgrade pickles a new class, this names it (and export/resume would refuse
    it)."""
    files = sorted(base.glob("global_step*/*_states.pt"))
    assert len(files) == 2 * 2 * WORLD
    for path in files:
        safe_load.check_globals(path)
        safe_load.load(path, "cpu", inert=True)
