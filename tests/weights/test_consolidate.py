"""The consolidated writer: format, ties, frozen and shards on plain models in one process; the
placement, window and error rules as pure functions; the streamed path over gloo between spawned
processes (no launcher, fake ZeRO-3 partitions)."""

from __future__ import annotations

import ast
import inspect
import json
import multiprocessing
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from finetune.io import seams
from finetune.weights import consolidate, shards
from finetune.weights.consolidate import (
    FROM_MASTER,
    FROM_MODULE,
    SOURCE_KEY,
    ConsolidationError,
    ConsolidationFailed,
    comm_device,
    reads_master,
    recv_window,
    save_consolidated,
    tensor_entries,
    weights_source,
)
from finetune.weights.shards import INDEX, ShardWriter, plan_shards

from conftest import free_port


def tiny(model_type: str, tied: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(vocab_size=97, tie_word_embeddings=tied)
    if model_type == "gpt2":
        kw.update(n_embd=32, n_layer=2, n_head=2, n_positions=64)
    else:
        kw.update(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=64,
        )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw))


@pytest.mark.parametrize("model_type,tied", [("llama", False), ("qwen2", True), ("gpt2", True)])
def test_round_trip_matches_save_pretrained_keys_and_values(tmp_path, model_type, tied):
    from transformers import AutoModelForCausalLM

    model = tiny(model_type, tied)
    # a frozen parameter comes out too
    if model_type != "gpt2":
        model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    else:
        model.transformer.h[0].mlp.c_fc.weight.requires_grad_(False)
    files = save_consolidated(model, tmp_path, torch.float32, "8KB")
    model.config.save_pretrained(tmp_path)
    index = json.loads((tmp_path / INDEX).read_text())
    assert set(files) == set(index["weight_map"].values()) | {INDEX}
    reference = tmp_path / "ref"
    model.save_pretrained(reference)
    ref_keys = set(load_file(reference / "model.safetensors"))
    ours = {}
    for shard in set(index["weight_map"].values()):
        ours.update(load_file(tmp_path / shard))
    assert set(ours) == ref_keys  # the same keys save_pretrained writes (tied copies dropped)
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    x = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(x).logits, model.eval()(x).logits)


def test_single_shard_is_model_safetensors_and_dtype_cast(tmp_path):
    model = tiny("llama", False)
    files = save_consolidated(model, tmp_path, torch.bfloat16, "5GB")
    assert set(files) == {"model.safetensors"}
    sd = load_file(tmp_path / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in sd.values())
    assert torch.equal(sd["lm_head.weight"], model.lm_head.weight.detach().to(torch.bfloat16))


def test_shard_plan_keeps_gather_order_and_respects_the_limit():
    model = tiny("llama", False)
    entries = tensor_entries(model)
    plan, meta = plan_shards(entries, torch.float32, "10KB")
    flat = [n for names in plan.filename_to_tensors.values() for n in names]
    assert flat == [e[0] for e in entries]
    for names in plan.filename_to_tensors.values():
        size = sum(meta[n].numel() * 4 for n in names)
        assert size <= 10_000 or len(names) == 1  # only a single oversized tensor may exceed it
    assert plan.total_size == sum(p.numel() * 4 for p in model.parameters())


def test_write_error_surfaces_as_oserror_after_the_last_module(tmp_path):
    model = tiny("llama", False)
    plan, _ = plan_shards(tensor_entries(model), torch.float32, "20KB")
    second = list(plan.filename_to_tensors)[1]
    (tmp_path / second).mkdir()  # a directory where a shard file must go
    with pytest.raises(ConsolidationFailed) as e:  # raised after every collective: safe to agree on
        save_consolidated(model, tmp_path, torch.float32, "20KB")
    assert isinstance(e.value.__cause__, IsADirectoryError)


@pytest.mark.parametrize(
    "site", ["save.consolidated_write", "save.consolidated_append", "save.consolidated_close"]
)
@pytest.mark.parametrize("kind", ["eio", "enospc", "error"])
def test_a_failure_inside_a_shard_is_held_and_leaves_no_partial_shard(
    tmp_path, monkeypatch, site, kind
):
    """After the open, mid-tensor, at the close: always ConsolidationFailed (the caller commits the
    partitioned checkpoint without safetensors), never a bare OSError, and no shard left behind."""

    monkeypatch.setenv(seams.FAULT, f"{site}:0:{kind}")
    monkeypatch.delenv("RANK", raising=False)
    folder = tmp_path / "global_step3"
    folder.mkdir()
    with pytest.raises(ConsolidationFailed, match="injected fault"):
        save_consolidated(tiny("llama", False), folder, torch.float32, "20KB")
    assert list(folder.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_disk_that_fills_mid_tensor_fails_the_consolidation_not_the_job(tmp_path):
    """The review's reproduction: ENOSPC in the middle of a shard. Closing the open file flushed the
    buffered bytes again and raised a plain OSError out of the writer's cleanup, which the manager
    takes for a failure mid-gather: rank 0 exited 1 while the others waited in the agreement. Now
    the failure is ConsolidationFailed and the partial shard is deleted (its space back for the
    rest of the save)."""
    import subprocess

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48k", "tmpfs", str(mnt)]).returncode
        != 0
    ):
        pytest.skip("cannot mount a tmpfs")
    try:
        model = tiny("llama", False)
        assert sum(p.numel() * 4 for p in model.parameters()) > 2 * 48 * 1024  # far more than fits
        with pytest.raises(ConsolidationFailed, match="No space left on device"):
            save_consolidated(model, mnt, torch.float32, "1GB")
        assert list(mnt.iterdir()) == []
        (mnt / "rng_state_0.pt").write_bytes(b"x" * 20_000)  # the rest of the save has its space
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


# --- placement, windows, checks -------------------------------------------------------------------


@pytest.mark.parametrize(
    "backend,accelerator,expected",
    [
        # an offloaded (CPU) partition goes to the GPU
        ("nccl", torch.device("cuda", 1), torch.device("cuda", 1)),
        # a GPU partition comes back to CPU for gloo
        ("gloo", torch.device("cuda", 0), torch.device("cpu")),
        ("gloo", torch.device("cpu"), torch.device("cpu")),
        ("ccl", torch.device("cpu"), torch.device("cpu")),  # DeepSpeed's CPU accelerator
        ("cpu:gloo,cuda:nccl", torch.device("cuda", 0), torch.device("cuda", 0)),
        ("NCCL", torch.device("cuda", 0), torch.device("cuda", 0)),
    ],
)
def test_p2p_device_follows_the_backend_not_the_tensor(backend, accelerator, expected):
    assert comm_device(backend, accelerator) == expected


@pytest.mark.parametrize(
    "partition_bytes,peers,budget,window",
    [
        (1 << 20, 15, 8 << 20, 8),  # eight 1 MB partitions fill the 8 MB budget
        (16 << 20, 15, 8 << 20, 1),  # one partition over the budget: still one rank at a time
        (1 << 10, 3, 8 << 20, 3),  # never more ranks than there are
        (0, 3, 8 << 20, 3),
        (1 << 20, 0, 8 << 20, 0),  # a single rank receives nothing
    ],
)
def test_receive_window_stays_within_the_budget_or_one_partition(
    partition_bytes, peers, budget, window
):
    got = recv_window(partition_bytes, peers, budget)
    assert got == window
    assert got * partition_bytes <= max(budget, partition_bytes)


class _Z3Optimizer:
    """Stands in for DeepSpeed's ZeRO-3 optimizer: what ``safe_get_local_fp32_param`` asks of it."""

    def __init__(self, master: torch.dtype = torch.float32):
        self.master_weights_and_grads_dtype = master

    def get_local_fp32_param(self, p, optim_state_key=None):
        return p.fake_master_partition if p.requires_grad else None


def _z3_param(
    dtype: torch.dtype, trainable: bool = True, optimizer: _Z3Optimizer | None = _Z3Optimizer()
):
    p = torch.nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=trainable)
    p.ds_id = 0
    if optimizer is not None:
        p._z3_optimizer = optimizer
    return p


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize(
    "module,requested,expected",
    [
        (BF16, FP32, True),  # an upcast of the module weights would lack the bits the master has
        (BF16, FP16, True),  # and a cast to fp16 would round twice
        (BF16, BF16, False),  # the module weights are the master cast to bf16 already
        (FP16, FP32, True),
        (FP32, BF16, False),  # fp32 module weights are the master
        (FP32, FP32, False),
    ],
)
def test_master_weights_are_read_when_the_module_weights_would_not_cast_exactly(
    module, requested, expected
):
    assert reads_master(_z3_param(module), requested) is expected


def test_no_master_for_frozen_parameters_or_without_an_optimizer():
    assert not reads_master(_z3_param(BF16, trainable=False), FP32)
    assert not reads_master(_z3_param(BF16, optimizer=None), FP32)
    # bf16 masters: the module weights
    assert not reads_master(_z3_param(BF16, optimizer=_Z3Optimizer(master=BF16)), FP32)
    # not a ZeRO-3 parameter
    assert not reads_master(torch.nn.Parameter(torch.zeros(2, dtype=BF16)), FP32)
    assert weights_source([_z3_param(BF16), _z3_param(BF16, trainable=False)]) == FROM_MASTER
    assert weights_source([_z3_param(BF16), _z3_param(BF16, optimizer=None)]) == FROM_MODULE
    assert weights_source(torch.nn.Linear(2, 2).parameters()) == FROM_MODULE


def test_a_partition_unlike_the_plan_is_named():
    p = torch.nn.Parameter(torch.empty(0))
    p.ds_tensor = torch.zeros(3)
    spec = torch.empty(4, device="meta")  # every rank's partition, as the parameter's metadata says
    with pytest.raises(
        ConsolidationError,
        match=r"^w: this rank's partition has 3 torch.float32 elements, planned 4",
    ):
        consolidate._local_partition(p, "w", spec, master=False)


def test_plan_rejects_a_dtype_safetensors_cannot_hold_naming_the_tensor():
    model = torch.nn.Linear(2, 2)
    # kept as is: not floating
    model.register_buffer("phase", torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"phase as torch\.complex64"):
        plan_shards(tensor_entries(model), torch.float32, "1GB")
    with pytest.raises(ValueError, match=r"weight as torch\.float8_e4m3fn"):
        plan_shards(tensor_entries(torch.nn.Linear(2, 2)), torch.float8_e4m3fn, "1GB")


def _writer(tmp_path):
    model = torch.nn.Linear(3, 2)
    plan, meta = plan_shards(tensor_entries(model), torch.float32, "1GB")
    return ShardWriter(tmp_path, plan, meta), model


def test_writer_mismatches_raise_a_named_error_even_under_python_O(tmp_path):
    writer, model = _writer(tmp_path)
    with pytest.raises(ConsolidationError, match="weight: gathered shape"):
        writer.write("weight", torch.zeros(3, 2))
    with pytest.raises(ConsolidationError, match="got bias, planned weight"):
        writer.write("bias", model.bias)
    writer.write("weight", model.weight)
    with pytest.raises(ConsolidationError, match="wrote 1 of 2"):
        writer.finish()
    assert not issubclass(ConsolidationError, AssertionError)
    tree = ast.parse(inspect.getsource(consolidate))
    assert not [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Assert)], (
        "asserts vanish under python -O"
    )


def test_writer_counts_streamed_elements(tmp_path):
    writer, model = _writer(tmp_path)
    writer.begin("weight")
    writer.append(model.weight.reshape(-1)[:4])
    with pytest.raises(ConsolidationError, match="weight: wrote 4 of 6 elements"):
        writer.end("weight", 6)


# --- the streamed path between processes ----------------------------------------------------------

WORLD = 3
FULL = {
    "a": torch.arange(10.0).reshape(2, 5),
    "b": torch.arange(100.0, 107.0),
    "c": torch.arange(3.0),
}
SMALL = torch.tensor([7.0, 8.0])  # under the threshold: written whole, not streamed
# 12 bytes: a, b and c are streamed; a's and b's partitions (16 and 12 bytes) come one rank per
# window, c's (4 bytes) both peers in one window.
STREAM = "12"


class _Unmovable(torch.Tensor):
    """A partition that can't be staged on the communication device (as a CUDA OOM would)."""

    def to(self, *args, **kwargs):
        raise RuntimeError("out of memory staging the partition (simulated)")


def _simulated_oom(self, piece):
    raise RuntimeError("CUDA out of memory (simulated)")


def _fake_zero3_model(rank: int) -> torch.nn.Module:
    """Parameters as ZeRO-3 leaves them: empty data, full shape in ds_shape, a padded flat
    partition."""
    model = torch.nn.Module()
    for name, full in FULL.items():
        n = -(-full.numel() // WORLD)
        flat = torch.cat([full.reshape(-1), torch.zeros(n * WORLD - full.numel())])
        p = torch.nn.Parameter(torch.empty(0))
        p.ds_shape, p.ds_numel, p.ds_tensor = (
            full.shape,
            full.numel(),
            flat[rank * n : (rank + 1) * n].clone(),
        )
        setattr(model, name, p)
    model.small = torch.nn.Parameter(SMALL.clone())
    return model


# The fp32 master weights of a bf16 run (not representable in bf16) and its frozen parameter.
MASTERS = {"a": torch.arange(10.0).reshape(2, 5) / 3, "b": torch.arange(100.0, 107.0) / 7}
FROZEN = torch.tensor([1 / 3, 2 / 3, 1.0]).to(BF16)
DTYPES = {"fp32": FP32, "fp16": FP16, "bf16": BF16}


def _partition(full: torch.Tensor, rank: int) -> torch.Tensor:
    n = -(-full.numel() // WORLD)
    return torch.cat([full.reshape(-1), full.new_zeros(n * WORLD - full.numel())])[
        rank * n : (rank + 1) * n
    ].clone()


def _fake_bf16_model(rank: int) -> torch.nn.Module:
    """bf16 module weights (their masters cast), the fp32 masters in a fake ZeRO-3 optimizer."""
    model, optimizer = torch.nn.Module(), _Z3Optimizer()
    for name, full in {**MASTERS, "frozen": FROZEN}.items():
        p = _z3_param(BF16, trainable=name != "frozen", optimizer=optimizer)
        p.ds_shape, p.ds_numel = full.shape, full.numel()
        p.ds_tensor = _partition(full.to(BF16), rank)
        p.fake_master_partition = _partition(full, rank)
        setattr(model, name, p)
    return model


def _save(rank: int, folder: str, scenario: str) -> dict:
    if scenario == "masters":  # every dtype from the same bf16 "run"
        model = _fake_bf16_model(rank)
        for name, dtype in DTYPES.items():
            Path(folder, name).mkdir(exist_ok=True)
            save_consolidated(model, Path(folder, name), dtype, "1GB")
        return {"files": sorted(p.name for p in Path(folder).glob("*/*.safetensors"))}
    model = _fake_zero3_model(rank)
    if scenario == "fail" and rank == 0:
        shards.ShardWriter.append = _simulated_oom
    if scenario == "fail" and rank == 2:
        model.a.ds_tensor = model.a.ds_tensor.as_subclass(_Unmovable)
    return {"files": sorted(save_consolidated(model, Path(folder), torch.float32, "1GB"))}


def _rank_main(rank: int, port: int, folder: str, scenario: str) -> None:
    # "masters": every parameter streamed (nothing here can be all-gathered like a real ZeRO-3 one)
    os.environ["FINETUNE_STREAM_BYTES"] = "1" if scenario == "masters" else STREAM
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=60),
    )
    try:
        outcome = _save(rank, folder, scenario)
    except Exception as e:  # noqa: BLE001 — reported to the test
        outcome = {"error": f"{type(e).__name__}: {e}"}
    # Times out (gloo raises) if any rank left the gathers early or is still waiting in one.
    in_step = torch.ones(1)
    torch.distributed.all_reduce(in_step)
    outcome["in_step"] = in_step.item() == WORLD
    Path(folder, f"rank{rank}.json").write_text(json.dumps(outcome))
    torch.distributed.destroy_process_group()
    # Skip interpreter teardown: once DeepSpeed is imported it now and then aborts there ("terminate
    # called without an active exception", after everything above returned), which is not ours to
    # test.
    os._exit(0)


def _run_ranks(folder: Path, scenario: str) -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, port, str(folder), scenario)) for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
        if p.exitcode is None:
            p.kill()
    assert [p.exitcode for p in procs] == [0] * WORLD
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_streamed_partitions_arrive_in_rank_order_over_batched_p2p(tmp_path):
    outcomes = _run_ranks(tmp_path, "ok")
    assert (
        outcomes
        == [{"files": ["model.safetensors"], "in_step": True}]
        + [{"files": [], "in_step": True}] * 2
    )
    written = load_file(tmp_path / "model.safetensors")
    assert set(written) == {*FULL, "small"}
    assert all(torch.equal(written[name], full) for name, full in FULL.items())
    assert torch.equal(written["small"], SMALL)


def test_errors_on_any_rank_are_raised_after_the_last_gather(tmp_path):
    """A non-I/O error writing on rank 0, and a staging failure on rank 2, each raised on its own
    rank once every rank is done: the all-reduce after the save completes on all three."""
    outcomes = _run_ranks(tmp_path, "fail")
    assert outcomes == [
        {
            "error": "ConsolidationFailed: RuntimeError: CUDA out of memory (simulated)",
            "in_step": True,
        },
        {"files": [], "in_step": True},
        {
            "error": (
                "ConsolidationFailed: RuntimeError: out of memory staging the partition (simulated)"
            ),
            "in_step": True,
        },
    ]


def test_bf16_weights_come_from_the_fp32_masters_in_a_wider_or_other_dtype(tmp_path):
    """A bf16 run's consolidated weights are its masters cast to the requested dtype: streamed from
    the masters for fp32 and fp16, the module weights (the same values) for bf16; the frozen
    parameter, which has no master, from its module weights. Recorded in each file's metadata."""
    from safetensors import safe_open

    outcomes = _run_ranks(tmp_path, "masters")
    assert [o.get("error") for o in outcomes] == [None] * WORLD and all(
        o["in_step"] for o in outcomes
    )
    for name, dtype in DTYPES.items():
        written = load_file(tmp_path / name / "model.safetensors")
        assert set(written) == {*MASTERS, "frozen"}
        for key, master in MASTERS.items():
            assert written[key].dtype == dtype and torch.equal(written[key], master.to(dtype)), (
                name,
                key,
            )
        assert torch.equal(written["frozen"], FROZEN.to(dtype))
        with safe_open(tmp_path / name / "model.safetensors", "pt") as f:
            assert f.metadata() == {"format": "pt", SOURCE_KEY: FROM_MASTER}
    # what the module weights would have given
    assert not torch.equal(MASTERS["a"].to(BF16).float(), MASTERS["a"])
