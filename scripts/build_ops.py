"""Build DeepSpeed's ops now (once, minutes) instead of inside the first training run.

They go into $TORCH_EXTENSIONS_DIR, by default <venv>/torch_extensions, which is where finetune
looks at run time (finetune.ops.use_venv_extensions_dir). Run it with the same PATH as training:
a different `ninja` invalidates the build.

* CPU (no accelerator): the shared-memory all-reduce, fused Adam (C++) and CPU Adam (the offload
  config's optimizer).
* CUDA: FusedAdam (needs nvcc, a CUDA toolkit matching torch's CUDA major version) and CPU Adam
  (needs a C++ compiler). What can't be built here is reported; runs then use DeepSpeed's
  torch_adam (torch.optim.AdamW) for it, saying so in one log line.

The ops are independent compiles, each mostly one compiler process: they build side by side, one
process each (the three CPU ops on 2 cores: 256 s in a fresh clone, 9.5 min of CPU).

Exit status: 0 when every op the runs need on this machine is ready, 1 otherwise (with --strict,
which `make gpu-setup` uses; `make setup` only reports).
"""

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from finetune.ops import load_op, use_venv_extensions_dir  # noqa: E402

OPS = {
    "cpu": ("ShareMemCommBuilder", "FusedAdamBuilder", "CPUAdamBuilder"),
    "cuda": ("FusedAdamBuilder", "CPUAdamBuilder"),
}


def build_one(name: str) -> int:
    """Build one op in this process; prints one line; 0 when it is ready."""
    use_venv_extensions_dir()
    start = time.perf_counter()
    try:
        load_op(name)
    except Exception as e:  # any build failure: reported by name, the other ops still tried
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        then = (
            "runs use torch_adam instead" if "Adam" in name else "runs try to build it on first use"
        )
        print(
            f"DeepSpeed op {name.removesuffix('Builder')}: NOT built "
            f"({type(e).__name__}: {reason}); {then}",
            flush=True,
        )
        return 1
    print(
        f"DeepSpeed op {name.removesuffix('Builder')}: ready in {time.perf_counter() - start:.1f}s",
        flush=True,
    )
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strict", action="store_true", help="Exit 1 when an op can't be built.")
    p.add_argument("--one", metavar="BUILDER", help=argparse.SUPPRESS)  # the per-op child
    ns = p.parse_args()
    if ns.one:
        return build_one(ns.one)
    from deepspeed.accelerator import get_accelerator

    kind = get_accelerator().device_name()
    if kind not in OPS:
        print(f"no ops to prebuild for the {kind} accelerator", flush=True)
        return 0
    children = [subprocess.Popen([sys.executable, __file__, "--one", name]) for name in OPS[kind]]
    codes = [child.wait() for child in children]
    return 1 if any(codes) and ns.strict else 0


if __name__ == "__main__":
    sys.exit(main())
