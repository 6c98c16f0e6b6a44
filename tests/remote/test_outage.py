"""A bucket that does not answer at start (remote/prefix.py): which client errors are an outage
(io.remote.transient), what counts as a restart (restarted), and reach's rule: a first start exits
2, a restart waits with backoff and then gives up with RemoteUnavailable (exit 75). One process,
no launcher; the end-to-end runs are tests/distributed/test_remote_outage.py."""

from __future__ import annotations

import time

import pytest
from s3_server import require_s3

from finetune import run_config
from finetune.cli import parse_train_args
from finetune.config import ConfigError
from finetune.io import seams
from finetune.io.remote import transient
from finetune.remote.prefix import RemoteUnavailable, Unreachable, reach, restarted

pytest.importorskip("boto3", reason="the s3 extra (boto3) is not installed")

from botocore.exceptions import (  # noqa: E402 — after the skip: boto3 is optional
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    ReadTimeoutError,
    SSLError,
)

URI = "s3://ckpt/run"
BUCKET = "outage"


def client_error(code: str, status: int) -> ClientError:
    response = {
        "Error": {"Code": code, "Message": code},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return ClientError(response, "PutObject")


def name(error: Exception) -> str:
    code = error.response["Error"]["Code"] if isinstance(error, ClientError) else ""
    return f"{type(error).__name__}{'-' if code else ''}{code}"


@pytest.mark.parametrize(
    "error",
    [
        EndpointConnectionError(endpoint_url="http://127.0.0.1:1"),
        ConnectTimeoutError(endpoint_url="http://10.0.0.1:9000"),
        ReadTimeoutError(endpoint_url="http://10.0.0.1:9000"),
        client_error("ServiceUnavailable", 503),
        client_error("InternalError", 500),
        client_error("BadGateway", 502),
        client_error("SlowDown", 503),
        ConnectionResetError("reset by peer"),
    ],
    ids=name,
)
def test_an_outage_is_transient(error):
    assert transient(error)


@pytest.mark.parametrize(
    "error",
    [
        client_error("NoSuchBucket", 404),
        client_error("AccessDenied", 403),
        client_error("InvalidAccessKeyId", 403),
        client_error("SignatureDoesNotMatch", 403),
        NoCredentialsError(),
        SSLError(endpoint_url="https://s3.example", error="certificate verify failed"),
        ValueError("not the client's"),
    ],
    ids=name,
)
def test_a_wrong_bucket_credential_or_certificate_is_not(error):
    assert not transient(error)


# --- what counts as a restart ---------------------------------------------------------------------


def test_a_requeued_job_is_a_restart(tmp_path):
    out = tmp_path / "out"  # a fresh disk: nothing in OUT says anything
    assert restarted(out, URI, {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"})
    assert restarted(out, URI, {"TORCHELASTIC_RESTART_COUNT": "2"})
    assert not restarted(out, URI, {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "0"})
    assert not restarted(out, URI, {"SLURM_RESTART_COUNT": "3"})  # no job: not SLURM's count
    assert not restarted(out, URI, {"TORCHELASTIC_RESTART_COUNT": "0"})


def test_an_output_dir_with_a_committed_checkpoint_is_a_restart(tmp_path):
    out = tmp_path / "out"
    (out / "global_step2").mkdir(parents=True)
    assert not restarted(out, URI, {})  # a folder without a manifest is no commit
    (out / "global_step2" / "manifest.json").write_text('{"files": {}}\n')
    assert restarted(out, URI, {})


@pytest.mark.parametrize("flag", ["--remote_output_dir", "--resume_from_checkpoint"])
def test_an_output_dir_whose_run_config_names_the_prefix_is_a_restart(tmp_path, flag):
    out = tmp_path / "out"
    out.mkdir()
    cfg = parse_train_args(
        ["--max_steps", "2", "--save_checkpoint", "--output_dir", str(out), flag, URI + "/"]
    )
    run_config.write(cfg, str(out), "test")
    assert restarted(out, URI, {})
    assert not restarted(out, "s3://ckpt/another-run", {})


# --- reach: retried on a restart, exit 2 on a first start ----------------------------------------


class Bucket:
    """A start-up step whose bucket is down for its first ``down`` calls."""

    def __init__(self, down: int, error: Exception | None = None):
        self.down = down
        self.calls = 0
        self.error = error or Unreachable(f"--remote_output_dir {URI}: cannot write there (down)")

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.down:
            raise self.error
        return "opened"


@pytest.fixture
def requeued(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    monkeypatch.setattr("finetune.remote.prefix.FIRST_RETRY_S", 0.05)
    return tmp_path / "out"


@pytest.fixture
def first_start(tmp_path, monkeypatch):
    for var in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path / "out"


def test_a_restart_waits_for_the_bucket_to_come_back(requeued, monkeypatch):
    monkeypatch.setenv(seams.REMOTE_WAIT_S, "30")
    bucket = Bucket(down=3)
    assert reach(bucket, URI, requeued) == "opened"
    assert bucket.calls == 4
    shared = Bucket(down=1)
    assert reach(shared, URI, requeued, on=True, share=True) == "opened"


def test_a_restart_gives_up_after_the_wait_with_remote_unavailable(requeued, monkeypatch):
    monkeypatch.setenv(seams.REMOTE_WAIT_S, "0.5")
    bucket = Bucket(down=10**6)
    began = time.monotonic()
    with pytest.raises(RemoteUnavailable, match="cannot write there .*after 0.5 s"):
        reach(bucket, URI, requeued)
    assert 0.5 <= time.monotonic() - began < 5
    assert bucket.calls >= 3  # backoff from 0.05 s: several tries within the wait


def test_a_first_start_that_cannot_reach_the_bucket_is_exit_2_at_once(first_start):
    bucket = Bucket(down=1)
    with pytest.raises(ConfigError) as e:
        reach(bucket, URI, first_start)
    assert str(e.value) == f"--remote_output_dir {URI}: cannot write there (down)"
    assert bucket.calls == 1


def test_a_wrong_bucket_on_a_restart_is_exit_2_without_waiting(requeued):
    bucket = Bucket(down=1, error=ConfigError(f"--remote_output_dir {URI}: no such bucket"))
    with pytest.raises(ConfigError, match="no such bucket"):
        reach(bucket, URI, requeued)
    assert bucket.calls == 1


# --- the lease: an attempt cut off after its PUT -------------------------------------------------


@pytest.fixture
def s3(request):
    """The real server (SeaweedFS) in this process's environment; skipped without it."""
    require_s3()
    return request.getfixturevalue("aws_env")


def test_a_retried_lease_take_adopts_the_runs_own_record(s3):
    """A restart's first try at the lease wrote it, then lost the answer; the next try finds the
    run's own record (an earlier identity): it is rewritten as this try's, not judged a live
    holder (exit 2)."""
    from finetune.io.remote import S3Storage
    from finetune.lease import encode, identity, is_ours
    from finetune.remote.lease import LEASE, acquire

    remote = S3Storage(f"s3://{BUCKET}/adopt")
    earlier = {**identity("run-1", 30.0), "started": "2000-01-01T00:00:00+00:00"}
    remote.write_bytes(LEASE, encode(earlier))
    lease = acquire(remote, "run-1", renew_s=30.0)
    try:
        assert is_ours(remote.read_tagged(LEASE)[0], lease.info)
        assert lease.check() and not lease.lost
    finally:
        lease.release()
    assert remote.read_tagged(LEASE) is None
