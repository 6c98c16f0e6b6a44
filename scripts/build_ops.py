"""Compile DeepSpeed's CPU ops now (once, ~3 minutes) instead of inside the first training run.

On a CPU-only machine every run JIT-loads three ops (shared-memory all-reduce, fused Adam, CPU
Adam for the offload config) into $TORCH_EXTENSIONS_DIR. On a GPU machine it does nothing.
Run it with the same PATH as training: a different `ninja` invalidates the build.
"""

import time

from deepspeed.accelerator import get_accelerator

if __name__ == "__main__":
    acc = get_accelerator()
    if acc.device_name() == "cpu":
        for name in ("ShareMemCommBuilder", "FusedAdamBuilder", "CPUAdamBuilder"):
            start = time.perf_counter()
            builder = acc.create_op_builder(name)
            if builder is not None:
                builder.load(verbose=False)
                print(f"DeepSpeed op {builder.NAME}: ready in {time.perf_counter() - start:.1f}s", flush=True)
