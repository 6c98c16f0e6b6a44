"""Shared fixtures: tiny models built from configs (no hub), data files, and a launcher runner."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Tokenized datasets are cached (finetune/data/cache.py) in datasets' cache: one per test session,
# shared by its runs (restarts hit it, as users' do), never the user's ~/.cache.
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="finetune-test-datasets-"))
BIN = Path(sys.executable).parent
# Starts the ranks of a run itself, forked after the imports every rank makes (its docstring).
SPAWN_RANKS = REPO / "tests" / "spawn_ranks.py"
# launcher_cmd("forked")'s report of the ranks, in the temp folder: removed with the run (a fault
# test's RankRun names its own report and reads it after the run).
FORKED_REPORT = "finetune-ranks-"
TOKENIZER_DIR = REPO / "finetune" / "resources" / "tokenizer"

# Each architecture as small as it goes; all share the embedded tokenizer (vocab 513).
ARCHS = {
    "llama": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    ),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=256),
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    ),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_tiny_model(arch: str, out: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    kw = dict(ARCHS[arch])
    config = AutoConfig.for_model(
        kw.pop("model_type"),
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **kw,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session", autouse=True)
def no_stale_shm_buffers():
    """Remove DeepSpeed shared-memory buffers that no live process maps (left by killed runs).

    Each is ~69 MB of RAM; older finetune versions (and bare DeepSpeed) leave two per run, which
    over a test session on a reused machine adds up to gigabytes and makes everything swap.
    """
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(
                line.split()[-1] for line in maps.read_text().splitlines() if "/dev/shm/" in line
            )
        except OSError:
            continue
    for buf in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*"):
        if str(buf) not in mapped:
            try:
                buf.unlink(missing_ok=True)
            except OSError:
                pass


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: build_tiny_model(arch, root / arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def data_files(tmp_path_factory) -> dict[str, Path]:
    """Small files in each format the CLI reads, from the embedded data's sentences."""
    root = tmp_path_factory.mktemp("data")
    lines = [
        json.loads(ln)["text"]
        for ln in (REPO / "finetune/resources/data/train.jsonl").read_text().splitlines()
    ][:240]
    pairs = [(t.split(". ", 1)[0] + ".", t.split(". ", 1)[1]) for t in lines if ". " in t]
    import csv

    with open(root / "pc.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["question", "answer"])
        w.writerows(pairs)
    with open(root / "chat.jsonl", "w") as f:
        for p, c in pairs:
            msgs = [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
            f.write(json.dumps({"messages": msgs}) + "\n")
    with open(root / "text.jsonl", "w") as f:
        for t in lines:
            f.write(json.dumps({"text": t}) + "\n")
    return {
        "pc_csv": root / "pc.csv",
        "chat_jsonl": root / "chat.jsonl",
        "text_jsonl": root / "text.jsonl",
    }


@dataclass
class Result:
    returncode: int
    output: str
    out_dir: Path
    leaked_shm: tuple = ()  # DeepSpeed shm buffer names the run left in /dev/shm (then removed)

    def metrics(self) -> list[dict]:
        path = self.out_dir / "metrics.jsonl"
        return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []

    def eval_rows(self) -> list[dict]:
        return [r for r in self.metrics() if "eval_loss" in r]

    def train_rows(self) -> list[dict]:
        return [r for r in self.metrics() if "loss" in r]


def launcher_cmd(launcher: str, nprocs: int) -> list[str]:
    port = str(free_port())
    if launcher == "deepspeed":
        return [
            str(BIN / "deepspeed"),
            "--num_gpus",
            str(nprocs),
            "--master_port",
            port,
            "--module",
            "finetune",
        ]
    if launcher == "torchrun":
        return [
            str(BIN / "torchrun"),
            "--nproc_per_node",
            str(nprocs),
            "--master_port",
            port,
            "-m",
            "finetune",
        ]
    if launcher == "accelerate":
        return [
            str(BIN / "accelerate"),
            "launch",
            "--multi_gpu",
            "--num_processes",
            str(nprocs),
            "--main_process_port",
            port,
            "-m",
            "finetune",
        ]
    if launcher == "python":
        return [sys.executable, "-m", "finetune"]
    if launcher == "forked":  # its report (the ranks' pids) is named by the port: unique
        report = Path(tempfile.gettempdir()) / f"{FORKED_REPORT}{port}.json"
        return [
            *(sys.executable, str(SPAWN_RANKS), str(nprocs), str(report), port, "--fork"),
            *("--zygote", str(zygote()), "--"),
        ]
    raise ValueError(launcher)


_ZYGOTE: list[subprocess.Popen] = []
_SESSION_ENV = dict(os.environ)  # before any test changed it: the zygote's environment


def zygote() -> Path:
    """This test process's zygote (tests/spawn_ranks.py --serve): it imports what every rank
    imports once, then forks each forked launch's ranks, so a launch costs ~3.7 CPU-s instead of
    ~9.7 (a 2-rank, 2-step run with a save). Started at the first forked launch, with the
    environment tests give their runs as it was when the session began (not as the first test
    left it); a launch whose environment differs in what imports read, or that comes before the
    zygote listens, imports for itself. Stopped at the end of the session."""
    path = _zygote_file("sock")
    if not _ZYGOTE:
        path.unlink(missing_ok=True)
        with open(_zygote_file("log"), "w") as log:
            _ZYGOTE.append(
                subprocess.Popen(
                    [sys.executable, str(SPAWN_RANKS), "--serve", str(path)],
                    cwd=REPO,
                    env=child_env(base=_SESSION_ENV),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    return path


@pytest.fixture(autouse=True, scope="session")
def _stop_the_zygote():
    yield
    for proc in _ZYGOTE:
        proc.kill()
        proc.wait()
        for suffix in ("sock", "log"):
            _zygote_file(suffix).unlink(missing_ok=True)


def _zygote_file(suffix: str) -> Path:
    """This test process's zygote's socket ("sock") or output ("log"), in the temp folder."""
    return Path(tempfile.gettempdir()) / f"finetune-zygote-{os.getpid()}.{suffix}"


def node_launcher(node: int, port: str, nodes: int = 2) -> list[str]:
    """torchrun for one "node" of one rank, on loopback: a job on ``nodes`` such launches sharing
    ``port``, each with its own flags (a node-local --output_dir, a cache folder of its own)."""
    return [
        *(str(BIN / "torchrun"), "--nnodes", str(nodes), "--node_rank", str(node)),
        *("--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", port),
        *("-m", "finetune"),
    ]


def child_env(extra: dict | None = None, base: dict | None = None) -> dict:
    """The environment of a run a test starts: ``base`` (default: this process's, now) with what
    every run gets here, then ``extra``."""
    env = dict(os.environ if base is None else base)
    # One DeepSpeed op cache per venv (see the Makefile): a shared one thrashes between checkouts.
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
            # torch.compile as a no-op: finetune compiles nothing, but DeepSpeed's ZeRO optimizer
            # check imports its Muon optimizer, whose @torch.compile decorator imports inductor:
            # ~1 s of CPU per rank, every start (deepspeed/runtime/zero/utils.py
            # is_zero_supported_optimizer). A test of a compiled path would set it to "0".
            "TORCHDYNAMO_DISABLE": "1",
            # BIN first, once: finetune's op setup, run in this process by some tests, puts it
            # first in os.environ too, and the zygote compares environments (spawn_ranks.py)
            "PATH": os.pathsep.join(
                [str(BIN), *(p for p in env.get("PATH", "").split(os.pathsep) if p != str(BIN))]
            ),
        }
    )
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(extra or {})
    return env


class Running:
    """A command started in its own process group, output to a file (a pipe could fill and block
    it).

    ``finish`` always kills the whole group afterwards: ranks that outlived their launcher (or a
    timeout) would keep both cores busy, and a DeepSpeed op-build lock held, for every later test.
    """

    def __init__(self, cmd: list[str], cwd: Path, env: dict, out_dir: Path | None = None):
        self.cmd, self.out_dir = cmd, out_dir
        cwd.mkdir(parents=True, exist_ok=True)
        self.log = Path(cwd) / f"run-{os.getpid()}-{id(self)}.log"
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(
                cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def finish(self, timeout: float) -> Result:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"timed out after {timeout}s: {' '.join(self.cmd)}\n{self.output()[-6000:]}"
            ) from None
        finally:
            self.kill()
        return Result(self.proc.returncode, self.output(), self.out_dir, self.leaked_shm)

    def kill(self) -> None:
        import psutil

        try:  # descendants too: scripts/launch.sh puts its launcher in a session of its own
            stray = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            stray = []
        # A zygote's ranks are no descendants, and their group is the launch's: killed first, and
        # waited for, so that every rank is gone when this returns, as with the others.
        ranks = list(self.rank_pids().values()) if self._ranks_report() is not None else []
        for group in [*_groups_of(ranks), self.proc.pid]:
            try:
                os.killpg(group, 9)
            except (ProcessLookupError, PermissionError):
                pass
        for p in stray:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        if self.proc.poll() is None:
            self.proc.wait()
        _wait_gone(ranks)
        port = next(
            (
                self.cmd[i + 1]
                for i, a in enumerate(self.cmd)
                if a in ("--master_port", "--main_process_port")
            ),
            None,
        )
        report = self._ranks_report()
        if report is not None:
            port = self.cmd[self.cmd.index(str(SPAWN_RANKS)) + 3]  # NPROCS REPORT PORT
            if report.name.startswith(FORKED_REPORT):
                for path in (report, Path(f"{report}.pids")):
                    path.unlink(missing_ok=True)
        self.leaked_shm = (
            tuple(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*")) if port else ()
        )
        for leaked in self.leaked_shm:
            leaked.unlink(missing_ok=True)  # left by a run that crashed or was killed on purpose

    def _ranks_report(self) -> Path | None:
        """Where tests/spawn_ranks.py reports this command's ranks; None under a launcher."""
        if str(SPAWN_RANKS) not in self.cmd:
            return None
        return Path(self.cmd[self.cmd.index(str(SPAWN_RANKS)) + 2])

    def rank_pids(self) -> dict[int, int]:
        """{RANK: pid} of the training processes under this command (not the launchers)."""
        import psutil

        report = self._ranks_report()
        if report is not None:  # forked ranks show the environment they were forked with
            try:
                pids = json.loads(Path(f"{report}.pids").read_text())
            except FileNotFoundError:
                return {}
            return {int(r): pid for r, pid in pids.items()}
        ranks = {}
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                env = child.environ()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if "LOCAL_RANK" in env and "RANK" in env and "finetune" in " ".join(child.cmdline()):
                ranks[int(env["RANK"])] = child.pid
        return ranks


def _groups_of(pids: list[int]) -> list[int]:
    """The process groups of ``pids`` other than this test process's own."""
    groups = set()
    for pid in pids:
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            pass
    return sorted(groups - {os.getpgrp(), 0, 1})


def _wait_gone(pids: list[int], timeout: float = 10.0) -> None:
    """Until each of ``pids`` has exited (a zombie counts: its parent reaps it), for ``timeout``."""
    import psutil

    deadline = time.monotonic() + timeout
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.01)


def run_cli(args: list[str], cwd) -> subprocess.CompletedProcess:
    """`python -m finetune ARGS` as a user runs it: one plain process, no launcher's variables."""
    from finetune.config import LEGACY_TIMEOUT_ENV

    drop = ("WORLD_SIZE", "RANK", "LOCAL_RANK", LEGACY_TIMEOUT_ENV)
    env = {k: v for k, v in os.environ.items() if k not in drop} | {"COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "finetune", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def run_group(cmd: list[str], cwd: Path, env: dict, timeout: float) -> tuple[str, int]:
    """Run ``cmd`` to the end in its own process group (see Running); returns (output, exit
    code)."""
    r = Running(cmd, cwd, env).finish(timeout)
    return r.output, r.returncode


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"gave up after {timeout}s waiting for {what}")


def last_logged_step(out: Path) -> int:
    """The newest training step in OUT/metrics.jsonl (0 before the first): progress of a live
    run."""
    from finetune.metrics import read_metrics

    return max((r["step"] for r in read_metrics(str(out)) if "loss" in r), default=0)


def assert_verifies(folder: Path) -> None:
    """`finetune verify FOLDER`, as a user runs it, exits 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "finetune", "verify", str(folder)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def finetune_cmd(
    launcher: str, nprocs: int, args: tuple, out: Path, output_dir_flag: bool = True
) -> list[str]:
    cmd = launcher_cmd(launcher, nprocs) + list(args)
    if output_dir_flag and "--output_dir" not in args:
        cmd += ["--output_dir", str(out)]
    return cmd


@pytest.fixture
def run_finetune(tmp_path):
    """Run the real CLI on ``nprocs`` ranks; returns a Result (never raises on a non-zero exit).

    Unless a test names a launcher, the ranks are forked by tests/spawn_ranks.py after the imports
    every rank makes (torch, DeepSpeed, transformers, datasets), made once per test worker by its
    zygote (``zygote()``): a 2-step 2-rank run with a save takes 3.7 CPU-s so, 9.7 when it imports
    for itself, 13.8 under torchrun and more under DeepSpeed's launcher, which starts two processes
    that each import DeepSpeed first. Each rank is still a process of its own with the environment
    a launcher gives it, and a rank's exit code passes through. The tests of what a
    launcher does (its signal forwarding, how it reports a failure, the product's everyday run)
    name it: ``launcher="deepspeed"``, ``"torchrun"``, ``"accelerate"``.
    """

    def run(
        *args: str,
        launcher: str = "forked",
        nprocs: int = 2,
        out_dir: Path | None = None,
        env: dict | None = None,
        timeout: int = 600,
        output_dir_flag: bool = True,
    ) -> Result:
        out = out_dir or tmp_path / "out"
        cmd = finetune_cmd(launcher, nprocs, args, out, output_dir_flag)
        return Running(cmd, tmp_path, child_env(env), out).finish(timeout)

    return run


@pytest.fixture
def start_finetune(tmp_path):
    """Start the real CLI on ``nprocs`` ranks and return the Running process (for signal and kill
    tests); the ranks forked as for run_finetune unless a test names a launcher."""
    started = []

    def start(
        *args: str,
        launcher: str = "forked",
        nprocs: int = 2,
        out_dir: Path | None = None,
        env: dict | None = None,
    ) -> Running:
        out = out_dir or tmp_path / "out"
        started.append(
            Running(finetune_cmd(launcher, nprocs, args, out), tmp_path, child_env(env), out)
        )
        return started[-1]

    yield start
    for r in started:
        r.kill()


def checkpoint_files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


def partitioned_file_set(world: int, tokenizer_files: set[str]) -> set[str]:
    files = {
        "config.json",
        "generation_config.json",
        "manifest.json",
        "trainer_state.json",
    } | tokenizer_files
    for r in range(world):
        files |= {
            f"rng_state_{r}.pt",
            f"zero_pp_rank_{r}_mp_rank_00_model_states.pt",
            f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
        }
    return files


EMBEDDED_TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}


def has_tmpfs_mount() -> bool:
    return shutil.which("mount") is not None and os.geteuid() == 0


def write_ds(tmp_path, cfg: dict, name: str = "ds.json") -> str:
    """A DeepSpeed JSON written into ``tmp_path``; its path."""
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return str(path)


def base_ds(**extra) -> dict:
    """The shipped ZeRO-3 config with ``extra`` keys replaced."""
    cfg = json.loads((REPO / "configs" / "ds_zero3.json").read_text())
    cfg.update(extra)
    return cfg


# Under xdist (`make test` / `make check` run `-n WORKERS --dist loadscope`): the tests of a module
# that launches real ranks stay on one worker, so its module fixtures (one shared run) run once; the
# SLURM modules share one worker, one cluster at a time (their job scripts pick ports by job id).
# Every other test is a unit of its own. xdist hands out the largest units first, so the unit tests
# fill the gaps at the end. (xdist's own loadgroup marks groups by rewriting node ids, which
# pytest 9 no longer reads; this scheduler needs only the ids.)
GROUPED = (
    "tests/distributed/",
    "tests/e2e/",
    "tests/faults/",
    "tests/checkpoint/test_at_rest.py",
    "tests/test_bench.py",
)
# Handed out before all others, in this order (xdist's order is by test count): the longest units,
# the bench smoke's fixture (~4 min) and the SLURM tests (~6 min), which once ran last, one worker
# alone on them; then the tests that launch ranks from modules of unit tests (~15-45 s each), which
# would otherwise come last of all, units of one test in collection order, one worker alone on the
# last of them while the other has no work left.
FIRST = (
    "tests/test_bench.py",
    "tests/slurm",
    "tests/test_end_to_end.py",
    "tests/test_gpu_readiness.py::test_the_fallback_config_trains_saves_and_resumes_under_offload",
    "tests/test_schedules.py::test_every_steps_lr_is_transformers_schedule_across_a_resume",
    "tests/test_trainer.py::test_real_deepspeed_skips_non_finite_steps",
)


@pytest.hookimpl(optionalhook=True)  # a hook of xdist's: without xdist, tests run serially
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            if module.startswith("tests/slurm/"):
                return "tests/slurm"
            return module if module.startswith(GROUPED) else nodeid

        def _assign_work_unit(self, node) -> None:
            first = [scope for scope in self.workqueue if scope.startswith(FIRST)]
            first.sort(
                key=lambda scope: next(i for i, p in enumerate(FIRST) if scope.startswith(p))
            )
            for scope in reversed(first):
                self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    return ModuleGroups(config, log)


# The fault sweep's summary table and its long/sampled split (tests/faults; `make faults`).
pytest_plugins = ["faults.plugin"]


# --- object storage (tests/s3_server.py) -------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory, request):
    """A real S3 server on loopback (SeaweedFS) for the requesting module, its ``BUCKET`` created;
    killed, data and all, after the module. Modules that use it call ``require_s3()`` first."""
    from s3_server import SeaweedS3

    with SeaweedS3(tmp_path_factory.mktemp("s3")) as s3:
        s3.create_bucket(request.module.BUCKET)
        yield s3


@pytest.fixture
def aws_env(server, monkeypatch):
    """The server's endpoint and test credentials in this process's environment (boto3 reads
    them); returns the server."""
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    return server
