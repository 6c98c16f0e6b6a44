"""A run that loses its output dir's lease to another run (it stalled longer than the other watched)
stops at the next step boundary with exit code 3 and writes nothing more there: 2 real ranks."""

from __future__ import annotations

import json
import os
import re

import pytest

from finetune.exit_status import EXIT_LEASE_LOST, EXIT_STATUS
from finetune.io import seams
from finetune.lease import LEASE, identity

from conftest import last_logged_step, wait_until

pytestmark = pytest.mark.distributed
# Exit 3 through DeepSpeed's launcher, which passes a rank's exit code on (torchrun reports 1).

TIMEOUT = 420


def _write(path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".planted")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def test_a_run_that_lost_its_lease_stops_with_exit_3_and_touches_nothing(start_finetune):
    """The review's split brain: the lost lease was read once per save, before the manifest; the run
    trained on, appended rows and events, and finally overwrote the new holder's exit_status.json.
    Here another run (this test process, alive) takes the lease over mid-run, with its own
    exit_status.json: the run must stop at the next boundary, exit 3 on every rank, and leave the
    lease, exit_status.json and the checkpoints as the new holder has them."""
    run = start_finetune(
        "--max_steps",
        "2000",
        "--logging_steps",
        "1",
        "--eval_steps",
        "100000",
        "--save_checkpoint",
        "--save_steps",
        "5",
        "--max_train_samples",
        "64",
        env={seams.LEASE_RENEW_S: "0.2"},
    )
    out = run.out_dir
    wait_until(
        lambda: (out / "latest").exists() and last_logged_step(out) >= 7,
        TIMEOUT,
        "a checkpoint and step 7",
    )
    # this process: alive, so the run must not take the lease back
    newcomer = identity("newcomer", 30.0)
    lease = (json.dumps(newcomer, indent=2) + "\n").encode()
    status = json.dumps({"exit_code": None, "reason": "running", "run_id": "newcomer"}).encode()
    _write(out / EXIT_STATUS, status)
    _write(out / LEASE, lease)
    result = run.finish(TIMEOUT)
    log = result.output[-6000:]
    assert result.returncode == EXIT_LEASE_LOST, log
    stopped = re.search(r"stopping at step (\d+) without writing anything more into", result.output)
    assert stopped, log
    step = int(stopped.group(1))
    # The new holder's files, byte for byte.
    assert (out / LEASE).read_bytes() == lease and (out / EXIT_STATUS).read_bytes() == status
    # Nothing past the step where it stopped: no row, no commit, no end event.
    assert last_logged_step(out) <= step
    committed = sorted(int(p.name.removeprefix("global_step")) for p in out.glob("global_step*"))
    assert committed and committed[-1] <= step
    assert int((out / "latest").read_text().strip().removeprefix("global_step")) <= step
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert "end" not in {e["event"] for e in events} and max(e["step"] for e in events) <= step
