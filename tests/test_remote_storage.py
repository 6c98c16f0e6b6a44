"""S3Storage (finetune/io/remote.py) against a real S3 server: SeaweedFS on loopback, started for
this module (~3 s). The Storage contract LocalStorage keeps, as far as an object store can (no
rename: a remote commit is the manifest uploaded last), checksums kept in object metadata, multipart
uploads, and the one-line errors for a URI that cannot be used."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from s3_server import require_s3

from finetune.io.durable import hash_file
from finetune.io.remote import CHECKSUM_KEY, RemoteError, S3Storage, S3Uri, is_remote
from finetune.io.storage import Storage

require_s3()  # skips the module without boto3 or the `weed` binary

BUCKET = "ckpt"


@pytest.fixture
def storage(aws_env, request) -> S3Storage:
    # a prefix of its own per test: the bucket is shared by the module
    return S3Storage(f"s3://{BUCKET}/t/{request.node.name}")


def test_uris():
    assert S3Uri.parse("s3://b/p/q/") == S3Uri("b", "p/q")
    assert S3Uri.parse("s3://b") == S3Uri("b", "")
    assert S3Uri("b", "p").key("x/y") == "p/x/y" and S3Uri("b", "").key("x") == "x"
    assert is_remote("s3://b/p") and not is_remote("/local/out")
    for bad, says in (("gs://b/p", "unsupported scheme gs://"), ("s3:///p", "no bucket name")):
        with pytest.raises(RemoteError, match=says):
            S3Uri.parse(bad)


def test_the_contract(storage):
    assert isinstance(storage, Storage)
    assert storage.local_path("x") is None
    storage.makedirs("a/b")  # nothing: folders are prefixes
    storage.write_bytes("a/b/f", b"12345")
    assert storage.stat("a/b/f").size == 5 and not storage.stat("a/b/f").is_dir
    assert storage.stat("a").is_dir and storage.stat("missing") is None
    storage.write_bytes("a/g", b"1")
    assert [(e.name, e.is_dir) for e in storage.list("a")] == [("b", True), ("g", False)]
    assert storage.list("missing") == []
    assert storage.read_bytes("a/b/f") == b"12345" and storage.read_bytes("a/none") is None
    size, digest = storage.checksum("a/b/f")
    assert size == 5 and len(digest) == 32
    storage.replace_bytes("a/b/f", b"new")
    assert storage.read_bytes("a/b/f") == b"new"
    assert storage.checksum("a/b/f")[0] == 3
    walked = list(storage.walk("a"))
    assert walked == [("a/b", [], ["f"]), ("a", ["b"], ["g"])], "deepest folder first"
    with pytest.raises(OSError):
        storage.remove("a/b")  # not empty
    for rel in ("a/b/f", "a/g", "a/b", "a", "a"):  # folders go with their keys; missing: nothing
        storage.remove(rel)
    assert storage.list() == [] and storage.stat("a") is None
    assert storage.describe("x/y").startswith("s3://ckpt/t/") and storage.describe("x/y").endswith(
        "/x/y"
    )
    with pytest.raises(OSError, match="no atomic rename"):
        storage.rename("a", "c")
    assert storage.exchange("a", "c") is False


def test_checksums_match_a_local_file_and_come_from_metadata_without_a_download(storage, tmp_path):
    local = tmp_path / "f.bin"
    local.write_bytes(os.urandom(40 << 20) + b"tail")  # over the 16 MiB part size: multipart
    want = hash_file(local)
    storage.upload_file(local, "ckpt/f.bin", want[1])
    head = storage.head("ckpt/f.bin")
    assert head["Metadata"][CHECKSUM_KEY] == want[1] and head["ContentLength"] == want[0]
    assert "-" in head["ETag"], "uploaded in parts"
    assert storage.checksum("ckpt/f.bin") == want
    assert storage.hash_object("ckpt/f.bin") == want, "the stored bytes, downloaded and hashed"
    back = tmp_path / "back.bin"
    storage.download_file("ckpt/f.bin", back)
    assert hash_file(back) == want
    storage.write_bytes("small", b"abc")
    assert storage.checksum("small") == hash_file(_file(tmp_path / "s", b"abc"))


def test_an_object_without_our_metadata_is_hashed_from_its_bytes(storage, server, tmp_path):
    server.client().put_object(Bucket=BUCKET, Key=storage.uri.key("foreign"), Body=b"xyz")
    assert storage.checksum("foreign") == hash_file(_file(tmp_path / "x", b"xyz"))
    with pytest.raises(FileNotFoundError):
        storage.checksum("nothing")


def test_a_wrong_credential_is_refused(server, monkeypatch):
    for k, v in server.env(AWS_SECRET_ACCESS_KEY="wrong").items():
        monkeypatch.setenv(k, v)
    from botocore.exceptions import ClientError

    with pytest.raises(ClientError):
        S3Storage(f"s3://{BUCKET}/x").write_bytes("probe", b"1")


def test_without_the_client_package_the_error_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "boto3", None)
    with pytest.raises(RemoteError, match="pip install boto3"):
        S3Storage("s3://b/p")


def _file(path, data: bytes):
    path.write_bytes(data)
    return path


def test_verify_of_an_unreachable_endpoint_is_one_line_exit_2(tmp_path):
    from s3_server import free_ports

    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_ports(1)[0]}",  # nothing listens
        "AWS_ACCESS_KEY_ID": "k",
        "AWS_SECRET_ACCESS_KEY": "s",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "finetune", "verify", "s3://ckpt/run"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "s3://ckpt/run: cannot read it" in lines[0], proc.stderr
