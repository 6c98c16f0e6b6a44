"""Which launcher started this process, translated into torch's RANK / WORLD_SIZE / LOCAL_RANK /
MASTER_ADDR / MASTER_PORT, before any process group exists.

torchrun, accelerate and DeepSpeed's pdsh, mpich and impi launchers export RANK themselves (the
mpich/impi runners also MASTER_ADDR: ``MPICHRunner.get_cmd`` and ``IMPIRunner.get_cmd`` in
deepspeed/launcher/multinode_runner.py).
``mpirun`` (OpenMPI, MVAPICH, Hydra: MPICH and Intel MPI) and ``srun`` export their own variables,
which ``adopt_launcher_env`` translates. Everything here reads a mapping, so each launcher is
unit-tested with a fake environment.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from finetune.config import ConfigError

# What each mpirun exports before the program starts: (rank, world size, local rank candidates).
# srun --mpi=pmi2 also sets PMI_RANK / PMI_SIZE but no local rank (Slurm's mpi_pmi2.c, task hook):
# PMI without a launcher's local rank is srun's, and SLURM's own variables describe that world.
MPI_VARIABLES = (
    (
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        ("OMPI_COMM_WORLD_LOCAL_RANK",),
    ),  # OpenMPI, PRRTE
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", ("MV2_COMM_WORLD_LOCAL_RANK",)),  # MVAPICH2
    # Hydra (MPICH, Intel MPI) and Cray PALS: the variables that main() in DeepSpeed's
    # deepspeed/launcher/launcher_helper.py maps.
    ("PMI_RANK", "PMI_SIZE", ("MPI_LOCALRANKID", "PALS_LOCAL_RANKID")),
)


@dataclass(frozen=True)
class Launch:
    """The world as a launcher describes it."""

    source: str  # the variables it came from, for messages
    rank: int
    world_size: int
    local_rank: int  # the process's index on its node (not yet a device: see local_device_index)
    # None: init()'s 127.0.0.1 (one host) or DeepSpeed's MPI discovery
    master_addr: str | None = None
    master_port: str | None = None


def adopt_launcher_env(env: MutableMapping[str, str] | None = None) -> Launch | None:
    """Export RANK / WORLD_SIZE / LOCAL_RANK (and MASTER_ADDR / MASTER_PORT where known) from the
    launcher's own variables; None under plain python. Idempotent.

    Raises ConfigError for an environment that names some of a world but not all of it: it would
    otherwise become a 1-rank world that trains alone and shares the output_dir with its peers.
    """
    env = os.environ if env is None else env
    launch = detect(env)
    if launch is None:
        return None
    env.update(
        RANK=str(launch.rank), WORLD_SIZE=str(launch.world_size), LOCAL_RANK=str(launch.local_rank)
    )
    if launch.master_addr:
        env["MASTER_ADDR"] = launch.master_addr
    if launch.master_port:
        env["MASTER_PORT"] = launch.master_port
    return launch


def detect(env: Mapping[str, str]) -> Launch | None:
    """The launcher's world. An explicit RANK wins (torchrun under mpirun sets its own), then
    mpirun's variables (inside an sbatch job the ranks also inherit the batch step's SLURM_PROCID,
    which are not theirs), then srun's."""
    if "RANK" in env:
        if "WORLD_SIZE" not in env:
            raise ConfigError(
                f"RANK={env['RANK']} is set but WORLD_SIZE is not: set both (and LOCAL_RANK, "
                "MASTER_ADDR), or start finetune with torchrun, deepspeed, srun or mpirun"
            )
        return _checked(
            Launch(
                "RANK/WORLD_SIZE",
                _int(env, "RANK"),
                _int(env, "WORLD_SIZE"),
                _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
                env.get("MASTER_ADDR"),
                env.get("MASTER_PORT"),
            )
        )
    launch = _from_mpi(env) or _from_slurm(env)
    if launch is not None:
        return launch
    partial = [
        v
        for v in ("OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
        if v in env
    ]
    if partial:
        raise ConfigError(
            f"{partial[0]}={env[partial[0]]} is set but not this world's size and local rank (no "
            "mpirun or srun variables beside it): set RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR"
        )
    if env.get("WORLD_SIZE", "1") != "1":
        raise ConfigError(
            f"WORLD_SIZE={env['WORLD_SIZE']} is set but RANK is not: set both (and LOCAL_RANK, "
            "MASTER_ADDR), or start finetune with torchrun, deepspeed, srun or mpirun"
        )
    return None


def deepspeed_discovers_master(env: Mapping[str, str] | None = None) -> bool:
    """Whether DeepSpeed's ``init_distributed`` must find MASTER_ADDR itself: an mpirun world of
    more than one rank that did not export it (DeepSpeed's openmpi and mvapich runners do not:
    ``OpenMPIRunner.get_cmd`` and ``MVAPICHRunner.get_cmd`` in
    deepspeed/launcher/multinode_runner.py). init() then leaves MASTER_ADDR unset, so that
    init_distributed runs its discovery (``init_distributed`` in deepspeed/comm/comm.py)."""
    env = os.environ if env is None else env
    if "MASTER_ADDR" in env:
        return False
    launch = _from_mpi(env)  # raises where nothing could discover it
    return launch is not None and launch.world_size > 1


def local_rank(env: Mapping[str, str] | None = None) -> int:
    """This process's index on its node, from the environment alone (before adoption too)."""
    env = os.environ if env is None else env
    if "LOCAL_RANK" in env:
        return _int(env, "LOCAL_RANK")
    launch = detect(env)
    return launch.local_rank if launch is not None else 0


def local_device_index(device_count: int | None = None) -> int:
    """The accelerator this rank drives: LOCAL_RANK modulo the devices this process sees.

    Under ``srun --gpus-per-task=1`` or ``--gpu-bind`` each task sees only its own GPU, as device 0,
    while SLURM_LOCALID counts the node's tasks: local rank 3 is then device 0. Where every rank
    sees all of the node's GPUs this is LOCAL_RANK itself. Reads the environment only and creates no
    CUDA context (``torch.cuda.device_count()``), so it works before ``init()``. ``device_count``:
    the devices visible (default: the DeepSpeed accelerator's; on CPU the local rank is returned).
    """
    local = local_rank()
    if device_count is None:
        from deepspeed.accelerator import get_accelerator

        acc = get_accelerator()
        if acc.device_name() == "cpu":
            return local
        device_count = acc.device_count()
    return local % device_count if device_count > 0 else local


def check_deepspeed_local_rank(device_index: int, env: Mapping[str, str] | None = None) -> None:
    """DeepSpeed reads LOCAL_RANK as the device ordinal (``get_local_rank`` in
    deepspeed/comm/comm.py: "local rank (= GPU device ID)"; ``zero.Init`` and
    ``DeepSpeedEngine._set_distributed_vars``), and under OpenMPI requires it to equal
    OMPI_COMM_WORLD_LOCAL_RANK (``DeepSpeedEngine._configure_with_arguments``, an assert in
    deepspeed.initialize)."""
    env = os.environ if env is None else env
    ompi = env.get("OMPI_COMM_WORLD_LOCAL_RANK")
    if ompi is not None and ompi != str(device_index):
        raise ConfigError(
            f"this rank drives device {device_index} but OMPI_COMM_WORLD_LOCAL_RANK={ompi}, and "
            "DeepSpeed requires the two to be equal: under mpirun let every rank see all of its "
            "node's GPUs (no per-rank CUDA_VISIBLE_DEVICES), and start no launcher from mpirun"
        )


def expand_nodelist(nodelist: str, source: str = "host list") -> list[str]:
    """A SLURM host list as hosts, in order: ``node[01-03],gpu7`` → node01 node02 node03 gpu7.

    What ``scontrol show hostnames`` does, without a process per rank or a slurm.conf: ranges keep
    the width of their lower bound (``[08-10]`` → 08 09 10), several bracket groups in one name
    expand left to right (``r[1-2]n[1-2]`` → r1n1 r1n2 r2n1 r2n2), text after a group is kept
    (``n[1-2]-ib``). Anything else raises ConfigError naming ``source``.
    """
    hosts: list[str] = []
    for entry in _split_entries(nodelist.strip(), source):
        parts = re.split(r"\[([^\[\]]*)\]", entry)  # literal, group, literal, …, literal
        names = [""]
        for i, part in enumerate(parts):
            if i % 2 == 0:
                if "[" in part or "]" in part:
                    raise _bad_nodelist(nodelist, source, f"unbalanced brackets in {entry!r}")
                names = [n + part for n in names]
            else:
                names = [n + v for n in names for v in _expand_group(part, nodelist, source)]
        hosts.extend(names)
    return hosts


def _split_entries(nodelist: str, source: str) -> list[str]:
    """The comma-separated entries outside brackets (an empty one is skipped, as scontrol does)."""
    if re.search(r"\s", nodelist):
        raise _bad_nodelist(nodelist, source, "whitespace inside")
    entries: list[str] = []
    depth = 0  # brackets open at this character
    start = 0  # where the current entry begins
    for i, ch in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise _bad_nodelist(nodelist, source, "unbalanced or nested brackets")
        if ch == "," and depth == 0:
            entries.append(nodelist[start:i])
            start = i + 1
    if depth:
        raise _bad_nodelist(nodelist, source, "unbalanced brackets")
    entries.append(nodelist[start:])
    return [e for e in entries if e]


def _expand_group(group: str, nodelist: str, source: str) -> list[str]:
    values = []
    for item in group.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not m or int(m.group(2) or m.group(1)) < int(m.group(1)):
            raise _bad_nodelist(nodelist, source, f"bad range {item!r}")
        lo = m.group(1)
        hi = m.group(2) or lo
        values += [f"{n:0{len(lo)}d}" for n in range(int(lo), int(hi) + 1)]
    return values


def _bad_nodelist(nodelist: str, source: str, why: str) -> ConfigError:
    return ConfigError(
        f"{source}={nodelist!r}: cannot expand this host list ({why}); export MASTER_ADDR="
        f'<rank 0\'s host> (e.g. $(scontrol show hostnames "${source}" | head -n 1))'
    )


def _from_mpi(env: Mapping[str, str]) -> Launch | None:
    for rank_var, size_var, local_vars in MPI_VARIABLES:
        if rank_var not in env:
            continue
        local_var = next((v for v in local_vars if v in env), None)
        if rank_var == "PMI_RANK" and local_var is None:
            continue  # srun's PMI (see MPI_VARIABLES): _from_slurm
        missing = [v for v in (size_var, local_var or local_vars[0]) if v not in env]
        if missing:
            raise ConfigError(
                f"{rank_var}={env[rank_var]} is set but {' and '.join(missing)} not: an incomplete "
                "mpirun environment; set RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR instead"
            )
        launch = _checked(
            Launch(
                f"{rank_var.rsplit('_', 1)[0]}_*",
                _int(env, rank_var),
                _int(env, size_var),
                _int(env, local_var),
                env.get("MASTER_ADDR"),
                env.get("MASTER_PORT"),
            )
        )
        if (
            launch.master_addr is None
            and launch.world_size > 1
            and not _deepspeed_can_discover(env)
        ):
            raise ConfigError(
                f"started by mpirun ({rank_var}={launch.rank} of {launch.world_size}) "
                "without MASTER_ADDR: export it on every rank (mpirun -x "
                "MASTER_ADDR=<rank 0's host>, or a MASTER_ADDR line in .deepspeed_env), "
                "or install mpi4py so DeepSpeed can discover it"
            )
        return launch
    return None


def _deepspeed_can_discover(env: Mapping[str, str]) -> bool:
    """What ``init_distributed`` (deepspeed/comm/comm.py) does when a variable is missing: AzureML's
    patch (in_aml and not in_dlts) reads AzureML's own variables; SageMaker's logs MASTER_ADDR
    (``patch_aws_sm_env_for_torch_nccl_backend``, a KeyError without it); otherwise
    ``mpi_discovery`` imports mpi4py (its first line)."""
    if in_azureml(env):
        return True
    return "SM_TRAINING_ENV" not in env and _mpi4py_available()


def _mpi4py_available() -> bool:
    return importlib.util.find_spec("mpi4py") is not None


def in_azureml(env: Mapping[str, str] | None = None) -> bool:
    """DeepSpeed's in_aml() and not in_dlts() (the test in ``init_distributed``,
    deepspeed/comm/comm.py): its AzureML patch sets the world."""
    env = os.environ if env is None else env
    return "AZUREML_EXPERIMENT_ID" in env and "DLTS_JOB_ID" not in env


def master_from_mpi() -> str:
    """Rank 0's address, broadcast over MPI (what DeepSpeed's ``mpi_discovery`` in
    deepspeed/comm/comm.py does).

    Done here rather than by init_distributed: its discovery (``mpi_discovery``) also overwrites
    LOCAL_RANK with a count of the ranks on this host, and the communicator is bound to that device
    (``TorchBackend.init_process_group`` in deepspeed/comm/torch.py) before init() could put the
    device index back; with one GPU visible per rank that is an invalid ordinal. Collective over
    MPI_COMM_WORLD.
    """
    import socket

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    addr = socket.gethostbyname(socket.gethostname()) if comm.Get_rank() == 0 else None
    return comm.bcast(addr, root=0)


# The step ids of the batch script, the extern and the interactive (salloc) step
# (SLURM_BATCH_SCRIPT, SLURM_EXTERN_CONT, SLURM_INTERACTIVE_STEP), for Slurm versions that
# export one there.
BATCH_STEP_IDS = frozenset(
    {"4294967290", "4294967291", "4294967292", "batch", "extern", "interactive"}
)


def _from_slurm(env: Mapping[str, str]) -> Launch | None:
    """One srun task per rank. MASTER_ADDR: the step's first host, where srun starts task 0."""
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return None
    rank = _int(env, "SLURM_PROCID")
    world = _int(env, "SLURM_NTASKS")
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    if world > 1 and (step is None or step in BATCH_STEP_IDS):
        # The batch script itself (one process) also has SLURM_PROCID=0 and the job's SLURM_NTASKS:
        # taken as rank 0 of N it would wait for N-1 peers that never start, until --ddp_timeout.
        raise ConfigError(
            f"started in an sbatch script's batch step (SLURM_NTASKS={world}, no srun "
            "step): start one task per rank with `srun python -m finetune …`, or a "
            "launcher (deepspeed, torchrun)"
        )
    local = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
    addr = env.get("MASTER_ADDR")
    if addr is None:
        var = next((v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST") if env.get(v)), None)
        if var is not None:
            addr = expand_nodelist(env[var], var)[0]
        elif world > 1:
            raise ConfigError(
                f"srun task {rank} of {world} but neither SLURM_STEP_NODELIST nor "
                "SLURM_JOB_NODELIST is set: export MASTER_ADDR=<rank 0's host>"
            )
    port = env.get("MASTER_PORT") or str(29500 + int(env.get("SLURM_JOB_ID", "0") or 0) % 1000)
    return _checked(Launch("SLURM_PROCID/SLURM_NTASKS", rank, world, local, addr, port))


def _checked(launch: Launch) -> Launch:
    if not (0 <= launch.rank < launch.world_size and launch.local_rank >= 0):
        raise ConfigError(
            f"{launch.source}: rank {launch.rank}, world size {launch.world_size}, local rank "
            f"{launch.local_rank} is not a world"
        )
    return launch


def _int(env: Mapping[str, str], var: str) -> int:
    try:
        return int(env[var])
    except ValueError:
        raise ConfigError(f"{var}={env[var]!r} is not an integer") from None
