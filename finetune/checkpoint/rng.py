"""Per-rank RNG capture and restore: Python, NumPy, torch's CPU generator, and this rank's device.

Only the *current* device's generator is saved (DeepSpeed's accelerator ``get_rng_state()`` with no
index): a rank draws only on its own device. Saving every visible GPU's generator
(``torch.cuda.get_rng_state_all``) breaks resumes on a different node shape: a rank that sees fewer
GPUs fails with IndexError in ``set_rng_state_all``, one that sees them in another order silently
gets another device's stream.
"""

from __future__ import annotations

import logging
import random

import numpy as np
import torch

logger = logging.getLogger("finetune")


def _device_accelerator():
    """DeepSpeed's accelerator when training runs on one (CUDA, XPU, ...); None on CPU."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    return None if acc.device_name() == "cpu" else acc


def rng_state() -> dict:
    """This rank's RNG streams, as tensors/plain types so
    `torch.load(weights_only=True)` reads them."""
    py = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": {
            "version": py[0],
            "state": torch.tensor(py[1], dtype=torch.int64),
            "gauss": py[2],
        },
        "numpy": {
            "kind": np_state[0],
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    acc = _device_accelerator()
    if acc is not None:
        state["device"] = {"type": acc.device_name(), "state": acc.get_rng_state()}
    return state


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    n = state["numpy"]
    np.random.set_state(
        (
            n["kind"],
            n["keys"].numpy().astype(np.uint32),
            n["pos"],
            n["has_gauss"],
            n["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    acc = _device_accelerator()
    if acc is None:
        return
    saved = state.get("device")
    if saved is not None and saved["type"] == acc.device_name():
        acc.set_rng_state(saved["state"])
    elif "cuda" in state and acc.device_name() == "cuda":
        # Checkpoints before issue 10: every visible GPU's generator, by device index. This rank's
        # own is the one at its current device, when the node still has that many GPUs.
        index, saved_all = acc.current_device(), state["cuda"]
        if index < len(saved_all):
            acc.set_rng_state(saved_all[index])
        else:
            logger.warning(
                "this checkpoint's RNG state has %d GPU generator(s); "
                "device %d keeps its seeded one",
                len(saved_all),
                index,
            )
    elif saved is not None:
        logger.warning(
            "RNG state saved on %s, resuming on %s: the device generator keeps its seed",
            saved["type"],
            acc.device_name(),
        )
