"""What the benchmark scripts share: the repository's paths, a free port, the environment their
launches run in, the machine and versions a figure was measured on, medians, JSON results, and
(for bench/run_all.py) a measure's entry in latest.json and the launching of each script under a
time limit.

A script reaches it with the repository on ``sys.path`` (``python bench/SUBJECT/SCRIPT.py`` puts
only its own folder there)::

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.harness import REPO, free_port  # noqa: E402

Standard library only at import time: workers under the DeepSpeed launcher import it too.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
PY = sys.executable
BIN = Path(PY).parent
MB = 1e6

# The ~134M Llama of bench/save/checkpoint_save.py and bench/resume/export.py is every checkpoint
# measure's model in the full run; --smoke replaces it with this.
TINY_MODEL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env() -> dict:
    """The environment of a DeepSpeed launch from a script: one thread per rank (the ranks share
    the machine's cores), the venv's ``bin`` first, no rank variables of an enclosing launch."""
    e = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        PATH=f"{BIN}:{os.environ.get('PATH', '')}",
    )
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(k, None)
    return e


def med(xs: list[float | None]) -> float | None:
    """The median of the values that are there (None when none is)."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def write_json(path: Path | str, result: dict) -> None:
    """A script's results, as the JSON run_all.py reads back."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {path}")


# --- environment --------------------------------------------------------------------------------


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def disk_of(path: Path) -> dict:
    """The mount, filesystem type, device and size of the filesystem holding ``path``."""
    path = path.resolve()
    best = None
    for line in _read("/proc/mounts").splitlines():
        dev, mnt, fstype, *_ = line.split()
        mnt = mnt.replace("\\040", " ")
        if (str(path) == mnt or str(path).startswith(mnt.rstrip("/") + "/")) and (
            best is None or len(mnt) > len(best[1])
        ):
            best = (dev, mnt, fstype)
    out: dict = {"path": str(path)}
    if best:
        dev, mnt, fstype = best
        out.update(device=dev, mount=mnt, fstype=fstype)
        name = Path(dev).name
        for cand in (
            name,
            name.rstrip("0123456789"),
            name.split("p")[0] if name.startswith("nvme") else name,
        ):
            rot = _read(f"/sys/block/{cand}/queue/rotational").strip()
            if rot:
                out["rotational"] = rot == "1"
                model = _read(f"/sys/block/{cand}/device/model").strip()
                if model:
                    out["model"] = model
                break
    try:
        st = os.statvfs(path)
        out.update(
            size_gb=round(st.f_blocks * st.f_frsize / 1e9, 1),
            free_gb=round(st.f_bavail * st.f_frsize / 1e9, 1),
        )
    except OSError:
        pass
    return out


def accelerator() -> str:
    """The GPU this machine's torch sees and its CUDA, or that there is none (CPU ranks, gloo)."""
    import torch

    if not torch.cuda.is_available():
        return "none (CPU, gloo)"
    n = torch.cuda.device_count()
    return f"{n} x {torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda}, NCCL)"


def machine(work: Path | None = None) -> dict:
    """The CPU, cores, RAM, kernel, virtualization and accelerator of this machine, the load on
    it now, and (given ``work``) the filesystem the benchmark writes to."""
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in _read("/proc/cpuinfo").splitlines()
            if ln.startswith("model name")
        ),
        platform.processor(),
    )
    mem = next(
        (
            int(ln.split()[1]) * 1024
            for ln in _read("/proc/meminfo").splitlines()
            if ln.startswith("MemTotal")
        ),
        0,
    )
    virt = None
    try:
        virt = (
            subprocess.run(
                ["systemd-detect-virt"], capture_output=True, text=True, timeout=5
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        if "hypervisor" in _read("/proc/cpuinfo"):
            virt = "a hypervisor (cpuinfo flag)"
    out = {
        "cpu_model": cpu,
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "ram_gib": round(mem / 2**30, 1),
        "kernel": platform.release(),
        "virtualization": virt,
        "accelerator": accelerator(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    if work is not None:
        out["bench_dir_disk"] = disk_of(work)
    return out


def versions() -> dict:
    """Python's and the libraries' versions, finetune's commit and whether the tree had changes."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in (
        "torch",
        "deepspeed",
        "transformers",
        "accelerate",
        "datasets",
        "tokenizers",
        "safetensors",
    ):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None

    def git(*args: str) -> str | None:
        try:
            return subprocess.run(
                ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10
            ).stdout.rstrip("\n")  # porcelain's lines start with a space where not staged
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain")
    out["finetune_commit"] = git("rev-parse", "HEAD")
    out["finetune_dirty"] = bool(status) if status is not None else None
    if status:
        out["finetune_changed_files"] = [ln[3:] for ln in status.splitlines()]
    return out


# --- running the scripts ------------------------------------------------------------------------


class Runner:
    """Runs one bench script as a child in its own process group, its output into a log (and,
    line by line, to this process's stdout), killed as a group at the timeout."""

    def __init__(
        self, results: Path, timeout: float, quiet: bool, concurrent: bool = False
    ) -> None:
        self.results, self.timeout, self.quiet = results, timeout, quiet
        self.logs = results / "run_all_logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        # With scripts running side by side (--jobs > 1), a buffer that appeared during one script
        # may be another's, just created: stale buffers are then removed once, by sweep(), at the
        # end.
        self.concurrent = concurrent
        self.shm_at_start = set(_shm_buffers())
        self.live: set[subprocess.Popen] = set()
        self._lock = threading.Lock()

    def __call__(
        self, name: str, script: str, args: list[object], ok_codes: tuple[int, ...] = (0,)
    ) -> tuple[int, str]:
        """Run ``bench/<script> <args>``; its exit code and output (raises when the code is not
        one of ``ok_codes``)."""
        cmd = [PY, str(BENCH / script), *[str(a) for a in args]]
        log = self.logs / f"{name}.log"
        shm_before = set(_shm_buffers())
        with open(log, "w") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            proc = subprocess.Popen(
                cmd,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
                env=child_env(),
            )
            with self._lock:
                self.live.add(proc)
            timer = threading.Timer(self.timeout, _kill_group, (proc, False))  # a silent hang too
            timer.start()
            try:
                for line in proc.stdout:
                    f.write(line)
                    f.flush()
                    if not self.quiet:
                        print(f"[{name}] {line.rstrip()}", flush=True)
                proc.wait()
            finally:
                timer.cancel()
                _kill_group(proc)  # ranks that outlived their launcher
                with self._lock:
                    self.live.discard(proc)
                if not self.concurrent:
                    _remove_stale_shm(set(_shm_buffers()) - shm_before)
        text = log.read_text(errors="replace")
        if proc.returncode not in ok_codes:
            why = (
                f"killed after {self.timeout:.0f} s"
                if proc.returncode == -signal.SIGKILL
                else f"exited {proc.returncode}"
            )
            raise RuntimeError(
                f"{script} {why}; last lines of {log}:\n" + "\n".join(text.splitlines()[-25:])
            )
        return proc.returncode, text

    def sweep(self) -> None:
        """After concurrent scripts: the stale buffers any of them left."""
        if self.concurrent:
            _remove_stale_shm(set(_shm_buffers()) - self.shm_at_start)

    def kill_all(self) -> None:
        with self._lock:
            live = list(self.live)
        for proc in live:
            _kill_group(proc, False)


def _shm_buffers() -> list[Path]:
    return list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*"))


def _remove_stale_shm(new: set[Path]) -> None:
    """DeepSpeed's shared-memory all-reduce buffers (~69 MB of RAM each) that appeared during a
    script and no live process maps: HF Trainer's runs (bare DeepSpeed) leave two per launch."""
    if not new:
        return
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(
                line.split()[-1] for line in maps.read_text().splitlines() if "/dev/shm/" in line
            )
        except OSError:
            continue
    for buf in new:
        if str(buf) not in mapped:
            buf.unlink(missing_ok=True)


def _kill_group(proc: subprocess.Popen, wait: bool = True) -> None:
    """Kill the script's process group and every descendant (data_path.py starts its launches in
    sessions of their own); a no-op for what already exited."""
    import psutil

    stray = []
    if proc.poll() is None:  # once reaped, its pid may be another process's
        try:
            stray = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for p in stray:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    if wait:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def child_env() -> dict:
    env = dict(os.environ)
    # The venv's ninja first, and one DeepSpeed op cache per venv (see the Makefile): otherwise
    # DeepSpeed rebuilds its CPU ops (minutes) inside a timed launch.
    env["PATH"] = f"{Path(PY).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    env.update(
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


# --- measures and their entries in latest.json ------------------------------------------------


def goal_met(goal: str, value: float | None) -> bool | None:
    if value is None:
        return None
    op, bound = goal.split()
    return value >= float(bound) if op == ">=" else value <= float(bound)


class Unavailable(Exception):
    """The measure cannot run in this checkout (recorded as its error, not a failure of the
    suite)."""


@dataclass(frozen=True)
class Measure:
    """One figure of the suite: ours / baseline, and the goal that ratio is held to."""

    key: str
    what: str
    goal: str

    def entry(
        self,
        ours: float,
        baseline: float,
        unit: str,
        baseline_name: str,
        raw: object,
        **extra: object,
    ) -> dict:
        """The measure's entry in latest.json (ratio = ours / baseline)."""
        ratio = ours / baseline if baseline else None
        return {
            "what": self.what,
            "ours": ours,
            "baseline": baseline,
            "ratio": ratio,
            "unit": unit,
            "baseline_name": baseline_name,
            "goal": self.goal,
            "met": goal_met(self.goal, ratio),
            "raw": raw,
            **extra,
        }

    def error(self, error: str, skipped: bool = False) -> dict:
        """The entry of a measure that has no figure: it failed, or (``skipped``) could not run."""
        out = {"what": self.what, "goal": self.goal, "error": error}
        if skipped:
            out["skipped"] = True
        return out


@dataclass
class Ctx:
    """What a measure's function gets: the mode's sizes (by run key), where results and scratch
    files go, and the runner that launches its script."""

    smoke: bool
    sizes: dict[str, dict]
    results: Path
    work: Path
    run: Callable[..., tuple[int, str]]

    @property
    def model_args(self) -> list[str]:
        """The checkpoint measures' model flag: the tiny Llama in --smoke, their default else."""
        return ["--model_json", json.dumps(TINY_MODEL)] if self.smoke else []

    @property
    def model_settings(self) -> dict:
        return {
            "model": ("tiny Llama " + json.dumps(TINY_MODEL))
            if self.smoke
            else "~134M Llama (hidden 768, 12 layers, vocab 32000, untied head), fp32"
        }


@dataclass(frozen=True)
class Run:
    """One script's launch in the suite: the measures its results give (P3's run gives P3 and
    P4; a sub-measure is an entry under its measure's ``sub``), its sizes in each mode, and the
    function that launches it and reads its JSON back."""

    measures: tuple[Measure, ...]
    script: str  # relative to bench/
    fn: Callable[[Ctx], dict | tuple[dict, ...]]
    full: dict
    smoke: dict
    subs: tuple[Measure, ...] = ()

    @property
    def key(self) -> str:
        return self.measures[0].key
