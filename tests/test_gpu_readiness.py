"""What a GPU run decides before any GPU work, tested with fake CUDA nodes on CPU: bf16
auto-detection from this rank's own device, and the Adam op (compiled, or torch_adam without a
toolkit). The real thing runs in tests/gpu when there is a GPU."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from finetune import ops
from finetune.config import CONFIGS_DIR
from finetune.ds_config import auto_precision


class FakeCudaNode:
    """DeepSpeed's accelerator on a node of GPUs with the given compute capabilities, recording
    which devices anything asked about; touching the *current* device (GPU 0 before the device
    is set) or allocating fails the test."""

    def __init__(self, monkeypatch, capabilities: list[tuple[int, int]]):
        self.capabilities, self.asked = capabilities, []
        monkeypatch.setattr("deepspeed.accelerator.get_accelerator", lambda: self)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(capabilities))
        monkeypatch.setattr(torch.cuda, "get_device_capability", self.get_device_capability)
        monkeypatch.setattr(torch.version, "hip", None)
        for name in ("is_bf16_supported", "current_device", "set_device", "init"):
            monkeypatch.setattr(torch.cuda, name, self._forbidden(name))

    def _forbidden(self, name):
        def call(*args, **kwargs):
            raise AssertionError(
                f"torch.cuda.{name} touches the current device (GPU 0 on every rank here)"
            )

        return call

    def device_name(self):
        return "cuda"

    def device_count(self):
        return len(self.capabilities)

    def is_bf16_supported(self):
        raise AssertionError(
            "the accelerator's is_bf16_supported looks at the current device and accepts emulation"
        )

    def get_device_capability(self, device=None):
        if not isinstance(device, int):
            raise AssertionError(f"asked about {device!r}, not this rank's device by index")
        self.asked.append(device)
        return self.capabilities[device]


@pytest.mark.parametrize(
    "capability, want", [((8, 0), "bf16"), ((9, 0), "bf16"), ((7, 0), "fp32"), ((7, 5), "fp32")]
)
def test_auto_precision_reads_this_ranks_device_only(monkeypatch, capability, want):
    """LOCAL_RANK 3 of a node of 8: only device 3 is asked; V100 (7.0) and T4 (7.5) emulate bf16 →
    fp32."""
    node = FakeCudaNode(monkeypatch, [(6, 0)] * 3 + [capability] + [(6, 0)] * 4)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert auto_precision() == want
    assert node.asked == [3]


def test_auto_precision_where_each_task_sees_one_gpu(monkeypatch):
    """srun --gpus-per-task=1: SLURM_LOCALID 5 but one visible GPU, device 0."""
    node = FakeCudaNode(monkeypatch, [(8, 0)])
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert auto_precision() == "bf16"
    assert node.asked == [0]


# --- the Adam op ---------------------------------------------------------------------------


def _config(name: str) -> dict:
    return json.loads((CONFIGS_DIR / name).read_text())


def test_which_op_deepspeed_will_compile_for_each_shipped_config():
    assert ops.adam_op(_config("ds_zero3.json")) == "FusedAdamBuilder"
    assert ops.adam_op(_config("ds_zero3_offload.json")) == "CPUAdamBuilder"
    torch_adam = _config("ds_zero3.json")
    torch_adam["optimizer"]["params"]["torch_adam"] = True
    assert ops.adam_op(torch_adam) is None
    assert ops.adam_op({"optimizer": {"type": "SGD"}}) is None
    assert ops.adam_op({}) is None  # finetune passes its own torch AdamW then


def test_an_adam_op_that_cannot_be_built_becomes_torch_adam(monkeypatch, caplog):
    monkeypatch.setenv("WORLD_SIZE", "1")

    def no_toolkit(name):
        raise RuntimeError("CUDA_HOME does not exist, unable to compile CUDA op(s)")

    cfg = _config("ds_zero3.json")
    with caplog.at_level(logging.WARNING, logger="finetune"):
        out = ops.ensure_adam(cfg, load=no_toolkit)
    assert out["optimizer"]["params"]["torch_adam"] is True
    # a copy
    assert out["optimizer"]["type"] == "AdamW" and "torch_adam" not in cfg["optimizer"]["params"]
    assert (
        "FusedAdam can't be loaded or built here" in caplog.text
        and "torch.optim.AdamW" in caplog.text
    )
    loaded = []
    assert ops.ensure_adam(cfg, load=loaded.append) is cfg and loaded == ["FusedAdamBuilder"]


def test_a_checkpoint_trained_with_torch_adam_resumes_with_it_even_where_the_op_loads(
    monkeypatch, caplog
):
    """torch's param groups lack the bias_correction FusedAdam / CPU Adam read at their first
    step."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    loaded = []
    with caplog.at_level(logging.WARNING, logger="finetune"):
        out = ops.ensure_adam(_config("ds_zero3.json"), saved="torch_adam", load=loaded.append)
    assert out["optimizer"]["params"]["torch_adam"] is True and loaded == []
    assert "trained with torch.optim.AdamW" in caplog.text
    assert ops.adam_impl(out) == "torch_adam"
    assert ops.adam_impl(_config("ds_zero3.json")) == "FusedAdam"
    assert ops.adam_impl(_config("ds_zero3_offload.json")) == "CPUAdam"
    assert (
        ops.ensure_adam(_config("ds_zero3.json"), saved="FusedAdam", load=loaded.append)[
            "optimizer"
        ]
        == _config("ds_zero3.json")["optimizer"]
    )


@pytest.mark.parametrize(
    "change, named",
    [
        (
            lambda c: c["zero_optimization"]["offload_optimizer"].update(ratio=0.5),
            "offload_optimizer.ratio",
        ),
        (
            lambda c: c.setdefault("bf16", {}).update(bf16_master_weights_and_grads=True),
            "bf16.bf16_master_weights_and_grads",
        ),
        (
            lambda c: c["optimizer"]["params"].update(bias_correction=False),
            "bias_correction: false",
        ),
    ],
)
def test_configs_only_deepspeeds_adam_can_run_fail_instead_of_falling_back(
    monkeypatch, change, named
):
    from finetune.config import ConfigError

    monkeypatch.setenv("WORLD_SIZE", "1")
    cfg = _config("ds_zero3_offload.json")
    change(cfg)

    def no_compiler(name):
        raise RuntimeError("Unable to JIT load the cpu_adam op")

    with pytest.raises(ConfigError, match=named):
        ops.ensure_adam(cfg, load=no_compiler)


def test_torch_adam_drops_the_settings_torch_has_no_argument_for():
    cfg = _config("ds_zero3.json")
    cfg["optimizer"]["params"].update(bias_correction=True, set_grad_none=True)
    params = ops.use_torch_adam(cfg)["optimizer"]["params"]
    assert (
        "bias_correction" not in params
        and "set_grad_none" not in params
        and params["torch_adam"] is True
    )


def test_a_build_lock_an_interrupted_build_left_is_refused_not_waited_for(monkeypatch, tmp_path):
    """Torch waits for a build lock with no timeout: a preempted first build would hang every later
    run."""
    import time

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    ops.check_build_lock("fused_adam")  # no lock
    (tmp_path / "fused_adam" / "lock").touch()
    ops.check_build_lock("fused_adam")  # a build in progress: waited for
    with pytest.raises(RuntimeError, match="fused_adam/lock is 20 min old"):
        ops.check_build_lock("fused_adam", now=time.time() + 20 * 60)


def test_ranks_whose_auto_precision_differs_are_stopped(monkeypatch):
    from finetune import distributed as dist
    from finetune.config import ConfigError
    from finetune.ds_config import check_precision

    monkeypatch.setattr(dist, "all_gather_object", lambda p: ["bf16", "bf16", "fp32"])
    with pytest.raises(ConfigError, match="rank 0: bf16; rank 2: fp32"):
        check_precision("bf16")


def test_ops_are_found_where_make_setup_built_them(monkeypatch, tmp_path):
    """Inside a venv: <venv>/torch_extensions and the venv's ninja, unless TORCH_EXTENSIONS_DIR is
    set."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "ninja").write_text("#!/bin/sh\n")
    (venv / "bin" / "ninja").chmod(0o755)
    monkeypatch.setattr(sys, "prefix", str(venv))
    monkeypatch.setattr(sys, "base_prefix", "/usr")
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    ops.use_venv_extensions_dir()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(venv / "torch_extensions")
    assert os.environ["PATH"].split(os.pathsep)[0] == str(venv / "bin")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/elsewhere")
    ops.use_venv_extensions_dir()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == "/elsewhere"


@pytest.mark.e2e
def test_the_fallback_config_trains_saves_and_resumes_under_offload(run_finetune, tmp_path):
    """What a machine without a compiler gets for the offload config: torch.optim.AdamW stepping
    offloaded fp32 partitions (DeepSpeed's torch_adam), through a save; then a resume where CPU Adam
    loads (here it does: `make setup` built it) keeps torch's Adam, whose state it can read."""
    fallback = tmp_path / "fallback.json"
    fallback.write_text(json.dumps(ops.use_torch_adam(_config("ds_zero3_offload.json"))))
    args = ("--save_checkpoint", "--logging_steps", "1")
    first = run_finetune(
        "--deepspeed_config", str(fallback), *args, "--max_steps", "2", launcher="python", nprocs=1
    )
    assert first.returncode == 0, first.output[-3000:]
    optim = torch.load(
        first.out_dir / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        weights_only=False,
    )
    groups = optim["optimizer_state_dict"]["optimizer_state_dict"]["param_groups"]
    assert all("foreach" in g for g in groups)  # torch's AdamW, not DeepSpeedCPUAdam
    assert (
        json.loads((first.out_dir / "global_step2" / "trainer_state.json").read_text())["adam"]
        == "torch_adam"
    )
    again = run_finetune(
        "--deepspeed_config",
        str(CONFIGS_DIR / "ds_zero3_offload.json"),
        *args,
        "--max_steps",
        "3",
        "--resume_from_checkpoint",
        "auto",
        launcher="python",
        nprocs=1,
    )
    assert again.returncode == 0, again.output[-3000:]
    assert [r["step"] for r in again.train_rows()][-1] == 3
    assert "trained with torch.optim.AdamW" in again.output


def test_cpu_info_is_asked_once_per_process(monkeypatch, tmp_path):
    """DeepSpeed asks py-cpuinfo twice per op it loads (~1.1 s of CPU each, every rank, every
    start)."""
    import cpuinfo

    from finetune.ops import remember_cpu_info

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))  # nothing kept from other processes

    calls = []
    monkeypatch.setattr(
        cpuinfo, "get_cpu_info", lambda: calls.append(1) or {"arch": "X86_64", "flags": ["avx2"]}
    )
    remember_cpu_info()
    remember_cpu_info()  # idempotent: not wrapped twice
    from cpuinfo import get_cpu_info  # as DeepSpeed imports it, at each call

    assert get_cpu_info() is get_cpu_info() and len(calls) == 1


def test_cpu_info_is_kept_between_processes_per_kind_of_cpu(monkeypatch, tmp_path):
    """The next start on the same kind of CPU reads the answer beside the ops; another kind of CPU
    (another key) and an unreadable file ask again."""
    import cpuinfo

    from finetune import ops

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    calls = []

    def start(key: str) -> dict:
        """A process start: py-cpuinfo unwrapped, then wrapped, then asked (twice, as DeepSpeed)."""
        monkeypatch.setattr(ops, "_cpu_key", lambda: key)
        monkeypatch.setattr(
            cpuinfo, "get_cpu_info", lambda: calls.append(key) or {"arch": key, "flags": ["avx2"]}
        )
        ops.remember_cpu_info()
        assert cpuinfo.get_cpu_info() == cpuinfo.get_cpu_info()
        return cpuinfo.get_cpu_info()

    assert start("X86_64")["arch"] == "X86_64" and calls == ["X86_64"]
    assert start("X86_64")["arch"] == "X86_64" and calls == ["X86_64"]  # kept: not asked
    assert start("ARM_8")["arch"] == "ARM_8" and calls == ["X86_64", "ARM_8"]
    (tmp_path / "cpuinfo-X86_64.json").write_text("{not json")
    assert start("X86_64")["arch"] == "X86_64" and calls == ["X86_64", "ARM_8", "X86_64"]
    assert start("X86_64")["arch"] == "X86_64" and len(calls) == 3  # rewritten
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == ["cpuinfo-ARM_8.json", "cpuinfo-X86_64.json"]


def test_the_cpu_key_is_what_identifies_the_cpu():
    from finetune.ops import _cpu_key

    key = _cpu_key()
    if key is None:
        pytest.skip("no /proc/cpuinfo here")
    assert len(key) == 16 and key == _cpu_key()


@pytest.mark.parametrize(
    "given, want",
    [("9.0a", "9.0"), ("8.0;9.0a+PTX", "8.0;9.0+PTX"), ("10.0f 12.0a", "10.0;12.0")],
)
def test_an_arch_list_deepspeed_cannot_parse_is_made_plain(monkeypatch, given, want):
    """Seen on an H200 image with TORCH_CUDA_ARCH_LIST=9.0a: DeepSpeed's own parser raised at every
    FusedAdam load (prebuilt or not), so runs fell back to torch_adam and HF Trainer crashed."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    builder = FusedAdamBuilder()
    builder.jit_mode = True  # as in jit_load: the arch list then comes from the environment
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", given)
    with pytest.raises(ValueError, match="invalid literal"):
        builder.compute_capability_args()
    assert ops.parsable_cuda_arch_list() == given
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == want
    builder.compute_capability_args()  # parses now


@pytest.mark.parametrize("given", ["9.0", "8.0;9.0+PTX", "7.5 8.0"])
def test_a_plain_arch_list_is_left_alone(monkeypatch, given):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", given)
    assert ops.parsable_cuda_arch_list() is None
    assert os.environ["TORCH_CUDA_ARCH_LIST"] == given


LAZY_MUON = """
import sys
import torch
from deepspeed.runtime import compiler
from finetune.ops import import_muon_lazily

eager = compiler.compile
import_muon_lazily()
import_muon_lazily()  # idempotent
assert compiler.compile is eager  # put back
from deepspeed.runtime.zero.muon import original_muon
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
assert "torch._inductor.compile_fx" not in sys.modules, "torch.compile was set up at import"
compiled = []
torch.compile = lambda f: compiled.append(f.__name__) or f  # what compiler.compile() returns
g = torch.randn(4, 3)
first = original_muon.zeropower_via_newtonschulz5(g, 2)
again = original_muon.zeropower_via_newtonschulz5(g, 2)
assert compiled == ["zeropower_via_newtonschulz5"], compiled  # at the first call, once
assert torch.equal(first, again) and first.shape == g.shape
print("ok")
"""


def test_muon_is_imported_with_its_compile_deferred_to_the_first_call():
    """ZeRO imports DeepSpeed's Muon module whatever the optimizer, and its ``@torch.compile``
    set-up imports torch's inductor (~1.5 s per rank, every start): deferred to the first call."""
    out = subprocess.run(
        [sys.executable, "-c", LAZY_MUON], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
