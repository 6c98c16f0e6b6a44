"""``finetune verify s3://…``: a remote checkpoint (or a remote output dir's newest committed one)
against its manifest, from object sizes and the checksums kept in each object's metadata, with no
download; ``--full`` downloads every object and hashes its bytes.

A remote checkpoint is committed when its ``manifest.json`` is there (uploaded last, after every
file it lists): a folder without one is a copy in progress, skipped or interrupted, never resumed
from. What counts as a checkpoint, an output dir or neither is what counts locally (a prefix is a
checkpoint when it holds a manifest, a rank's model states or ``trainer_state.json``, as
``looks_like_checkpoint`` says of a folder), so every exit code is a local folder's: 0 intact,
1 damaged, 2 not a checkpoint, an output dir with no committed checkpoint, or a bucket that cannot
be read (docs/CHECKPOINTS.md "Exit codes").
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from fnmatch import fnmatch
from typing import TypeVar

from finetune.checkpoint_format.manifest import MANIFEST, RANK_FILE_PATTERNS, missing_rank_files
from finetune.checkpoint_format.outdir import ABANDONED, LATEST, OutputDir, committed, uncommitted
from finetune.checkpoint_format.policy import newest_first, step_of
from finetune.checkpoint_format.state import TRAINER_STATE
from finetune.config import ConfigError
from finetune.io.remote import CHECKSUM_KEY, RemoteError, S3Storage, refusal
from finetune.remote.lease import LEASE

T = TypeVar("T")
PARALLEL = 8  # objects checked at a time (HEAD requests; downloads with --full)
NAMED_UPLOADS = 3  # pending multipart uploads a note names (the oldest); the rest are counted
# a rank's model states: with the manifest and trainer_state.json, what makes a folder a checkpoint
MODEL_STATES = RANK_FILE_PATTERNS[0].format(r="*")


def main(uri: str, full: bool) -> int:
    root, rel = _one_line(uri, lambda: locate(uri))
    start = time.perf_counter()
    problems, files, nbytes = _one_line(uri, lambda: check(root, rel, full))
    seconds = time.perf_counter() - start
    where = root.describe(rel)
    if not problems:
        what = "sizes and checksums (downloaded)" if full else "sizes and checksums (metadata)"
        print(f"OK {where}: {files} files, {nbytes / 1e6:.1f} MB, {what} match ({seconds:.2f} s)")
    else:
        print(f"DAMAGED {where}: {len(problems)} problem(s)")
        for problem in problems:
            print(f"  - {problem}")
    if rel:  # an output dir: what else is in it
        for note in _one_line(uri, lambda: notes(root)):
            print(f"  note: {note}")
    return 0 if not problems else 1


def _one_line(uri: str, work: Callable[[], T]) -> T:
    """``work()``, with whatever the client raises (a wrong endpoint, credential or bucket) made a
    one-line ConfigError naming ``uri``: exit 2, as for a local path that cannot be read."""
    try:
        return work()
    except (ConfigError, RemoteError) as e:
        raise ConfigError(str(e)) from None
    except Exception as e:  # noqa: BLE001 — the client's (endpoint, credentials, bucket): one line
        raise ConfigError(f"{uri}: cannot read it ({type(e).__name__}: {e})") from None


def locate(uri: str) -> tuple[S3Storage, str]:
    """(the storage at ``uri``, the checkpoint in it: "" for ``uri`` itself, else an output dir's
    newest committed one); ConfigError when there is none."""
    root = S3Storage(uri)
    rel = checkpoint_in(root)
    if rel is not None:
        return root, rel
    if step_of(root.uri.prefix.rsplit("/", 1)[-1]) is not None:
        raise ConfigError(
            f"{uri}: not a committed checkpoint (no {MANIFEST}, {TRAINER_STATE} or rank files)"
        )
    raise ConfigError(f"{uri}: not a checkpoint (no {MANIFEST}, no committed checkpoint)")


def checkpoint_in(root: S3Storage) -> str | None:
    """ "" when ``root`` is a checkpoint (``looks_like_checkpoint``), else, unless it is named like
    one, its newest committed checkpoint (commit order), else None: the folder a local
    ``find_checkpoint`` and ``verify`` check."""
    if root.stat(MANIFEST) is not None:
        return ""
    if step_of(root.uri.prefix.rsplit("/", 1)[-1]) is None:
        found = committed(OutputDir(root))
        if found:
            return newest_first(found)[0].tag
    return "" if looks_like_checkpoint(root) else None


def looks_like_checkpoint(root: S3Storage) -> bool:
    """What a local folder's ``looks_like_checkpoint`` asks: a manifest, ``trainer_state.json`` or
    a rank's model states."""
    if root.stat(MANIFEST) is not None or root.stat(TRAINER_STATE) is not None:
        return True
    return any(not e.is_dir and fnmatch(e.name, MODEL_STATES) for e in root.list())


def check(
    root: S3Storage, rel: str, full: bool, manifest: dict | None = None
) -> tuple[list[str], int, int]:
    """(problems, files checked, bytes listed) of checkpoint ``rel`` under ``root``; ``manifest``:
    its manifest when the caller has read it already."""
    prefix = f"{rel}/" if rel else ""
    if manifest is None:
        data = root.read_bytes(prefix + MANIFEST)
        if data is None:
            missing = f"{MANIFEST} missing: not committed remotely (a copy in progress or cut off)"
            return [missing], 0, 0
        try:
            manifest = json.loads(data)
        except ValueError:
            return [f"{MANIFEST} unreadable"], 0, 0
    listed = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(listed, dict):
        return [f"{MANIFEST} unreadable"], 0, 0
    problems = missing_rank_files(manifest)

    def one(name: str) -> str | None:
        want = listed[name]
        head = root.head(prefix + name)
        if head is None:
            return f"{name}: missing"
        if head["ContentLength"] != want["size"]:
            return f"{name}: size {head['ContentLength']} bytes, manifest says {want['size']}"
        kept = head.get("Metadata", {}).get(CHECKSUM_KEY)
        if full or not kept:
            size, digest = root.hash_object(prefix + name)
            if size != want["size"] or digest != want["checksum"]:
                return f"{name}: checksum mismatch (the stored bytes; corrupted)"
        elif kept != want["checksum"]:
            return f"{name}: checksum mismatch (object metadata)"
        return None

    with ThreadPoolExecutor(PARALLEL) as pool:
        problems += [p for p in pool.map(one, sorted(listed)) if p]
    state = root.read_bytes(prefix + "trainer_state.json")
    try:
        world = json.loads(state).get("world_size") if state is not None else None
    except ValueError:
        world = "unreadable"
    if world != manifest.get("world_size"):
        problems.append(
            f"trainer_state.json: world_size {world} but the manifest says "
            f"{manifest.get('world_size')}"
        )
    return problems, len(listed), sum(int(m["size"]) for m in listed.values())


def notes(root: S3Storage) -> list[str]:
    """What a remote output dir holds besides its newest committed checkpoint."""
    out = OutputDir(root)
    found = committed(out)
    aside = [e.name for e in root.list(ABANDONED) if e.is_dir]
    lines = []
    for t in uncommitted(out, found):
        entry = next((name for name in aside if name.startswith(f"{t}-")), None)
        if entry is not None:
            lines.append(
                f"{t}: the data of a commit set aside ({ABANDONED}/{entry}: a timeline a rollback "
                "left); kept until this history saves that step again; resume ignores it"
            )
        else:
            lines.append(
                f"{t}: no manifest.json, so not committed remotely (a copy in progress, skipped "
                "or cut off, or not this history's); resume ignores it"
            )
    if aside:
        lines.append(
            f"{ABANDONED}: {len(aside)} commit(s) set aside ({', '.join(sorted(aside))}): "
            "never deleted by finetune (remove them by hand when not needed)"
        )
    latest = out.read_latest()
    newest = newest_first(found)[0].tag if found else None
    if latest is not None and latest != newest:
        lines.append(
            f"{LATEST}: names {latest}, but the newest committed checkpoint is {newest}; resume "
            "goes by the commit order"
        )
    return lines + _pending_uploads_note(root)


def _pending_uploads_note(root: S3Storage) -> list[str]:
    """A note naming the multipart uploads pending under the prefix, if any: a run cut off in the
    middle of an upload leaves its parts stored (and billed) where no listing of objects shows
    them. A bucket that refuses to list them gets a note saying so, not an error."""
    try:
        pending = root.pending_uploads()
    except Exception as e:  # noqa: BLE001 — a refusal is a note; any other error is raised again
        code = refusal(e)
        if code is None:
            raise
        return [f"multipart uploads: the bucket refuses to list them ({code})"]
    if not pending:
        return []
    now = datetime.now(timezone.utc)
    named = ", ".join(
        f"{u.rel} ({_age((now - u.initiated).total_seconds())} old)"
        for u in pending[:NAMED_UPLOADS]
    )
    more = len(pending) - NAMED_UPLOADS
    return [
        f"multipart uploads: {len(pending)} pending, never completed (stored and billed, not "
        f"listed as objects): {named}{f' and {more} more' if more > 0 else ''}; the next run "
        "on this prefix aborts those begun before it took the lease"
    ]


def _age(seconds: float) -> str:
    """A duration in its largest whole unit: "40 s", "12 min", "5 h", "3 d"."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{int(seconds // size)} {unit}"
    return f"{max(int(seconds), 0)} s"


def listing(uri: str, checksums: bool) -> tuple[str | None, list[dict], list[str]]:
    """``finetune ls s3://…``: (latest, a row per checkpoint folder: tag, step, manifest (None:
    not committed remotely), problems, bytes; the notes). ConfigError, one line, when ``uri``
    holds no output dir or cannot be read."""
    return _one_line(uri, lambda: _listing(uri, checksums))


def _listing(uri: str, checksums: bool) -> tuple[str | None, list[dict], list[str]]:
    root = S3Storage(uri)
    out = OutputDir(root)
    if looks_like_checkpoint(root):
        raise ConfigError(f"{uri}: a checkpoint, not an output dir (list the prefix above)")
    tags = out.tags()
    if not tags and root.stat(LATEST) is None and root.stat(LEASE) is None:
        raise ConfigError(
            f"{uri}: not a finetune output dir (no checkpoints, no {LATEST} or {LEASE} there)"
        )
    rows = []
    for tag in tags:
        manifest = _manifest(root, tag)
        if manifest is None:
            rows.append({"tag": tag, "step": step_of(tag), "manifest": None})
            continue
        problems, _, nbytes = check(root, tag, checksums, manifest)
        rows.append(
            {
                "tag": tag,
                "step": step_of(tag),
                "manifest": manifest,
                "problems": problems,
                "bytes": nbytes,
            }
        )
    return out.read_latest(), rows, notes(root)


def _manifest(root: S3Storage, tag: str) -> dict | None:
    """Checkpoint ``tag``'s manifest, None when there is none or it is not one."""
    data = root.read_bytes(f"{tag}/{MANIFEST}")
    try:
        manifest = json.loads(data) if data is not None else None
    except ValueError:
        return None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return None
    return manifest


def manifests(uri: str) -> dict[str, dict | None]:
    """``finetune export --best s3://…``: each checkpoint folder's manifest (None: not committed
    remotely). ConfigError, one line, when ``uri`` cannot be read."""

    def read() -> dict[str, dict | None]:
        root = S3Storage(uri)
        return {tag: _manifest(root, tag) for tag in OutputDir(root).tags()}

    return _one_line(uri, read)
