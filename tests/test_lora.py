"""LoRA's pure parts, without DeepSpeed: the flags, the base model's fingerprint, the resume checks,
the adapter checks `finetune verify` runs, and the --merge_lora arithmetic against peft's own
merge_and_unload. The 2-rank runs are in tests/distributed/test_lora_runs.py."""

from __future__ import annotations

import json
import shutil
import types
from pathlib import Path

import pytest
import torch

from finetune.config import ConfigError
from finetune.lora import (
    BASE_KEY,
    base_identity,
    check_resumable,
    fingerprint,
    lora_config,
    same_base,
)
from finetune.resolve import resolve
from finetune.run_config import load as load_run_config
from finetune.weights.adapter import (
    ADAPTER_WEIGHTS,
    check_adapter_file,
    expected_tensors,
    verify_adapter,
)
from finetune.weights.shards import shard_header


def _resolve(**values):
    return resolve(values, world_size=1)


# --- flags ----------------------------------------------------------------------------------------


def test_lora_flags_without_use_peft_exit_2_naming_them():
    with pytest.raises(ConfigError, match=r"`--lora_r`, `--lora_target_modules` need `--use_peft`"):
        _resolve(lora_r=8, lora_target_modules="q_proj")
    _resolve(lora_r=16)  # the default value, as run_config.yaml writes it: not a request


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("lora_r", 0, "`--lora_r` must be positive"),
        ("lora_alpha", -1, "`--lora_alpha` must be positive"),
        ("lora_dropout", 1.0, r"`--lora_dropout` must be in \[0, 1\)"),
        ("lora_target_modules", " , ", "`--lora_target_modules` names no module"),
    ],
)
def test_lora_flag_ranges(flag, value, message):
    with pytest.raises(ConfigError, match=message):
        _resolve(use_peft=True, **{flag: value})


def test_module_lists_from_the_command_line_a_comma_list_or_a_yaml_list(tmp_path):
    from finetune.cli import parse_train_args

    cfg = parse_train_args(["--use_peft", "--lora_target_modules", "q_proj", "v_proj,o_proj"])
    assert cfg.model.lora_target_modules == "q_proj,v_proj,o_proj"
    run = tmp_path / "run.yaml"
    run.write_text(
        "use_peft: true\nlora_target_modules: [q_proj, v_proj]\nlora_modules_to_save: lm_head\n"
    )
    cfg = parse_train_args(["--config", str(run)])
    assert (cfg.model.lora_target_modules, cfg.model.lora_modules_to_save) == (
        "q_proj,v_proj",
        "lm_head",
    )
    run.write_text("lora_target_modules: [q_proj, 3]\n")
    with pytest.raises(
        ConfigError, match="`lora_target_modules` must be a string or a list of strings"
    ):
        load_run_config(str(run))


def test_lora_config_follows_trls_meaning():
    cfg = _resolve(
        use_peft=True,
        lora_r=4,
        lora_alpha=8,
        lora_target_modules="all-linear",
        lora_modules_to_save="lm_head,embed_tokens",
    ).model
    lc = lora_config(cfg, "base")
    assert (lc.r, lc.lora_alpha, lc.target_modules, lc.modules_to_save) == (
        4,
        8,
        "all-linear",
        ["lm_head", "embed_tokens"],
    )
    # peft's default for the architecture
    assert lora_config(_resolve(use_peft=True).model).target_modules is None
    assert set(
        lora_config(
            _resolve(use_peft=True, lora_target_modules="q_proj v_proj").model
        ).target_modules
    ) == {"q_proj", "v_proj"}


# --- the base's fingerprint -----------------------------------------------------------------------


@pytest.fixture
def base_copy(tiny_models, tmp_path):
    folder = tmp_path / "base"
    shutil.copytree(tiny_models["llama"], folder)
    return folder


def _edit(folder: Path, fn) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    save_file(fn(weights), folder / "model.safetensors", metadata={"format": "pt"})


def test_fingerprint_is_stable_and_follows_the_weights_not_the_folder(base_copy, tmp_path):
    first = fingerprint(base_copy)
    moved = tmp_path / "moved"
    shutil.copytree(base_copy, moved)
    assert fingerprint(moved)["digest"] == first["digest"] == fingerprint(base_copy)["digest"]
    # a fine-tune: every value moves
    _edit(base_copy, lambda w: {k: v * 1.001 for k, v in w.items()})
    assert fingerprint(base_copy)["digest"] != first["digest"]
    _edit(moved, lambda w: {**w, "lm_head.weight": w["lm_head.weight"][:-1]})  # another shape
    assert fingerprint(moved)["digest"] != first["digest"]


def test_fingerprint_reads_blocks_not_whole_tensors(base_copy, monkeypatch):
    """A 70B base must not be read whole at every start: per tensor, at most three 4 KiB blocks."""
    import builtins

    from finetune import lora

    reads: list[int] = []
    real_open = builtins.open

    class Counting:
        def __init__(self, f):
            self.f = f

        def read(self, n=-1):
            data = self.f.read(n)
            reads.append(len(data))
            return data

        def seek(self, *args):
            return self.f.seek(*args)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    path = base_copy / "model.safetensors"
    raw = path.read_bytes()
    tensors = len(
        [
            k
            for k in json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
            if k != "__metadata__"
        ]
    )
    monkeypatch.setattr(builtins, "open", lambda *a, **k: Counting(real_open(*a, **k)))
    lora._safetensors_digest(path)
    data_reads = reads[2:]  # after the 8-byte length and the header
    assert 0 < len(data_reads) <= 3 * tensors and max(data_reads) <= lora.BLOCK
    # At most 12 KiB per tensor whatever its size: a 5 GB shard of ~300 tensors costs ~4 MB of
    # reads.
    assert sum(data_reads) <= 3 * lora.BLOCK * tensors


def test_a_hub_base_is_fingerprinted_from_its_cached_copy_with_its_commit(
    tiny_models, tmp_path, monkeypatch
):
    """A hub id: the snapshot the hub cache holds (HF_HUB_OFFLINE, as in these tests), its commit
    recorded."""
    import huggingface_hub

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--org--tiny"
    shutil.copytree(tiny_models["llama"], repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    args = _resolve(use_peft=True).model
    args = type(args)(**{**args.__dict__, "model_name_or_path": "org/tiny"})
    identity = base_identity(args, 42, Path("unused"))
    assert identity["revision"] == commit and identity["source"] == "org/tiny"
    assert identity["fingerprint"]["digest"] == fingerprint(tiny_models["llama"])["digest"]
    missing = type(args)(**{**args.__dict__, "model_name_or_path": "org/not-cached"})
    unknown = base_identity(missing, 42, Path("unused"))
    assert unknown["fingerprint"] is None
    assert same_base(unknown, identity) is False and same_base(
        unknown, dict(unknown, revision=commit)
    )


def test_a_folder_without_weight_files_has_no_fingerprint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert fingerprint(tmp_path) is None


def test_a_config_base_is_its_config_and_seed(tmp_path):
    from finetune.modeling import EMBEDDED_MODEL_DIR

    args = _resolve(use_peft=True).model
    a, b = base_identity(args, 42, EMBEDDED_MODEL_DIR), base_identity(args, 43, EMBEDDED_MODEL_DIR)
    assert (
        a["kind"] == "random init from a config" and not same_base(a, b) and same_base(a, dict(a))
    )


# --- resume checks --------------------------------------------------------------------------------


def _saved(base: dict | None, **model_args) -> dict:
    defaults = {"lora_r": 16, "lora_target_modules": None, "lora_modules_to_save": None}
    return {BASE_KEY: base, "args": {"model": {**defaults, **model_args}}}


def test_resume_refuses_another_base_or_other_adapter_shapes_naming_both(base_copy, tmp_path):
    args = _resolve(use_peft=True, model_name_or_path=str(base_copy)).model
    mine = base_identity(args, 42, Path("unused"))
    ckpt = tmp_path / "global_step4"
    check_resumable(ckpt, _saved(mine), args, mine)  # the same: fine
    moved = dict(mine, source="/elsewhere/base")
    check_resumable(ckpt, _saved(moved), args, mine)  # the same weights found elsewhere: fine
    _edit(base_copy, lambda w: {k: v + 0.01 for k, v in w.items()})
    other = base_identity(args, 42, Path("unused"))
    with pytest.raises(
        ConfigError,
        match=r"--model_name_or_path: .*trained on .*base \(weights fingerprint "
        r"\w+\), this run loads .*base \(weights fingerprint \w+\): another base",
    ):
        check_resumable(ckpt, _saved(mine), args, other)
    with pytest.raises(ConfigError, match=r"--lora_r: .*trained with --lora_r 8, this run has 16"):
        check_resumable(ckpt, _saved(mine, lora_r=8), args, mine)
    with pytest.raises(
        ConfigError, match=r"--lora_target_modules: .*q_proj,v_proj, this run has None"
    ):
        check_resumable(ckpt, _saved(mine, lora_target_modules="q_proj,v_proj"), args, mine)
    with pytest.raises(ConfigError, match="holds LoRA adapters .* resume it with --use_peft"):
        check_resumable(ckpt, _saved(mine), _resolve().model, None)
    with pytest.raises(ConfigError, match="--use_peft: .* is a full fine-tuning checkpoint"):
        check_resumable(ckpt, _saved(None), args, mine)
    # full fine-tuning both: not ours to judge
    check_resumable(ckpt, _saved(None), _resolve().model, None)


# --- adapter checks -------------------------------------------------------------------------------


@pytest.fixture
def adapter_folder(tiny_models, tmp_path):
    """A LoRA checkpoint's config files (no rank files) and peft's own adapter file for them."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "global_step4"
    folder.mkdir()
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_models["llama"]),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]),
    )
    model.peft_config["default"].save_pretrained(str(folder))
    shutil.copy(tiny_models["llama"] / "config.json", folder)
    save_file(get_peft_model_state_dict(model), folder / ADAPTER_WEIGHTS)
    return folder


def test_expected_tensors_are_what_peft_saves(adapter_folder):
    from safetensors import safe_open

    with safe_open(adapter_folder / ADAPTER_WEIGHTS, "pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    expected = expected_tensors(adapter_folder)
    assert dict(expected.values()) == saved
    assert len(saved) == 2 * 2 * 2 + 1  # q and v, A and B, 2 blocks; lm_head's trained copy


def test_verify_adapter_names_an_empty_or_incomplete_adapter_file(adapter_folder):
    assert verify_adapter(adapter_folder) == []
    weights = adapter_folder / ADAPTER_WEIGHTS
    expected = dict(expected_tensors(adapter_folder).values())
    header = json.loads(
        weights.read_bytes()[8 : 8 + int.from_bytes(weights.read_bytes()[:8], "little")]
    )
    size = sum(
        v["data_offsets"][1] - v["data_offsets"][0]
        for k, v in header.items()
        if k != "__metadata__"
    )
    assert check_adapter_file(weights, expected, {"tensors": 9, "bytes": size}) == []
    assert (
        "the manifest records 9 tensors, 1 bytes"
        in check_adapter_file(weights, expected, {"tensors": 9, "bytes": 1})[0]
    )
    # what saving unfetched ZeRO-3 partitions gives: no tensors
    weights.write_bytes(shard_header([], {}))
    assert len(weights.read_bytes()) < 64
    problems = verify_adapter(adapter_folder)
    assert problems and "9 of 9 adapter tensors missing" in problems[0]


def test_custom_model_code_is_never_run_to_check_an_adapter(adapter_folder, tiny_models):
    """config.json with auto_map (--trust_remote_code): the adapters are what rank 0's file lists,
    under peft's key renaming, and no model is built."""
    from finetune.weights.adapter import _peft_key

    config = json.loads((adapter_folder / "config.json").read_text())
    (adapter_folder / "config.json").write_text(
        json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "x.Y"}})
    )
    # no rank files here: nothing listed, nothing built
    assert expected_tensors(adapter_folder) == {}
    assert (
        _peft_key("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight")
        == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    )
    assert (
        _peft_key("base_model.model.lm_head.modules_to_save.default.weight")
        == "base_model.model.lm_head.weight"
    )
    assert (
        _peft_key("base_model.model.model.embed_tokens.lora_embedding_B.default")
        == "base_model.model.model.embed_tokens.lora_embedding_B"
    )


def test_an_adapter_config_that_matches_nothing_is_an_empty_adapter(adapter_folder):
    config = json.loads((adapter_folder / "adapter_config.json").read_text())
    (adapter_folder / "adapter_config.json").write_text(
        json.dumps({**config, "target_modules": ["no_such_module"], "modules_to_save": None})
    )
    problems = verify_adapter(adapter_folder)
    assert problems and problems[0].startswith("adapter_config.json:")


# --- --merge_lora against peft's merge_and_unload -------------------------------------------------


def _merge_with_both(
    base: Path, lora_kwargs: dict, tmp_path: Path, **config_override
) -> tuple[dict, dict]:
    """(peft's merge_and_unload state dict, ours written from the same adapters) for one base."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from finetune.offline.lora_export import _write_merged

    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base),
        LoraConfig(init_lora_weights=False, **lora_kwargs),
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "modules_to_save" in name:
                p.add_(0.05)  # a trained copy that differs from the base
    saved = get_peft_model_state_dict(model)
    config = json.loads(
        json.dumps(
            model.peft_config["default"].to_dict(),
            default=lambda o: sorted(o) if isinstance(o, set) else str(o),
        )
    )
    config.update(config_override)
    entries = {k: types.SimpleNamespace(shape=v.shape, tensor=v.float()) for k, v in saved.items()}
    source = types.SimpleNamespace(
        folder=tmp_path / "global_step1", pieces=lambda e: [e.tensor.reshape(-1)]
    )
    staging = tmp_path / "merged"
    staging.mkdir()
    _write_merged(base, source, entries, config, staging, torch.float32, "5GB", progress=False)
    ours = load_file(staging / "model.safetensors")
    theirs = model.merge_and_unload().state_dict()
    return theirs, ours


def test_merge_matches_peft_for_linear_layers_and_modules_to_save(tiny_models, tmp_path):
    theirs, ours = _merge_with_both(
        tiny_models["llama"],
        dict(r=4, lora_alpha=8, target_modules="all-linear", modules_to_save=["lm_head"]),
        tmp_path,
    )
    assert set(ours) == set(theirs)
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], atol=1e-6, rtol=0, msg=k)
    assert not torch.equal(
        ours["lm_head.weight"],
        __import__("safetensors.torch", fromlist=["load_file"]).load_file(
            tiny_models["llama"] / "model.safetensors"
        )["lm_head.weight"],
    )


def test_merge_matches_peft_for_conv1d_and_embeddings(tiny_models, tmp_path):
    """GPT-2: Conv1D layers store weights transposed (fan_in_fan_out) and the embedding is tied to
    the head."""
    theirs, ours = _merge_with_both(
        tiny_models["gpt2"],
        dict(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc", "wte"], fan_in_fan_out=True),
        tmp_path,
    )
    for k, v in ours.items():
        torch.testing.assert_close(v, theirs[k], atol=1e-6, rtol=0, msg=k)
    assert "transformer.wte.weight" in ours and "transformer.h.0.attn.c_attn.weight" in ours


def test_a_delta_that_does_not_fit_the_base_weight_is_refused(tiny_models, tmp_path):
    """GPT-2's c_attn adapters merged as if fan_in_fan_out were off: (192, 64) onto a (64, 192)
    weight."""
    with pytest.raises(
        ConfigError,
        match=r"delta for transformer.h.0.attn.c_attn.weight is \(192, 64\), the base's "
        r"weight \(64, 192\)",
    ):
        _merge_with_both(
            tiny_models["gpt2"],
            dict(r=4, target_modules=["c_attn"], fan_in_fan_out=True),
            tmp_path,
            fan_in_fan_out=False,
        )
