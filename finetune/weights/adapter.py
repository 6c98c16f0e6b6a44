"""A LoRA checkpoint's adapter files, and the checks that its adapters are all there.

Every LoRA checkpoint (``--use_peft``) holds ``adapter_config.json`` beside config.json: with the
base model's config it says which tensors the adapters are, so export and verification need
nothing else. With ``--save_consolidated`` it also holds ``adapter_model.safetensors``, gathered
from the ZeRO-3 partitions like the full model's consolidated shards
(``consolidate.save_consolidated`` on the trainable parameters alone), under the keys peft saves
(``get_peft_model_state_dict``'s own renaming, asked with placeholders):
``PeftModel.from_pretrained(base, folder)`` loads the folder.

The empty-adapter failure (a 40-byte adapter_model.safetensors: what saving a ZeRO-3 model's
partitioned parameters without gathering them writes) cannot pass verification: ``verify_adapter``
rebuilds the tensors the adapters must have, from config.json and adapter_config.json on the meta
device (no weights, no memory), and holds the rank files' trainable parameters, and the adapter file
with the tensor count and bytes its manifest records, to them.

Used by the online save (checkpoint/contents.py: the config and, consolidated, the adapter file),
by ``finetune export`` of a LoRA checkpoint (offline/lora_export.py) and by ``finetune verify`` and
``finetune ls --verify`` (offline/verify.py, listing.py).
"""

from __future__ import annotations

import copy
import json
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from finetune.weights.shards import read_header

if TYPE_CHECKING:
    from peft import PeftModel

    from finetune.weights.consolidate import TensorEntry

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# peft's name for the one adapter get_peft_model adds (lora.py adds no other)
ADAPTER_NAME = "default"
UNSHARDED = 1 << 62  # peft writes one adapter file, whatever its size; so do we


def saved_keys(peft_model: PeftModel) -> dict[str, str]:
    """{trainable parameter's name in ``peft_model``: its key in
    adapter_model.safetensors}, as peft's ``get_peft_model_state_dict`` names them (asked
    with placeholders: nothing is gathered)."""
    from peft import get_peft_model_state_dict

    placeholders = {n: torch.empty(0) for n, p in peft_model.named_parameters() if p.requires_grad}
    saved = get_peft_model_state_dict(
        peft_model, state_dict=placeholders, save_embedding_layers=False
    )
    by_id = {id(t): key for key, t in saved.items()}
    keys = {name: by_id.get(id(t)) for name, t in placeholders.items()}
    unsaved = [name for name, key in keys.items() if key is None]
    if unsaved:
        raise ValueError(f"peft would not save the trainable parameter(s) {', '.join(unsaved[:3])}")
    return keys


def save_adapter(
    model: PeftModel, folder: Path, dtype: torch.dtype
) -> tuple[dict[str, tuple[int, str]], dict]:
    """adapter_model.safetensors of ``model`` (a peft model under ZeRO-3), gathered and written by
    rank 0. Collective: every rank must call it. Returns (rank 0's {file: (size, checksum)}, {}
    elsewhere; {"tensors", "bytes"} of the file, on every rank)."""
    from finetune.weights.consolidate import ConsolidationFailed, save_consolidated

    try:  # from the module structure, alike on every rank: raises before any collective or nowhere
        keys = saved_keys(model)
    except Exception as e:  # noqa: BLE001
        # no gather has started: a failed consolidation, agreed as such
        raise ConsolidationFailed(f"{type(e).__name__}: {e}") from e
    if not keys:
        raise ConsolidationFailed("the model has no trainable adapter parameters to save")

    def select(entries: list[TensorEntry]) -> list[TensorEntry]:
        return [
            (keys[name], module, attr, True)
            for name, module, attr, is_param in entries
            if is_param and name in keys
        ]

    files = save_consolidated(
        model, folder, dtype, UNSHARDED, select=select, basename="adapter_model"
    )
    params = dict(model.named_parameters())
    size = sum(torch.Size(getattr(params[n], "ds_shape", params[n].shape)).numel() for n in keys)
    return files, {"tensors": len(keys), "bytes": size * torch.empty(0, dtype=dtype).element_size()}


def write_adapter_config(model: PeftModel, folder: Path) -> Path:
    """adapter_config.json of the active adapter, as PeftModel.save_pretrained writes it."""
    config = copy.copy(model.peft_config[model.active_adapter])
    config.inference_mode = True
    config.save_pretrained(str(folder))
    return folder / ADAPTER_CONFIG


# --- what the adapters must be --------------------------------------------------------------------


def expected_tensors(folder: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{trainable parameter name: (adapter file key, shape)} the adapters of ``folder`` must have:
    the base built from its config.json on the meta device, wrapped by peft per adapter_config.json.

    A model whose code is not in transformers (``auto_map``: ``--trust_remote_code``) is not built:
    checking a checkpoint must not run code that came with it. Its adapters are then what rank 0's
    file lists, under peft's key renaming; the checks left are that the files agree with each other.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    if "auto_map" in json.loads((folder / "config.json").read_text()):
        shapes = rank_shapes(folder) or {}
        return {n: (_peft_key(n), shape) for n, shape in shapes.items()}
    config = AutoConfig.from_pretrained(folder)
    lora = LoraConfig.from_pretrained(str(folder))
    lora.inference_mode = False  # so that peft marks the adapters trainable, as in training
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = get_peft_model(
            AutoModelForCausalLM.from_config(config), lora, autocast_adapter_dtype=False
        )
    keys = saved_keys(model)
    return {n: (keys[n], tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad}


def _peft_key(name: str) -> str:
    """The adapter file's key of a trainable parameter: peft drops the adapter's name."""
    name = name.replace(f".modules_to_save.{ADAPTER_NAME}.", ".")
    return re.sub(rf"\.(lora_\w+)\.{ADAPTER_NAME}(?=\.|$)", r".\1", name)


def rank_shapes(folder: Path) -> dict[str, tuple[int, ...]] | None:
    """{name: shape} of the optimizer's parameters in rank 0's model-states file (the same on every
    rank; for adapters the file is small); None without rank files."""
    from finetune.weights import safe_load

    path = folder / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    if not path.is_file():
        return None
    state = safe_load.load(path, "cpu", mmap=True, inert=True)
    return {n: tuple(s) for group in state.get("param_shapes") or [] for n, s in group.items()}


def is_adapter_checkpoint(folder: Path) -> bool:
    return (folder / ADAPTER_CONFIG).is_file()


def verify_adapter(folder: Path, manifest: dict | None = None) -> list[str]:
    """Problems with a LoRA checkpoint's adapters ([] for an intact one, or no LoRA checkpoint):
    the rank files' trainable parameters, and adapter_model.safetensors when present, against the
    tensors the adapters must have; the file's tensor count and bytes against the manifest."""
    if not is_adapter_checkpoint(folder):
        return []
    try:
        expected = expected_tensors(folder)
    except Exception as e:  # noqa: BLE001 — a damaged or foreign config: reported, not raised
        return [
            f"{ADAPTER_CONFIG}: can't tell which tensors the adapters have ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:200]})"
        ]
    if not expected:
        return [
            f"{ADAPTER_CONFIG}: its target modules match nothing in the model (an empty adapter)"
        ]
    problems = _check_rank_file(folder, {n: shape for n, (_, shape) in expected.items()})
    weights = folder / ADAPTER_WEIGHTS
    if weights.is_file():
        problems += check_adapter_file(
            weights, dict(expected.values()), (manifest or {}).get("adapter")
        )
    return problems


def check_adapter_file(
    path: Path, expected: dict[str, tuple[int, ...]], recorded: dict | None
) -> list[str]:
    """adapter_model.safetensors holds exactly the ``expected`` {key: shape}, and as many tensors
    and bytes as ``recorded`` (the manifest's "adapter")."""
    try:
        header = read_header(path)
    except (OSError, ValueError) as e:
        return [f"{path.name}: unreadable safetensors header ({type(e).__name__})"]
    header.pop("__metadata__", None)
    name = path.name
    problems = []
    got = {k: tuple(v.get("shape", ())) for k, v in header.items()}
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    if missing:
        problems.append(
            f"{name}: {len(missing)} of {len(expected)} adapter tensors missing (e.g. {missing[0]})"
        )
    if extra:
        problems.append(f"{name}: {len(extra)} tensors the adapters don't have (e.g. {extra[0]})")
    wrong = [k for k in set(got) & set(expected) if got[k] != tuple(expected[k])]
    if wrong:
        problems.append(
            f"{name}: {wrong[0]} has shape {got[wrong[0]]}, the adapters' "
            f"is {tuple(expected[wrong[0]])}"
            + (f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else "")
        )
    if recorded:
        size = sum(v["data_offsets"][1] - v["data_offsets"][0] for v in header.values())
        if (len(header), size) != (recorded.get("tensors"), recorded.get("bytes")):
            problems.append(
                f"{name}: {len(header)} tensors, {size} bytes; the manifest records "
                f"{recorded.get('tensors')} tensors, {recorded.get('bytes')} bytes"
            )
    return problems


def _check_rank_file(folder: Path, expected: dict[str, tuple[int, ...]]) -> list[str]:
    """Rank 0's model-states file lists, as the optimizer's parameters, exactly the adapters'
    tensors (every rank's file lists the same ones; rank 0's is read: for adapters it is small)."""
    path = folder / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    try:
        got = rank_shapes(folder)
    except Exception as e:  # noqa: BLE001 — damage, reported as such
        return [f"{path.name}: unreadable ({type(e).__name__})"]
    if got is None:
        # no rank files (a copied adapter folder): the manifest check names what is missing
        return []
    if got == expected:
        return []
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    if missing or extra:
        what = f"{len(missing)} adapter tensors missing" + (
            f" (e.g. {missing[0]})" if missing else ""
        )
        what += f", {len(extra)} others" + (f" (e.g. {extra[0]})" if extra else "") if extra else ""
        return [f"{path.name}: its trainable parameters are not the adapters': {what}"]
    bad = next(n for n in got if got[n] != expected[n])
    return [f"{path.name}: {bad} has shape {got[bad]}, the adapters' is {expected[bad]}"]
