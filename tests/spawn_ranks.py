"""Start N finetune ranks as independent processes, the way ``srun`` (without --kill-on-bad-exit)
or ``mpirun`` do: no launcher kills the survivors when one rank dies, so a rank that would hang
waiting for a dead or failed peer shows up as one.

    python spawn_ranks.py NPROCS REPORT.json MASTER_PORT [--fork [--zygote SOCKET]] -- [flags...]
    python spawn_ranks.py --serve SOCKET

Each rank gets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT and inherits this
process's group and output. REPORT.json.pids holds ``{rank: pid}`` once every rank is started. When
every rank has exited, REPORT.json holds each rank's exit code (negative: killed by that signal)
and the wall-clock time it exited; REPORT ``-`` writes neither. The exit code is the first non-zero
rank's (as the shell reports a signal: 128 + signal), else 0: a rank's own code passes through, as
under DeepSpeed's launcher (torchrun reports any failure as 1).

Without ``--fork`` each rank is ``python -m finetune``. With it, this process imports the libraries
every rank imports (torch, transformers, DeepSpeed, datasets: ~6 s of one core) once, then forks
the ranks, which run ``python -m finetune``'s code from there: the same processes, minus the
imports, which are ~60 % of a short test run's CPU. What a fault test looks at (saves, commits,
kills, signals, exits) starts after that; a test about signals *during* start-up runs without it.
With ``--zygote`` those imports were made once, by a zygote that serves many launches (its
section below): the ranks are then in a group of their own, which this process's signals reach.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

# What every rank imports before its first step (import order as in a run); finetune itself is
# not preloaded: its modules read their environment (the fault to inject, the rank) when imported.
PRELOAD = (
    "torch",
    "torch.distributed",
    "deepspeed",
    "deepspeed.runtime.engine",
    "deepspeed.runtime.zero.muon.muon_optimizer",  # imported by DeepSpeed's ZeRO optimizer check
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
    "transformers.optimization",
    "datasets",
)


def _rank_env(rank: int, nprocs: int, port: str) -> dict:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(nprocs),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
    }


def _forked_rank(env: dict, args: list[str]) -> None:
    """In the child: become ``python -m finetune ARGS`` (finetune/__main__.py's two steps); never
    returns (finetune's entry leaves with os._exit)."""
    os.environ.update(env)
    sys.argv = [sys.argv[0], *args]
    sys.path[0] = os.getcwd()  # as under -m: the working directory, not this script's folder
    code = 1
    try:
        from finetune.preemption import catch_early

        catch_early()
        from finetune.cli import entry

        entry()
    finally:
        os._exit(code)  # only when entry itself failed to import or raised


def main(argv: list[str]) -> int:
    if argv[:1] == ["--serve"]:
        return serve(argv[1])
    nprocs, report, port = int(argv[0]), argv[1], argv[2]
    rest = argv[3:]
    fork = rest[:1] == ["--fork"]
    rest = rest[1:] if fork else rest
    zygote = None
    if rest[:1] == ["--zygote"]:
        zygote, rest = rest[1], rest[2:]
    args = rest[1:] if rest[:1] == ["--"] else rest
    if zygote is not None:
        code = through_zygote(zygote, [str(nprocs), report, port, *args])
        if code is not None:
            return code
    return launch(nprocs, report, port, args, fork, preloaded=False)


def launch(
    nprocs: int,
    report: str,
    port: str,
    args: list[str],
    fork: bool,
    preloaded: bool,
    then: Callable[[], None] = lambda: None,
) -> int:
    """Start the ranks, then ``then()``, wait for every one, write REPORT; the exit code as the
    module's docstring says."""
    started = time.time()
    pids: list[int] = []
    if fork:
        import importlib

        if not preloaded:
            for name in PRELOAD:
                importlib.import_module(name)
        sys.stdout.flush()
        sys.stderr.flush()
        for r in range(nprocs):
            pid = os.fork()
            if pid == 0:
                _forked_rank(_rank_env(r, nprocs, port), args)
            pids.append(pid)
    else:
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "finetune", *args],
                env=dict(os.environ, **_rank_env(r, nprocs, port)),
            )
            for r in range(nprocs)
        ]
        pids = [p.pid for p in procs]
    then()
    if report != "-":
        with open(report + ".pids.tmp", "w") as f:
            json.dump({str(r): pid for r, pid in enumerate(pids)}, f)
        os.replace(report + ".pids.tmp", report + ".pids")
    codes: list[int | None] = [None] * nprocs
    ended: list[float | None] = [None] * nprocs
    while None in codes:
        for r, pid in enumerate(pids):
            if codes[r] is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[r], ended[r] = os.waitstatus_to_exitcode(status), time.time()
        time.sleep(0.02)
    if report != "-":
        with open(report + ".tmp", "w") as f:
            json.dump({"pids": pids, "codes": codes, "ended": ended, "started": started}, f)
        os.replace(report + ".tmp", report)
    failed = next((c for c in codes if c), 0)
    return 128 - failed if failed < 0 else failed


# --- a zygote: the imports made once per test worker ---------------------------------------------
#
# ``--serve SOCKET`` imports PRELOAD once and then, for each client (``--zygote SOCKET``: this
# script as a launcher), forks a launch that takes over the client's standard streams, working
# directory and environment, becomes a process group of its own, forks the ranks and reports their
# exit code back. The client stays the test's process: a signal it gets is passed to the launch's
# group, and when it dies (SIGKILL to its group) the launch kills its ranks. A client whose
# environment differs from the zygote's in anything the imports may have read (all but FINETUNE_*,
# which only finetune reads, AWS_*, the libraries' verbosity, pytest's per-test variable and the
# shell's own) is refused and starts its ranks itself.

IGNORED_ENV = ("FINETUNE_", "AWS_")  # AWS_*: read by boto3 when a client is made
IGNORED_NAMES = {"PYTEST_CURRENT_TEST", "_", "PWD", "OLDPWD", "SHLVL"} | {
    # read by transformers and datasets when imported, and set by finetune's CLI when it runs (in a
    # test's own process too); a rank's console setup sets both libraries' levels itself
    "TRANSFORMERS_VERBOSITY",
    "DATASETS_VERBOSITY",
}
FORWARDED = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGCONT")


def _import_env(env: dict) -> dict:
    return {
        k: v for k, v in env.items() if not k.startswith(IGNORED_ENV) and k not in IGNORED_NAMES
    }


def _differ(own: dict, added: dict, env: dict) -> list[str]:
    """The variables a client's ``env`` has otherwise than the zygote's before its imports
    (``own``), but for those the imports set (``added``), which the client may have set alike by
    importing the same libraries."""
    theirs = _import_env(env)
    return sorted(
        k
        for k in own.keys() | theirs.keys()
        if theirs.get(k) != own.get(k) and not (k in added and theirs.get(k) in (None, added[k]))
    )


def _send(conn, message: dict, fds: list[int] | None = None) -> None:
    import socket

    data = json.dumps(message).encode() + b"\n"
    if fds:
        socket.send_fds(conn, [data], fds)
    else:
        conn.sendall(data)


def _receive(conn, nfds: int = 0) -> tuple[dict | None, list[int]]:
    import socket

    data, fds = b"", []
    while not data.endswith(b"\n"):
        if nfds and not fds:
            chunk, fds, _, _ = socket.recv_fds(conn, 1 << 20, nfds)
        else:
            chunk = conn.recv(1 << 20)
        if not chunk:
            return None, fds
        data += chunk
    return json.loads(data), fds


def serve(path: str) -> int:
    import importlib
    import socket

    own = _import_env(dict(os.environ))
    for name in PRELOAD:
        importlib.import_module(name)
    # what the imports set for themselves (torch's and DeepSpeed's defaults): each launch keeps it
    added = {k: v for k, v in os.environ.items() if k not in own and k not in IGNORED_NAMES}
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(8)
    sys.stdout.flush()
    sys.stderr.flush()
    while True:
        conn, _ = server.accept()
        request, fds = _receive(conn, 3)
        differ = _differ(own, added, request["env"]) if request is not None else None
        if differ != [] or len(fds) != 3:
            if differ:
                print(f"spawn_ranks zygote: refused, its environment differs: {differ}", flush=True)
            _send(conn, {"ok": False})
            conn.close()
            for fd in fds:
                os.close(fd)
            continue
        child = os.fork()
        if child == 0:  # the launch, forked twice: its parent is gone at once, not this zygote's
            server.close()
            if os.fork() != 0:
                os._exit(0)
            _launched(conn, fds, request, added)
        os.waitpid(child, 0)
        conn.close()
        for fd in fds:
            os.close(fd)


def _launched(conn, fds: list[int], request: dict, added: dict) -> None:
    """In the launch: the client's streams, folder and environment, a group of its own; never
    returns."""
    import signal
    import threading

    try:  # a failure before "ok" sends the client to its own imports, after it to exit code 1
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update({**added, **request["env"]})
        _send(conn, {"ok": True, "group": os.getpgrp()})
        nprocs, report, port, *args = request["argv"]

        def orphaned() -> None:  # the client died (SIGKILL to the test's group): so do the ranks
            _receive(conn)
            os.killpg(0, 9)

        def started() -> None:  # the ranks get what the client passes on; the launch waits
            for name in FORWARDED:
                signal.signal(getattr(signal, name), signal.SIG_IGN)
            threading.Thread(target=orphaned, daemon=True).start()

        code = launch(int(nprocs), report, port, args, fork=True, preloaded=True, then=started)
        _send(conn, {"code": code})
    finally:
        os._exit(0)  # nobody waits for the launch: its ranks' code went to the client


def through_zygote(path: str, argv: list[str]) -> int | None:
    """As a client: the ranks started by the zygote at ``path``; their exit code, or None when
    the zygote is not there or refuses this environment."""
    import signal
    import socket

    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        _send(conn, {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}, [0, 1, 2])
        reply, _ = _receive(conn)
    except OSError:
        return None
    if not reply or not reply["ok"]:
        return None
    group = reply["group"]

    def forward(sig: int, _frame: object) -> None:
        try:
            os.killpg(group, sig)
        except ProcessLookupError:  # every rank has exited
            pass

    for name in FORWARDED:
        signal.signal(getattr(signal, name), forward)
    done, _ = _receive(conn)
    return done["code"] if done else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
