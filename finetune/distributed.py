"""Process-group setup and rank helpers.

Works unchanged under the DeepSpeed launcher, torchrun, accelerate, srun, mpirun and plain python:
``launchers.adopt_launcher_env`` turns what each exports into RANK / WORLD_SIZE / LOCAL_RANK /
MASTER_ADDR / MASTER_PORT.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

from finetune import launchers
from finetune.config import DEFAULT_DDP_TIMEOUT, ConfigError
from finetune.console import swallow_build_notice
from finetune.io.progress import watch

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("finetune")

T = TypeVar("T")


def _initialized() -> ModuleType | None:
    """torch.distributed once a process group exists, else None. Without importing torch: the CLI
    reports bad flags (and their rank) before torch is loaded, and no group exists before then."""
    td = sys.modules.get("torch.distributed")
    return td if td is not None and td.is_available() and td.is_initialized() else None


def adopt_launcher_env() -> None:
    """``launchers.adopt_launcher_env`` for ``cli.main``, which calls it before parsing (the batch
    size reads WORLD_SIZE) and outside its error handling: an environment that cannot be adopted
    is reported by ``init()``, which adopts again, as the usual one line and exit 2."""
    try:
        launchers.adopt_launcher_env()
    except ConfigError:
        return  # init() raises it


def env_rank() -> int:
    """The rank from the environment, usable before the process group exists."""
    return int(os.environ.get("RANK", "0"))


def init(timeout_s: int | None = None) -> None:
    """Create the process group (a 1-rank group under plain python);
    ``timeout_s`` = --ddp_timeout."""
    import deepspeed

    global _timeout_s
    _timeout_s = int(timeout_s or DEFAULT_DDP_TIMEOUT)

    launchers.adopt_launcher_env()
    # An mpirun world without MASTER_ADDR: rank 0's address over mpi4py,
    # or (AzureML) DeepSpeed's patch.
    discover = launchers.deepspeed_discovers_master()
    if discover and not launchers.in_azureml():
        # mpi4py: checked by deepspeed_discovers_master
        os.environ["MASTER_ADDR"] = launchers.master_from_mpi()
        discover = False
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if not discover:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port()) if world_size_env() == 1 else "29500"
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    local = launchers.local_device_index()
    launchers.check_deepspeed_local_rank(local)
    # DeepSpeed takes LOCAL_RANK for the device ordinal (init_process_group's device_id,
    # engine.set_device, zero.Init): a task that sees one GPU must say 0, not its SLURM_LOCALID.
    os.environ["LOCAL_RANK"] = str(local)
    if acc.device_name() != "cpu":
        # Before any collective: NCCL runs object/tensor collectives on the *current* device, and
        # without this every rank of a node would use device 0 until deepspeed.initialize.
        acc.set_device(local)
    # The timeout bounds how long a dead peer goes unnoticed; long single-rank work
    # polls (gather_outcomes).
    # distributed_port: only MPI discovery reads it (DeepSpeed's init_distributed hands it to
    # mpi_discovery alone, deepspeed/comm/comm.py), else it would take 29500.
    with swallow_build_notice():  # its "…shm_comm_op built successfully", once per rank
        deepspeed.init_distributed(
            timeout=timedelta(seconds=_timeout_s), distributed_port=int(os.environ["MASTER_PORT"])
        )
    # MPI discovery recounts it by host name (DeepSpeed's mpi_discovery, deepspeed/comm/comm.py)
    os.environ["LOCAL_RANK"] = str(local)
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
    if get_accelerator().device_name() != "cpu" or os.environ.get("LOCAL_SIZE") != str(
        world_size()
    ):
        return
    name = "deepspeed_allreduce_buffer_{}_{}_{}_{}".format(
        os.getuid(), os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""), rank()
    )
    barrier()
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except OSError:
        pass  # already gone, or not ours to remove: a leak, not a failure


def device() -> torch.device:
    """Where this rank's tensors go: the accelerator's current device, or CPU."""
    import torch
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    return (
        torch.device("cpu")
        if acc.device_name() == "cpu"
        else torch.device(acc.current_device_name())
    )


def world_size_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank() -> int:
    td = _initialized()
    return td.get_rank() if td is not None else env_rank()


def world_size() -> int:
    td = _initialized()
    return td.get_world_size() if td is not None else world_size_env()


# --sequence_parallel_size: the ranks that share each sequence, contiguous (DeepSpeed's groups:
# ranks r*N .. r*N+N-1 hold one row's shards); set once, by build, before the data is made.
_sequence_parallel = 1


def set_sequence_parallel(size: int) -> None:
    global _sequence_parallel
    _sequence_parallel = size


def sequence_parallel_size() -> int:
    return _sequence_parallel


def sequence_parallel_rank() -> int:
    """Which shard of each row this rank holds."""
    return rank() % _sequence_parallel


def data_parallel_size() -> int:
    """Ranks that train on different rows: the world size / --sequence_parallel_size."""
    return world_size() // _sequence_parallel


def data_parallel_rank() -> int:
    return rank() // _sequence_parallel


def is_main() -> bool:
    return rank() == 0


def barrier() -> None:
    td = _initialized()
    if td is not None:
        td.barrier()


def any_rank(flag: bool) -> bool:
    """True on every rank iff ``flag`` is true on at least one rank. Every rank must call this."""
    return bool(all_gather_object(bool(flag)).count(True))


def all_gather_object(obj: T) -> list[T]:
    """Every rank's ``obj`` as a list indexed by rank. Every rank must call this."""
    td = _initialized()
    if td is None or td.get_world_size() == 1:
        return [obj]
    out = [None] * td.get_world_size()
    td.all_gather_object(out, obj)
    return out


class RankError(RuntimeError):
    """Another rank failed in work every rank agreed on; carries that rank's message."""


_timeout_s = DEFAULT_DDP_TIMEOUT  # --ddp_timeout, set by init()


def poll_seconds() -> float:
    """How often ranks that wait for another rank's long work check in: well inside the timeout."""
    return max(0.05, min(5.0, _timeout_s / 4))


def describe_error(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


@dataclass
class Outcomes:
    """What every rank's share of some work came to (see ``gather_outcomes``)."""

    result: Any = None  # this rank's result (None where it did not run or failed)
    results: list | None = None  # every rank's result, by rank (when asked to share them)
    errors: dict[int, str] = field(default_factory=dict)  # rank → "Type: first line of the message"
    kinds: dict[int, str] = field(default_factory=dict)  # rank → exception class name
    own: BaseException | None = None  # this rank's exception, for its traceback

    @property
    def ok(self) -> bool:
        return not self.errors

    def describe(self) -> str:
        return "; ".join(f"rank {r}: {e}" for r, e in sorted(self.errors.items()))

    def raise_any(self) -> None:
        """The same failure on every rank: the failing rank re-raises its own exception; the others
        raise a ConfigError (a bad input is bad everywhere) or a RankError naming the rank."""
        if self.own is not None:
            raise self.own
        if self.errors:
            r = min(self.errors)
            if self.kinds[r] == "ConfigError":
                raise ConfigError(self.errors[r].split(": ", 1)[-1])
            raise RankError(f"rank {r} failed: {self.errors[r]}")


class StepTimeout(TimeoutError):
    """An agreed step's work made no progress for its deadline (a hung mount, a syscall in D-state).
    Its thread is left behind (it cannot be stopped); every rank treats the step as failed."""


WAIT_LOG_S = 60.0  # how often rank 0 says which ranks an agreed step still waits for


def io_deadline() -> float:
    """How long a storage step of a save, commit, retention or resume may go without progress
    before it fails on every rank: --ddp_timeout, as long as one collective may wait."""
    return float(_timeout_s)


def gather_outcomes(
    fn: Callable[[], Any],
    on: bool = True,
    *,
    share: bool = False,
    inline: bool = False,
    poll_s: float | None = None,
    step: str = "",
    deadline_s: float | None = None,
    stop: Callable[[], bool] | None = None,
    cancel: threading.Event | None = None,
) -> Outcomes:
    """The agreement primitive: run rank-local work, then tell every rank how it went everywhere.

    ``fn`` runs on the ranks where ``on`` is true (every rank, one rank, each storage's leader);
    every rank must call this. Nothing ``fn`` raises escapes before the agreement: it is caught,
    all-gathered, and every rank returns the same ``errors`` (and, with ``share``, every rank's
    result), so all of them take the same branch next and none is left alone in a collective.
    While ``fn`` runs (in a thread), the ranks all-gather a "done" flag every ``poll_s`` seconds
    (default: a quarter of --ddp_timeout, at most 5 s): waiting for a long ``fn`` (a tokenization
    or a universal conversion of hours) never holds one collective open past its timeout. ``step``
    names the work: rank 0 logs "waiting for rank r: <step> (N s)" once a minute while it runs.
    ``deadline_s``: a rank whose ``fn`` has made no progress (``progress.progress()``) for that
    long fails with StepTimeout, decided from the gathered clocks so every rank decides alike; its
    thread is abandoned (a syscall stuck in D-state cannot be interrupted), so ``fn`` must leave
    nothing half-done that a late finish could harm. ``fn`` must not call collectives itself (it
    runs beside them). ``stop``/``cancel``: when ``stop()`` is true on any rank at a poll (a
    preemption signal), ``cancel`` is set on every rank; ``fn`` is expected to notice and return
    early. ``cancel`` is also set when the step is given up at its deadline: a thread that comes
    back later checks it before any further side effect (a rename's ``latest``, the next file).
    ``inline``: ``fn`` is quick and bounded and touches no storage (a value already computed): run
    it here, no thread, no polling.
    """
    box: dict = {}
    ctx = {"last": time.monotonic()}

    def work():
        watch(ctx)
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 — every rank learns of it below
            box["error"] = e
        finally:
            watch(None)

    late: list[int] = []
    if inline or (world_size() == 1 and deadline_s is None and stop is None):
        if on:
            work()
    else:
        late = _poll(work, on, poll_s or poll_seconds(), ctx, step, deadline_s, stop, cancel)
        if late and cancel is not None:
            # every rank alike (``late`` is agreed): the abandoned work stops where it can
            cancel.set()
    own = box.get("error")
    if rank() in late:
        own = StepTimeout(
            f"{step or 'an agreed step'} made no progress for {deadline_s:g} s (a hung filesystem?)"
            if time.monotonic() - ctx["last"] >= deadline_s
            else f"{step or 'an agreed step'} given up: another rank's made "
            f"no progress for {deadline_s:g} s"
        )
    # A ConfigError subclass (LeaseHeld…) is a bad input everywhere:
    # every rank exits 2 with its line.
    kind = (
        None
        if own is None
        else ("ConfigError" if isinstance(own, ConfigError) else type(own).__name__)
    )
    result = None if late else box.get("result")  # a late result (after the deadline) never counts
    mine = (None if own is None else (kind, describe_error(own)), result if share else None)
    gathered = all_gather_object(mine)
    out = Outcomes(result=result, own=own)
    for r, (failure, _) in enumerate(gathered):
        if failure is not None:
            out.kinds[r], out.errors[r] = failure
    if share:
        out.results = [result for _, result in gathered]
    return out


def _poll(
    work: Callable[[], None],
    on: bool,
    poll_s: float,
    ctx: dict,
    step: str,
    deadline_s: float | None,
    stop: Callable[[], bool] | None = None,
    cancel: threading.Event | None = None,
) -> list[int]:
    """Run ``work`` on a thread where ``on`` and all-gather (done, seconds without progress, asked
    to stop) every ``poll_s`` until every rank is done, or until a rank not done has gone
    ``deadline_s`` without progress; returns the ranks given up on. Collective."""
    thread = (
        threading.Thread(target=_on_this_device(work), name="finetune-agreed", daemon=True)
        if on
        else None
    )
    if thread is not None:
        thread.start()
    start = time.monotonic()
    logged = 0
    while True:
        if thread is not None:
            thread.join(timeout=poll_s)
        busy = thread is not None and thread.is_alive()
        views = all_gather_object(
            (
                busy,
                time.monotonic() - ctx["last"] if busy else 0.0,
                time.monotonic() - start,
                bool(stop is not None and stop()),
            )
        )
        waiting = [r for r, (b, _, _, _) in enumerate(views) if b]
        if cancel is not None and any(v[3] for v in views):
            cancel.set()  # every rank alike: the work (where it runs) stops early
        if not waiting:
            return []
        stalled = max(views[r][1] for r in waiting)
        if deadline_s is not None and stalled >= deadline_s:
            hung = [r for r in waiting if views[r][1] >= deadline_s]
            log_main(
                logging.ERROR,
                "giving up on rank %s: %s made no progress for %.0f s (deadline %g s)",
                _ranks(hung),
                step or "an agreed step",
                stalled,
                deadline_s,
            )
            return waiting  # the step failed: a rank still busy with it is abandoned too
        waited = max(v[2] for v in views)
        if waited >= (logged + 1) * WAIT_LOG_S:
            logged = int(waited // WAIT_LOG_S)
            log_main(
                logging.WARNING,
                "waiting for rank %s: %s (%.0f s)",
                _ranks(waiting),
                step or "an agreed step",
                waited,
            )


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8]))
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")


def _on_this_device(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` for another thread, on the caller's device: a CUDA thread starts on device 0, so
    without this every rank's agreed work (restoring its RNG, loading an op, reading device
    properties) would act on GPU 0."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.device_name() == "cpu":
        return fn
    index = acc.current_device()

    def bound():
        acc.set_device(index)
        fn()

    return bound


def run_agreed(
    fn: Callable[[], T],
    on: bool = True,
    poll_s: float | None = None,
    *,
    step: str = "",
    deadline_s: float | None = None,
) -> T | None:
    """``gather_outcomes`` that raises the same error on every rank if ``fn`` failed on any.

    Returns ``fn``'s result where it ran (None elsewhere).
    """
    out = gather_outcomes(fn, on, poll_s=poll_s, step=step, deadline_s=deadline_s)
    out.raise_any()
    return out.result


def share_from(
    src: int, fn: Callable[[], T], *, step: str = "", deadline_s: float | None = None
) -> T:
    """``fn``'s result computed on rank ``src`` only, on every rank; its failure raised on all."""
    out = gather_outcomes(fn, on=rank() == src, share=True, step=step, deadline_s=deadline_s)
    out.raise_any()
    return out.results[src]


def all_reduce_sum(values: list[float]) -> list[float]:
    """Element-wise sum over ranks (float64 so sums of counts stay exact). Collective."""
    # On the rank's device: NCCL reduces only accelerator tensors (gloo takes CPU ones).
    import torch

    t = torch.tensor(values, dtype=torch.float64, device=device())
    td = _initialized()
    if td is not None and td.get_world_size() > 1:
        td.all_reduce(t)
    return t.cpu().tolist()


def log_main(level: int, msg: str, *args: object) -> None:
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
    handler.setFormatter(
        logging.Formatter("[%(asctime)s] [finetune] [rank%(rank)s] %(message)s", "%H:%M:%S")
    )
    handler.addFilter(_RankFilter())
    handler.addFilter(_add_rank)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _add_rank(record: logging.LogRecord) -> bool:
    record.rank = rank()
    return True


def shutdown() -> None:
    td = _initialized()
    if td is not None:
        td.destroy_process_group()
