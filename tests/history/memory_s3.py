"""An S3 bucket in memory behind the part of boto3's client that ``finetune.io.remote.S3Storage``
calls, so the history explorer runs the real remote code (lineage, copy, fetch, retention, the
lease) thousands of times a minute without a server.

Only what S3Storage uses is here, with S3's answers: ``NoSuchKey`` from ``get_object``, a 404
``ClientError`` from ``head_object`` and ``download_file``, 412 ``PreconditionFailed`` from a
conditional ``put_object``/``delete_object`` whose condition fails, ETags that change with every
write, user metadata kept as given. The real server's behaviour (SeaweedFS) is tested in
tests/remote and tests/distributed; this one is for the decisions above it.

Two things a real bucket does to a run are on cue: an ``outage`` (every request fails as a
connection refused does: ``io.remote.transient``), and a process that is gone (``Process.gone``:
its requests change nothing, as a killed job's cannot). Requests from a copy's upload thread wait
for the process's main thread to let them through (``Process.turns``), so a history runs the same
way every time it is replayed.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError, EndpointConnectionError

ENDPOINT = "http://memory-s3.invalid"
COPY_THREAD = "remote-copy"  # finetune.remote.copy's upload thread


class NoSuchKey(ClientError):
    def __init__(self, key: str) -> None:
        super().__init__(
            {"Error": {"Code": "NoSuchKey", "Message": key}, "ResponseMetadata": {}}, "GetObject"
        )


def _error(code: str, status: int, operation: str) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
        operation,
    )


class ProcessGone(BaseException):
    """A request from a process the history has killed: it changes nothing, and ends the thread
    that made it (no ``except Exception`` of the code under test holds it back)."""


@dataclass
class Stored:
    data: bytes
    metadata: dict[str, str]
    etag: str
    modified: datetime = field(default_factory=lambda: datetime.now(timezone.utc))


@dataclass
class Bucket:
    """Every object of every bucket: ``(bucket, key) → Stored``; the outage switch."""

    objects: dict[tuple[str, str], Stored] = field(default_factory=dict)
    outage: bool = False
    lock: threading.RLock = field(default_factory=threading.RLock)
    _etags: Any = field(default_factory=lambda: itertools.count(1))

    def snapshot(self) -> dict[tuple[str, str], Stored]:
        with self.lock:
            return dict(self.objects)

    def restore(self, objects: dict[tuple[str, str], Stored]) -> None:
        with self.lock:
            self.objects = dict(objects)

    def etag(self) -> str:
        return f'"{next(self._etags):032x}"'


class Process:
    """One process's view of the bucket: its requests stop counting once it is ``gone``; its copy
    thread's requests go only while the main thread waits for them (``turns`` set)."""

    def __init__(self) -> None:
        self.gone = False
        self.turns = threading.Event()

    def end(self) -> None:
        """The process is gone: a request its copy thread is waiting to make fails now."""
        self.gone = True
        self.turns.set()

    def admit(self) -> None:
        if threading.current_thread().name == COPY_THREAD:
            # end() wakes it at once; the poll covers a turn ended by _settle as the process went
            while not self.turns.wait(0.05) and not self.gone:
                pass
        if self.gone:
            raise ProcessGone("this process was killed")


class Body:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def read(self) -> bytes:
        return self.data

    def iter_chunks(self, size: int) -> Any:
        for i in range(0, len(self.data), size):
            yield self.data[i : i + size]


class _Exceptions:
    NoSuchKey = NoSuchKey


class Paginator:
    def __init__(self, client: MemoryS3Client, operation: str) -> None:
        self.client = client
        self.operation = operation

    def paginate(self, Bucket: str, Prefix: str = "", Delimiter: str | None = None) -> Any:  # noqa: N803
        if self.operation == "list_multipart_uploads":
            self.client._enter()
            return iter([{"Uploads": []}])  # a memory upload is one request: none ever pending
        return iter([self.client._list(Bucket, Prefix, Delimiter)])


class MemoryS3Client:
    """boto3's S3 client as S3Storage uses it, over ``bucket``, on behalf of ``process``."""

    exceptions = _Exceptions

    def __init__(self, bucket: Bucket, process: Process) -> None:
        self.bucket = bucket
        self.process = process

    def _enter(self) -> None:
        self.process.admit()
        if self.bucket.outage:
            raise EndpointConnectionError(endpoint_url=ENDPOINT)

    def _get(self, bucket: str, key: str) -> Stored | None:
        return self.bucket.objects.get((bucket, key))

    # --- objects ---------------------------------------------------------------------------------

    def get_object(self, Bucket: str, Key: str) -> dict:  # noqa: N803
        self._enter()
        with self.bucket.lock:
            found = self._get(Bucket, Key)
            if found is None:
                raise NoSuchKey(Key)
            return {"Body": Body(found.data), "ETag": found.etag, "Metadata": found.metadata}

    def head_object(self, Bucket: str, Key: str) -> dict:  # noqa: N803
        self._enter()
        with self.bucket.lock:
            found = self._get(Bucket, Key)
            if found is None:
                raise _error("404", 404, "HeadObject")
            return {
                "ContentLength": len(found.data),
                "ETag": found.etag,
                "Metadata": dict(found.metadata),
                "LastModified": found.modified,
            }

    def put_object(
        self,
        Bucket: str,  # noqa: N803
        Key: str,  # noqa: N803
        Body: bytes,  # noqa: N803
        Metadata: dict[str, str] | None = None,  # noqa: N803
        IfMatch: str | None = None,  # noqa: N803
        IfNoneMatch: str | None = None,  # noqa: N803
    ) -> dict:
        self._enter()
        with self.bucket.lock:
            found = self._get(Bucket, Key)
            if IfNoneMatch == "*" and found is not None:
                raise _error("PreconditionFailed", 412, "PutObject")
            if IfMatch is not None and (found is None or found.etag != IfMatch):
                raise _error("PreconditionFailed", 412, "PutObject")
            stored = Stored(bytes(Body), dict(Metadata or {}), self.bucket.etag())
            self.bucket.objects[(Bucket, Key)] = stored
            return {"ETag": stored.etag}

    def delete_object(self, Bucket: str, Key: str, IfMatch: str | None = None) -> dict:  # noqa: N803
        self._enter()
        with self.bucket.lock:
            found = self._get(Bucket, Key)
            if IfMatch is not None:
                if found is None:
                    raise _error("NoSuchKey", 404, "DeleteObject")
                if found.etag != IfMatch:
                    raise _error("PreconditionFailed", 412, "DeleteObject")
            self.bucket.objects.pop((Bucket, Key), None)
            return {}

    def delete_objects(self, Bucket: str, Delete: dict) -> dict:  # noqa: N803
        self._enter()
        with self.bucket.lock:
            for obj in Delete["Objects"]:
                self.bucket.objects.pop((Bucket, obj["Key"]), None)
            return {}

    def upload_file(
        self,
        Filename: str,  # noqa: N803
        Bucket: str,  # noqa: N803
        Key: str,  # noqa: N803
        ExtraArgs: dict | None = None,  # noqa: N803
        Config: object = None,  # noqa: N803
    ) -> None:
        data = Path(Filename).read_bytes()
        metadata = (ExtraArgs or {}).get("Metadata")
        self.put_object(Bucket=Bucket, Key=Key, Body=data, Metadata=metadata)

    def download_file(self, Bucket: str, Key: str, Filename: str, Config: object = None) -> None:  # noqa: N803
        self._enter()
        with self.bucket.lock:
            found = self._get(Bucket, Key)
            if found is None:
                raise _error("404", 404, "HeadObject")
            data = found.data
        Path(Filename).write_bytes(data)

    # --- listings --------------------------------------------------------------------------------

    def get_paginator(self, operation: str) -> Paginator:
        return Paginator(self, operation)

    def list_objects_v2(self, Bucket: str, Prefix: str = "", MaxKeys: int = 1000) -> dict:  # noqa: N803
        page = self._list(Bucket, Prefix, None)
        contents = page["Contents"][:MaxKeys]
        return {"Contents": contents, "KeyCount": len(contents)}

    def _list(self, bucket: str, prefix: str, delimiter: str | None) -> dict:
        self._enter()
        with self.bucket.lock:
            keys = sorted(k for b, k in self.bucket.objects if b == bucket and k.startswith(prefix))
            contents, prefixes = [], []
            for key in keys:
                rest = key[len(prefix) :]
                if delimiter and delimiter in rest:
                    common = prefix + rest.split(delimiter, 1)[0] + delimiter
                    if common not in prefixes:
                        prefixes.append(common)
                else:
                    contents.append(
                        {"Key": key, "Size": len(self.bucket.objects[(bucket, key)].data)}
                    )
            page = {"Contents": contents, "KeyCount": len(contents) + len(prefixes)}
            if delimiter:
                page["CommonPrefixes"] = [{"Prefix": p} for p in prefixes]
            return page

    def abort_multipart_upload(self, Bucket: str, Key: str, UploadId: str) -> dict:  # noqa: N803
        self._enter()
        raise _error("NoSuchUpload", 404, "AbortMultipartUpload")
