"""Multipart uploads left pending in a real bucket (SeaweedFS on loopback): a failed transfer aborts
its own (io/remote.py's upload_file, through the transfer manager); one cut off with its process is
named by `finetune ls s3://` (remote/verify.py's notes) and aborted by the next run's start when it
began before that run took the prefix's lease (remote/prefix.py)."""

from __future__ import annotations

import logging
import time

import pytest
from s3_server import require_s3

from finetune.io.remote import PendingUpload, S3Storage
from finetune.remote.lease import LEASE
from finetune.remote.prefix import UPLOAD_MARGIN_S, abort_stale_uploads, open_remote
from finetune.remote.verify import notes

require_s3()  # skips the module without boto3 or the `weed` binary

BUCKET = "multipart"
PART = b"x" * 1024


@pytest.fixture
def prefix(server, monkeypatch, request, caplog) -> S3Storage:
    """An empty prefix of its own; the test is skipped when the server cannot list or abort
    multipart uploads (what everything here stands on)."""
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    for var in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    caplog.set_level(logging.INFO, logger="finetune")
    from botocore.exceptions import ClientError

    remote = S3Storage(f"s3://{BUCKET}/{request.node.name}")
    try:
        begin(remote, "probe")
        for upload in remote.pending_uploads():
            remote.abort_upload(upload)
    except ClientError as e:
        pytest.skip(f"the S3 server cannot list or abort multipart uploads: {e}")
    assert remote.pending_uploads() == []
    return remote


def begin(remote: S3Storage, rel: str) -> str:
    """A multipart upload to ``rel`` with one part stored, never completed (a run killed in the
    middle of a large file): its id."""
    key = remote.uri.key(rel)
    upload_id = remote.client.create_multipart_upload(Bucket=BUCKET, Key=key)["UploadId"]
    remote.client.upload_part(Bucket=BUCKET, Key=key, UploadId=upload_id, PartNumber=1, Body=PART)
    return upload_id


def pending(remote: S3Storage) -> list[str]:
    return [u.rel for u in remote.pending_uploads()]


def test_pending_uploads_are_listed_under_the_prefix_only(prefix):
    begin(prefix, "global_step2/model.safetensors")
    sibling = S3Storage(f"{prefix.describe()}-sibling", client=prefix.client)
    begin(sibling, "global_step2/model.safetensors")  # same start of key, another prefix
    found = prefix.pending_uploads()
    assert [u.rel for u in found] == ["global_step2/model.safetensors"]
    assert isinstance(found[0], PendingUpload) and found[0].initiated.tzinfo is not None
    assert pending(sibling) == ["global_step2/model.safetensors"]


def test_pending_uploads_are_read_page_by_page(prefix):
    ids = {begin(prefix, f"global_step2/part_{i}.pt") for i in range(3)}
    pages = prefix.client.get_paginator("list_multipart_uploads").paginate(
        Bucket=BUCKET, Prefix=f"{prefix.uri.prefix}/", PaginationConfig={"PageSize": 1}
    )
    assert sum(1 for _ in pages) >= 3  # the server pages them
    assert {u.upload_id for u in prefix.pending_uploads()} == ids


def test_ls_notes_name_the_pending_uploads_with_their_age(prefix):
    assert not any(line.startswith("multipart uploads") for line in notes(prefix))
    for i in range(5):
        begin(prefix, f"global_step4/zero_pp_rank_{i}_mp_rank_00_optim_states.pt")
    said = [line for line in notes(prefix) if line.startswith("multipart uploads")]
    assert len(said) == 1, notes(prefix)
    assert said[0].startswith("multipart uploads: 5 pending, never completed"), said
    assert "global_step4/zero_pp_rank_0_mp_rank_00_optim_states.pt (" in said[0]
    assert " s old)" in said[0] and "and 2 more" in said[0], said


def test_the_start_aborts_uploads_begun_before_the_lease_and_no_later_ones(
    prefix, tmp_path, caplog
):
    begin(prefix, "global_step2/cut_off.pt")  # an earlier run's, killed
    time.sleep(UPLOAD_MARGIN_S + 1.5)  # the server dates uploads and objects in whole seconds
    opened = open_remote(prefix.describe(), "next-run", tmp_path)
    try:
        assert pending(prefix) == []
        assert prefix.stat("global_step2/cut_off.pt") is None  # aborted, not completed
        assert "aborted 1 multipart upload(s) an earlier run left pending" in caplog.text
        taken = prefix.head(LEASE)["LastModified"]  # the lease's time, by the server's clock
        begin(prefix, "global_step4/this_runs.pt")
        assert abort_stale_uploads(prefix, taken) == []
        assert pending(prefix) == ["global_step4/this_runs.pt"]
    finally:
        opened.release()


def test_a_bucket_that_refuses_to_list_uploads_does_not_stop_the_run(prefix, tmp_path, caplog):
    from botocore.exceptions import ClientError

    def refuse(self: S3Storage, rel: str = "") -> list[PendingUpload]:
        error = {"Error": {"Code": "AccessDenied", "Message": "Access Denied"}}
        raise ClientError(error, "ListMultipartUploads")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(S3Storage, "pending_uploads", refuse)
        opened = open_remote(prefix.describe(), "next-run", tmp_path)
        opened.release()
        assert (
            notes(prefix)[-1] == "multipart uploads: the bucket refuses to list them (AccessDenied)"
        )
    assert opened.lease is not None
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any("could not abort the multipart uploads" in r.getMessage() for r in warned)


def test_a_failed_multipart_transfer_aborts_its_upload(prefix, tmp_path):
    big = tmp_path / "big.bin"
    big.write_bytes(b"\0" * (40 << 20))  # above upload_file's 16 MiB multipart threshold
    calls = []

    def fail_the_second_part(params: dict, **_: object) -> None:
        calls.append(params["PartNumber"])
        if params["PartNumber"] == 2:
            raise ConnectionResetError("cut off")

    prefix.client.meta.events.register("provide-client-params.s3.UploadPart", fail_the_second_part)
    try:
        with pytest.raises(ConnectionResetError):
            prefix.upload_file(big, "global_step2/big.bin", "0" * 32)
    finally:
        prefix.client.meta.events.unregister(
            "provide-client-params.s3.UploadPart", fail_the_second_part
        )
    assert 2 in calls
    assert pending(prefix) == []
    assert prefix.stat("global_step2/big.bin") is None
