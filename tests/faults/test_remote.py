"""Faults on the way to --remote_output_dir, against a real S3 server (SeaweedFS on loopback):
the two upload sites of the fault registry (REMOTE) on the ranks that reach them in every kind,
the server killed mid-upload and restarted, and the server down for longer than a save interval.

After each: the bucket's `latest` names a checkpoint that `finetune verify` accepts and every
remote folder with a manifest verifies (a folder without one is never resumed from); no local
checkpoint newer than the bucket's newest commit was deleted; the run ended as documented
(0 when a later copy lands; the final copy failing 6 tries is exit 1; a killed rank -9, the other
1); and the next run (`--resume_from_checkpoint auto`, same prefix) trains to the end with its
final checkpoint committed in the bucket. `make check` runs the sample; `make faults` all.
"""

from __future__ import annotations

import contextlib
import io
import json
import time
from pathlib import Path

import pytest
from s3_server import require_s3

from finetune.io import seams
from finetune.io.faults import KINDS

from conftest import wait_until
from harness import (
    DDP_TIMEOUT,
    KILLED,
    LEADER,
    REMOTE,
    RUN_TIMEOUT,
    RankRun,
    Ranks,
    output_dir_problems,
    run_ranks,
    train_args,
)

pytestmark = [pytest.mark.distributed, pytest.mark.faults]
require_s3()  # skips the module without boto3 or the `weed` binary

BUCKET = "faults"
STEPS = 3  # saves at 1, 2 and 3 (the harness saves every step); the fault at step 1's copy
# one of each site and kind family in `make check`; the rest in `make faults`
SAMPLE = {("remote.upload", 1, "eio"), ("remote.commit", 0, "error"), ("remote.upload", 0, "kill")}


def uri_for(request) -> str:
    return f"s3://{BUCKET}/{request.node.name.replace('[', '-').replace(']', '')}"


def verify(uri: str) -> tuple[int, str]:
    from finetune.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        code = main(["verify", uri])
    return code, buf.getvalue()


def bucket_problems(uri: str) -> list[str]:
    """What no fault may leave in the bucket: a `latest` naming anything but a checkpoint that
    verifies; a folder with a manifest that does not."""
    from finetune.io.remote import S3Storage

    remote, problems = S3Storage(uri), []
    latest = remote.read_bytes("latest")
    if latest is not None:
        code, text = verify(f"{uri}/{latest.decode().strip()}")
        if code != 0:
            problems.append(f"latest names {latest!r}, which does not verify: {text[-500:]}")
    for entry in remote.list():
        if entry.is_dir and remote.stat(f"{entry.name}/manifest.json") is not None:
            code, text = verify(f"{uri}/{entry.name}")
            if code != 0:
                problems.append(f"{entry.name} has a manifest but does not verify: {text[-500:]}")
    return problems


def remote_head(uri: str) -> int:
    from finetune.io.remote import S3Storage

    latest = S3Storage(uri).read_bytes("latest")
    return int(latest.decode().strip().removeprefix("global_step")) if latest else 0


def uncopied_deleted(out: Path, uri: str) -> list[str]:
    """Local checkpoints committed (events.jsonl) after the bucket's newest commit that are gone."""
    head = remote_head(uri)
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    return [
        e["tag"]
        for e in events
        if e["event"] == "checkpoint" and e["step"] > head and not (out / e["tag"]).is_dir()
    ]


def events(out: Path, kind: str) -> list[dict]:
    lines = (out / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def args(uri: str, steps: int = STEPS, *extra: str) -> tuple[str, ...]:
    return (*train_args(steps, *extra), "--remote_output_dir", uri)


def check_after(r: Ranks, uri: str) -> None:
    assert not bucket_problems(uri), bucket_problems(uri)
    assert not uncopied_deleted(r.out_dir, uri), "an uncopied local checkpoint was deleted"
    assert not output_dir_problems(r.out_dir), output_dir_problems(r.out_dir)


def resumes_to_the_end(tmp: Path, out: Path, uri: str, steps: int, env: dict) -> Ranks:
    again = run_ranks(tmp / "again", 2, args(uri, steps), out, env)
    assert again.codes == [0, 0], again.output[-6000:]
    assert remote_head(uri) == steps, "the next run's final checkpoint is committed in the bucket"
    check_after(again, uri)
    return again


def _cases():
    for site, reached_by in REMOTE.items():
        for rank in [0] if reached_by == LEADER else [0, 1]:
            for kind in KINDS:
                long = (site, rank, kind) not in SAMPLE
                yield pytest.param(
                    site,
                    rank,
                    kind,
                    id=f"{site}-{rank}-{kind}",
                    marks=[pytest.mark.faults_long] if long else [],
                )


@pytest.mark.timeout(4 * RUN_TIMEOUT)
@pytest.mark.parametrize("site,rank,kind", list(_cases()))
def test_remote_site(site, rank, kind, aws_env, tmp_path, request, fault_record):
    uri = uri_for(request)
    # each file's upload slowed: step 1's copy is still the newest complete one at a boundary
    # (of several complete, only the newest is committed: step 1's commit would be skipped)
    env = aws_env.env(**{seams.FAULT: f"{site}:{rank}:1:{kind}", seams.SLOW_UPLOAD: "0.1"})
    r = run_ranks(tmp_path, 2, args(uri), tmp_path / "out", env)
    fired = r.fired(site)
    assert fired, f"{site} was never reached\n{r.output[-4000:]}"
    if r.exited_by() is not None:
        fault_record["time_to_exit_s"] = round(r.exited_by() - fired[0], 1)
    if kind == "kill":
        assert r.codes == [KILLED if i == rank else 1 for i in range(2)], r.output[-6000:]
        assert r.exited_by() - fired[0] < 2 * DDP_TIMEOUT + 20
    else:
        # step 1's copy failed on one rank; the final checkpoint's copy landed
        assert r.codes == [0, 0], r.output[-6000:]
        assert remote_head(uri) == STEPS
        # Step 1's failure is counted at a boundary, unless step 2's commit (the newest complete
        # wins) landed before that boundary's tally: step 1 is then settled by it, as skipped.
        fate = events(r.out_dir, "remote_upload_failed") or events(r.out_dir, "remote_skipped")
        assert fate and fate[0]["tag"] == "global_step1", fate
    check_after(r, uri)
    resumes_to_the_end(tmp_path, r.out_dir, uri, STEPS + 2, aws_env.env())


def test_a_copy_that_fails_at_every_try_ends_the_run_with_exit_1(aws_env, tmp_path, request):
    """The manifest upload fails whenever it is tried (every data object landed each time): the
    final checkpoint's copy fails its 6 tries (waits shortened by the seam), the run exits 1 as for
    a failed final save, the bucket holds no checkpoint (no manifest), and every local checkpoint
    is kept."""
    uri = uri_for(request)
    env = aws_env.env(**{seams.FAULT: "remote.commit:0:error", seams.REMOTE_RETRY_S: "0.1"})
    r = run_ranks(tmp_path, 2, args(uri), tmp_path / "out", env)
    assert r.codes == [1, 1], r.output[-6000:]
    assert f"the final checkpoint global_step{STEPS} did not reach {uri}" in r.output
    assert remote_head(uri) == 0 and not bucket_problems(uri)
    assert sorted(p.name for p in r.out_dir.glob("global_step*")) == [
        f"global_step{s}" for s in range(1, STEPS + 1)
    ], "--save_total_limit 2 deleted nothing the bucket lacks"
    status = json.loads((r.out_dir / "exit_status.json").read_text())
    assert status["exit_code"] == 1, status
    check_after(r, uri)
    resumes_to_the_end(tmp_path, r.out_dir, uri, STEPS + 2, aws_env.env())


def _started(uri: str) -> bool:
    from finetune.io.remote import S3Storage

    remote = S3Storage(uri)
    return any(e.is_dir and e.name.startswith("global_step") for e in remote.list())


def test_the_server_killed_mid_upload_and_restarted(aws_env, tmp_path, request, fault_record):
    """SIGKILL of the S3 server while a copy uploads (each file slowed), back 3 s later: the copy
    in flight fails or is retried by the client, a later one lands, the run exits 0."""
    uri = uri_for(request)
    env = aws_env.env(**{seams.SLOW_UPLOAD: "0.3"})
    run = RankRun(tmp_path, 2, args(uri, 6), tmp_path / "out", env)
    wait_until(lambda: _started(uri), RUN_TIMEOUT, "a copy under way")
    aws_env.kill()
    t0 = time.monotonic()
    time.sleep(3)
    aws_env.start()
    fault_record["server_down_s"] = round(time.monotonic() - t0, 1)
    r = run.finish(RUN_TIMEOUT)
    assert r.codes == [0, 0], r.output[-6000:]
    assert remote_head(uri) == 6
    check_after(r, uri)


def test_the_server_down_across_saves(aws_env, tmp_path, request, fault_record):
    """The server stopped (SIGKILL) past the client's own retries and across three saves: the
    copies fail (kept locally, tried again while newest), training goes on committing locally (no
    step waits for the network); once it is back the newest checkpoint is copied and the run
    exits 0."""
    uri = uri_for(request)
    out = tmp_path / "out"
    # a save every step, each file's write slowed: the outage spans several saves
    env = aws_env.env(**{seams.SLOW_SAVE: "0.2"})
    run = RankRun(tmp_path, 2, args(uri, 40), out, env)
    wait_until(lambda: remote_head(uri) >= 1, RUN_TIMEOUT, "a first commit in the bucket")
    aws_env.kill()
    down_at = time.monotonic()
    before = len(events(out, "checkpoint"))

    def failing_while_saving() -> bool:
        saved = len(events(out, "checkpoint")) - before
        return bool(events(out, "remote_upload_failed")) and saved >= 3

    wait_until(failing_while_saving, RUN_TIMEOUT, "copies failing while three saves commit locally")
    fault_record["saves_while_down"] = len(events(out, "checkpoint")) - before
    aws_env.start()
    fault_record["server_down_s"] = round(time.monotonic() - down_at, 1)
    r = run.finish(RUN_TIMEOUT)
    assert r.codes == [0, 0], r.output[-6000:]
    fault_record["failed_tries"] = len(events(r.out_dir, "remote_upload_failed"))
    assert remote_head(uri) == 40
    check_after(r, uri)
