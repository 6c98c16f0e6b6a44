"""The site sweep: a fault at every named site (faults.SITES), on rank 0 and a non-zero rank, of
every kind, each in a real multi-rank run of independent ranks (no launcher kills the survivors).

Each case checks the documented exit code of every rank, that the last rank exited within
BOUND_S of the fault, that the output dir holds nothing that claims completeness falsely and a
`latest` that verifies, and that `--resume_from_checkpoint auto` then trains to the end.
`make check` runs the sample (every site once); `make faults` runs them all.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from faults.plugin import LONG_ENV

from finetune.io import seams
from finetune.io.faults import KINDS

from harness import (
    BOUND_S,
    EXPORT,
    EXPORT_SAMPLE,
    RUN_TIMEOUT,
    long_cases,
    run_case,
    run_ranks,
    sampled_cases,
    train_args,
)

pytestmark = [pytest.mark.distributed, pytest.mark.faults]

SAMPLED = set(sampled_cases())


@pytest.fixture(scope="session")
def resume_seed(tmp_path_factory):
    """An output dir holding global_step1 and global_step2 of a clean 2-rank run (copied per
    case)."""
    tmp = tmp_path_factory.mktemp("fault-seed")
    r = run_ranks(tmp, 2, train_args(2), tmp / "out")
    assert r.codes == [0, 0], r.output[-6000:]
    return tmp / "out"


def _param(case):
    return pytest.param(
        case, id=case.id, marks=[] if case in SAMPLED else [pytest.mark.faults_long]
    )


@pytest.mark.timeout(3 * RUN_TIMEOUT)
@pytest.mark.parametrize("case", [_param(c) for c in long_cases()])
def test_site(case, tmp_path, request, fault_record):
    seed = request.getfixturevalue("resume_seed") if case.scenario != "fresh" else None
    long = os.environ.get(LONG_ENV) == "1"
    fault_record.update(run_case(case, tmp_path, seed, resume="always" if long else "if_changed"))


@pytest.mark.parametrize(
    "kind", [pytest.param(k, marks=[] if k == "eio" else [pytest.mark.faults_long]) for k in KINDS]
)
def test_verify_command_reports_a_file_it_cannot_read(kind, request, fault_record):
    """`finetune verify` (one process): a read that fails is damage (exit 1), never a pass."""
    folder = request.getfixturevalue("resume_seed") / "global_step2"
    env = {**os.environ, seams.FAULT: f"verify.read_file:0:{kind}"}
    proc = subprocess.run(
        [sys.executable, "-m", "finetune", "verify", str(folder)],
        capture_output=True,
        text=True,
        env=env,
        timeout=BOUND_S,
    )
    assert proc.returncode == (-9 if kind == "kill" else 1), proc.stdout + proc.stderr
    if kind in ("eio", "enospc"):
        assert "DAMAGED" in proc.stdout and "unreadable (OSError" in proc.stdout, proc.stdout
    clean = subprocess.run(
        [sys.executable, "-m", "finetune", "verify", str(folder)], capture_output=True, text=True
    )
    assert clean.returncode == 0, clean.stdout + clean.stderr


def _export(folder, out, env=None):
    return subprocess.run(
        [sys.executable, "-m", "finetune", "export", str(folder), str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=BOUND_S,
    )


@pytest.mark.parametrize(
    "site,kind",
    [
        pytest.param(
            site, kind, marks=[] if EXPORT_SAMPLE[site] == kind else [pytest.mark.faults_long]
        )
        for site in EXPORT
        for kind in KINDS
    ],
)
def test_export_site(site, kind, request, tmp_path, fault_record):
    """`finetune export` failing at each of its sites: the documented exit code, one line for an I/O
    error, OUT never created, and a rerun that removes the staging a kill left and exports."""
    folder = request.getfixturevalue("resume_seed") / "global_step2"
    out = tmp_path / "hf"
    start = time.time()
    proc = _export(folder, out, {seams.FAULT: f"{site}:0:2:{kind}"})
    fault_record["time_to_exit_s"] = round(time.time() - start, 2)
    log = proc.stdout + proc.stderr
    assert f"injecting {kind} at {site}" in proc.stderr, log
    assert proc.returncode == EXPORT[site][kind], log
    if kind in ("eio", "enospc"):
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("finetune: error:") and "Traceback" not in proc.stderr, log
    assert not out.exists(), (
        f"{site} {kind}: {out} was created: {sorted(p.name for p in out.iterdir())}"
    )
    clean = _export(folder, out)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors"))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left
