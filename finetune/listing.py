"""``finetune ls OUT``: the checkpoints of an output dir, one row each, and what else is in it.

Per checkpoint: step, when it was committed, size, world size (with ``spN`` when N ranks shared
each row: sequence parallelism), the train and eval loss logged at (or last before) its step,
whether it holds consolidated weights, the seconds its rank files took to write (its
``checkpoint`` event's ``writer_s``), and its state: sizes checked against the manifest, or with
``--verify`` checksums too (what ``finetune verify`` checks). Below: the notes ``finetune verify
OUT`` gives (uncommitted folders, a stale ``latest``, leftovers of crashed saves, torn metrics
lines), and the disk space. Node-local storage: each node lists the ranks' files it holds.

Cheap by design: manifests are read and files stat'ed, metrics.jsonl and events.jsonl are read
once; checksums only with ``--verify``. Reads only; a damaged checkpoint is reported, not an error
(exit 0).
"""

from __future__ import annotations

import json
import os
import textwrap
from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from finetune.checkpoint_format.best import EVAL_KEY, named_best
from finetune.checkpoint_format.manifest import (
    MANIFEST,
    looks_like_checkpoint,
    read_manifest,
    stored_ranks,
    verify,
)
from finetune.checkpoint_format.outdir import ABANDONED, LATEST, STAGING, OutputDir, step_of
from finetune.commands import Parser
from finetune.config import ConfigError
from finetune.data.mixture import read_tokens_by_source, source_lines
from finetune.exit_status import EXIT_STATUS
from finetune.io.remote import is_remote
from finetune.lease import LEASE
from finetune.metrics import METRICS, read_events, read_metrics
from finetune.offline.verify import notes
from finetune.weights.adapter import ADAPTER_CONFIG, is_adapter_checkpoint
from finetune.weights.universal import UNIVERSAL

WIDTH = 100  # the table fits a terminal this wide; full problem texts go below it
UNCOMMITTED = "uncommitted"
# what only a run writes into OUT
RUN_FILES = (METRICS, LATEST, EXIT_STATUS, STAGING, ABANDONED, LEASE)


@dataclass(kw_only=True)
class Checkpoint:
    """One row: what the manifest, the metrics and the check say about one checkpoint folder.
    None: not known (no manifest, no metrics, or a bucket's row)."""

    tag: str
    step: int
    committed_at: str | None = None  # UTC ISO-8601; None for a folder that was never committed
    bytes: int
    world_size: int | None = None
    ranks: list[int] | None = None  # node-local storage: the ranks whose files this folder holds
    sequence_parallel_size: int | None = None  # ranks that shared each row (None: not recorded)
    train_loss: float | None = None
    # the step it was logged at: the checkpoint's, or the last before
    train_loss_step: int | None = None
    eval_loss: float | None = None
    eval_loss_step: int | None = None
    consolidated: bool | None = None
    status: str
    problems: list[str] = field(default_factory=list)
    latest: bool = False
    lora: bool = False  # LoRA adapters (--use_peft): "consolidated" means adapter_model.safetensors
    tokens_by_source: dict | None = None  # --dataset_mixture: trainer_state.json's (local only)
    eval: dict | None = None  # the evaluation of its step, from its manifest
    best: bool = False  # the best checkpoint (--metric_for_best_model), as the newest commit says
    # seconds rank 0's writer spent on its files, pacing excluded (events.jsonl)
    writer_s: float | None = None


@dataclass
class Listing:
    """Everything ``finetune ls`` shows (``--json`` prints it as is)."""

    output_dir: str
    latest: str | None
    checkpoints: list[Checkpoint]
    notes: list[str]
    free_bytes: int | None  # None for a bucket
    checkpoint_bytes: int
    best: dict | None = None  # the best checkpoint's tag, metric, value, greater_is_better


def main(argv: list[str]) -> int:
    p = Parser(
        prog="finetune ls",
        description="List an output dir's checkpoints (step, time, size, world size, losses, "
        "seconds to write, state) and what else is in it. Exit 0 when listed, damaged "
        "checkpoints included; 2 when OUT is not an output dir.",
    )
    p.add_argument(
        "output_dir",
        metavar="OUT",
        help="An output dir (--output_dir of a run), or s3://BUCKET/PREFIX (--remote_output_dir).",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="Check every file's checksum too, not only its size "
        "(reads every byte: as slow as `finetune verify` on each checkpoint).",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="Print the listing as one JSON object instead of a table.",
    )
    ns = p.parse_args(argv)
    if is_remote(ns.output_dir):
        listing = collect_remote(ns.output_dir, checksums=ns.verify)
    else:
        listing = collect(Path(ns.output_dir), checksums=ns.verify)
    print(json.dumps(asdict(listing), indent=2) if ns.json else render(listing))
    return 0


def collect(out: Path, checksums: bool = False) -> Listing:
    """Everything ``finetune ls`` shows, read from ``out``; ConfigError if it is no output dir."""
    storage = OutputDir(out)
    _check_output_dir(out, storage)
    latest = storage.read_latest()
    losses = _Losses(read_metrics(str(out)))
    manifests: dict = {}  # each read once, by _checkpoint
    rows = [_checkpoint(out / tag, losses, checksums, manifests) for tag in storage.tags()]
    written = _writer_seconds(out)
    for row in rows:
        row.latest = row.tag == latest
        row.writer_s = written.get(row.tag)
        row.tokens_by_source = read_tokens_by_source(out / row.tag)
    extra = _node_local_note(rows) + _set_aside_note(out) + _universal_notes(out, rows)
    return Listing(
        str(out),
        latest,
        rows,
        notes(out) + extra,
        storage.free_bytes(),
        sum(r.bytes for r in rows),
        _mark_best(rows, manifests),
    )


def collect_remote(uri: str, checksums: bool = False) -> Listing:
    """``finetune ls s3://BUCKET/PREFIX``: remote/verify.py's rows (sizes and metadata
    checksums; ``--verify`` downloads) and notes. No losses (metrics.jsonl stays in OUT) and no
    free space (a bucket reports none)."""
    from finetune.remote.verify import listing

    latest, rows, notes_ = listing(uri, checksums)
    checkpoints: list[Checkpoint] = []
    manifests: dict[str, dict | None] = {}
    for row in rows:
        manifest = row.pop("manifest")
        manifests[row["tag"]] = manifest
        if manifest is None:
            checkpoints.append(
                Checkpoint(
                    tag=row["tag"],
                    step=row["step"],
                    bytes=0,
                    status=UNCOMMITTED,
                    problems=[f"{MANIFEST} missing or unreadable (never committed remotely)"],
                )
            )
            continue
        problems = row["problems"]
        checkpoints.append(
            Checkpoint(
                tag=row["tag"],
                step=row["step"],
                committed_at=_stamp(manifest.get("committed_at")),
                bytes=row["bytes"],
                world_size=_int_or_none(manifest.get("world_size")),
                ranks=_ranks(manifest),
                sequence_parallel_size=_sequence_parallel(manifest),
                consolidated=_bool_or_none(manifest.get("consolidated")),
                status=_status(problems, checksums),
                problems=problems,
                latest=row["tag"] == latest,
                lora=ADAPTER_CONFIG in manifest["files"],
            )
        )
    best = _mark_best(checkpoints, manifests)
    return Listing(uri, latest, checkpoints, notes_, None, sum(c.bytes for c in checkpoints), best)


def _mark_best(rows: list[Checkpoint], manifests: Mapping[str, Mapping | None]) -> dict | None:
    """Each row gets its manifest's eval row, and the best one (``named_best``) its mark; returns
    the best record."""
    record = named_best(manifests)
    for row in rows:
        manifest = manifests.get(row.tag)
        evaluated = manifest.get(EVAL_KEY) if isinstance(manifest, Mapping) else None
        row.eval = dict(evaluated) if isinstance(evaluated, Mapping) else None
        row.best = record is not None and row.tag == record["tag"]
    return record


def _status(problems: list[str], checksums: bool) -> str:
    """The status column of a committed checkpoint: its first problem, or what was checked."""
    return (
        f"DAMAGED: {problems[0]}" if problems else f"ok ({'checksums' if checksums else 'sizes'})"
    )


def _ranks(manifest: dict) -> list[int] | None:
    ranks = manifest.get("ranks")
    return ranks if isinstance(ranks, list) else None


def _sequence_parallel(manifest: dict) -> int | None:
    return _int_or_none(manifest.get("sequence_parallel_size", 1))  # absent: whole rows


def _bool_or_none(value: object) -> bool | None:
    return value if isinstance(value, bool) else None


def _stamp(stamp: object) -> str | None:
    if not isinstance(stamp, str):
        return None
    try:
        return datetime.fromisoformat(stamp).astimezone(timezone.utc).isoformat(timespec="seconds")
    except ValueError:
        return None


def _check_output_dir(out: Path, storage: OutputDir) -> None:
    if not out.is_dir():
        raise ConfigError(f"{out}: {'not a folder' if out.exists() else 'no such folder'}")
    if looks_like_checkpoint(out):
        raise ConfigError(
            f"{out}: a checkpoint, not an output dir (list its output "
            f"dir: finetune ls {out.parent})"
        )
    if not storage.tags() and not any((out / name).exists() for name in RUN_FILES):
        raise ConfigError(
            f"{out}: not a finetune output dir (no checkpoints, "
            f"{METRICS}, {LATEST} or {EXIT_STATUS})"
        )


def _checkpoint(folder: Path, losses: _Losses, checksums: bool, manifests: dict) -> Checkpoint:
    step = step_of(folder.name)
    train, train_step = losses.at(step, "loss")
    evaluated, eval_step = losses.at(step, "eval_loss")
    manifest = read_manifest(folder)
    manifests[folder.name] = manifest
    # a crash mid-copy, or a save from before manifests: resume never picks it
    if not isinstance(manifest, dict):
        return Checkpoint(
            tag=folder.name,
            step=step,
            bytes=_folder_bytes(folder),
            train_loss=train,
            train_loss_step=train_step,
            eval_loss=evaluated,
            eval_loss_step=eval_step,
            status=UNCOMMITTED,
            problems=[f"{MANIFEST} missing or unreadable (never committed)"],
        )
    problems = _problems(folder, manifest, checksums)
    return Checkpoint(
        tag=folder.name,
        step=step,
        committed_at=_committed_at(folder, manifest),
        bytes=_int_or_none(manifest.get("total_bytes")) or _folder_bytes(folder),
        world_size=_int_or_none(manifest.get("world_size")),
        ranks=_ranks(manifest),
        sequence_parallel_size=_sequence_parallel(manifest),
        train_loss=train,
        train_loss_step=train_step,
        eval_loss=evaluated,
        eval_loss_step=eval_step,
        consolidated=_bool_or_none(manifest.get("consolidated")),
        status=_status(problems, checksums),
        problems=problems,
        lora=is_adapter_checkpoint(folder),
    )


def _writer_seconds(out: Path) -> dict[str, float]:
    """Each tag's writer seconds from its ``checkpoint`` event (the last one: a later save of the
    same step is the folder there now): ``writer_busy_s``, rank 0's writer's own seconds on its
    files with the waits that pace an --async_save excluded, else (events from before it)
    ``writer_s``, the wall time of the writes; none from events older than both."""
    found = {}
    for event in read_events(out):
        if event.get("event") != "checkpoint":
            continue
        for key in ("writer_busy_s", "writer_s"):
            seconds = event.get(key)
            if isinstance(seconds, (int, float)) and not isinstance(seconds, bool):
                found[str(event.get("tag"))] = float(seconds)
                break
    return found


def _problems(folder: Path, manifest: dict, checksums: bool) -> list[str]:
    """What ``finetune verify`` (``--quick`` without ``checksums``) finds wrong with ``folder``."""
    try:
        problems = verify(folder, checksums=checksums).problems
    except (TypeError, ValueError, AttributeError) as e:
        # a hand-edited manifest: one damaged row, not a crash
        return [f"{MANIFEST}: malformed ({type(e).__name__}: {e})"]
    # as `finetune verify`: would resume's unpickling refuse it? (opcodes only)
    if not problems and checksums:
        # imports torch: only when asked to verify
        from finetune.weights.safe_load import refusals

        problems = refusals(folder, stored_ranks(manifest))
    # as `finetune verify`: adapters complete?
    if not problems and checksums and is_adapter_checkpoint(folder):
        # imports peft and transformers: only when asked
        from finetune.weights.adapter import verify_adapter

        problems = verify_adapter(folder, manifest)
    return problems


def _committed_at(folder: Path, manifest: dict) -> str | None:
    """The manifest's ``committed_at``; for checkpoints saved before that key existed, the time
    manifest.json was last written (the commit, unless someone copied the folder since)."""
    stamp = _stamp(manifest.get("committed_at"))
    if stamp is not None:
        return stamp  # else hand-edited or missing: the file's time is the next best
    try:
        mtime = (folder / MANIFEST).stat().st_mtime
    except OSError:
        return None
    return datetime.fromtimestamp(mtime, timezone.utc).isoformat(timespec="seconds")


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _folder_bytes(folder: Path) -> int:
    """Bytes of the files directly in ``folder`` (checkpoint folders are flat; a cached universal
    conversion below it is reported on its own)."""
    total = 0
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
    except OSError:
        pass  # unreadable: its rows and notes say so; the size is what could be counted
    return total


class _Losses:
    """metrics.jsonl read once, indexed by step: the loss at a step is the row logged at it, or the
    last one before it (logging every N steps need not land on a save step). A step logged twice
    (a resumed run re-logging it) takes the later row, as the file reads top to bottom."""

    def __init__(self, rows: list[dict]):
        self.series: dict[str, tuple[list[int], list[float]]] = {}
        for key in ("loss", "eval_loss"):
            by_step = {
                row["step"]: float(row[key])
                for row in rows
                if _int_or_none(row.get("step")) is not None
                and isinstance(row.get(key), (int, float))
                and not isinstance(row.get(key), bool)
            }
            steps = sorted(by_step)
            self.series[key] = (steps, [by_step[s] for s in steps])

    def at(self, step: int, key: str) -> tuple[float | None, int | None]:
        steps, values = self.series[key]
        i = bisect_right(steps, step)
        return (values[i - 1], steps[i - 1]) if i else (None, None)


# --- what else takes space ---------------------------------------------------------------------


def _node_local_note(rows: list[Checkpoint]) -> list[str]:
    local = [r for r in rows if r.ranks is not None and r.ranks != list(range(r.world_size or 0))]
    if not local:
        return []
    newest = local[-1]
    return [
        f"node-local checkpoints: this storage holds the files of rank(s) {_ranges(newest.ranks)} "
        f"of {newest.world_size} ({newest.tag}); the other nodes' output dirs hold the rest"
    ]


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] → "0-2,5": a node's ranks are usually one run of numbers."""
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)


def _set_aside_note(out: Path) -> list[str]:
    """Checkpoints under ``.abandoned``: kept, never deleted by finetune, so they use disk until
    someone removes them."""
    try:
        kept = [p for p in (out / ABANDONED).iterdir() if p.is_dir()]
    except OSError:
        return []
    if not kept:
        return []
    size = sum(
        _int_or_none((read_manifest(p) or {}).get("total_bytes")) or _folder_bytes(p) for p in kept
    )
    return [
        f"{ABANDONED}: {len(kept)} checkpoint(s) set aside ({_human(size)}): timelines a "
        "resume left, or folders finetune did not commit; kept, never deleted by finetune "
        "(remove them by hand when not needed)"
    ]


def _universal_notes(out: Path, rows: list[Checkpoint]) -> list[str]:
    """Cached universal conversions (resume on another world size): not in a checkpoint's
    manifest, so not in its size; their own manifest lists their files."""
    found = []
    for row in rows:
        target = out / row.tag / UNIVERSAL
        if target.is_dir():
            files = (read_manifest(target) or {}).get("files") or {}
            size = sum(meta.get("size", 0) for meta in files.values() if isinstance(meta, dict))
            found.append(
                f"{row.tag}/{UNIVERSAL}: a universal conversion (for resuming on another "
                f"world size), {_human(size) if files else 'size unknown (no manifest)'}; "
                "not in the sizes above"
            )
    return found


# --- the table ---------------------------------------------------------------------------------

HEADERS = (
    "",
    "step",
    "committed at",
    "size",
    "world",
    "train",  # losses
    "eval",
    "consolidated",
    "write",
    "status",
)


def render(listing: Listing) -> str:
    rows = [_cells(c) for c in listing.checkpoints]
    lines = _table(rows) if rows else ["no checkpoints"]
    if any(c.latest for c in listing.checkpoints):
        lines.append(f"* = named by {LATEST}")
    lines += source_lines(listing.checkpoints)
    lines += _best_legend(listing.best, listing.checkpoints)
    for c in listing.checkpoints:
        if c.problems and c.status != UNCOMMITTED:  # the table has room for the first one at most
            lines.append(f"{c.tag}: {len(c.problems)} problem(s)")
            lines += [_wrap(p, "  - ") for p in c.problems]
    lines += [_wrap(n, "note: ") for n in listing.notes]
    count = sum(c.status != UNCOMMITTED for c in listing.checkpoints)
    if listing.free_bytes is None:  # a bucket
        lines.append(
            f"bucket: {_human(listing.checkpoint_bytes)} in {len(listing.checkpoints)} checkpoint "
            f"folder(s) ({count} committed)"
        )
        return "\n".join(lines)
    lines.append(
        _wrap(
            f"{_human(listing.checkpoint_bytes)} in {len(listing.checkpoints)} checkpoint "
            f"folder(s) ({count} committed); {_human(listing.free_bytes)} free on "
            f"{listing.output_dir}'s filesystem",
            "disk: ",
        )
    )
    return "\n".join(lines)


def _wrap(text: str, lead: str) -> str:
    # Paths are not broken: a long one overflows rather than becoming uncopyable.
    return textwrap.fill(
        text,
        WIDTH,
        initial_indent=lead,
        subsequent_indent=" " * len(lead),
        break_long_words=False,
        break_on_hyphens=False,
    )


def _best_legend(best: Mapping | None, rows: list[Checkpoint]) -> list[str]:
    """The line under the table for the row marked best (none without one)."""
    if best is None or not any(r.best for r in rows):
        return []
    better = "higher is better" if best["greater_is_better"] else "lower is better"
    return [f"+ = the best: {best['metric']} {best['value']:.4f} ({better})"]


def _cells(c: Checkpoint) -> list[str]:
    when = "-"
    if c.committed_at is not None:  # in the reader's local time
        when = datetime.fromisoformat(c.committed_at).astimezone().strftime("%Y-%m-%d %H:%M")
    world = "-" if c.world_size is None else str(c.world_size)
    if c.ranks is not None and c.ranks != list(range(c.world_size or 0)):
        world = f"{len(c.ranks)}/{world}"  # node-local: ranks held here / world size
    if (c.sequence_parallel_size or 1) > 1:
        world += f" sp{c.sequence_parallel_size}"  # ranks sharing each row
    consolidated = {True: "yes", False: "no", None: "-"}[c.consolidated]
    if c.lora:
        consolidated = "adapter" if c.consolidated else f"{consolidated} (LoRA)"
    return [
        ("*" if c.latest else "") + ("+" if c.best else ""),
        str(c.step),
        when,
        _human(c.bytes),
        world,
        _loss(c.train_loss, c.train_loss_step, c.step),
        _loss(c.eval_loss, c.eval_loss_step, c.step),
        consolidated,
        "-" if c.writer_s is None else f"{c.writer_s:.1f}s",
        c.status,
    ]


def _loss(value: float | None, logged_at: int | None, step: int) -> str:
    if value is None:
        return "-"
    # @: last logged before the step
    return f"{value:.4f}" if logged_at == step else f"{value:.4f}@{logged_at}"


def _table(rows: list[list[str]]) -> list[str]:
    """Left-aligned text columns, numbers right-aligned; the last column (status) cut to WIDTH."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(HEADERS)]
    right = {1, 3, 4, 5, 6, 8}
    out = []
    for cells in [list(HEADERS), *rows]:
        text = "  ".join(
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells[:-1], widths))
        )
        status = cells[-1]
        if len(text) + 2 + len(status) > WIDTH and status.startswith("DAMAGED: "):
            # half a file name helps no one: the problems follow the table in full
            status = "DAMAGED (below)"
        text = f"{text}  {status}"
        out.append(text if len(text) <= WIDTH else text[: WIDTH - 1] + "…")
    return out


def _human(n: int) -> str:
    """Decimal units, as `df -H` and the save log lines."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
