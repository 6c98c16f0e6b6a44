"""manifest.json: every file of a checkpoint with its size and checksum; its presence marks completion.

The checksum is xxh3-128 (xxhash ships with `datasets`): it runs at memory speed, so hashing while
writing costs little, and it detects truncation and bit flips. (DESIGN.md named sha256; the
checkpoint issue asks for a fast checksum, which wins.)
"""

from __future__ import annotations

import ctypes
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import xxhash

_WRITEBACK_EVERY = 32 << 20
_SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range():
    """Linux sync_file_range(2) through libc; None elsewhere (the closing fsync still runs)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_sync_file_range = _load_sync_file_range()

MANIFEST = "manifest.json"
ALGORITHM = "xxh3_128"
FORMAT_VERSION = 1
_CHUNK = 8 << 20


class HashingWriter:
    """A write-only file wrapper that hashes and counts what passes through it."""

    def __init__(self, f: BinaryIO):
        self.f, self.h, self.size = f, xxhash.xxh3_128(), 0
        # torch.save's C++ writer turns an exception from write() into an opaque RuntimeError;
        # keep the real one (ENOSPC, EIO…) so the report names it.
        self.os_error: OSError | None = None
        self.kicked = 0  # bytes already handed to the kernel's writeback

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        try:
            # torch hands over a whole storage (often hundreds of MB) in one call: slice it so the
            # disk starts on the first slice while later ones are still being hashed and copied.
            for i in range(0, len(view), _WRITEBACK_EVERY):
                piece = view[i:i + _WRITEBACK_EVERY]
                self.h.update(piece)
                self.f.write(piece)
                self.size += len(piece)
                if self.size - self.kicked >= _WRITEBACK_EVERY:
                    self._start_writeback()
            return len(view)
        except OSError as e:
            self.os_error = self.os_error or e
            raise

    def _start_writeback(self) -> None:
        """Ask the kernel to start writing what we wrote so far, without waiting for it, so the
        disk works while we serialise the rest and the closing fsync has little left to do."""
        self.f.flush()
        if _sync_file_range is not None:
            _sync_file_range(self.f.fileno(), self.kicked, self.size - self.kicked, _SYNC_FILE_RANGE_WRITE)
        self.kicked = self.size

    def flush(self) -> None:
        self.f.flush()

    def digest(self) -> str:
        return self.h.hexdigest()


def hash_file(path: str | os.PathLike) -> tuple[int, str]:
    h, size = xxhash.xxh3_128(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def write_json_durably(path: str | os.PathLike, obj) -> tuple[int, str]:
    data = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    h = xxhash.xxh3_128()
    h.update(data)
    return len(data), h.hexdigest()


def build_manifest(tag: str, files: dict[str, tuple[int, str]], world_size: int, versions: dict,
                   ranks: list[int] | None = None) -> dict:
    """``ranks``: node-local storage holds only these ranks' files (absent = all of them)."""
    manifest = {"format_version": FORMAT_VERSION, "tag": tag, "world_size": world_size, "algorithm": ALGORITHM,
                "versions": versions, "total_bytes": sum(size for size, _ in files.values()),
                "files": {name: {"size": size, "checksum": digest} for name, (size, digest) in sorted(files.items())}}
    if ranks is not None:
        manifest["ranks"] = sorted(ranks)
    return manifest


def stored_ranks(manifest: dict) -> list[int]:
    """The ranks whose files the checkpoint folder holds: all, or one node's (node-local storage)."""
    return manifest.get("ranks", list(range(int(manifest.get("world_size", 0)))))


def read_manifest(folder: str | os.PathLike) -> dict | None:
    path = Path(folder) / MANIFEST
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# --- verification ----------------------------------------------------------------------------

RANK_FILE_PATTERNS = ("zero_pp_rank_{r}_mp_rank_00_model_states.pt", "zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
                      "rng_state_{r}.pt")


@dataclass
class Report:
    folder: Path
    is_checkpoint: bool = True
    problems: list[str] = field(default_factory=list)
    files: int = 0
    bytes_checked: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.is_checkpoint and not self.problems


def looks_like_checkpoint(folder: Path) -> bool:
    return folder.is_dir() and ((folder / MANIFEST).exists() or any(folder.glob("zero_pp_rank_*_model_states.pt"))
                                or (folder / "trainer_state.json").exists())


def verify(folder: str | os.PathLike, *, checksums: bool = True, ranks: list[int] | None = None,
           shared: bool = True) -> Report:
    """Check ``folder`` against its manifest: every file present with its size (and checksum),
    one file set per rank of the recorded world size, a readable training state.

    ``ranks``/``shared`` restrict the work to some ranks' files and/or the shared files, so ranks
    can split a verification between them.
    """
    folder = Path(folder)
    report = Report(folder)
    start = time.perf_counter()
    if not looks_like_checkpoint(folder):
        report.is_checkpoint = False
        return report
    manifest = read_manifest(folder)
    if manifest is None:
        report.problems.append(f"{MANIFEST} missing or unreadable (an incomplete save?)")
        return report
    world = int(manifest.get("world_size", 0))
    listed = manifest.get("files", {})
    mine = set(listed) if ranks is None else _files_of(listed, ranks, world, shared)
    for r in stored_ranks(manifest) if ranks is None else ranks:
        for pattern in RANK_FILE_PATTERNS:
            name = pattern.format(r=r)
            if name not in listed and not (name.startswith("zero") and _bf16_variant(name) in listed):
                report.problems.append(f"{name}: rank {r} of {world} has no such file in the manifest")
    for name in sorted(mine):
        report.problems.extend(_check_file(folder / name, name, listed[name], checksums))
        report.files += 1
        report.bytes_checked += listed[name]["size"]
    if shared:
        report.problems.extend(_check_trainer_state(folder, world))
    report.seconds = time.perf_counter() - start
    return report


def _bf16_variant(name: str) -> str:
    return f"bf16_{name}"


def _files_of(listed: dict, ranks: list[int], world: int, shared: bool) -> set[str]:
    """The manifest's files that belong to ``ranks`` (plus the shared ones if ``shared``)."""
    per_rank = {r: {p.format(r=r) for p in RANK_FILE_PATTERNS} | {_bf16_variant(p.format(r=r)) for p in RANK_FILE_PATTERNS}
                for r in range(world)}
    any_rank = set().union(*per_rank.values()) if per_rank else set()
    wanted = set().union(*(per_rank.get(r, set()) for r in ranks)) if ranks else set()
    return {n for n in listed if n in wanted or (shared and n not in any_rank)}


def _check_file(path: Path, name: str, meta: dict, checksums: bool) -> list[str]:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return [f"{name}: missing"]
    if size != meta["size"]:
        return [f"{name}: size {size} bytes, manifest says {meta['size']} (truncated or overwritten)"]
    if checksums and hash_file(path)[1] != meta["checksum"]:
        return [f"{name}: checksum mismatch (corrupted)"]
    return []


def _check_trainer_state(folder: Path, world: int) -> list[str]:
    try:
        state = json.loads((folder / "trainer_state.json").read_text())
    except (OSError, ValueError) as e:
        return [f"trainer_state.json: unreadable ({type(e).__name__})"]
    if state.get("world_size") != world:
        return [f"trainer_state.json: world_size {state.get('world_size')} but the manifest says {world}"]
    return []
