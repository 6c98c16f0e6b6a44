"""DeepSpeed's universal checkpoint format, converted in pieces that survive an interruption.

A checkpoint saved by N ranks resumes on M != N ranks through ``<checkpoint>/universal`` (what
DeepSpeed's ``ds_to_universal`` writes: ``zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt``,
``zero/optimizer_state.pt`` and the rank files' model states). Run whole, the conversion starts
over after every interruption, so under frequent preemption it never finishes. Here it runs as
DeepSpeed's own ZeRO-3 steps called one piece at a time, each piece's files fsynced and then
marked done in ``universal.tmp/.pieces``:

  extract   one piece per saved rank: its optimizer file cut into per-parameter fragments
            (``tmp/<param>/0/<state>.<rank>``), DeepSpeed's ``extract_zero_shards_stage3``;
  merge     one piece per parameter: its fragments of every rank concatenated into
            ``zero/<param>/<state>.pt`` (``merge_zero3_slices``), checked against the
            parameter's size (DeepSpeed's merge takes whatever fragments it finds);
  finish    the optimizer's common state and the model-state files; the fragments removed.

A rerun (the next start after a preemption, a crash, a kill) skips every piece marked done, as long
as ``.pieces/source.json`` names the same saved checkpoint (its save id); a piece cut short has no
marker and is done again. So the conversion makes progress in any window longer than its largest
piece: one rank's optimizer file (1/N of the checkpoint) or one parameter.

It runs in a child process (``to_universal``) whose every ``torch.load`` is restricted to the
allow-list (safe_load.run_module), that ignores the preemption signals (its parent decides when to
stop, and kills it) and dies with its parent. Where the installed DeepSpeed lacks the functions
this calls, or the checkpoint has tensor-parallel or AutoEP files, DeepSpeed's ``ds_to_universal``
runs whole instead (not resumable).

Fault site (io/faults.py): ``resume.universal_piece``, before each piece, in the child. Test seam:
``FINETUNE_SLOW_UNIVERSAL=<seconds>`` sleeps before each piece.

Used by resume on another world size (checkpoint/resume.py) and by ``finetune export --universal``
(offline/export.py); ``finetune ls`` reports a cached conversion's size from its manifest.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from finetune.checkpoint_format.manifest import MANIFEST, check_file, read_manifest
from finetune.io import seams
from finetune.io.durable import fsync_path, hash_file, sync_filesystem, write_json_durably
from finetune.io.faults import fault_point
from finetune.weights import safe_load

if TYPE_CHECKING:
    import torch

UNIVERSAL = "universal"
PIECES = ".pieces"  # inside <target>.tmp: source.json and one marker per finished piece
STATES = ("fp32", "exp_avg", "exp_avg_sq")


class Interrupted(RuntimeError):
    """The conversion was stopped on purpose (a preemption); the pieces done are kept."""


# --- the parent's side ----------------------------------------------------------------------------


def to_universal(folder: Path, target: Path, cancel: threading.Event | None = None) -> str:
    """Convert ``folder`` into ``target`` (staged in ``target.tmp``, renamed into place with a
    manifest.json of its files and the save id it was converted from). Resumes the pieces a
    previous attempt finished. ``cancel``: when set, the child is killed and Interrupted raised
    (what it finished is kept). Raises RuntimeError naming DeepSpeed's last line on failure; a rank
    file naming a class off the allow-list raises ``safe_load.UnsafePickle`` first. Returns the
    converter's summary (pieces done now and before)."""
    # what it reads: refused here, one line, naming the class
    for path in sorted(folder.glob("*_states.pt")):
        safe_load.check_globals(path)
    tmp = target.with_name(f"{target.name}.tmp")
    cmd = [
        sys.executable,
        "-c",
        _CHILD,
        str(os.getpid()),
        __name__,
        str(folder),
        str(tmp),
        (read_manifest(folder) or {}).get("save_id") or "",
    ]
    with open(os.devnull, "rb") as stdin:
        # A process group of its own: a stop kills it with its workers, all at once.
        proc = subprocess.Popen(
            cmd,
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    lines: list[str] = []

    def read():
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("finetune: "):  # the child's own announcements (an injected fault)
                sys.stderr.write(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while proc.poll() is None:
        if cancel is not None and cancel.wait(0.2):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # finished in the meantime
            proc.wait()
            raise Interrupted(
                f"stopped converting {folder.name}; {done_pieces(tmp)} piece(s) done are kept"
            )
        if cancel is None:
            proc.wait()
    reader.join(5)
    if proc.returncode in (-signal.SIGTERM, -signal.SIGUSR1, -signal.SIGINT):
        # A preemption signal in the instant before the child could ignore it: the ranks got it too.
        raise Interrupted(
            f"the conversion of {folder.name} was stopped by a signal; "
            f"{done_pieces(tmp)} piece(s) done are kept"
        )
    if proc.returncode != 0:
        last = [line.strip() for line in lines if line.strip()]
        raise RuntimeError(
            f"DeepSpeed's ds_to_universal failed on {folder} (exit {proc.returncode}): "
            f"{last[-1] if last else 'no output'}"
        )
    # The manifest from what each piece hashed as it finished (nothing is read back here: at 70B
    # that would be ~1 TB on one rank, in a window no preemption waits for); the markers go only
    # after the rename, so an interruption up to there leaves every piece done.
    write_universal_manifest(tmp, (read_manifest(folder) or {}).get("save_id"), piece_hashes(tmp))
    os.replace(tmp, target)
    fsync_path(target.parent)
    shutil.rmtree(target / PIECES, ignore_errors=True)
    return next(
        (line.strip() for line in reversed(lines) if line.startswith("converted")), "converted"
    )


# The child ignores the preemption signals and dies with its parent from its first
# instructions (the parent decides when a preemption stops it, and kills it; a parent killed
# while the child imports must not leave it converting beside the next run's), then runs
# main() with every torch.load restricted.
_CHILD = (
    "import ctypes, os, signal, sys\n"
    "for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT): signal.signal(s, signal.SIG_IGN)\n"
    "try:\n    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG\n"
    "except (OSError, AttributeError):\n    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)  # the parent died before the line above\n"
    "from finetune.weights.safe_load import run_module\n"
    "run_module(sys.argv[2], sys.argv[3:])\n"
)


def piece_hashes(tmp: Path) -> dict[str, tuple[int, str]]:
    """{file relative to the conversion: (size, xxh3)} that the finished pieces recorded."""
    found: dict[str, tuple[int, str]] = {}
    for marker in sorted((tmp / PIECES).glob("*")):
        if marker.name != "source.json":
            found.update(
                {
                    name: tuple(v)
                    for name, v in ((_read_json(marker) or {}).get("files") or {}).items()
                }
            )
    return found


def done_pieces(tmp: Path) -> int:
    try:
        return sum(1 for p in (tmp / PIECES).iterdir() if p.name != "source.json")
    except OSError:
        return 0


def write_universal_manifest(
    target: Path, source_save_id: str | None, known: dict[str, tuple[int, str]] | None = None
) -> None:
    """``target``'s manifest.json: every file (but the pieces' markers) with its size and checksum,
    from ``known`` where the file's size still matches, else hashed now."""
    known = known or {}
    files = {}
    for p in sorted(target.rglob("*")):
        rel = str(p.relative_to(target))
        if not p.is_file() or p.name == MANIFEST or rel.startswith(f"{PIECES}/"):
            continue
        files[rel] = (
            known[rel] if rel in known and known[rel][0] == p.stat().st_size else hash_file(p)
        )
    write_json_durably(
        target / MANIFEST,
        {
            "source_save_id": source_save_id,
            "files": {n: {"size": s, "checksum": c} for n, (s, c) in files.items()},
        },
    )


def verify_universal(
    target: Path,
    source_save_id: str | None,
    checksums: bool = True,
    cancel: threading.Event | None = None,
) -> list[str]:
    """Problems of a universal conversion against its manifest (empty: reusable). ``cancel``:
    checked between files (a preemption stops a verification of hundreds of GB): Interrupted."""
    manifest = read_manifest(target)
    if manifest is None:
        return [f"{MANIFEST} missing or unreadable (an interrupted or foreign conversion)"]
    if manifest.get("source_save_id") != source_save_id:
        return [
            f"converted from save {manifest.get('source_save_id')}, the "
            f"checkpoint is save {source_save_id}"
        ]
    problems = []
    for name, meta in manifest.get("files", {}).items():
        if cancel is not None and cancel.is_set():
            raise Interrupted(f"stopped verifying {target}")
        problems += check_file(target / name, name, meta, checksums)
    return problems


# --- the child's side: the pieces -----------------------------------------------------------------


class Pieces:
    """``<out>/.pieces``: which pieces of this conversion are done, for which saved checkpoint."""

    def __init__(self, out: Path, source: str):
        self.out = out
        self.dir = out / PIECES
        known = _read_json(self.dir / "source.json")
        if known is not None and known.get("source") != source:
            # Another save's conversion (the folder was replaced): nothing of it is ours.
            shutil.rmtree(out, ignore_errors=True)
        self.dir.mkdir(parents=True, exist_ok=True)
        if known is None or known.get("source") != source:
            write_json_durably(self.dir / "source.json", {"source": source})
            fsync_path(self.dir)

    def done(self, name: str) -> bool:
        return (self.dir / name).is_file()

    def run(
        self,
        name: str,
        work: Callable[[], None],
        written: Callable[[], list[Path]],
        final: bool = True,
    ) -> float:
        """``work()``; then what ``written()`` lists made durable, then the piece marked done (a
        marker lost in a crash only means the piece is done again), with the size and checksum of
        each file ``final`` (part of the conversion, not a fragment): hashed now, from the page
        cache, so the manifest needs no second read. Returns its seconds."""
        fault_point("resume.universal_piece")
        seams.pause(seams.SLOW_UNIVERSAL)
        start = time.perf_counter()
        work()
        if not sync_filesystem(self.out):  # one flush of the filesystem, where Linux has syncfs
            files = written()
            for path in files:
                fsync_path(path)
            for parent in sorted({p.parent for p in files}):
                fsync_path(parent)
        record = {str(p.relative_to(self.out)): hash_file(p) for p in written()} if final else {}
        marker = self.dir / f".{name}.tmp"
        marker.write_text(json.dumps({"files": record}) + "\n")
        os.replace(marker, self.dir / name)
        return time.perf_counter() - start


# What the forked workers need (set before the pool forks; a worker inherits it).
_JOB: dict = {}


def _piece(kind: str, arg: int | str) -> float:
    """One piece in a worker: ("extract", rank) or ("merge", parameter name)."""
    job = _JOB
    ds = job["ds"]
    fragments = job["fragments"]
    zero = job["zero"]
    shapes = job["shapes"]
    dp = job["dp"]
    if kind == "extract":
        return job["pieces"].run(
            f"extract-{arg:06d}",
            lambda: ds.extract_zero_shards_stage3(
                job["optim_grid"], job["shapes_grid"], dp, str(fragments), (0, arg)
            ),
            lambda: [
                fragments / n / "0" / f"{s}.{ds.dp_index_to_str(arg)}"
                for n in shapes
                for s in STATES
            ],
            final=False,
        )
    return job["pieces"].run(
        f"merge-{_safe(arg)}",
        lambda: _merge(ds, fragments, zero, arg, shapes[arg], dp),
        lambda: [zero / arg / f"{s}.pt" for s in STATES],
    )


def _run_pieces(todo: list[tuple[str, object]], workers: int) -> list[float]:
    """Pieces in ``workers`` forked processes (in this one when 1): their seconds. Each marks itself
    done; a failure in any (an injected kill included) fails the conversion, the
    others' marks kept."""
    if workers <= 1 or len(todo) <= 1:
        return [_piece(kind, arg) for kind, arg in todo]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # A worker dies with the converter: none may go on writing pieces after a preemption killed it.
    with ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("fork"), initializer=_die_with_parent
    ) as pool:
        return list(pool.map(_piece, *zip(*todo)))


def convert(folder: Path, out: Path, source: str) -> None:
    """The ZeRO-3 conversion of ``folder`` into ``out``, piece by piece (see the module doc); the
    pieces of each phase in parallel, as many as DeepSpeed's own conversion
    would (min(4, cores))."""
    import deepspeed.checkpoint.ds_to_universal as ds

    if not _can_split(ds, folder):
        print("converting in one piece (DeepSpeed's ds_to_universal): not resumable", flush=True)
        _whole(ds, folder, out)
        return
    pieces = Pieces(out, source)
    optim_files = ds._filter_zero3_optim_files(ds._get_optim_files(str(folder)))
    model_files = ds._get_zero3_model_state_files(str(folder))
    optim_grid, _, dp = ds._build_zero3_rank_grid(optim_files)
    model_grid, _, _ = ds._build_zero3_rank_grid(model_files)
    shapes_grid = [ds._parse_model_states_stage3([model_grid[0][0]])]
    shapes = {name: shape for group in shapes_grid[0] for name, shape in group.items()}
    _JOB.update(
        ds=ds,
        pieces=pieces,
        optim_grid=optim_grid,
        shapes_grid=shapes_grid,
        shapes=shapes,
        dp=dp,
        fragments=out / "tmp",
        zero=out / "zero",
    )
    workers = max(1, min(4, os.cpu_count() or 1))
    # Every rank's fragments before any merge: a merge takes whatever fragments it finds.
    took = _run_pieces(
        [("extract", r) for r in range(dp) if not pieces.done(f"extract-{r:06d}")], workers
    )
    took += _run_pieces(
        [("merge", n) for n in sorted(shapes) if not pieces.done(f"merge-{_safe(n)}")], workers
    )

    def finish():
        ds._save_optimizer_state_stage3(argparse.Namespace(output_folder=str(out)), optim_files)
        for f in model_files:
            shutil.copy2(f, out)

    if not pieces.done("finish"):
        took.append(
            pieces.run(
                "finish",
                finish,
                lambda: [
                    out / "zero" / "optimizer_state.pt",
                    *(out / Path(f).name for f in model_files),
                ],
            )
        )
    shutil.rmtree(out / "tmp", ignore_errors=True)
    total = dp + len(shapes) + 1
    print(
        f"converted {folder.name}: {len(took)} of {total} pieces now, {total - len(took)} done "
        f"before; the longest {max(took, default=0.0):.1f} s",
        flush=True,
    )


def _merge(
    ds: ModuleType, fragments: Path, zero: Path, name: str, shape: torch.Size, dp: int
) -> None:
    """One parameter: DeepSpeed's merge (it concatenates whatever fragments it finds, and merges
    start only once every rank's extraction is marked done), then the merged size checked against
    the parameter's: a fragment missing or short fails here, never in the resumed run."""
    import torch

    ds.merge_zero3_slices(dp, str(zero), str(fragments), name)
    want = ds._shape_numel(shape)
    for state in STATES:
        got = torch.load(
            zero / name / f"{state}.pt", map_location="cpu", mmap=True, weights_only=True
        ).numel()
        if got != want:
            raise RuntimeError(
                f"{name}: merged {state} has {got} elements, the "
                f"parameter {want} (a fragment missing?)"
            )


def _can_split(ds: ModuleType, folder: Path) -> bool:
    """DeepSpeed has what the pieces call, and the checkpoint is plain ZeRO-3 data parallel (no
    tensor-parallel grid, no AutoEP expert files)."""
    needed = (
        "_filter_zero3_optim_files",
        "_get_optim_files",
        "_get_zero3_model_state_files",
        "_build_zero3_rank_grid",
        "_parse_model_states_stage3",
        "extract_zero_shards_stage3",
        "merge_zero3_slices",
        "dp_index_to_str",
        "_save_optimizer_state_stage3",
        "_shape_numel",
    )
    if not all(hasattr(ds, n) for n in needed):
        return False
    if any(ds._is_expert_model_state_file(str(f)) for f in folder.glob("*model_states.pt")):
        return False
    optim = ds._filter_zero3_optim_files(ds._get_optim_files(str(folder)))
    _, tp, _ = ds._build_zero3_rank_grid(optim)
    return tp == 1


def _whole(ds: ModuleType, folder: Path, out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    workers = str(max(1, min(4, os.cpu_count() or 1)))
    sys.argv = [
        "ds_to_universal",
        "--input_folder",
        str(folder),
        "--output_folder",
        str(out),
        "--num_extract_workers",
        workers,
        "--num_merge_workers",
        workers,
    ]
    ds.main(ds.parse_arguments())
    # DeepSpeed's pointer, beside the checkpoint
    (out.parent / "latest_universal").unlink(missing_ok=True)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the parent dies (a rank killed mid-conversion must not leave
    a converter writing beside the next run's)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main(argv: list[str]) -> None:
    convert(Path(argv[0]), Path(argv[1]), argv[2])


if __name__ == "__main__":
    main(sys.argv[1:])
