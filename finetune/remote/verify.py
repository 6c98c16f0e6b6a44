"""``finetune verify s3://…``: a remote checkpoint (or a remote output dir's newest committed one)
against its manifest, from object sizes and the checksums kept in each object's metadata, with no
download; ``--full`` downloads every object and hashes its bytes.

A remote checkpoint is committed when its ``manifest.json`` is there (uploaded last, after every
file it lists): a folder without one is a copy in progress, skipped or interrupted, never resumed
from. Exit codes as for a local folder: 0 intact, 1 damaged, 2 not a checkpoint.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

from finetune.checkpoint_format.manifest import MANIFEST, missing_rank_files
from finetune.checkpoint_format.outdir import LATEST, OutputDir, committed, uncommitted
from finetune.checkpoint_format.policy import newest_first, step_of
from finetune.config import ConfigError
from finetune.io.remote import CHECKSUM_KEY, RemoteError, S3Storage

PARALLEL = 8  # objects checked at a time (HEAD requests; downloads with --full)


def main(uri: str, full: bool) -> int:
    try:
        root, rel = locate(uri)
        start = time.perf_counter()
        problems, files, nbytes = check(root, rel, full)
    except (ConfigError, RemoteError) as e:
        raise ConfigError(str(e)) from None
    except Exception as e:  # noqa: BLE001 — the client's (endpoint, credentials, bucket): one line
        raise ConfigError(f"{uri}: cannot read it ({type(e).__name__}: {e})") from None
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
        for note in notes(root):
            print(f"  note: {note}")
    return 0 if not problems else 1


def locate(uri: str) -> tuple[S3Storage, str]:
    """(the storage at ``uri``, the checkpoint in it: "" for ``uri`` itself, else an output dir's
    newest committed one); ConfigError when there is none."""
    root = S3Storage(uri)
    rel = checkpoint_in(root)
    if rel is None:
        raise ConfigError(f"{uri}: not a checkpoint (no manifest.json, no committed checkpoint)")
    return root, rel


def checkpoint_in(root: S3Storage) -> str | None:
    """ "" when ``root`` is a checkpoint (its manifest is there, or it is named like one), else its
    newest committed checkpoint (commit order), else None."""
    if root.stat(MANIFEST) is not None or step_of(root.uri.prefix.rsplit("/", 1)[-1]) is not None:
        return ""
    found = committed(OutputDir(root))
    return newest_first(found)[0].tag if found else None


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
    lines = [
        f"{t}: no manifest.json, so not committed remotely (a copy in progress, skipped or cut "
        "off); resume ignores it"
        for t in uncommitted(out, found)
    ]
    latest = out.read_latest()
    newest = newest_first(found)[0].tag if found else None
    if latest is not None and latest != newest:
        lines.append(
            f"{LATEST}: names {latest}, but the newest committed checkpoint is {newest}; resume "
            "goes by the commit order"
        )
    return lines


def listing(uri: str, checksums: bool) -> tuple[str | None, list[dict], list[str]]:
    """``finetune ls s3://…``: (latest, a row per checkpoint folder: tag, step, manifest (None:
    not committed remotely), problems, bytes; the notes). ConfigError, one line, when ``uri``
    holds no output dir or cannot be read."""
    try:
        root = S3Storage(uri)
        out = OutputDir(root)
        tags = out.tags()
        if not tags and root.read_bytes(LATEST) is None:
            if root.stat(MANIFEST) is not None:
                raise ConfigError(f"{uri}: a checkpoint, not an output dir (list the prefix above)")
            raise ConfigError(f"{uri}: no checkpoints and no {LATEST} there")
        rows = []
        for tag in tags:
            data = root.read_bytes(f"{tag}/{MANIFEST}")
            try:
                manifest = json.loads(data) if data is not None else None
            except ValueError:
                manifest = None
            if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
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
    except (ConfigError, RemoteError) as e:
        raise ConfigError(str(e)) from None
    except Exception as e:  # noqa: BLE001 — the client's (endpoint, credentials, bucket): one line
        raise ConfigError(f"{uri}: cannot read it ({type(e).__name__}: {e})") from None
