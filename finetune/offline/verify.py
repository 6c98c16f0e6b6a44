"""``finetune verify``: a checkpoint against its manifest, and what else an output dir holds.

``main`` checks the checkpoint (sizes and checksums; the pickles' opcodes; a LoRA checkpoint's
adapters). ``notes`` is what it reports about an output dir besides its newest checkpoint.

None of these damages a committed checkpoint, so none changes verify's exit code; each is named
with what a resume does about it (docs/CHECKPOINTS.md "Verify"):
  * a checkpoint folder with no readable manifest.json: not committed (damage, or a copy that
    never finished); resume never picks it
  * ``latest`` naming no committed checkpoint, an older one than the newest, or not a file: it is
    a hint for DeepSpeed's tools (zero_to_fp32.py); resume uses the commit order
  * leftovers of crashed saves (``.staging/…``, ``.trash-…``, temp files): removed at the next start
  * torn lines in metrics.jsonl (a crash mid-append): dropped at the next resume
Nothing here reads a pickle or writes anything.
"""

from __future__ import annotations

from pathlib import Path

from finetune.checkpoint_format.manifest import read_manifest, stored_ranks
from finetune.checkpoint_format.manifest import verify as check_checkpoint
from finetune.checkpoint_format.outdir import (
    LATEST,
    OutputDir,
    committed,
    find_checkpoint,
    uncommitted,
)
from finetune.checkpoint_format.policy import newest_first
from finetune.commands import Parser
from finetune.config import ConfigError
from finetune.io.remote import is_remote
from finetune.metrics import METRICS, torn_lines
from finetune.weights.adapter import verify_adapter


def notes(out: Path) -> list[str]:
    """One line per finding in output dir ``out``; [] when there is nothing to say."""
    storage = OutputDir(out)
    found = committed(storage)
    names = {c.tag for c in found}
    lines = [
        f"{t}: no readable manifest.json, so not a committed checkpoint (damage, or a save or "
        "copy that never finished); resume ignores it"
        for t in uncommitted(storage, found)
    ]
    lines += _latest(out, newest_first(found)[0].tag if found else None, names)
    lines += [
        f"{rel}: left by a crashed save; removed when the next run starts"
        for rel in storage.leftovers()
    ]
    lines += _metrics(out / METRICS)
    return lines


def _latest(out: Path, newest: str | None, names: set[str]) -> list[str]:
    path = out / LATEST
    if not path.exists() and not path.is_symlink():
        return []
    why = "resume goes by the commit order, not by it, and rewrites it at the next save"
    if not path.is_file():
        return [
            f"{LATEST}: not a file; remove it (a save replaces `latest` and cannot replace this)"
        ]
    try:
        tag = path.read_text().strip()
    except (OSError, ValueError) as e:
        return [f"{LATEST}: unreadable ({type(e).__name__}); {why}"]
    if tag not in names:
        return [
            f"{LATEST}: names {tag or 'nothing'}, which is not a committed checkpoint here; {why}"
        ]
    if tag != newest:
        return [
            f"{LATEST}: names {tag}, but the newest committed checkpoint is {newest} (a crash "
            f"between a commit and its update); {why}"
        ]
    return []


def _metrics(path: Path) -> list[str]:
    if not path.exists():
        return []
    if not path.is_file():
        return [
            f"{METRICS}: not a file; remove it (a run cannot log to it, "
            "and a resume fails reading it)"
        ]
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return [f"{METRICS}: unreadable ({type(e).__name__}: {e.strerror or e})"]
    torn = torn_lines(text)
    if not torn:
        return []
    shown = ", ".join(map(str, torn[:5])) + (", …" if len(torn) > 5 else "")
    return [
        f"{METRICS}: {len(torn)} torn line(s) (line {shown}; a crash "
        "mid-append); dropped at the next resume"
    ]


def main(argv: list[str]) -> int:
    """``finetune verify CKPT|OUT``: exit 0 intact, 1 damaged, 2 not a checkpoint (or an output
    dir with no committed checkpoint)."""
    from finetune.weights.safe_load import refusals  # imports torch: only here

    p = Parser(
        prog="finetune verify",
        description="Check a checkpoint against its manifest.json. "
        "Exit 0 intact, 1 damaged (names the files), 2 not a checkpoint.",
    )
    p.add_argument(
        "checkpoint",
        help="A checkpoint folder or s3:// URI, or an output dir (its newest committed checkpoint "
        "is checked, "
        "and the rest of the dir is looked over: uncommitted folders, `latest`, leftovers of "
        "crashed saves, torn metrics lines; reported as notes).",
    )
    p.add_argument("--quick", action="store_true", help="Check file sizes only, not checksums.")
    p.add_argument(
        "--full",
        action="store_true",
        help="s3:// only: download every object and hash it (default: sizes and the checksums "
        "kept in each object's metadata, no download).",
    )
    ns = p.parse_args(argv)
    if is_remote(ns.checkpoint):
        from finetune.remote import verify as remote_verify

        return remote_verify.main(ns.checkpoint, full=ns.full)
    folder = find_checkpoint(ns.checkpoint)
    if folder is not None and folder != Path(ns.checkpoint) and read_manifest(folder) is None:
        # an output dir whose folders are all uncommitted holds no checkpoint to check, as a
        # bucket's prefix does not (find_checkpoint fell back to its highest folder)
        raise ConfigError(
            f"{ns.checkpoint}: no committed checkpoint ({folder.name} has no readable "
            "manifest.json: a save or copy that never finished)"
        )
    report = check_checkpoint(folder, checksums=not ns.quick) if folder else None
    if report is None or not report.is_checkpoint:
        raise ConfigError(
            f"{ns.checkpoint}: not a checkpoint (no manifest.json or DeepSpeed files)"
        )
    # intact; would resume and export unpickle it? (reads the pickles' opcodes)
    if report.ok and not ns.quick:
        report.problems += refusals(folder, stored_ranks(read_manifest(folder) or {}))
    if report.ok:  # a LoRA checkpoint: are its adapters all there? (headers and shapes only)
        report.problems += verify_adapter(folder, read_manifest(folder))
    what = "sizes" if ns.quick else "sizes and checksums"
    if report.ok:
        rate = report.bytes_checked / 1e9 / max(report.seconds, 1e-9)
        print(
            f"OK {folder}: {report.files} files, {report.bytes_checked / 1e6:.1f} MB, {what} match "
            f"({report.seconds:.2f} s, {rate:.2f} GB/s)"
        )
    else:
        print(f"DAMAGED {folder}: {len(report.problems)} problem(s)")
        for problem in report.problems:
            print(f"  - {problem}")
    if folder.resolve() != Path(ns.checkpoint).resolve():  # an output dir: what else is in it
        for note in notes(Path(ns.checkpoint)):
            print(f"  note: {note}")
    return 0 if report.ok else 1
