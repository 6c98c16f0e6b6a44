"""finetune.launchers: what mpirun, srun and the torch launchers export, turned into torch's
variables, on fake environments; SLURM host lists; the device a rank drives; and distributed.init
with DeepSpeed's init_distributed and accelerator faked (no process group, no GPU)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from finetune import distributed as dist
from finetune import launchers
from finetune.config import ConfigError
from finetune.launchers import adopt_launcher_env, expand_nodelist, local_device_index

PREFIXES = (
    "SLURM_",
    "OMPI_",
    "PMI_",
    "PMIX_",
    "MV2_",
    "PALS_",
    "MPI_LOCAL",
    "AZUREML_",
    "AZ_BATCH",
    "SM_",
    "DLTS_",
)
TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No launcher variables from whatever runs pytest; every variable restored afterwards."""
    for var in list(os.environ):
        if var in TORCH_VARS or var.startswith(PREFIXES):
            monkeypatch.delenv(var)
    for var in TORCH_VARS:  # recorded as absent, so that what init() sets is removed again
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    monkeypatch.setattr(launchers, "_mpi4py_available", lambda: False)


def setenv(monkeypatch, **values):
    for k, v in values.items():
        monkeypatch.setenv(k, str(v))


def torch_env() -> dict:
    return {k: os.environ[k] for k in TORCH_VARS if k in os.environ}


# --- mpirun ---------------------------------------------------------------------------------

OMPI = dict(
    OMPI_COMM_WORLD_RANK=5,
    OMPI_COMM_WORLD_SIZE=16,
    OMPI_COMM_WORLD_LOCAL_RANK=1,
    OMPI_COMM_WORLD_LOCAL_SIZE=8,
)


def test_openmpi_ranks_get_their_true_rank_and_world_size(monkeypatch):
    setenv(monkeypatch, **OMPI, MASTER_ADDR="node01")
    dist.adopt_launcher_env()  # what cli.main calls first
    assert torch_env() == {
        "RANK": "5",
        "WORLD_SIZE": "16",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "node01",
    }


def test_mpirun_inside_an_sbatch_job_ignores_the_batch_steps_slurm_variables(monkeypatch):
    # mpirun's ranks inherit the batch step's SLURM_PROCID=0 / SLURM_NTASKS: not theirs.
    setenv(
        monkeypatch,
        **OMPI,
        MASTER_ADDR="node01",
        SLURM_PROCID=0,
        SLURM_NTASKS=16,
        SLURM_LOCALID=0,
        SLURM_JOB_NODELIST="node[01-02]",
        SLURM_JOB_ID=77,
    )
    adopt_launcher_env()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == (
        "5",
        "16",
        "1",
    )


@pytest.mark.parametrize(
    "env, expected",
    [
        (
            dict(MV2_COMM_WORLD_RANK=3, MV2_COMM_WORLD_SIZE=4, MV2_COMM_WORLD_LOCAL_RANK=1),
            ("3", "4", "1"),
        ),
        # Hydra: MPICH, Intel MPI
        (dict(PMI_RANK=6, PMI_SIZE=8, MPI_LOCALRANKID=2), ("6", "8", "2")),
        (dict(PMI_RANK=6, PMI_SIZE=8, PALS_LOCAL_RANKID=2), ("6", "8", "2")),  # Cray PALS
    ],
    ids=["mvapich", "hydra", "pals"],
)
def test_other_mpi_launchers(monkeypatch, env, expected):
    setenv(monkeypatch, **env, MASTER_ADDR="node01")
    adopt_launcher_env()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == expected


def test_an_explicit_rank_wins_over_mpirun_and_srun_variables(monkeypatch):
    # torchrun (or DeepSpeed's pdsh/mpich/impi launchers) started from mpirun or srun sets its own.
    mine = {
        "RANK": "2",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29400",
    }
    setenv(
        monkeypatch,
        **mine,
        **OMPI,
        SLURM_PROCID=0,
        SLURM_NTASKS=1,
        SLURM_STEP_NODELIST="node[01-04]",
    )
    dist.adopt_launcher_env()
    assert torch_env() == mine


@pytest.mark.parametrize(
    "env, names",
    [
        (dict(OMPI_COMM_WORLD_RANK=1), "OMPI_COMM_WORLD_SIZE"),
        (dict(OMPI_COMM_WORLD_RANK=1, OMPI_COMM_WORLD_SIZE=4), "OMPI_COMM_WORLD_LOCAL_RANK"),
        (dict(MV2_COMM_WORLD_RANK=1, MV2_COMM_WORLD_LOCAL_RANK=1), "MV2_COMM_WORLD_SIZE"),
        # neither a launcher's local rank nor srun's variables
        (dict(PMI_RANK=1, PMI_SIZE=4), "PMI_RANK"),
        (dict(PMIX_RANK=3), "PMIX_RANK"),
        (dict(RANK=1), "WORLD_SIZE"),
        (dict(WORLD_SIZE=4), "RANK"),
        (dict(RANK=4, WORLD_SIZE=4), "not a world"),
        (
            dict(OMPI_COMM_WORLD_RANK="x", OMPI_COMM_WORLD_SIZE=4, OMPI_COMM_WORLD_LOCAL_RANK=0),
            "not an integer",
        ),
    ],
)
def test_a_partial_launcher_environment_is_an_error_not_a_one_rank_world(monkeypatch, env, names):
    setenv(monkeypatch, **env, MASTER_ADDR="node01")
    before = dict(os.environ)
    with pytest.raises(ConfigError, match=names):
        adopt_launcher_env()
    assert dict(os.environ) == before  # nothing half-adopted


def test_mpirun_without_master_addr_fails_fast_naming_what_to_set(monkeypatch):
    setenv(monkeypatch, **OMPI)
    with pytest.raises(ConfigError, match=r"MASTER_ADDR.*mpi4py"):
        adopt_launcher_env()


def test_mpirun_without_master_addr_leaves_it_to_deepspeeds_mpi_discovery_when_it_can(monkeypatch):
    monkeypatch.setattr(launchers, "_mpi4py_available", lambda: True)
    setenv(monkeypatch, **OMPI)
    adopt_launcher_env()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], "MASTER_ADDR" in os.environ) == (
        "5",
        "16",
        False,
    )
    assert launchers.deepspeed_discovers_master()


def test_azureml_mpi_discovery_needs_no_mpi4py(monkeypatch):
    # DeepSpeed's patch_aml_env_for_torch_nccl_backend reads AzureML's own variables.
    setenv(monkeypatch, **OMPI, AZUREML_EXPERIMENT_ID="x")
    assert launchers.deepspeed_discovers_master()


def test_a_one_rank_mpirun_needs_no_master_addr(monkeypatch):
    setenv(
        monkeypatch, OMPI_COMM_WORLD_RANK=0, OMPI_COMM_WORLD_SIZE=1, OMPI_COMM_WORLD_LOCAL_RANK=0
    )
    adopt_launcher_env()
    assert torch_env() == {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    assert not launchers.deepspeed_discovers_master()


# --- srun -----------------------------------------------------------------------------------

SRUN = dict(SLURM_PROCID=3, SLURM_NTASKS=8, SLURM_LOCALID=3, SLURM_JOB_ID=1234, SLURM_STEP_ID=0)


def test_bare_srun_with_a_bracketed_nodelist_uses_its_first_host(monkeypatch):
    setenv(monkeypatch, **SRUN, SLURM_STEP_NODELIST="node[01-04]", SLURM_JOB_NODELIST="node[00-04]")
    dist.adopt_launcher_env()
    assert torch_env() == {
        "RANK": "3",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "3",
        "MASTER_ADDR": "node01",
        "MASTER_PORT": str(29500 + 1234 % 1000),
    }


@pytest.mark.parametrize(
    "env, master",
    [
        (dict(SLURM_JOB_NODELIST="gpu-a[1,3-5],gpu-b7"), "gpu-a1"),
        (dict(SLURM_STEP_NODELIST="n[001-002]-ib"), "n001-ib"),
        (dict(SLURM_STEP_NODELIST="node07"), "node07"),
        # the sbatch scripts' export
        (dict(SLURM_STEP_NODELIST="node[01-04]", MASTER_ADDR="10.1.1.1"), "10.1.1.1"),
    ],
)
def test_srun_master_addr(monkeypatch, env, master):
    setenv(monkeypatch, **SRUN, **env)
    adopt_launcher_env()
    assert os.environ["MASTER_ADDR"] == master


def test_srun_with_pmi2_is_srun(monkeypatch):
    # srun --mpi=pmi2 adds PMI_RANK / PMI_SIZE and no local rank (Slurm's mpi_pmi2.c)
    setenv(monkeypatch, **SRUN, PMI_RANK=3, PMI_SIZE=8, SLURM_STEP_NODELIST="node[01-04]")
    adopt_launcher_env()
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["MASTER_ADDR"]) == (
        "3",
        "3",
        "node01",
    )


def test_srun_without_a_nodelist_or_master_addr_fails_fast(monkeypatch):
    setenv(monkeypatch, **SRUN)
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        adopt_launcher_env()


def test_an_unreadable_nodelist_names_its_variable_and_is_not_replaced_by_the_local_host(
    monkeypatch,
):
    setenv(monkeypatch, **SRUN, SLURM_STEP_NODELIST="node[01-04")
    with pytest.raises(ConfigError, match=r"SLURM_STEP_NODELIST.*export MASTER_ADDR"):
        adopt_launcher_env()
    # cli.main's call leaves it to init(), which reports it as a usage error
    dist.adopt_launcher_env()
    assert "MASTER_ADDR" not in os.environ and "RANK" not in os.environ


# --- host lists -----------------------------------------------------------------------------

NODELISTS = [
    ("node[01-04]", ["node01", "node02", "node03", "node04"]),
    ("gpu-a[1,3-5],gpu-b7", ["gpu-a1", "gpu-a3", "gpu-a4", "gpu-a5", "gpu-b7"]),
    ("n[001-002]-ib", ["n001-ib", "n002-ib"]),
    ("a[8-10]", ["a8", "a9", "a10"]),
    ("a[08-10]", ["a08", "a09", "a10"]),
    ("a[098-101]", ["a098", "a099", "a100", "a101"]),
    ("a[01,3]", ["a01", "a3"]),
    ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
    ("r[1-2]-n[1-2]-ib", ["r1-n1-ib", "r1-n2-ib", "r2-n1-ib", "r2-n2-ib"]),
    ("x,y[1-2],z.example.org", ["x", "y1", "y2", "z.example.org"]),
    (" node3 ", ["node3"]),
    ("a,,b", ["a", "b"]),
    ("", []),
]


@pytest.mark.parametrize("nodelist, hosts", NODELISTS)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize(
    "nodelist",
    [
        "node[01-04",
        "node01-04]",
        "a[3-1]",
        "a[]",
        "a[x-y]",
        "a[[1-2]]",
        "a[1 -2]",
        "a[1-2]]",
        "a[-1]",
    ],
)
def test_expand_nodelist_refuses_what_it_cannot_read(nodelist):
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST="):
        expand_nodelist(nodelist, "SLURM_JOB_NODELIST")


def test_expand_nodelist_agrees_with_scontrol(tmp_path):
    if not shutil.which("scontrol"):
        pytest.skip("scontrol not installed")
    # `scontrol show hostnames` needs a configuration, not a controller
    conf = tmp_path / "slurm.conf"
    conf.write_text(
        "ClusterName=t\nSlurmctldHost=localhost\nNodeName=localhost CPUs=1\n"
        "PartitionName=p Nodes=localhost\n"
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for nodelist, hosts in NODELISTS:
        # Slurm 22.05 has no text after a group; we accept it
        if not nodelist.strip() or "]-" in nodelist:
            continue
        proc = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        if proc.returncode != 0:
            pytest.skip(f"scontrol does not work here: {proc.stderr.strip()}")
        assert proc.stdout.split() == hosts, nodelist


# --- the device a rank drives ---------------------------------------------------------------


@pytest.mark.parametrize(
    "local, count, device", [(3, 1, 0), (3, 8, 3), (3, 2, 1), (0, 1, 0), (5, 0, 5)]
)
def test_local_device_index(monkeypatch, local, count, device):
    monkeypatch.setenv("LOCAL_RANK", str(local))
    assert local_device_index(count) == device


def test_local_device_index_before_adoption_reads_the_launchers_variables(monkeypatch):
    # srun --gpus-per-task=1: one GPU each
    setenv(monkeypatch, **SRUN, SLURM_STEP_NODELIST="node[01-04]")
    assert local_device_index(1) == 0
    assert local_device_index(8) == 3
    assert "LOCAL_RANK" not in os.environ


class FakeAccelerator:
    def __init__(self, name: str = "cuda", count: int = 8):
        self.name, self.count, self.devices = name, count, []

    def device_name(self, index=None):
        return self.name

    def device_count(self):
        return self.count

    def set_device(self, index):
        self.devices.append(index)


@pytest.fixture
def fake_deepspeed(monkeypatch):
    """distributed.init with init_distributed recorded (the environment it saw, its port) and a fake
    accelerator."""
    import deepspeed
    import deepspeed.accelerator

    seen, acc = {}, FakeAccelerator()

    def init_distributed(timeout, distributed_port=29500, **_):
        seen.update(env=torch_env(), port=distributed_port)
        # as DeepSpeed's mpi_discovery: LOCAL_RANK counted by host name
        if "MASTER_ADDR" not in os.environ:
            os.environ.update(
                MASTER_ADDR="10.9.9.9", MASTER_PORT=str(distributed_port), LOCAL_RANK="7"
            )

    monkeypatch.setattr(deepspeed, "init_distributed", init_distributed)
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: acc)
    monkeypatch.setattr(dist, "_setup_logging", lambda: None)
    monkeypatch.setattr(dist, "_unlink_shm_buffer", lambda: None)
    monkeypatch.setattr(dist, "_timeout_s", dist._timeout_s)
    return seen, acc


def test_init_under_mpirun_starts_the_true_world(monkeypatch, fake_deepspeed):
    seen, acc = fake_deepspeed
    setenv(monkeypatch, **OMPI, MASTER_ADDR="node01")
    dist.init(60)
    assert seen["env"] == {
        "RANK": "5",
        "WORLD_SIZE": "16",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "node01",
        "MASTER_PORT": "29500",
    }
    assert acc.devices == [1]


def test_init_with_one_gpu_per_task_drives_device_0(monkeypatch, fake_deepspeed):
    seen, acc = fake_deepspeed
    acc.count = 1  # srun --gpus-per-task=1: SLURM_LOCALID 3 sees one GPU
    setenv(monkeypatch, **SRUN, SLURM_STEP_NODELIST="node[01-04]")
    dist.init(60)
    assert (
        acc.devices == [0] and seen["env"]["LOCAL_RANK"] == "0" and os.environ["LOCAL_RANK"] == "0"
    )
    assert seen["env"]["MASTER_ADDR"] == "node01"


def test_init_finds_master_addr_over_mpi_before_deepspeed_could_recount_local_rank(
    monkeypatch, fake_deepspeed
):
    """mpirun without MASTER_ADDR, mpi4py installed: rank 0's address is broadcast before
    init_distributed, so DeepSpeed's own discovery (which rewrites LOCAL_RANK by host name and binds
    the communicator to that device) never runs."""
    seen, acc = fake_deepspeed
    monkeypatch.setattr(launchers, "_mpi4py_available", lambda: True)
    monkeypatch.setattr(launchers, "master_from_mpi", lambda: "10.1.1.1")
    setenv(monkeypatch, **OMPI, MASTER_PORT=29611)
    dist.init(60)
    assert (
        seen["env"]["MASTER_ADDR"] == "10.1.1.1"
        and seen["env"]["LOCAL_RANK"] == "1"
        and seen["port"] == 29611
    )
    assert os.environ["LOCAL_RANK"] == "1" and acc.devices == [1]


def test_init_leaves_master_addr_to_deepspeeds_azureml_patch(monkeypatch, fake_deepspeed):
    seen, acc = fake_deepspeed
    setenv(monkeypatch, **OMPI, MASTER_PORT=29611, AZUREML_EXPERIMENT_ID="x")
    dist.init(60)
    assert "MASTER_ADDR" not in seen["env"] and seen["port"] == 29611
    assert os.environ["LOCAL_RANK"] == "1" and acc.devices == [1]  # not discovery's host-name count


def test_init_refuses_a_device_deepspeed_would_reject_under_openmpi(monkeypatch, fake_deepspeed):
    seen, acc = fake_deepspeed
    # a per-rank CUDA_VISIBLE_DEVICES: device 0, but DeepSpeed asserts LOCAL_RANK == OMPI's 1
    acc.count = 1
    setenv(monkeypatch, **OMPI, MASTER_ADDR="node01")
    with pytest.raises(ConfigError, match="OMPI_COMM_WORLD_LOCAL_RANK=1"):
        dist.init(60)
    assert not seen


def test_init_refuses_a_partial_environment(monkeypatch, fake_deepspeed):
    seen, _ = fake_deepspeed
    setenv(monkeypatch, OMPI_COMM_WORLD_RANK=1, MASTER_ADDR="node01")
    with pytest.raises(ConfigError, match="OMPI_COMM_WORLD_SIZE"):
        dist.init(60)
    assert not seen


def test_init_under_plain_python_is_one_rank(fake_deepspeed):
    seen, acc = fake_deepspeed
    dist.init(60)
    assert {k: seen["env"][k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")} == {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
    }
    assert acc.devices == [0]


# --- one real mpirun ------------------------------------------------------------------------

MPI_CHECK = """
import os, torch
import finetune.distributed as dist
dist.adopt_launcher_env()
dist.init(60)
t = torch.ones(1)
torch.distributed.all_reduce(t)
print("world", dist.rank(), dist.world_size(), int(t.item()), os.environ["LOCAL_RANK"], flush=True)
dist.shutdown()
"""


@pytest.mark.distributed
def test_a_real_openmpi_world(tmp_path):
    if not (shutil.which("mpirun") and shutil.which("ompi_info")):
        pytest.skip("OpenMPI's mpirun not installed")
    from conftest import child_env, free_port

    env = {k: v for k, v in child_env().items() if not k.startswith(PREFIXES)}
    # containers run as root
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    proc = subprocess.run(
        [
            "mpirun",
            "--oversubscribe",
            "-np",
            "2",
            "-x",
            "MASTER_ADDR=127.0.0.1",
            "-x",
            f"MASTER_PORT={free_port()}",
            sys.executable,
            "-c",
            MPI_CHECK,
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    worlds = sorted(
        line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("world ")
    )
    assert proc.returncode == 0 and worlds == [["0", "2", "2", "0"], ["1", "2", "2", "1"]], (
        proc.stdout + proc.stderr
    )


@pytest.mark.parametrize("step", [None, "4294967291"])
def test_python_started_in_the_batch_step_of_a_multi_task_job_fails_fast(monkeypatch, step):
    """`python -m finetune` in an `sbatch -n 8` script (no srun): the batch step's SLURM_PROCID=0
    and SLURM_NTASKS=8 would make it rank 0 of 8, waiting for peers that never start."""
    batch = dict(
        SLURM_PROCID=0,
        SLURM_NTASKS=8,
        SLURM_LOCALID=0,
        SLURM_JOB_ID=1234,
        SLURM_JOB_NODELIST="node[01-02]",
    )
    setenv(monkeypatch, **batch, **({"SLURM_STEP_ID": step} if step else {}))
    with pytest.raises(ConfigError, match="batch step .*srun python -m finetune"):
        adopt_launcher_env()
    assert "RANK" not in os.environ


def test_a_one_task_batch_step_is_one_process(monkeypatch):
    setenv(
        monkeypatch,
        SLURM_PROCID=0,
        SLURM_NTASKS=1,
        SLURM_LOCALID=0,
        SLURM_JOB_ID=1234,
        SLURM_JOB_NODELIST="node01",
    )
    adopt_launcher_env()
    assert torch_env()["RANK"] == "0" and torch_env()["WORLD_SIZE"] == "1"
