"""Object storage behind the ``Storage`` protocol: ``s3://bucket/prefix``.

An object store has no folders, no rename and no fsync: a key ``prefix/rel`` is a file, a folder is
the set of keys under ``prefix/rel/``, and a ``PUT`` that returned is durable and atomic (a reader
sees the old object or the new one, never a part). So ``write_bytes`` and ``replace_bytes`` are one
``PUT`` each, ``makedirs`` and ``sync`` do nothing, and ``rename``/``exchange`` are not offered
(a remote commit is the manifest uploaded last, not a rename: see docs/CHECKPOINTS.md).

Every object this module uploads carries its xxh3-128 (the manifest's checksum) in its metadata
(``x-amz-meta-xxh3``), so ``checksum`` and a remote ``verify`` read sizes and checksums without
downloading; ``verify --full`` downloads and hashes.

Credentials and the endpoint come the standard AWS way (the environment, ``~/.aws``,
``AWS_PROFILE``, ``AWS_ENDPOINT_URL``); nothing here prints or stores them. The client library
(boto3) is optional: without it an ``s3://`` URI is a one-line error naming the package.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from finetune.io.storage import Entry, Stat

SCHEMES = ("s3",)
CLIENT_PACKAGE = "boto3"
CHECKSUM_KEY = "xxh3"  # object metadata: x-amz-meta-xxh3
_MB = 1 << 20


class RemoteError(Exception):
    """A remote URI that cannot be used (scheme, missing client, bucket, credentials): one line."""


def is_remote(path: str | os.PathLike) -> bool:
    return isinstance(path, str) and "://" in path


@dataclass(frozen=True)
class S3Uri:
    bucket: str
    prefix: str  # no leading or trailing "/"; "" for the bucket's root

    @classmethod
    def parse(cls, uri: str) -> S3Uri:
        scheme, sep, rest = uri.partition("://")
        if not sep or scheme not in SCHEMES:
            raise RemoteError(
                f"{uri}: unsupported scheme {scheme + '://' if sep else '(none)'}; "
                f"supported: {', '.join(s + '://' for s in SCHEMES)}"
            )
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise RemoteError(f"{uri}: no bucket name (s3://BUCKET/PREFIX)")
        return cls(bucket, prefix.strip("/"))

    def key(self, rel: str = "") -> str:
        rel = rel.strip("/")
        return f"{self.prefix}/{rel}" if self.prefix and rel else (self.prefix or rel)

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


def make_client() -> Any:
    """A boto3 S3 client (typed by boto3 at run time only) configured by the AWS chain, with
    retries (standard mode, 5 tries) and a connection pool large enough for parallel parts."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise RemoteError(
            f"s3:// needs the {CLIENT_PACKAGE} package: pip install {CLIENT_PACKAGE}"
        ) from None
    config = Config(retries={"mode": "standard", "max_attempts": 5}, max_pool_connections=32)
    return boto3.session.Session().client("s3", config=config)


# Error codes of a service failing on its side, or asking the client to slow down.
TRANSIENT_CODES = (
    "InternalError",
    "ServiceUnavailable",
    "SlowDown",
    "RequestTimeout",
    "Throttling",
)


def transient(error: BaseException) -> bool:
    """A client error that says the service did not answer (connection refused or reset, a
    timeout) or failed on its side (5xx, throttling): an outage, as distinct from a wrong bucket,
    an access denied or a bad credential, which the service answered. A TLS failure is a
    configuration's, not an outage's."""
    try:
        from botocore.exceptions import ConnectionError as NoConnection
        from botocore.exceptions import HTTPClientError, SSLError
    except ImportError:
        return False
    if isinstance(error, SSLError):
        return False
    if isinstance(error, (NoConnection, HTTPClientError, ConnectionError, TimeoutError)):
        return True
    response = getattr(error, "response", None) or {}
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    code = response.get("Error", {}).get("Code", "")
    return (isinstance(status, int) and status >= 500) or code in TRANSIENT_CODES


def refusal(error: BaseException) -> str | None:
    """The error code of a request the service answered and refused (``AccessDenied``,
    ``NotImplemented``…): a client error that is not ``transient``; None for any other error."""
    try:
        from botocore.exceptions import ClientError
    except ImportError:
        return None
    if not isinstance(error, ClientError) or transient(error):
        return None
    return error.response.get("Error", {}).get("Code") or "refused"


def _missing(error: Exception) -> bool:
    """A client error that says the object is not there."""
    code = getattr(error, "response", {}).get("Error", {}).get("Code", "")
    return code in ("404", "NoSuchKey", "NotFound")


def _condition_failed(error: Exception) -> bool:
    """A client error that says a conditional write's condition did not hold (412), or that a
    concurrent conditional write to the same key won (409)."""
    response = getattr(error, "response", {})
    code = response.get("Error", {}).get("Code", "")
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412)


@dataclass(frozen=True)
class PendingUpload:
    """A multipart upload begun and neither completed nor aborted: its parts are stored (and
    billed) though no listing of objects shows them."""

    rel: str  # the key it uploads to, under the storage's prefix
    upload_id: str
    initiated: datetime  # by the server's clock


class S3Storage:
    """``Storage`` over ``s3://bucket/prefix``; ``rel`` paths are ``/``-separated keys under it."""

    def __init__(self, uri: str, client: Any = None):
        self.uri = S3Uri.parse(uri)
        self.client = client or make_client()

    # --- what the protocol names -----------------------------------------------------------------

    def describe(self, rel: str = "") -> str:
        key = self.uri.key(rel)
        return f"s3://{self.uri.bucket}/{key}" if key else f"s3://{self.uri.bucket}"

    def local_path(self, rel: str = "") -> None:
        return None

    def stat(self, rel: str) -> Stat | None:
        head = self.head(rel) if rel else None
        if head is not None:
            return Stat(False, head["ContentLength"], head["ContentLength"])
        return Stat(True, 0, 0) if self._has_keys(self._folder(rel)) else None

    def list(self, rel: str = "") -> list[Entry]:
        found: list[Entry] = []
        prefix = self._folder(rel)
        for page in self._pages(prefix, delimiter="/"):
            # Some S3 servers (SeaweedFS) keep listing a prefix for a while after its last key
            # went; S3 does not. A prefix counts while a key is under it (one request per
            # prefix: a checkpoint folder holds files, an output dir a few checkpoints).
            found += [
                Entry(p["Prefix"][len(prefix) :].rstrip("/"), True)
                for p in page.get("CommonPrefixes", [])
                if self._has_keys(p["Prefix"])
            ]
            found += [
                Entry(o["Key"][len(prefix) :], False)
                for o in page.get("Contents", [])
                if o["Key"] != prefix
            ]
        return sorted(found, key=lambda e: e.name)

    def walk(self, rel: str) -> Iterator[tuple[str, list[str], list[str]]]:
        tree: dict[str, tuple[set[str], list[str]]] = {rel.strip("/"): (set(), [])}
        base = self._folder("")
        for page in self._pages(self._folder(rel)):
            for obj in page.get("Contents", []):
                path = obj["Key"][len(base) :]
                parent, _, name = path.rpartition("/")
                tree.setdefault(parent, (set(), []))[1].append(name)
                while parent != rel.strip("/") and parent:
                    up, _, child = parent.rpartition("/")
                    tree.setdefault(up, (set(), []))[0].add(child)
                    parent = up
        for folder in sorted(tree, key=lambda f: (-f.count("/") - bool(f), f)):
            dirs, files = tree[folder]
            yield folder or ".", sorted(dirs), sorted(files)

    def read_bytes(self, rel: str) -> bytes | None:
        try:
            found = self.client.get_object(Bucket=self.uri.bucket, Key=self.uri.key(rel))
        except self.client.exceptions.NoSuchKey:
            return None
        return found["Body"].read()

    def write_bytes(
        self,
        rel: str,
        data: bytes,
        checksum: str | None = None,
        metadata: dict[str, str] | None = None,
    ) -> None:
        """One PUT; ``metadata``: more object metadata besides the checksum."""
        from finetune.io.durable import hash_bytes

        self.client.put_object(
            Bucket=self.uri.bucket,
            Key=self.uri.key(rel),
            Body=data,
            Metadata={CHECKSUM_KEY: checksum or hash_bytes(data), **(metadata or {})},
        )

    replace_bytes = write_bytes  # a PUT replaces atomically

    def checksum(self, rel: str) -> tuple[int, str]:
        """(size, xxh3) from the object's metadata; objects without it are downloaded and hashed."""
        head = self.head(rel)
        if head is None:
            raise FileNotFoundError(self.describe(rel))
        known = head.get("Metadata", {}).get(CHECKSUM_KEY)
        if known:
            return head["ContentLength"], known
        return self.hash_object(rel)

    def hash_object(self, rel: str) -> tuple[int, str]:
        """Download and hash (``verify --full``): the bytes as stored, not what metadata says."""
        import xxhash

        digest = xxhash.xxh3_128()
        size = 0
        body = self.client.get_object(Bucket=self.uri.bucket, Key=self.uri.key(rel))["Body"]
        for chunk in body.iter_chunks(8 * _MB):
            digest.update(chunk)
            size += len(chunk)
        return size, digest.hexdigest()

    def makedirs(self, rel: str) -> None:
        pass  # folders are key prefixes

    def rename(self, src: str, dst: str) -> None:
        raise OSError(f"{self.describe(src)}: an object store has no atomic rename")

    def exchange(self, a: str, b: str) -> bool:
        return False

    def sync(self, rel: str) -> None:
        pass  # a PUT that returned is durable

    def remove(self, rel: str) -> None:
        """A key; a "folder" (a prefix) goes with its last key, and removing one that still has
        keys fails as rmdir would."""
        if self.head(rel) is not None:
            self.client.delete_object(Bucket=self.uri.bucket, Key=self.uri.key(rel))
        elif rel and self.stat(rel) is not None:
            raise OSError(errno.ENOTEMPTY, "folder not empty", self.describe(rel))

    def remove_tree(self, rel: str) -> int:
        """Every key under folder ``rel`` (batches of 1,000); how many."""
        keys = [
            o["Key"] for page in self._pages(self._folder(rel)) for o in page.get("Contents", [])
        ]
        for i in range(0, len(keys), 1000):
            self.client.delete_objects(
                Bucket=self.uri.bucket,
                Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True},
            )
        return len(keys)

    def free_bytes(self) -> int:
        return sys.maxsize  # no quota an S3 API reports

    # --- object-store operations beyond the protocol ---------------------------------------------

    def head(self, rel: str) -> dict | None:
        """The object's HEAD (size, ETag, metadata), or None when there is none."""
        from botocore.exceptions import ClientError

        try:
            return self.client.head_object(Bucket=self.uri.bucket, Key=self.uri.key(rel))
        except ClientError as e:
            if _missing(e):
                return None
            raise

    def upload_file(
        self,
        local: str | os.PathLike,
        rel: str,
        checksum: str,
        metadata: dict[str, str] | None = None,
    ) -> None:
        """One file, multipart with parallel parts above 16 MiB (retried by the client), its
        checksum in the object's metadata; ``metadata``: more of it. A multipart transfer that
        fails, or that an exception in this thread interrupts, is aborted by the transfer manager
        itself (s3transfer's failure cleanup, registered when it creates the upload); one cut off
        with its process stays pending until ``abort_upload`` (the next run's start:
        remote/prefix.py)."""
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(
            multipart_threshold=16 * _MB, multipart_chunksize=16 * _MB, max_concurrency=8
        )
        self.client.upload_file(
            os.fspath(local),
            self.uri.bucket,
            self.uri.key(rel),
            ExtraArgs={"Metadata": {CHECKSUM_KEY: checksum, **(metadata or {})}},
            Config=config,
        )

    def download_file(self, rel: str, local: str | os.PathLike) -> None:
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(multipart_chunksize=16 * _MB, max_concurrency=8)
        self.client.download_file(
            self.uri.bucket, self.uri.key(rel), os.fspath(local), Config=config
        )

    def pending_uploads(self, rel: str = "") -> list[PendingUpload]:
        """The multipart uploads pending under folder ``rel``, oldest first (every page)."""
        base = self._folder("")
        pages = self.client.get_paginator("list_multipart_uploads").paginate(
            Bucket=self.uri.bucket, Prefix=self._folder(rel)
        )
        found = [
            PendingUpload(u["Key"][len(base) :], u["UploadId"], u["Initiated"])
            for page in pages
            for u in page.get("Uploads", [])
        ]
        return sorted(found, key=lambda u: (u.initiated, u.rel))

    def abort_upload(self, upload: PendingUpload) -> None:
        """Abort ``upload``, its stored parts deleted; one already gone is no error."""
        from botocore.exceptions import ClientError

        try:
            self.client.abort_multipart_upload(
                Bucket=self.uri.bucket, Key=self.uri.key(upload.rel), UploadId=upload.upload_id
            )
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") != "NoSuchUpload":
                raise

    # --- conditional writes: the remote lease's atomic steps -------------------------------------

    def read_tagged(self, rel: str) -> tuple[bytes, str] | None:
        """(the object's bytes, its ETag), or None when there is none."""
        try:
            found = self.client.get_object(Bucket=self.uri.bucket, Key=self.uri.key(rel))
        except self.client.exceptions.NoSuchKey:
            return None
        return found["Body"].read(), found["ETag"]

    def put_if(self, rel: str, data: bytes, etag: str | None) -> str | None:
        """PUT ``data`` only if the object is absent (``etag`` None: If-None-Match: *) or still the
        one whose ETag is ``etag`` (If-Match): its new ETag, or None when the condition failed
        (412) or a concurrent conditional write won (409)."""
        cond = {"IfMatch": etag} if etag else {"IfNoneMatch": "*"}
        try:
            done = self.client.put_object(
                Bucket=self.uri.bucket, Key=self.uri.key(rel), Body=data, **cond
            )
        except Exception as e:
            if _condition_failed(e):
                return None
            raise
        return done["ETag"]

    def delete_if(self, rel: str, etag: str) -> bool:
        """Delete the object only while its ETag is ``etag``; False when it is not (or gone)."""
        try:
            self.client.delete_object(Bucket=self.uri.bucket, Key=self.uri.key(rel), IfMatch=etag)
        except Exception as e:
            if _condition_failed(e) or _missing(e):
                return False
            raise
        return True

    def _has_keys(self, prefix: str) -> bool:
        found = self.client.list_objects_v2(Bucket=self.uri.bucket, Prefix=prefix, MaxKeys=1)
        return found.get("KeyCount", 0) > 0

    def _folder(self, rel: str) -> str:
        key = self.uri.key(rel)
        return f"{key}/" if key else ""

    def _pages(self, prefix: str, delimiter: str | None = None) -> Iterator[dict]:
        query = {"Bucket": self.uri.bucket, "Prefix": prefix}
        if delimiter:
            query["Delimiter"] = delimiter
        yield from self.client.get_paginator("list_objects_v2").paginate(**query)
