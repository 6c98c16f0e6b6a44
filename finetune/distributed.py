"""Process-group setup and rank helpers.

Works unchanged under the DeepSpeed launcher, torchrun, accelerate, srun and plain python: all of
them (after ``adopt_slurm_env``) export RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import uuid
from datetime import timedelta
from pathlib import Path

import torch

from finetune.config import ConfigError

logger = logging.getLogger("finetune")


def adopt_slurm_env() -> None:
    """Under ``srun`` (one task per rank) derive torch's variables from SLURM's.

    Only when no launcher already set RANK: the DeepSpeed launcher inside an sbatch script sets
    its own, and those must win.
    """
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ or "SLURM_NTASKS" not in os.environ:
        return
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    os.environ.setdefault("MASTER_PORT", str(29500 + int(os.environ.get("SLURM_JOB_ID", "0")) % 1000))
    if "MASTER_ADDR" not in os.environ:
        # The sbatch scripts export MASTER_ADDR from `scontrol show hostnames`; this covers a bare srun.
        nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST", "")
        first = nodelist.split(",")[0]
        os.environ["MASTER_ADDR"] = first if first and "[" not in first else socket.gethostname()


def env_rank() -> int:
    """The rank from the environment, usable before the process group exists."""
    return int(os.environ.get("RANK", "0"))


def init() -> None:
    """Create the process group (a 1-rank group under plain python)."""
    import deepspeed

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port()) if world_size_env() == 1 else "29500"
    # Long timeout: a consolidated save of a large model legitimately keeps ranks apart a while.
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.device_name() != "cpu":
        # Before any collective: NCCL runs object/tensor collectives on the *current* device, and
        # without this every rank of a node would use device 0 until deepspeed.initialize.
        acc.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(timeout=timedelta(minutes=int(os.environ.get("FINETUNE_DIST_TIMEOUT_MIN", "30"))))
    _setup_logging()
    _unlink_shm_buffer()


def _unlink_shm_buffer() -> None:
    """Remove the name of DeepSpeed's CPU shared-memory all-reduce buffer once every rank mapped it.

    DeepSpeed's CPU backend (all ranks on one node, LOCAL_SIZE set by its launcher) creates
    ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>`` (~69 MB per rank) and never
    unlinks it, so every run leaks RAM until reboot, and a later run on the same port may map a
    stale buffer. Each rank maps every peer's buffer inside ``init_distributed``; after a barrier
    the names are no longer needed and the mappings stay valid.
    """
    from deepspeed.accelerator import get_accelerator

    # DeepSpeed's own condition (comm/torch.py + shm_interface.cpp), from facts every rank shares,
    # so every rank takes the barrier or none does; GPU runs skip it.
    if get_accelerator().device_name() != "cpu" or os.environ.get("LOCAL_SIZE") != str(world_size()):
        return
    name = "deepspeed_allreduce_buffer_{}_{}_{}_{}".format(
        os.getuid(), os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""), rank())
    barrier()
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except OSError:
        pass  # already gone, or not ours to remove: a leak, not a failure


def device() -> torch.device:
    """Where this rank's tensors go: the accelerator's current device, or CPU."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    return torch.device("cpu") if acc.device_name() == "cpu" else torch.device(acc.current_device_name())


def world_size_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else env_rank()


def world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else world_size_env()


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def agree(flag: bool) -> bool:
    """True on every rank iff ``flag`` is true on every rank. Every rank must call this.

    Local facts (a failed write, a signal, a file that verifies) go through here before any
    branch that leads to different collectives, so no rank is left waiting in one alone.
    """
    return not any_rank(not flag)


def any_rank(flag: bool) -> bool:
    """True on every rank iff ``flag`` is true on at least one rank. Every rank must call this."""
    return bool(all_gather_object(bool(flag)).count(True))


def all_gather_object(obj):
    """Every rank's ``obj`` as a list indexed by rank. Every rank must call this."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return [obj]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


class RankError(RuntimeError):
    """Another rank failed in work every rank agreed on; carries that rank's message."""


def run_agreed(fn, on: bool = True, poll_s: float = 5.0):
    """Run ``fn`` on the ranks where ``on`` is true, then agree on the outcome. Every rank must call this.

    Returns ``fn``'s result where it ran (None elsewhere). If ``fn`` raised on any rank, every
    rank raises: that rank its own exception, the others the same ConfigError (a bad input is bad
    everywhere) or a RankError naming the rank. So no rank can leave the others waiting in a later
    collective. ``fn`` runs in a thread while every rank all-gathers a "done" flag each ``poll_s``
    seconds: ranks that wait for a long ``fn`` (a tokenization of hours) never sit in one
    collective past its timeout. ``fn`` must not call collectives itself (it runs beside them).
    """
    outcome: dict = {}

    def work():
        try:
            outcome["result"] = fn()
        except BaseException as e:  # noqa: BLE001 — every rank re-raises it below, after agreeing
            outcome["error"] = e

    thread = threading.Thread(target=work, name="finetune-agreed", daemon=True) if on else None
    if thread is not None:
        if world_size() == 1:
            work()  # nobody to keep company: no thread
        else:
            thread.start()
    while world_size() > 1:
        if thread is not None:
            thread.join(timeout=poll_s)
        if all(all_gather_object(thread is None or not thread.is_alive())):
            break
    error = outcome.get("error")
    described = None if error is None else (type(error).__name__, str(error).strip().splitlines()[0] if str(error).strip() else "")
    failures = [(r, d) for r, d in enumerate(all_gather_object(described)) if d is not None]
    if error is not None:
        raise error
    if failures:
        r, (kind, message) = failures[0]
        if kind == "ConfigError":
            raise ConfigError(message)
        raise RankError(f"rank {r} failed: {kind}: {message}")
    return outcome.get("result")


PROBE = ".storage-probe"  # marker files that show which ranks share a folder


def _touch(marker: Path) -> str | None:
    """Create ``marker`` (and its folder); the error as text instead of raised: the caller's
    rank must still reach the collectives that follow."""
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError as e:
        return f"rank {rank()}: {e}"
    return None


def sharing_groups(folder: Path, flag: str) -> list[list[int]]:
    """Ranks grouped by which of them see the same ``folder`` (one group on shared storage). Collective.

    Found out, not guessed from host names (containers share them; a "node-local" path may be
    shared after all): every rank drops a marker file in ``folder``, and ranks that see each
    other's markers share it. ``flag`` names the folder in errors.
    """
    if world_size() == 1:
        return [[0]]
    nonce = all_gather_object(uuid.uuid4().hex if is_main() else None)[0]
    marker = folder / f"{PROBE}-{nonce}-{rank()}"
    error = _touch(marker)
    barrier()
    try:
        seen = sorted(int(p.name.rsplit("-", 1)[1]) for p in folder.glob(f"{PROBE}-{nonce}-*"))
    except OSError as e:
        seen, error = [rank()], error or f"rank {rank()}: {e}"
    views, errors = zip(*all_gather_object((seen, error)))
    barrier()
    try:
        marker.unlink(missing_ok=True)
    except OSError:
        pass  # a leftover marker is harmless: the next probe uses another nonce
    if any(errors):
        raise ConfigError(f"--{flag}: cannot write {folder}: {'; '.join(e for e in errors if e)}")
    for r, view in enumerate(views):
        if any(views[other] != view for other in view):
            raise ConfigError(f"--{flag}: ranks disagree about who shares {folder} (rank {r} sees {view}); "
                              "use storage local to each node, or storage all ranks share")
    return [list(v) for v in sorted({tuple(v) for v in views})]


def leads_storage(folder: Path, flag: str) -> bool:
    """Whether this rank is the first of the ranks that see the same ``folder``. Collective.

    For work where a duplicate is only wasted effort (two leaders on one storage publish the
    same thing atomically), so it is cheap at any world size: one marker file from rank 0, one
    lookup per rank (a name never seen before, so no filesystem cache can answer for the
    server), one all-gather. Ranks that see rank 0's marker share with it; the others are
    grouped by host (node-local disks).
    """
    if world_size() == 1:
        return True
    nonce = all_gather_object(uuid.uuid4().hex if is_main() else None)[0]
    marker = folder / f"{PROBE}-{nonce}"
    error = _touch(marker) if is_main() else None
    barrier()
    try:
        sees = marker.exists()
    except OSError:
        sees = False
    views = all_gather_object((sees, socket.gethostname(), error))
    if is_main():
        try:
            marker.unlink(missing_ok=True)
        except OSError:
            pass  # a leftover marker is harmless: the next probe uses another nonce
    if views[0][2]:
        raise ConfigError(f"--{flag}: cannot write {folder}: {views[0][2]}")
    me = rank()
    if views[me][0]:
        return me == 0
    return me == min(r for r, (s, host, _) in enumerate(views) if not s and host == views[me][1])


def all_reduce_sum(values: list[float]) -> list[float]:
    """Element-wise sum over ranks (float64 so sums of counts stay exact). Collective."""
    # On the rank's device: NCCL reduces only accelerator tensors (gloo takes CPU ones).
    t = torch.tensor(values, dtype=torch.float64, device=device())
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(t)
    return t.cpu().tolist()


def log_main(level: int, msg: str, *args) -> None:
    """Log on rank 0 only, whatever the level: for facts every rank knows (an agreed failure)."""
    if rank() == 0:
        logger.log(level, msg, *args)


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        # Warnings and errors are worth hearing from whichever rank has them; info is rank 0's.
        return record.levelno >= logging.WARNING or rank() == 0


def _setup_logging() -> None:
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(asctime)s] [finetune] [rank%(rank)s] %(message)s", "%H:%M:%S"))
    handler.addFilter(_RankFilter())
    handler.addFilter(_add_rank)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _add_rank(record: logging.LogRecord) -> bool:
    record.rank = rank()
    return True


def shutdown() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
