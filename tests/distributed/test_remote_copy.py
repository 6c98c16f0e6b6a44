"""--remote_output_dir against a real S3 server (SeaweedFS on loopback, tests/s3_server.py): a real
2-rank run copies each committed checkpoint in the background, the manifest last, then `latest`;
every object carries the manifest's checksum; retention keeps what is not yet copied; a bucket or
credential that does not work is exit 2 before training."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from s3_server import require_s3

from finetune.io.remote import CHECKSUM_KEY, S3Storage

from conftest import (
    EMBEDDED_TOKENIZER_FILES,
    Running,
    child_env,
    finetune_cmd,
    partitioned_file_set,
    wait_until,
)

pytestmark = pytest.mark.distributed
require_s3()  # skips the module without boto3 or the `weed` binary
# Runs that fail, are killed or are signalled go through DeepSpeed's launcher, which passes
# a rank's exit code on and forwards signals its own way (torchrun reports any failure as 1);
# the others take the fixtures' torchrun.

BUCKET = "runs"
TIMEOUT = 420


COPIED = f"s3://{BUCKET}/copied"
# a constant learning rate: 6 steps and a resume to 8 train the steps an 8-step run trains
SAVES = (
    "--save_checkpoint",
    "--save_steps",
    "2",
    "--save_total_limit",
    "1",
    "--logging_steps",
    "1",
    "--lr_scheduler_type",
    "constant",
)


def _events(out) -> list[dict]:
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def copied(server, tmp_path_factory):
    """One run for the module: 6 steps, a save every 2, --save_total_limit 1, copied to COPIED."""
    tmp = tmp_path_factory.mktemp("copied")
    args = ("--max_steps", "6", *SAVES, "--remote_output_dir", COPIED)
    cmd = finetune_cmd("forked", 2, args, tmp / "out")
    return Running(cmd, tmp, child_env(server.env()), tmp / "out").finish(TIMEOUT)


def _verify(uri: str, *flags: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "finetune", "verify", uri, *flags],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )


def test_each_checkpoint_is_copied_manifest_last_with_checksums(copied, aws_env):
    r, uri = copied, COPIED
    assert r.returncode == 0, r.output[-6000:]
    remote = S3Storage(uri)
    assert remote.read_bytes("latest") == b"global_step6\n"
    local = r.out_dir / "global_step6"
    manifest = json.loads((local / "manifest.json").read_text())
    assert remote.read_bytes("global_step6/manifest.json") == (local / "manifest.json").read_bytes()
    # every file the manifest lists, with its size and checksum in the object's metadata
    assert set(manifest["files"]) == partitioned_file_set(2, EMBEDDED_TOKENIZER_FILES) - {
        "manifest.json"
    }
    for name, want in manifest["files"].items():
        head = remote.head(f"global_step6/{name}")
        assert head is not None, name
        assert head["ContentLength"] == want["size"], name
        assert head["Metadata"][CHECKSUM_KEY] == want["checksum"], name
    rank_file = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    assert remote.hash_object(f"global_step6/{rank_file}") == (
        manifest["files"][rank_file]["size"],
        manifest["files"][rank_file]["checksum"],
    ), "the bytes stored are the bytes committed"
    # Only what a commit put there: no probe objects, no half-copied folder without a manifest.
    top = {e.name for e in remote.list()}
    assert not {n for n in top if n.startswith(".probe")}, top
    # --save_total_limit 1 in the bucket too: only the newest, and no copy cut short or skipped
    assert {n for n in top if n.startswith("global_step")} == {"global_step6"}, top
    events = _events(r.out_dir)
    copied = [e["tag"] for e in events if e["event"] == "remote_checkpoint"]
    skipped = [e["tag"] for e in events if e["event"] == "remote_skipped"]
    assert copied[-1] == "global_step6" and sorted(copied + skipped) == sorted(
        {"global_step2", "global_step4", "global_step6"}
    ), events
    # --save_total_limit 1 locally; nothing it deleted was uncopied (the copy of step 6 is there)
    assert sorted(p.name for p in r.out_dir.glob("global_step*")) == ["global_step6"]


def test_a_wrong_credential_is_exit_2_naming_the_flag_before_training(
    run_finetune, server, tmp_path
):
    uri = f"s3://{BUCKET}/refused"
    r = run_finetune(
        "--max_steps",
        "2",
        "--save_checkpoint",
        "--remote_output_dir",
        uri,
        env=server.env(AWS_SECRET_ACCESS_KEY="not-the-secret"),
        timeout=TIMEOUT,
    )
    assert r.returncode == 2, r.output[-6000:]
    errors = [ln for ln in r.output.splitlines() if "finetune: error:" in ln]
    assert errors and all("--remote_output_dir" in ln and uri in ln for ln in errors), errors
    assert "not-the-secret" not in r.output, "credentials are never printed"
    assert not list(r.out_dir.glob("global_step*")) and not (r.out_dir / "metrics.jsonl").exists()


def test_verify_checks_the_remote_copy_from_metadata_and_full_by_download(copied, server, aws_env):
    env = server.env()
    ok = _verify(COPIED, env=env)  # the output dir: its newest committed checkpoint
    assert ok.returncode == 0 and ok.stdout.startswith(f"OK {COPIED}/global_step6: "), ok
    assert "(metadata)" in ok.stdout
    full = _verify(f"{COPIED}/global_step6", "--full", env=env)
    assert full.returncode == 0 and "(downloaded)" in full.stdout, full
    # Damage at rest, in a copy of the checkpoint under another prefix (the run's stays intact).
    src, dst = S3Storage(f"{COPIED}/global_step6"), S3Storage(f"s3://{BUCKET}/damaged/global_step6")
    client = server.client()
    for entry in src.list():
        client.copy_object(
            Bucket=BUCKET,
            Key=dst.uri.key(entry.name),
            CopySource={"Bucket": BUCKET, "Key": src.uri.key(entry.name)},
        )
    flipped = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    body = bytearray(src.read_bytes(flipped))
    body[len(body) // 2] ^= 0xFF  # one bit flip, same size, the metadata still says intact
    meta = src.head(flipped)["Metadata"]
    client.put_object(Bucket=BUCKET, Key=dst.uri.key(flipped), Body=bytes(body), Metadata=meta)
    damaged = f"s3://{BUCKET}/damaged/global_step6"
    assert _verify(damaged, env=env).returncode == 0, "metadata alone cannot see a bit flip"
    flip = _verify(damaged, "--full", env=env)
    assert flip.returncode == 1 and f"{flipped}: checksum mismatch" in flip.stdout, flip
    client.delete_object(Bucket=BUCKET, Key=dst.uri.key("rng_state_1.pt"))
    gone = _verify(damaged, env=env)
    assert gone.returncode == 1 and "rng_state_1.pt: missing" in gone.stdout, gone
    # A folder without its manifest is not committed: not a checkpoint to verify (exit 2) or,
    # inside an output dir, a note.
    client.delete_object(Bucket=BUCKET, Key=dst.uri.key("manifest.json"))
    dropped = _verify(f"s3://{BUCKET}/damaged", env=env)
    assert dropped.returncode == 2 and "not a checkpoint" in dropped.stderr, dropped
    client.copy_object(
        Bucket=BUCKET,
        Key=f"copied/global_step8/{flipped}",
        CopySource={"Bucket": BUCKET, "Key": src.uri.key(flipped)},
    )
    try:
        noted = _verify(COPIED, env=env)
        assert noted.returncode == 0, noted
        assert "note: global_step8: no manifest.json, so not committed remotely" in noted.stdout
    finally:
        client.delete_object(Bucket=BUCKET, Key=f"copied/global_step8/{flipped}")


def _cli(*argv: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "finetune", *argv],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )


def test_ls_and_export_take_s3_uris(copied, server, tmp_path):
    """`finetune ls s3://…` lists the bucket's checkpoints checked from metadata (`--verify`: by
    download); `finetune export s3://…/global_stepN OUT` downloads it beside OUT, checks it against
    its manifest, exports the same weights as the local checkpoint, and leaves no download."""
    from safetensors.torch import load_file

    env = server.env()
    listed = _cli("ls", COPIED, env=env)
    assert listed.returncode == 0, listed.stderr
    row = next(ln for ln in listed.stdout.splitlines() if ln.startswith("*"))
    assert row.split()[1] == "6" and row.rstrip().endswith("ok (sizes)"), listed.stdout
    assert "bucket: " in listed.stdout and "(1 committed)" in listed.stdout, listed.stdout
    full = json.loads(_cli("ls", COPIED, "--verify", "--json", env=env).stdout)
    assert [(c["tag"], c["status"], c["world_size"]) for c in full["checkpoints"]] == [
        ("global_step6", "ok (checksums)", 2)
    ]
    assert full["checkpoints"][0]["bytes"] > 0 and full["free_bytes"] is None
    refused = _cli("ls", f"s3://{BUCKET}/nothing-here", env=env)
    assert refused.returncode == 2 and "no checkpoints" in refused.stderr, refused

    remote_out, local_out = tmp_path / "from-bucket", tmp_path / "from-disk"
    got = _cli("export", f"{COPIED}/global_step6", str(remote_out), "--dtype", "fp32", env=env)
    assert got.returncode == 0, got.stdout + got.stderr
    want = _cli(
        "export", str(copied.out_dir / "global_step6"), str(local_out), "--dtype", "fp32", env=env
    )
    assert want.returncode == 0, want.stdout + want.stderr
    a, b = load_file(remote_out / "model.safetensors"), load_file(local_out / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["from-bucket", "from-disk"], (
        "the download is removed"
    )
    # the best checkpoint (the final one, evaluated at the end) is marked; export --best takes it
    assert full["best"]["tag"] == "global_step6" and full["checkpoints"][0]["best"], full
    best = _cli("export", COPIED, str(tmp_path / "best"), "--best", "--dtype", "fp32", env=env)
    assert best.returncode == 0 and "global_step6" in best.stdout, best.stdout + best.stderr
    c = load_file(tmp_path / "best" / "model.safetensors")
    assert c.keys() == b.keys() and all(c[k].equal(b[k]) for k in c)
    missing = _cli("export", f"s3://{BUCKET}/copied/global_step4", str(tmp_path / "x"), env=env)
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1, missing
    assert "not a committed checkpoint" in missing.stderr and not (tmp_path / "x").exists()


def _rows(out) -> dict[int, dict]:
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


def test_an_s3_checkpoint_named_explicitly_is_fetched_and_resumed(
    copied, server, run_finetune, tmp_path, aws_env
):
    assert copied.returncode == 0, copied.output[-3000:]
    source = f"{COPIED}/global_step6"
    out = tmp_path / "explicit"
    r = run_finetune(
        "--max_steps",
        "7",
        *SAVES,
        "--resume_from_checkpoint",
        source,
        out_dir=out,
        env=server.env(),
        timeout=TIMEOUT,
    )
    assert r.returncode == 0, r.output[-6000:]
    assert sorted(_rows(out)) == [7] and f"fetched global_step6 from {COPIED}" in r.output
    resumed = [e["from"] for e in _events(out) if e["event"] == "resume"]
    assert resumed == ["global_step6"], resumed
    # the fetched folder was committed locally (then --save_total_limit 1 retired it for step 7)
    assert [p.name for p in out.glob("global_step*")] == ["global_step7"]
    # global_step7 was never copied (no --remote_output_dir): a run given one now copies it at
    # start, from what both sides hold, and ends (already at its last step) once it is there.
    caught = f"s3://{BUCKET}/caught"
    again = run_finetune(
        "--max_steps",
        "7",
        *SAVES,
        "--resume_from_checkpoint",
        "auto",
        "--remote_output_dir",
        caught,
        out_dir=out,
        env=server.env(),
        timeout=TIMEOUT,
    )
    assert again.returncode == 0, again.output[-6000:]
    assert "global_step7 is not yet committed in" in again.output
    assert S3Storage(caught).read_bytes("latest") == b"global_step7\n"
    assert _verify(caught, "--full", env=server.env()).returncode == 0
    bad = run_finetune(
        "--max_steps",
        "7",
        *SAVES,
        "--resume_from_checkpoint",
        f"s3://{BUCKET}/nothing-here",
        out_dir=tmp_path / "bad",
        env=server.env(),
        timeout=TIMEOUT,
    )
    assert bad.returncode == 2, bad.output[-3000:]
    assert "--resume_from_checkpoint s3://runs/nothing-here: no committed checkpoint" in bad.output


def test_auto_resumes_from_the_bucket_when_the_local_checkpoints_are_gone(
    copied, server, run_finetune, tmp_path
):
    """A new allocation: an empty --output_dir, the same bucket. `auto` finds global_step6 there,
    every rank downloads its share, it is committed locally, and training continues bit for bit
    as an uninterrupted 8-step run."""
    assert copied.returncode == 0, copied.output[-3000:]
    ref = run_finetune("--max_steps", "8", *SAVES, out_dir=tmp_path / "ref", timeout=TIMEOUT)
    assert ref.returncode == 0, ref.output[-6000:]
    new = tmp_path / "new"
    r = run_finetune(
        "--max_steps",
        "8",
        *SAVES,
        "--resume_from_checkpoint",
        "auto",
        "--remote_output_dir",
        COPIED,
        out_dir=new,
        env=server.env(),
        timeout=TIMEOUT,
    )
    assert r.returncode == 0, r.output[-6000:]
    assert "fetched global_step6 from" in r.output
    resumed = [e for e in _events(new) if e["event"] == "resume"]
    assert [e["from"] for e in resumed] == ["global_step6"], resumed
    want, got = _rows(ref.out_dir), _rows(new)
    assert sorted(got) == [7, 8]
    for step in (7, 8):
        assert got[step]["loss"] == want[step]["loss"], (step, got[step], want[step])
    # and the run copied its own newest back
    env = server.env()
    assert _verify(COPIED, env=env).stdout.startswith(f"OK {COPIED}/global_step8: ")


def test_a_rank_killed_mid_copy_leaves_the_bucket_committed_and_the_next_run_finishes_it(
    server, start_finetune, run_finetune, tmp_path, aws_env
):
    """kill -9 of rank 1 while a checkpoint is half in the bucket (FINETUNE_SLOW_UPLOAD stretches
    each copy): the bucket's `latest` names a checkpoint that verifies, the half copy has no
    manifest (not a checkpoint), nothing uncopied was deleted locally; the next run copies OUT's
    newest, trains on, and the half copy is gone once a newer one is committed."""
    uri, out = f"s3://{BUCKET}/killed", tmp_path / "out"
    run = start_finetune(
        "--max_steps",
        "100000",
        *SAVES,
        "--remote_output_dir",
        uri,
        out_dir=out,
        env=server.env(FINETUNE_SLOW_UPLOAD="0.3"),
        launcher="deepspeed",
    )
    remote = S3Storage(uri)

    def half_copied() -> list[str]:
        if remote.read_bytes("latest") is None:
            return []  # a first commit first
        tags = [e.name for e in remote.list() if e.is_dir and e.name.startswith("global_step")]
        return [t for t in tags if remote.stat(f"{t}/manifest.json") is None]

    half = wait_until(half_copied, TIMEOUT, "a commit in the bucket, then a copy in flight")
    os.kill(run.rank_pids()[1], signal.SIGKILL)
    killed = run.finish(120)
    assert killed.returncode != 0, killed.output[-3000:]
    env = server.env()
    latest = remote.read_bytes("latest").decode().strip()
    ok = _verify(uri, "--full", env=env)
    assert ok.returncode == 0 and ok.stdout.startswith(f"OK {uri}/{latest}: "), ok
    assert any(remote.stat(f"{t}/manifest.json") is None and remote.list(t) for t in half)
    local = sorted((p.name for p in out.glob("global_step*")), key=lambda t: int(t[11:]))
    assert set(half) <= set(local), "a checkpoint still copying was deleted locally"
    newest = int(local[-1].removeprefix("global_step"))
    assert newest > int(latest.removeprefix("global_step"))
    # The next run: catch-up of OUT's newest, two more steps, committed in the bucket.
    again = run_finetune(
        "--max_steps",
        str(newest + 2),
        *SAVES,
        "--resume_from_checkpoint",
        "auto",
        "--remote_output_dir",
        uri,
        out_dir=out,
        env=env,
        timeout=TIMEOUT,
    )
    assert again.returncode == 0, again.output[-6000:]
    assert remote.read_bytes("latest") == f"global_step{newest + 2}\n".encode()
    assert _verify(uri, "--full", env=env).returncode == 0
    tags = [e.name for e in remote.list() if e.is_dir and e.name.startswith("global_step")]
    assert tags == [f"global_step{newest + 2}"], "half copies and older commits are gone"


def test_one_run_per_prefix_a_second_is_exit_2_and_a_run_that_lost_the_prefix_stops(
    server, start_finetune, run_finetune, tmp_path, aws_env
):
    """While a run copies to a prefix, a second run given the same --remote_output_dir (its own
    --output_dir) exits 2 naming the first. When another run takes the prefix's lease over (as
    one does from a holder it judged dead), the first learns it within a heartbeat, commits
    nothing more there and stops with exit 3; OUT's exit_status.json says why, and its release
    leaves the other run's lease in place."""
    from finetune.lease import encode, identity
    from finetune.remote.lease import LEASE, holder

    uri = f"s3://{BUCKET}/leased"
    first = start_finetune(
        "--max_steps",
        "100000",
        *SAVES,
        "--remote_output_dir",
        uri,
        out_dir=tmp_path / "a",
        env=server.env(FINETUNE_SLOW_UPLOAD="0.2", FINETUNE_LEASE_RENEW_S="1"),
        launcher="deepspeed",
    )
    remote = S3Storage(uri)
    wait_until(lambda: remote.read_bytes("latest"), TIMEOUT, "the first run's first commit")
    run_id = holder(remote)["run_id"]
    second = run_finetune(
        "--max_steps",
        "2",
        *SAVES,
        "--remote_output_dir",
        uri,
        out_dir=tmp_path / "b",
        nprocs=1,
        env=server.env(),
        timeout=TIMEOUT,
    )
    assert second.returncode == 2, second.output[-6000:]
    assert f"--remote_output_dir {uri} is in use by another run (run id {run_id}," in second.output
    assert not list(second.out_dir.glob("global_step*"))
    # another run takes the prefix over
    remote.write_bytes(LEASE, encode({**identity("taker", 30.0), "host": "node-elsewhere"}))
    taken_at = remote.read_bytes("latest").decode().strip()
    stopped = first.finish(TIMEOUT)
    assert stopped.returncode == 3, stopped.output[-6000:]
    assert f"another run took over {uri}'s lease (run id taker" in stopped.output
    status = json.loads((stopped.out_dir / "exit_status.json").read_text())
    assert status["exit_code"] == 3 and status["reason"] == "remote lease lost", status
    assert holder(remote)["run_id"] == "taker", "the taker's lease is not deleted"
    # at most the one commit whose lease check came before the takeover
    now = remote.read_bytes("latest").decode().strip()
    assert int(now[11:]) - int(taken_at[11:]) <= 2, (taken_at, now)


def test_a_step_saved_again_on_a_new_timeline_is_uncommitted_before_its_objects_change(
    server, run_finetune, start_finetune, tmp_path, aws_env
):
    """A run resumed from an older checkpoint saves a step the bucket already holds from the
    abandoned timeline: that commit was set aside at the start (its manifest moved to
    .abandoned/), before any of its objects is overwritten, so at no instant does the bucket hold
    a manifest whose objects do not match it; the new commit then lands under the same tag."""
    from finetune.remote.verify import check

    uri, out = f"s3://{BUCKET}/timelines", tmp_path / "out"
    saves = ("--save_checkpoint", "--save_steps", "2", "--logging_steps", "1")
    first = run_finetune(
        "--max_steps",
        "4",
        *saves,
        "--remote_output_dir",
        uri,
        out_dir=out,
        env=server.env(),
        timeout=TIMEOUT,
    )
    assert first.returncode == 0, first.output[-6000:]
    remote = S3Storage(uri)
    old = json.loads(remote.read_bytes("global_step4/manifest.json"))["save_id"]
    again = start_finetune(
        "--max_steps",
        "4",
        *saves,
        "--remote_output_dir",
        uri,
        "--resume_from_checkpoint",
        str(out / "global_step2"),
        out_dir=out,
        env=server.env(FINETUNE_SLOW_UPLOAD="0.2"),
    )
    seen_mismatch, polls = [], 0
    while again.proc.poll() is None:
        found = remote.read_bytes("global_step4/manifest.json")
        if found is not None and json.loads(found)["save_id"] == old:
            problems = check(remote, "global_step4", False)[0]
            if problems and remote.read_bytes("global_step4/manifest.json") == found:
                seen_mismatch.append(problems)
        polls += 1
    r = again.finish(60)
    assert r.returncode == 0, r.output[-6000:]
    assert polls > 5 and not seen_mismatch, seen_mismatch[:2]
    assert f"set aside in {uri}, a timeline this resume leaves: global_step4-{old}" in r.output
    assert remote.read_bytes(f".abandoned/global_step4-{old}/manifest.json") is not None
    new = json.loads((out / "global_step4" / "manifest.json").read_text())["save_id"]
    assert (
        new != old and json.loads(remote.read_bytes("global_step4/manifest.json"))["save_id"] == new
    )
    assert _verify(f"{uri}/global_step4", "--full", env=server.env()).returncode == 0
