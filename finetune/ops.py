"""DeepSpeed's compiled ops: where they are cached, and an Adam that needs no compiler when
they can't be built.

DeepSpeed builds its C++/CUDA ops on first use (``OpBuilder.load`` → ``OpBuilder.jit_load``,
deepspeed/ops/op_builder/builder.py) into ``$TORCH_EXTENSIONS_DIR``. Two of them sit on our path:

* an ``optimizer`` of type Adam/AdamW in the DeepSpeed JSON (all of configs/) becomes FusedAdam,
  a CUDA op compiled from ``.cu`` sources with nvcc (``DeepSpeedEngine.get_optimizer_configuration``
  in deepspeed/runtime/engine.py; op_builder/fused_adam.py), or under ``offload_optimizer``
  DeepSpeedCPUAdam, a C++ op (the same method; the CPU builder on every accelerator, see
  ``CUDA_Accelerator._lazy_init_class_dict`` in accelerator/cuda_accelerator.py). A pip-installed
  CUDA torch comes without nvcc, so the first GPU run would fail inside ``deepspeed.initialize``
  with ``MissingCUDAException``.
* ``"torch_adam": true`` in the optimizer's params makes DeepSpeed use ``torch.optim.AdamW``
  instead (the same method's first branch): no compilation, the same update rule and state keys.

So before ``deepspeed.initialize`` every rank loads the op DeepSpeed is about to need (instant
when prebuilt by ``make setup``/``make gpu-setup``, a JIT build where a toolkit exists); if any rank
can't, every rank switches to torch_adam, and rank 0 says so in one log line.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import re
import shutil
import sys
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING

from finetune.config import ConfigError

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

logger = logging.getLogger("finetune")

ADAM_TYPES = ("adam", "adamw")
ADAM_KEY = "adam"  # trainer_state.json: what ran the Adam update (adam_impl)
TORCH_ADAM = "torch_adam"


def use_venv_extensions_dir() -> None:
    """Build and find DeepSpeed's ops where ``make setup`` prebuilt them:
    ``<venv>/torch_extensions``, with the venv's ``ninja``.

    Torch's own default (~/.cache/torch_extensions/py311_cu124) is shared by every checkout and
    environment of the user, so a run started outside ``make`` (the deepspeed launcher, an sbatch
    script) would not find the prebuilt ops and compile them again, or load another checkout's.
    And ninja keeps a log whose format differs between versions (the venv's pip ninja and a system
    one): a build made with one is rebuilt from scratch by the other, minutes per op, every time
    the two alternate. Only inside a virtual environment (sys.prefix is ours); an explicit
    TORCH_EXTENSIONS_DIR wins.
    """
    remember_cpu_info()
    parsable_cuda_arch_list()
    if sys.prefix == sys.base_prefix:
        return
    if not os.environ.get("TORCH_EXTENSIONS_DIR") and os.access(sys.prefix, os.W_OK):
        os.environ["TORCH_EXTENSIONS_DIR"] = str(Path(sys.prefix) / "torch_extensions")
    venv_bin = Path(sys.prefix) / "bin"
    if (venv_bin / "ninja").exists() and shutil.which("ninja") != str(venv_bin / "ninja"):
        os.environ["PATH"] = os.pathsep.join([str(venv_bin), os.environ.get("PATH", "")])


def parsable_cuda_arch_list(env: MutableMapping[str, str] = os.environ) -> str | None:
    """Rewrite ``TORCH_CUDA_ARCH_LIST`` entries with an architecture-specific suffix (``9.0a``,
    ``10.0f``) to their plain form, so DeepSpeed can build and load its ops; returns the old value
    when it changed anything.

    DeepSpeed 0.19.8 reads each entry as integers (``compute_capability_args`` in
    op_builder/builder.py) and raises ``ValueError: invalid literal for int() ... '0a'`` on a
    suffix, at every load of FusedAdam, prebuilt or not: seen on an H200 whose image sets
    ``TORCH_CUDA_ARCH_LIST=9.0a``, where FusedAdam then fell back to torch_adam and HF Trainer
    crashed. The ops use no architecture-specific instructions; JIT compiles in this process are
    DeepSpeed's ops only."""
    old = env.get("TORCH_CUDA_ARCH_LIST")
    if not old or not re.search(r"\d\.\d+[a-z]", old):
        return None
    fixed = ";".join(
        re.sub(r"^(\d+\.\d+)[a-z]+", r"\1", e.strip())
        for e in old.replace(" ", ";").split(";")
        if e.strip()
    )
    env["TORCH_CUDA_ARCH_LIST"] = fixed
    return old


def remember_cpu_info() -> None:
    """Ask py-cpuinfo about this CPU once per kind of CPU instead of twice per op, every start.

    Loading an op (prebuilt or not) makes DeepSpeed compute its compiler flags, which calls
    ``cpuinfo.get_cpu_info()`` for the architecture and again for the SIMD width
    (op_builder/builder.py cpu_arch, simd_width); each call spawns processes and costs ~1.1 s of
    CPU, on every rank, at every start: the CPU Adam op and the CPU backend's all-reduce op make
    four calls. The answer cannot change while the process runs, nor between processes on the same
    kind of CPU: it is kept in ``$TORCH_EXTENSIONS_DIR`` (beside the ops it was asked for) under a
    key made of what identifies the CPU (architecture, /proc/cpuinfo's vendor, model and flags),
    so a node of another kind asks again. DeepSpeed imports the function at each call, so the
    module attribute replaced here is the one it gets.
    """
    try:
        import cpuinfo
    except ImportError:
        return
    if not hasattr(cpuinfo.get_cpu_info, "cache_info"):
        ask = cpuinfo.get_cpu_info
        cpuinfo.get_cpu_info = functools.cache(lambda: _cpu_info_kept(ask))


MUON_MODULE = "deepspeed.runtime.zero.muon.original_muon"


def import_muon_lazily() -> None:
    """Import DeepSpeed's Muon optimizer with its ``@torch.compile`` applied at the first call
    instead of at import, before ``deepspeed.initialize`` imports it.

    ZeRO's optimizer (``DeepSpeedZeroOptimizer_Stage3.__init__``, and before it
    ``is_zero_supported_optimizer``) imports ``deepspeed.runtime.zero.muon.muon_optimizer`` for an
    ``isinstance`` check, whatever the optimizer; its ``original_muon`` decorates two functions with
    ``deepspeed.runtime.compiler.compile()``, i.e. ``torch.compile``, whose set-up imports torch's
    inductor: ~1.5 s of CPU on every rank at every start (two ranks on 2 cores: about 1.5 s of a
    restart's 11 s to its first step), for an optimizer no shipped config uses. ``torch.compile``
    compiles at the first call anyway; here the decorator itself waits for that call, so a Muon
    run compiles the same functions, a little later. Idempotent; nothing to do once imported.
    """
    if MUON_MODULE in sys.modules:
        return
    from deepspeed.runtime import compiler

    eager = compiler.compile

    def lazy():
        def decorate(func):
            compiled = None

            @functools.wraps(func)
            def call(*args, **kwargs):
                nonlocal compiled
                if compiled is None:
                    compiled = eager()(func)
                return compiled(*args, **kwargs)

            return call

        return decorate

    compiler.compile = lazy  # original_muon looks the name up as its decorators run
    try:
        importlib.import_module("deepspeed.runtime.zero.muon.muon_optimizer")
    except ImportError:
        pass  # as DeepSpeed's own imports of it: no Muon here
    finally:
        compiler.compile = eager


def _cpu_key() -> str | None:
    """What identifies this kind of CPU for the flags DeepSpeed compiles with; None where there is
    no /proc/cpuinfo (then nothing is kept between processes)."""
    import hashlib
    import platform

    try:
        with open("/proc/cpuinfo", errors="replace") as f:
            lines = f.read().split("\n\n", 1)[0].splitlines()  # the first processor
    except OSError:
        return None
    wanted = ("vendor_id", "model name", "flags", "features", "cpu model", "isa")
    ident = [ln for ln in lines if ln.split(":", 1)[0].strip().lower() in wanted]
    if not ident:
        return None
    text = "\n".join([platform.machine(), sys.version.split()[0], *ident])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _cpu_info_kept(ask: Callable[[], dict]) -> dict:
    import json

    where = os.environ.get("TORCH_EXTENSIONS_DIR")
    key = _cpu_key()
    if not where or key is None:
        return ask()
    path = Path(where) / f"cpuinfo-{key}.json"
    try:
        info = json.loads(path.read_text())
        if isinstance(info, dict) and "arch" in info and "flags" in info:
            return info
    except (OSError, ValueError):
        pass
    info = ask()
    try:  # best effort: another rank may write the same answer at the same time
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(info))
        os.replace(tmp, path)
    except OSError:
        pass
    return info


def adam_op(ds_config: dict) -> str | None:
    """The op builder DeepSpeed will load for this config's optimizer, or None (no compiled op)."""
    opt = ds_config.get("optimizer")
    if not isinstance(opt, dict) or str(opt.get("type", "")).lower() not in ADAM_TYPES:
        return None
    if (opt.get("params") or {}).get("torch_adam"):
        return None
    zero = ds_config.get("zero_optimization") or {}
    offload = (zero.get("offload_optimizer") or {}).get("device", "none")
    return "CPUAdamBuilder" if str(offload).lower() in ("cpu", "nvme") else "FusedAdamBuilder"


# a build holds its lock for minutes (FusedAdam: 1-3 min); older is an interrupted one
STALE_LOCK_S = 15 * 60


def load_op(builder_name: str) -> None:
    """Load (building it if need be) one of DeepSpeed's ops; raises when it can't be had."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(builder_name)
    if builder is None:
        raise RuntimeError(
            f"DeepSpeed has no {builder_name} for the {get_accelerator().device_name()} accelerator"
        )
    check_build_lock(builder.name)
    builder.load(verbose=False)


def check_build_lock(name: str, now: float | None = None) -> None:
    """Raise for a build lock an interrupted build left (a preempted job, a killed first run).

    Torch's JIT build waits for the lock file to go away with no timeout (FileBaton.wait,
    torch/utils/file_baton.py), so every later run would hang there, signals unnoticed.
    """
    import time

    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        raise RuntimeError(
            f"{lock} is {age / 60:.0f} min old, left by an interrupted "
            f"build: remove it to build {name}"
        )


def needs_deepspeed_adam(ds_config: dict) -> str | None:
    """Why this config can't run on torch's Adam, or None: features DeepSpeed implements only with
    DeepSpeedCPUAdam (asserted in stage3.py:299-302 and 313-316), or a setting torch's lacks."""
    zero = ds_config.get("zero_optimization") or {}
    if float((zero.get("offload_optimizer") or {}).get("ratio", 1.0)) < 1.0:
        return "zero_optimization.offload_optimizer.ratio < 1 (partial offload)"
    for section, key in (
        ("bf16", "bf16_master_weights_and_grads"),
        ("fp16", "fp16_master_weights_and_grads"),
    ):
        if (ds_config.get(section) or {}).get(key):
            return f"{section}.{key}"
    if ((ds_config.get("optimizer") or {}).get("params") or {}).get("bias_correction") is False:
        return "optimizer.params.bias_correction: false (torch's Adam always corrects)"
    return None


# FusedAdam / CPU Adam settings torch.optim.AdamW has no argument for (bias
# correction is always on there).
_DEEPSPEED_ADAM_ONLY = ("bias_correction", "set_grad_none")


def use_torch_adam(ds_config: dict) -> dict:
    """A copy of ``ds_config`` whose Adam is ``torch.optim.AdamW`` (or Adam): nothing to compile."""
    out = {**ds_config, "optimizer": {**ds_config["optimizer"]}}
    params = {
        k: v
        for k, v in (ds_config["optimizer"].get("params") or {}).items()
        if k not in _DEEPSPEED_ADAM_ONLY
    }
    out["optimizer"]["params"] = {**params, "torch_adam": True}
    return out


def adam_impl(ds_config: dict) -> str | None:
    """What runs the Adam update, as trainer_state.json records it: "torch_adam", "FusedAdam",
    "CPUAdam", or None (no Adam in the DeepSpeed JSON: finetune's own torch AdamW)."""
    opt = ds_config.get("optimizer")
    if isinstance(opt, dict) and (opt.get("params") or {}).get("torch_adam"):
        return TORCH_ADAM
    op = adam_op(ds_config)
    return op.removesuffix("Builder") if op else None


def ensure_adam(
    ds_config: dict, saved: str | None = None, load: Callable[[str], None] = load_op
) -> dict:
    """The config to hand ``deepspeed.initialize``: as given when its Adam op loads on every rank,
    else with ``torch_adam``. ``saved``: what the checkpoint being resumed was trained with; one
    trained with torch_adam resumes with it (torch's param groups lack the ``bias_correction``
    FusedAdam and CPU Adam read at their first step, in ``FusedAdam.step`` and
    ``DeepSpeedCPUAdam.step``; the other way round loads, torch's Adam fills in its defaults).
    Collective: every rank calls it."""
    from finetune import distributed as dist

    op = adam_op(ds_config)
    if op is None:
        return ds_config
    if saved == TORCH_ADAM:
        dist.log_main(
            logging.WARNING,
            "the checkpoint was trained with torch.optim.AdamW (torch_adam, no %s "
            "then): resuming with it, since its optimizer state can't be loaded into %s",
            op.removesuffix("Builder"),
            op.removesuffix("Builder"),
        )
        return use_torch_adam(ds_config)
    outcome = dist.gather_outcomes(lambda: load(op), on=True)
    if outcome.ok:
        return ds_config
    needs = needs_deepspeed_adam(ds_config)
    if needs:
        raise ConfigError(
            f"--deepspeed_config: {needs} needs DeepSpeed's {op.removesuffix('Builder')}, which "
            f"can't be loaded or built here ({outcome.describe()}); run `make gpu-setup` where a "
            "compiler (and for FusedAdam a CUDA toolkit) exists, or drop that setting"
        )
    opt = ds_config["optimizer"]
    # DeepSpeed's rule (DeepSpeedEngine._configure_basic_optimizer): type AdamW, or Adam with
    # adam_w_mode (default true).
    adamw = str(opt["type"]).lower() == "adamw" or (opt.get("params") or {}).get(
        "adam_w_mode", True
    )
    dist.log_main(
        logging.WARNING,
        "%s can't be loaded or built here (%s): using torch.optim.%s instead "
        "(DeepSpeed's torch_adam: same update, nothing to compile). `make gpu-setup` on a machine "
        "with a CUDA toolkit (nvcc) prebuilds it.",
        op.removesuffix("Builder"),
        outcome.describe(),
        "AdamW" if adamw else "Adam",
    )
    return use_torch_adam(ds_config)


def replay_adam_steps(engine: DeepSpeedEngine) -> int:
    """Make DeepSpeed's CPU Adam kernel continue a resumed run bit for bit;
    returns the steps replayed.

    DeepSpeedCPUAdam, and FusedAdam on the CPU accelerator, both update through cpu_adam_impl's
    ``ds_adam_step``, which keeps beta1^t and beta2^t as running float products, recomputed with
    ``pow`` whenever the step it is given is not the previous one plus 1 (csrc/includes/cpu_adam.h,
    ``IncrementStep``): in a resumed process, at its first step. Its products then differ from the
    uninterrupted run's in the last bits, and so do the losses a few steps later. Calling the kernel
    with empty tensors for steps 1..N rebuilds the same products without touching a parameter
    (N calls of a no-op update: ~1 µs each). GPU kernels compute the powers every
    step: nothing to do.
    """
    import torch

    opt = getattr(engine.optimizer, "optimizer", engine.optimizer)
    steps = max(
        (int(s.get("step", 0)) for s in getattr(opt, "state", {}).values() if isinstance(s, dict)),
        default=0,
    )
    if steps == 0 or not getattr(opt, "param_groups", None):
        return 0
    group = opt.param_groups[0]
    beta1, beta2 = group["betas"]
    args = (group["lr"], beta1, beta2, group["eps"])
    empty = torch.empty(0)
    if hasattr(opt, "ds_opt_adam") and hasattr(opt, "opt_id"):  # DeepSpeedCPUAdam
        for step in range(1, steps + 1):
            opt.ds_opt_adam.adam_update(
                opt.opt_id,
                step,
                *args,
                group["weight_decay"],
                group["bias_correction"],
                empty,
                empty,
                empty,
                empty,
            )
        return steps
    buf = getattr(opt, "_dummy_overflow_buf", None)
    # FusedAdam, CPU build
    if hasattr(opt, "multi_tensor_adam") and buf is not None and buf.device.type == "cpu":
        for step in range(1, steps + 1):
            opt.multi_tensor_adam(
                1,
                buf,
                [[empty], [empty], [empty], [empty]],
                *args,
                step,
                opt.adam_w_mode,
                1 if group["bias_correction"] else 0,
                group["weight_decay"],
            )
        return steps
    return 0
