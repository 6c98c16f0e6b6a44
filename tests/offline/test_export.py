"""Offline export, one process: reconstruction from rank files laid out as ZeRO-3 lays them out,
dtype and sharding, page release, bad inputs, and safe loading (verification against the manifest
first, restricted unpickling). Real 2-rank checkpoints:
tests/distributed/test_export_checkpoints.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from finetune.checkpoint_format.manifest import build_manifest
from finetune.cli import main
from finetune.io import durable
from finetune.io.durable import hash_file
from finetune.offline import export as ex
from finetune.weights import safe_load
from finetune.weights import zero_files as zf
from finetune.weights.consolidate import FROM_MASTER, FROM_MODULE, SOURCE_KEY
from finetune.weights.shards import INDEX

VOCAB = 97


def tiny(model_type: str, tied: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type,
        vocab_size=VOCAB,
        tie_word_embeddings=tied,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def _partition(t: torch.Tensor, world: int, r: int) -> torch.Tensor:
    """Rank r's ZeRO-3 partition of ``t``: ceil(numel / world) elements of the flattened tensor,
    zero-padded."""
    part = math.ceil(t.numel() / world)
    flat = torch.zeros(part * world, dtype=t.dtype)
    flat[: t.numel()] = t.reshape(-1)
    return flat[r * part : (r + 1) * part].clone()


def write_zero3(
    folder: Path,
    state: dict[str, torch.Tensor],
    world: int,
    *,
    frozen=(),
    buffers=(),
    shared: dict[str, str] | None = None,
    cuts=(0.5,),
) -> None:
    """Rank files in DeepSpeed's ZeRO-3 layout (what engine.save_checkpoint writes): trainable
    parameters in two optimizer groups (matrices, then vectors), each rank's flat fp32 space cut
    into sub-groups at the fractions ``cuts``, which straddle parameter boundaries."""
    from deepspeed.runtime.zero.config import ZeroStageEnum  # pickled as DeepSpeed pickles it

    shared = shared or {}
    trainable = [n for n in state if n not in frozen and n not in buffers and n not in shared]
    groups = [
        [n for n in trainable if state[n].dim() > 1],
        [n for n in trainable if state[n].dim() <= 1],
    ]
    param_shapes = [OrderedDict((n, state[n].shape) for n in g) for g in groups]
    order = [n for g in groups for n in g]
    for r in range(world):
        flat = torch.cat([_partition(state[n].float(), world, r) for n in order])
        bounds = sorted({0, flat.numel(), *(int(flat.numel() * c) + 1 for c in cuts)})
        module = OrderedDict(
            (n, state[n].clone() if n in buffers else torch.empty(0)) for n in state
        )
        model_states = {
            "module": module,
            "buffer_names": list(buffers),
            "param_shapes": param_shapes,
            "frozen_param_shapes": OrderedDict((n, state[n].shape) for n in frozen),
            "frozen_param_fragments": OrderedDict(
                (n, _partition(state[n], world, r)) for n in frozen
            ),
            "shared_params": dict(shared),
            "ds_version": "0.19.8",
        }
        optim = {
            "optimizer_state_dict": {
                "zero_stage": ZeroStageEnum.weights,
                "partition_count": world,
                "fp32_flat_groups": [flat[a:b].clone() for a, b in zip(bounds, bounds[1:])],
                "optimizer_state_dict": {
                    "state": {0: {"exp_avg": torch.full_like(flat, 7.0)}},
                    "param_groups": [],
                },
            }
        }
        torch.save(model_states, folder / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
        torch.save(optim, folder / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"world_size": world, "dtype": "fp32"}))
    seal(folder)


def seal(folder: Path, **extra) -> None:
    """manifest.json as a commit writes it: every file in ``folder`` with its size and checksum."""
    world = json.loads((folder / "trainer_state.json").read_text())["world_size"]
    files = {
        p.name: hash_file(p) for p in folder.iterdir() if p.is_file() and p.name != "manifest.json"
    }
    (folder / "manifest.json").write_text(
        json.dumps({**build_manifest(folder.name, files, world, {}), **extra})
    )


@pytest.fixture
def qwen_checkpoint(tmp_path):
    """A tied model on 3 ranks (padding on the last rank), one frozen parameter."""
    model = tiny("qwen2", tied=True)
    state = model.state_dict()
    folder = tmp_path / "global_step7"
    folder.mkdir()
    write_zero3(
        folder,
        state,
        world=3,
        frozen=("model.layers.0.mlp.up_proj.weight",),
        shared={"lm_head.weight": "model.embed_tokens.weight"},
        cuts=(1 / 3, 1 / 2),
    )
    model.config.save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "rng_state_0.pt").write_bytes(b"x")
    seal(folder)
    return model, folder


def test_rebuilds_weights_like_save_pretrained(tmp_path, qwen_checkpoint):
    from transformers import AutoModelForCausalLM

    model, folder = qwen_checkpoint
    result = ex.export_hf(folder, tmp_path / "hf", progress=False)
    out = tmp_path / "hf"
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer_config.json",
    ]
    ours = load_file(out / "model.safetensors")
    model.save_pretrained(tmp_path / "ref")
    ref = load_file(tmp_path / "ref" / "model.safetensors")
    assert set(ours) == set(ref) and "lm_head.weight" not in ours  # the tied copy is written once
    assert all(torch.equal(ours[k], ref[k]) for k in ref)
    assert result.tensors == len(ref) and not result.copied and result.dtype == torch.float32
    rank_files = sum(p.stat().st_size for p in folder.glob("zero_pp_rank_*.pt"))
    assert result.verified[0] > rank_files and "MB verified in" in result.summary()
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    x = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(x).logits, model.eval()(x).logits)


def test_a_shard_goes_to_writeback_as_it_is_written(tmp_path, qwen_checkpoint, monkeypatch):
    """The disk writes a shard while its later tensors are rebuilt (io/durable.py Writeback): the
    ranges handed to writeback follow each other from the shard's start to near its end."""
    every, kicks = 4096, []
    monkeypatch.setattr(durable, "_WRITEBACK_EVERY", every)
    monkeypatch.setattr(durable, "_sync_file_range", lambda fd, off, n, fl: kicks.append((off, n)))
    _, folder = qwen_checkpoint
    ex.export_hf(folder, tmp_path / "hf", progress=False)
    size = (tmp_path / "hf" / "model.safetensors").stat().st_size
    assert size > 4 * every and kicks[0][0] == 0, (size, kicks[:2])
    assert all(off + n == nxt for (off, n), (nxt, _) in zip(kicks, kicks[1:]))
    assert size - every < kicks[-1][0] + kicks[-1][1] <= size


def test_bf16_shards_and_excluded_frozen(tmp_path, qwen_checkpoint):
    model, folder = qwen_checkpoint
    out = tmp_path / "hf"
    ex.export_hf(
        folder, out, dtype="bf16", max_shard_size="8KB", exclude_frozen=True, progress=False
    )
    index = json.loads((out / INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert (
        len(shards) > 2
        and shards[-1] == f"model-{len(shards):05d}-of-{len(shards):05d}.safetensors"
    )
    ours = {k: v for s in shards for k, v in load_file(out / s).items()}
    state = model.state_dict()
    assert (
        set(ours)
        == set(index["weight_map"])
        == set(state) - {"lm_head.weight", "model.layers.0.mlp.up_proj.weight"}
    )
    assert all(
        v.dtype == torch.bfloat16 and torch.equal(v, state[k].to(torch.bfloat16))
        for k, v in ours.items()
    )
    assert index["metadata"]["total_size"] == sum(v.numel() * 2 for v in ours.values())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_buffers_keep_their_dtype(tmp_path):
    state = OrderedDict(
        w=torch.randn(5, 3), b=torch.randn(7), steps=torch.arange(4), scale=torch.tensor([0.5])
    )
    folder = tmp_path / "ckpt"
    folder.mkdir()
    write_zero3(folder, state, world=2, buffers=("steps", "scale"))
    (folder / "config.json").write_text("{}")
    seal(folder)
    ex.export_hf(folder, tmp_path / "hf", dtype="fp16", progress=False)
    ours = load_file(tmp_path / "hf" / "model.safetensors")
    assert list(ours) == list(state)  # the model's state-dict order
    assert ours["steps"].dtype == torch.int64 and torch.equal(ours["steps"], state["steps"])
    assert torch.equal(ours["w"], state["w"].half()) and ours["scale"].dtype == torch.float16


def test_reads_rank_files_without_importing_deepspeed(tmp_path, qwen_checkpoint):
    _, folder = qwen_checkpoint
    code = (
        "import sys; from finetune.offline.export import export_hf; "
        f"export_hf({str(folder)!r}, {str(tmp_path / 'hf')!r}, progress=False); "
        "assert 'deepspeed' not in sys.modules, 'deepspeed was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert (tmp_path / "hf" / "model.safetensors").exists()


def test_released_pages_read_back_intact(tmp_path):
    t = torch.randn(3 << 20)  # 12 MB: many whole pages
    torch.save({"x": t}, tmp_path / "t.pt")
    mapped = zf._load(tmp_path / "t.pt")["x"]
    pager = zf._Pager(tmp_path / "t.pt", mapped)
    assert pager.enabled == sys.platform.startswith("linux")
    pieces = [p.clone() for p in zf._chunks(mapped, pager)]  # each released after it is consumed
    # dropped pages come back from the file
    assert torch.equal(torch.cat(pieces), t) and torch.equal(mapped, t)
    anonymous = torch.randn(1 << 20)
    # never madvise memory not mapped from the file
    assert not zf._Pager(tmp_path / "t.pt", anonymous).enabled


def test_consolidated_weights_are_copied(tmp_path, qwen_checkpoint):
    model, folder = qwen_checkpoint
    ex.export_hf(folder, tmp_path / "first", progress=False)
    for name in ("model.safetensors",):
        (folder / name).write_bytes((tmp_path / "first" / name).read_bytes())
    seal(folder, consolidated=True)
    result = ex.export_hf(folder, tmp_path / "hf", progress=False)
    assert result.copied
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (
        folder / "model.safetensors"
    ).read_bytes()
    rebuilt = ex.export_hf(
        folder, tmp_path / "bf16", dtype="bf16", progress=False
    )  # another dtype: rebuilt
    assert not rebuilt.copied and rebuilt.dtype == torch.bfloat16


# --- copy or rebuild: the same command gives the same weights, consolidated or not ----------------

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize(
    "stored,training,weights_from,exact",
    [
        (FP32, BF16, FROM_MASTER, True),
        (FP16, BF16, FROM_MASTER, True),
        # bf16 module weights upcast: the masters' low bits are lost
        (FP32, BF16, FROM_MODULE, False),
        (FP32, BF16, None, False),  # the same, written before the source was recorded
        (FP16, BF16, None, False),  # rounded twice (to bf16, then to fp16)
        (BF16, BF16, None, True),  # DeepSpeed's bf16 module weights are the masters cast to bf16
        (FP16, FP16, FROM_MODULE, True),
        (BF16, FP32, None, True),  # fp32 module weights are the masters
        (FP32, FP32, None, True),
    ],
)
def test_consolidated_weights_are_exact_only_when_a_rebuild_writes_the_same(
    stored, training, weights_from, exact
):
    assert ex.exact_copy(stored, training, weights_from) is exact


@pytest.fixture
def bf16_run(tmp_path):
    """A bf16 run's checkpoint: fp32 masters not representable in bf16 in the rank files."""
    torch.manual_seed(0)
    state = OrderedDict(w=torch.randn(6, 5), b=torch.randn(7))
    folder = tmp_path / "global_step3"
    folder.mkdir()
    write_zero3(folder, state, world=2)
    (folder / "trainer_state.json").write_text(json.dumps({"world_size": 2, "dtype": "bf16"}))
    (folder / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))
    seal(folder)
    return state, folder


def _consolidate(folder: Path, state: dict, weights_from: str | None, listed: bool = True) -> None:
    """model.safetensors as a consolidated save writes it, its source recorded or (None) not;
    ``listed``: committed with it (else what a failed consolidation left behind)."""
    from safetensors.torch import save_file

    save_file(
        state,
        folder / "model.safetensors",
        metadata={"format": "pt", **({SOURCE_KEY: weights_from} if weights_from else {})},
    )
    if listed:
        seal(folder, consolidated=True)


@pytest.mark.parametrize("weights_from", [FROM_MODULE, None])
def test_upcast_module_weights_are_rebuilt_from_the_masters(tmp_path, bf16_run, weights_from):
    state, folder = bf16_run
    # before the fix
    _consolidate(folder, {k: v.to(BF16).float() for k, v in state.items()}, weights_from)
    result = ex.export_hf(folder, tmp_path / "hf", dtype="fp32", progress=False)
    assert not result.copied
    ours = load_file(tmp_path / "hf" / "model.safetensors")
    assert all(torch.equal(ours[k], v) for k, v in state.items())
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "float32"


def test_master_weights_are_copied_in_their_dtype_only(tmp_path, bf16_run):
    state, folder = bf16_run
    _consolidate(folder, dict(state), FROM_MASTER)
    result = ex.export_hf(folder, tmp_path / "fp32", dtype="fp32", progress=False)
    assert result.copied and result.dtype == FP32
    assert (tmp_path / "fp32" / "model.safetensors").read_bytes() == (
        folder / "model.safetensors"
    ).read_bytes()
    again = ex.export_hf(folder, tmp_path / "fp16", dtype="fp16", progress=False)
    assert (
        not again.copied and load_file(tmp_path / "fp16" / "model.safetensors")["w"].dtype == FP16
    )


def test_the_default_dtype_is_the_training_dtype_whatever_was_consolidated(tmp_path, bf16_run):
    state, folder = bf16_run
    plain = ex.export_hf(folder, tmp_path / "plain", progress=False)
    _consolidate(folder, dict(state), FROM_MASTER)  # fp32, from the masters
    result = ex.export_hf(folder, tmp_path / "hf", progress=False)
    assert not result.copied and result.dtype == plain.dtype == BF16
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (
        tmp_path / "plain" / "model.safetensors"
    ).read_bytes()
    rebuilt = load_file(tmp_path / "hf" / "model.safetensors")
    assert all(torch.equal(rebuilt[k], v.to(BF16)) for k, v in state.items())


def test_weights_a_failed_consolidation_left_are_not_copied(tmp_path, bf16_run):
    state, folder = bf16_run
    seal(folder, consolidated=False)  # committed without the weights it failed to write
    zeros = {k: torch.zeros_like(v) for k, v in state.items()}  # e.g. truncated
    _consolidate(folder, zeros, FROM_MASTER, listed=False)
    result = ex.export_hf(folder, tmp_path / "hf", dtype="fp32", progress=False)
    assert not result.copied
    assert torch.equal(load_file(tmp_path / "hf" / "model.safetensors")["w"], state["w"])


def test_without_rank_files_the_consolidated_weights_are_copied_as_they_are(tmp_path, bf16_run):
    state, folder = bf16_run
    _consolidate(folder, dict(state), None)
    for rank_file in folder.glob("zero_pp_rank_*"):
        rank_file.unlink()
    result = ex.export_hf(folder, tmp_path / "hf", progress=False)
    assert result.copied and result.dtype == FP32


# --- bad input: exit 2, one line naming the path, nothing written ---------------------------------


def _error(capsys, *argv) -> str:
    assert main(["export", *map(str, argv)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("finetune: error: "), lines
    return lines[0]


def test_not_a_checkpoint(tmp_path, capsys):
    assert str(tmp_path / "nope") in _error(capsys, tmp_path / "nope", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    assert "not a checkpoint" in _error(capsys, tmp_path / "empty", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_rank_file(tmp_path, capsys, qwen_checkpoint):
    _, folder = qwen_checkpoint
    (folder / "zero_pp_rank_2_mp_rank_00_optim_states.pt").unlink()
    message = _error(capsys, folder, tmp_path / "out")
    assert (
        str(folder / "zero_pp_rank_2_mp_rank_00_optim_states.pt") in message
        and "rank 2 of 3" in message
    )
    assert not (tmp_path / "out").exists() and not any(
        p.name.startswith(".out") for p in tmp_path.iterdir()
    )


def test_out_not_empty(tmp_path, capsys, qwen_checkpoint):
    _, folder = qwen_checkpoint
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert str(tmp_path / "out") in _error(capsys, folder, tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]
    (tmp_path / "empty_out").mkdir()  # an empty folder is fine
    assert main(["export", str(folder), str(tmp_path / "empty_out")]) == 0


def test_bad_flags(tmp_path, capsys, qwen_checkpoint):
    _, folder = qwen_checkpoint
    assert "--max_shard_size" in _error(
        capsys, folder, tmp_path / "out", "--max_shard_size", "huge"
    )
    assert "--universal" in _error(capsys, folder, "--universal", "--dtype", "bf16")
    with pytest.raises(SystemExit) as e:
        main(["export", str(folder)])  # OUT is required without --universal
    assert e.value.code == 2


# --- safe loading: verified before a byte is read; unpickled with weights_only=True ---------------


def _flip(path: Path, at: int, mask: int = 0xFF) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= mask
    path.write_bytes(bytes(data))


def test_damage_is_named_before_anything_is_read(tmp_path, capsys, qwen_checkpoint):
    _, folder = qwen_checkpoint
    rank_file = folder / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:-100])
    message = _error(capsys, folder, tmp_path / "out")
    assert f"{folder}: does not verify" in message and "--no_verify" in message
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt: size" in message
    assert not (tmp_path / "out").exists() and not any(
        p.name.startswith(".out") for p in tmp_path.iterdir()
    )
    # Unverified, the truncated rank file is still refused by its reader, with a line naming it.
    assert f"{rank_file}: unreadable DeepSpeed file" in _error(
        capsys, folder, tmp_path / "out", "--no_verify"
    )


def test_a_flipped_byte_exports_only_with_no_verify(tmp_path, capsys, qwen_checkpoint):
    _, folder = qwen_checkpoint
    config = folder / "config.json"
    # a 0 becomes a 1: still JSON, only the checksum notices
    _flip(config, config.read_bytes().index(b"0"), 0x01)
    assert "config.json: checksum mismatch" in _error(capsys, folder, tmp_path / "out")
    assert main(["export", str(folder), str(tmp_path / "out"), "--no_verify"]) == 0
    capsys.readouterr()
    _flip(config, 0)  # not even text: one line naming it, not a traceback
    assert f"{config}: unreadable" in _error(capsys, folder, tmp_path / "out2", "--no_verify")


def test_a_checkpoint_without_a_manifest_needs_no_verify(tmp_path, capsys, qwen_checkpoint):
    """A DeepSpeed checkpoint not saved by finetune: nothing to verify against, said so."""
    _, folder = qwen_checkpoint
    (folder / "manifest.json").unlink()
    message = _error(capsys, folder, tmp_path / "out")
    assert "no readable manifest.json" in message and "--no_verify" in message
    assert main(["export", str(folder), str(tmp_path / "out"), "--no_verify"]) == 0
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_only_files_the_manifest_vouches_for_are_read(tmp_path, capsys, qwen_checkpoint):
    _, folder = qwen_checkpoint
    (folder / "tokenizer_config.json").unlink()  # listed, gone: the export would silently lack it
    # unlisted weights would be read, even copied
    (folder / "model.safetensors").write_bytes(b"planted")
    message = _error(capsys, folder, tmp_path / "out")
    assert (
        "tokenizer_config.json: missing" in message
        and "model.safetensors: not in manifest.json" in message
    )


class Trojan:
    """A class no checkpoint of DeepSpeed's holds (unpickling it needs this module imported)."""


class CopiesAFile:
    """Unpickling this calls shutil.copyfile(src, dst): code run by loading the file."""

    def __init__(self, src: Path, dst: Path):
        self.src, self.dst = str(src), str(dst)

    def __reduce__(self):
        import shutil

        return shutil.copyfile, (self.src, self.dst)


def _plant(folder: Path, payload, tmp_path: Path) -> Path:
    """Add ``payload`` to rank 0's model states and re-seal the manifest, as whoever crafted the
    checkpoint would: it verifies."""
    path = folder / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=True)
    state["extra"] = payload
    torch.save(state, path)
    seal(folder)
    return path


@pytest.mark.parametrize("verify", [[], ["--no_verify"]])
def test_code_in_a_rank_file_is_never_run(tmp_path, capsys, qwen_checkpoint, verify):
    _, folder = qwen_checkpoint
    marker = tmp_path / "ran"
    path = _plant(folder, CopiesAFile(folder / "config.json", marker), tmp_path)
    message = _error(capsys, folder, tmp_path / "out", *verify)
    assert message.startswith(f"finetune: error: {path}: refused to unpickle shutil.copyfile")
    assert not marker.exists() and not (tmp_path / "out").exists()
    # Not even through DeepSpeed's converter, which asks torch.load for weights_only=False.
    assert (
        "shutil.copyfile" in _error(capsys, folder, "--universal", *verify) and not marker.exists()
    )
    assert not (folder / "universal").exists() and not (folder / "universal.tmp").exists()


def test_an_unknown_class_is_refused_by_name(tmp_path, capsys, qwen_checkpoint):
    _, folder = qwen_checkpoint
    _plant(folder, Trojan(), tmp_path)
    message = _error(capsys, folder, tmp_path / "out")
    assert "refused to unpickle" in message and f"{Trojan.__module__}.Trojan" in message


def test_the_allow_list_is_exactly_what_deepspeed_pickles(tmp_path):
    """Every class on the list loads (as DeepSpeed's own, or inert for export), and each is needed:
    torch's defaults cover everything else a ZeRO-3 rank file holds (real ones: test_at_rest.py)."""
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    dynamic = CreateLossScaler(
        torch.half,
        0,
        True,
        {
            "init_scale": 2**16,
            "scale_window": 1000,
            "min_scale": 1,
            "delayed_shift": 2,
            "consecutive_hysteresis": False,
            "raise_error_at_min_scale": True,
        },
    )
    static = CreateLossScaler(torch.bfloat16, 1.0, False, None)
    path = tmp_path / "optim_states.pt"
    torch.save(
        {
            "optimizer_state_dict": {
                "zero_stage": ZeroStageEnum.weights,
                "loss_scaler": static,
                "fp16": dynamic,
                "fp32_flat_groups": [torch.ones(3)],
            }
        },
        path,
    )
    assert sorted(torch.serialization.get_unsafe_globals_in_checkpoint(path)) == sorted(
        safe_load.DEEPSPEED_GLOBALS
    )
    safe_load.check_globals(path)
    osd = safe_load.load(path)["optimizer_state_dict"]
    assert osd["zero_stage"] is ZeroStageEnum.weights and type(osd["fp16"]) is type(dynamic)
    assert (
        osd["fp16"].__dict__ == dynamic.__dict__ and osd["loss_scaler"].__dict__ == static.__dict__
    )
    inert = safe_load.load(path, inert=True)["optimizer_state_dict"]
    assert isinstance(inert["zero_stage"], safe_load.Placeholder) and inert["zero_stage"].args == (
        3,
    )
    assert inert["fp16"].state == dynamic.__dict__
