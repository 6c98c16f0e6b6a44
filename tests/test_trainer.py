"""The training loop in one process (world size 1) around a fake engine: which steps count, what
metrics.jsonl and the checkpoints say when DeepSpeed skips optimizer steps, and that the hot path
reads nothing back from the device.

The engine is faked on purpose: under test is the loop's counting, not DeepSpeed's overflow
detection (on a GPU that is the fp16 run with ``"initial_scale_power": 32``; DeepSpeed refuses
fp16 on this CPU).
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from torch.overrides import TorchFunctionMode

import finetune.evaluation as evaluation
import finetune.run as run_module
import finetune.trainer as trainer_module
from finetune.checkpoint.checkpointer import Checkpointer
from finetune.checkpoint.resume import Resumer
from finetune.checkpoint.staging import Layout
from finetune.checkpoint_format.outdir import OutputDir
from finetune.checkpoint_format.state import TRAINER_STATE, TrainingState
from finetune.data import ResumableSampler, TrainData
from finetune.metrics import MetricsWriter, read_metrics
from finetune.preemption import Preemption
from finetune.resolve import resolve
from finetune.trainer import Trainer

PAD, LR, WARMUP, SCALE = 3, 1e-3, 2, 2.0**16
MICRO, ACCUM = 2, 2
PER_STEP = MICRO * ACCUM  # rows per optimizer step (one rank)


def _rows(n: int) -> list[dict]:
    """Row i starts with token 10 + i: a batch tells which rows it holds."""
    return [
        {"input_ids": [10 + i] * (1 + i % 3), "labels": [10 + i] * (1 + i % 3)} for i in range(n)
    ]


class _Optimizer(torch.optim.SGD):
    cur_scale = SCALE  # where DeepSpeed's ZeRO optimizers expose the fp16 loss scale


class _Writer:
    zipfile_serialization = True


class FakeEngine:
    """DeepSpeed's engine as the loop and the checkpoint manager use it, around a real optimizer and
    HF scheduler on one parameter. As in DeepSpeed (engine.py _take_model_step), a step whose
    micro-batches held a row of ``overflow_rows`` is skipped at the accumulation boundary: no
    optimizer or scheduler step, ``was_step_applied()`` False, the loss scale halved."""

    def __init__(self, module, total: int, overflow_rows=(), device: str = "cpu"):
        from transformers import get_scheduler

        self.module, self.device, self.overflow_rows = (
            module,
            torch.device(device),
            set(overflow_rows),
        )
        self.checkpoint_engine = _Writer()
        self.optimizer = _Optimizer([torch.nn.Parameter(torch.zeros(1))], lr=LR)
        self.lr_scheduler = get_scheduler(
            "linear", self.optimizer, num_warmup_steps=WARMUP, num_training_steps=total
        )
        self.micro_steps, self.boundaries, self._overflow, self._applied = 0, 0, False, False

    def __call__(self, input_ids, labels, attention_mask):
        if self.overflow_rows:  # the fake's own look at the data, outside the code under test
            self._overflow |= any(int(t) - 10 in self.overflow_rows for t in input_ids[:, 0])
        return SimpleNamespace(loss=(input_ids * attention_mask).float().mean() / 100)

    def backward(self, loss):
        pass

    def step(self):
        self.micro_steps += 1
        self._applied = False
        if self.micro_steps % ACCUM == 0:
            self.boundaries += 1
            self._applied = not self._overflow
            if self._applied:
                self.optimizer.step()
                self.lr_scheduler.step()
            else:
                self.optimizer.cur_scale /= 2
            self._overflow = False

    def was_step_applied(self) -> bool:
        return self._applied

    def get_lr(self):
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self):
        # As DeepSpeed's: None until this engine's first optimizer step (a resumed process has
        # none).
        return 1.0 if self.boundaries else None

    def fp16_enabled(self) -> bool:
        return True

    def train(self):
        pass

    def eval(self):
        pass

    def save_checkpoint(self, save_dir, tag, save_latest):
        folder = f"{save_dir}/{tag}"
        self.checkpoint_engine.makedirs(folder, exist_ok=True)
        state = {
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "cur_scale": self.optimizer.cur_scale,
        }
        self.checkpoint_engine.save(state, f"{folder}/zero_pp_rank_0_mp_rank_00_model_states.pt")
        self.checkpoint_engine.save(
            {"x": torch.ones(4)}, f"{folder}/zero_pp_rank_0_mp_rank_00_optim_states.pt"
        )

    def load_checkpoint(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states):
        path = f"{load_dir}/{tag}"
        state = torch.load(f"{path}/zero_pp_rank_0_mp_rank_00_model_states.pt", weights_only=True)
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.optimizer.cur_scale = state["cur_scale"]
        return path, {}


class FakeTokenizer:
    pad_token_id = PAD

    def save_pretrained(self, folder):
        with open(f"{folder}/tokenizer.json", "w") as f:
            f.write("{}")
        return (f"{folder}/tokenizer.json",)


@pytest.fixture(scope="module")
def tiny_module():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=32, n_positions=16))


@pytest.fixture
def make_trainer(tiny_module, monkeypatch):
    made = []
    # The fake engine trains a tiny GPT-2 while the flags name the embedded model: a resume's
    # architecture check (tested in test_modeling) would rightly refuse every checkpoint here.
    monkeypatch.setattr(
        "finetune.checkpoint.resume.check_checkpoint_model", lambda folder, args: None
    )

    def make(
        out, n_rows=64, overflow_rows=(), device="cpu", evalset=None, run_id="run1", **flags
    ) -> Trainer:
        cfg = resolve(
            {
                "output_dir": str(out),
                "save_checkpoint": True,
                "per_device_train_batch_size": MICRO,
                "gradient_accumulation_steps": ACCUM,
                "logging_steps": 1,
                "preempt_signals": "none",
                **flags,
            },
            world_size=1,
        )
        sampler = ResumableSampler(n_rows, 1, 0, cfg.train.seed)
        data = TrainData(_rows(n_rows), sampler, MICRO, ACCUM, PAD)
        total = cfg.train.max_steps or int(cfg.train.num_train_epochs * data.steps_per_epoch)
        engine = FakeEngine(tiny_module, total, overflow_rows, device)
        storage, state = OutputDir(out), TrainingState()
        manager = Checkpointer(
            storage,
            cfg.ckpt,
            Layout([[0]], False),
            engine=engine,
            states={"progress": state, "sampler": sampler},
            tokenizer=FakeTokenizer(),
            run_info={"args": {}},
            run_id=run_id,
            plan=Resumer(cfg, storage).plan_resume(),
        )
        made.append(
            Trainer(
                cfg,
                engine,
                FakeTokenizer(),
                data,
                evalset,
                total,
                manager,
                MetricsWriter(str(out)),
                state,
                Preemption(()),
            )
        )
        return made[-1]

    yield make
    for t in made:
        t.data.close()


def _rows_of_steps(seed: int, n_rows: int, *steps: int) -> list[int]:
    """One row of each of these loop iterations (0-based) of epoch 0: makes that step overflow."""
    order = ResumableSampler(n_rows, 1, 0, seed).epoch_order(0)
    return [order[k * PER_STEP] for k in steps]


def _train_rows(out) -> list[dict]:
    return [r for r in read_metrics(str(out)) if "loss" in r]


def _expected_lrs(total: int) -> list[float]:
    """The lr of each applied step: the schedule a run without skips follows."""
    from transformers import get_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    sched = get_scheduler("linear", opt, num_warmup_steps=WARMUP, num_training_steps=total)
    lrs = []
    for _ in range(total):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def _trainer_state(out, step: int) -> dict:
    return json.loads((out / f"global_step{step}" / TRAINER_STATE).read_text())


# --- skipped optimizer steps ----------------------------------------------------------------------


def test_skipped_steps_do_not_count_toward_max_steps_and_show_in_metrics(tmp_path, make_trainer):
    out = tmp_path / "out"
    t = make_trainer(
        out,
        overflow_rows=_rows_of_steps(42, 64, 1, 4),
        max_steps=5,
        save_steps=2,
        eval_steps=2,
        evalset=_rows(6),
    )
    assert t.train() == 0
    assert t.engine.boundaries == 7  # 5 applied + 2 skipped
    assert (t.state.global_step, t.state.skipped_steps) == (5, 2)
    rows = _train_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]  # each step number once
    assert [r["skipped_steps"] for r in rows] == [0, 1, 0, 1, 0]
    assert [r["loss_scale"] for r in rows] == [SCALE, SCALE / 2, SCALE / 2, SCALE / 4, SCALE / 4]
    # The schedule is the one of a run without skips: the scheduler steps only when the optimizer
    # does.
    assert [r["lr"] for r in rows] == pytest.approx(_expected_lrs(5), rel=0, abs=1e-15)
    assert rows[-1]["samples_seen"] == 7 * PER_STEP  # a skipped step's batches were consumed
    assert [r["step"] for r in read_metrics(str(out)) if "eval_loss" in r] == [0, 2, 4, 5]
    assert OutputDir(out).tags() == ["global_step2", "global_step4", "global_step5"]
    saved = {s: _trainer_state(out, s) for s in (2, 4, 5)}
    assert [saved[s]["skipped_steps"] for s in (2, 4, 5)] == [1, 2, 2]
    assert [saved[s]["sampler"]["consumed"] for s in (2, 4, 5)] == [
        3 * PER_STEP,
        6 * PER_STEP,
        7 * PER_STEP,
    ]


def test_resuming_between_skips_continues_exactly(tmp_path, make_trainer):
    """The data position, the skip counts and the (device-held) log window survive a resume: the
    resumed run overflows on the same batch and logs the same rows."""
    overflow = _rows_of_steps(42, 64, 1, 5)
    flags = dict(max_steps=6, save_steps=2, logging_steps=3)
    whole = tmp_path / "whole"
    assert make_trainer(whole, overflow_rows=overflow, **flags).train() == 0
    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    # Step 2's window holds steps 1-2 and the skip between them: saved as plain JSON.
    assert _trainer_state(resumed, 2)["window"]["skipped_steps"] == 1
    t = make_trainer(
        resumed,
        overflow_rows=overflow,
        run_id="run2",
        resume_from_checkpoint=str(resumed / "global_step2"),
        **flags,
    )
    assert t.train() == 0
    timing = ("tokens_per_s", "data_ms")
    strip = lambda rows: [{k: v for k, v in r.items() if k not in timing} for r in rows]  # noqa: E731
    assert strip(_train_rows(resumed)) == strip(_train_rows(whole))
    assert [r["skipped_steps"] for r in _train_rows(resumed)] == [1, 1]
    assert t.state.skipped_steps == 2 and t.engine.boundaries == 5  # steps 3-6 and the second skip


def test_resumed_at_its_last_step_from_a_save_between_two_rows_logs_them_and_ends(
    tmp_path, make_trainer
):
    """--max_steps 20 --save_steps 15 --logging_steps 10, then global_step15 resumed with
    --max_steps 15: no step runs, and the loop's end logged the restored window with an lr bound
    only inside the loop (UnboundLocalError, exit 1, `latest` never pointed back at step 15). The
    row it logs now is the one a run logging at step 15 writes."""
    out = tmp_path / "out"
    assert make_trainer(out, max_steps=20, save_steps=15, logging_steps=10).train() == 0
    t = make_trainer(
        out,
        run_id="run2",
        max_steps=15,
        logging_steps=10,
        resume_from_checkpoint=str(out / "global_step15"),
    )
    assert t.train() == 0
    assert (out / "latest").read_text().strip() == "global_step15"
    every5 = tmp_path / "every5"
    assert make_trainer(every5, max_steps=20, logging_steps=5).train() == 0
    timing = ("tokens_per_s", "data_ms")
    strip = lambda row: {k: v for k, v in row.items() if k not in timing}  # noqa: E731
    assert [r["step"] for r in _train_rows(out)] == [10, 15]
    assert strip(_train_rows(out)[-1]) == strip(
        next(r for r in _train_rows(every5) if r["step"] == 15)
    )


def test_an_epochs_run_with_skips_trains_its_steps_and_reads_into_the_next_epoch(
    tmp_path, make_trainer
):
    n = 16  # 4 steps per epoch
    order1 = ResumableSampler(n, 1, 0, 42).epoch_order(1)[:PER_STEP]
    row = next(
        r
        for r in ResumableSampler(n, 1, 0, 42).epoch_order(0)[PER_STEP : 2 * PER_STEP]
        if r not in order1
    )
    out = tmp_path / "out"
    t = make_trainer(out, n_rows=n, overflow_rows=[row], num_train_epochs=1)
    assert t.total_steps == 4 and t.train() == 0
    assert (t.state.global_step, t.state.skipped_steps, t.engine.boundaries) == (4, 1, 5)
    assert t.state.sampler["epoch"] == 1 and t.state.sampler["consumed"] == PER_STEP
    assert _train_rows(out)[-1]["epoch"] == 1.25


def test_a_run_that_only_skips_stops_with_exit_1_and_saves_nothing(
    tmp_path, make_trainer, monkeypatch
):
    monkeypatch.setattr(trainer_module, "MAX_SKIPS_IN_A_ROW", 3)
    out = tmp_path / "out"
    t = make_trainer(out, overflow_rows=range(64), max_steps=5, save_steps=1)
    assert t.train() == 1
    assert t.engine.boundaries == 3 and t.state.global_step == 0
    assert t.stop_note == {
        "reason": "failed",
        "error": "non-finite gradients",
        "step": 0,
        "skipped_in_a_row": 3,
        "skipped_steps": 3,
    }
    assert _train_rows(out) == [] and OutputDir(out).tags() == []


@pytest.mark.e2e
def test_real_deepspeed_skips_non_finite_steps_and_a_run_that_only_skips_stops(run_finetune):
    """Real DeepSpeed, one process on this CPU: ZeRO-3 skips a step whose gradient norm is not
    finite in any precision (zero/stage3.py step), as it skips an fp16 overflow. After a first step
    at a learning rate of 1e30 every gradient is: the run stops after MAX_SKIPS_IN_A_ROW with exit 1
    and nothing saved past step 1, instead of counting the skips as --max_steps."""
    r = run_finetune(
        "--max_steps",
        "6",
        "--learning_rate",
        "1e30",
        "--warmup_steps",
        "0",
        "--logging_steps",
        "1",
        "--save_checkpoint",
        "--save_steps",
        "1",
        launcher="python",
        nprocs=1,
    )
    assert r.returncode == 1, r.output[-4000:]
    status = json.loads((r.out_dir / "exit_status.json").read_text())
    assert (status["error"], status["step"], status["skipped_in_a_row"]) == (
        "non-finite gradients",
        1,
        trainer_module.MAX_SKIPS_IN_A_ROW,
    )
    assert [(x["step"], x["skipped_steps"], x["loss_scale"]) for x in r.train_rows()] == [
        (1, 0, None)
    ]  # fp32
    assert OutputDir(r.out_dir).tags() == ["global_step1"]


# --- no host sync in the hot path ---------------------------------------------------------------


class HostReads(TorchFunctionMode):
    """Records every read of a tensor on the meta device (our stand-in for the GPU: it has no data,
    so any host conversion of the device copy shows up here) and answers it with a dummy value."""

    READS = {
        "item": 1.0,
        "__float__": 1.0,
        "__int__": 1,
        "__index__": 1,
        "__bool__": True,
        "tolist": 1.0,
    }

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and first.is_meta:
            if name in self.READS:
                self.reads.append(name)
                return self.READS[name]
            if name in ("cpu", "numpy") or (name == "to" and "cpu" in map(str, args[1:])):
                self.reads.append(name)
                return torch.zeros(first.shape, dtype=first.dtype)
        return func(*args, **(kwargs or {}))


def test_a_training_step_reads_nothing_back_from_the_device(tmp_path, make_trainer):
    t = make_trainer(tmp_path / "out", device="meta", max_steps=5)
    with HostReads() as mode:
        for _ in range(3):
            t._train_step()
    assert mode.reads == []  # 6 micro-batches, not one host sync
    w = t.state.window
    assert (
        isinstance(w.loss_sum, torch.Tensor) and w.loss_sum.is_meta and w.micro_batches == 3 * ACCUM
    )
    consumed = t.data.sampler.epoch_order(0)[: 3 * PER_STEP]
    # counted on the host copy (row i has 1 + i % 3 tokens)
    assert w.tokens == sum(1 + i % 3 for i in consumed)
    assert t.engine.boundaries == 3 and t.engine.was_step_applied()


def test_evaluation_reads_the_device_once_and_pins_like_training(
    tmp_path, make_trainer, monkeypatch
):
    t = make_trainer(
        tmp_path / "out",
        device="meta",
        max_steps=5,
        evalset=_rows(10),
        per_device_eval_batch_size=2,
    )
    t.data.pin_memory = True  # what build_trainer sets on CUDA
    real, pinned = evaluation.eval_batches, []

    def spy(*args, pin_memory=False, **collation):
        pinned.append(pin_memory)
        return real(*args, **collation)  # this machine may have no CUDA to pin with

    monkeypatch.setattr(evaluation, "eval_batches", spy)
    with HostReads() as mode:
        t.evaluate()  # 5 batches
    assert mode.reads == ["__float__"] and pinned == [True]


@pytest.mark.parametrize(
    "error,kept", [(ValueError("a crash while building"), False), ("config", True)]
)
def test_a_previous_exit_status_is_kept_on_bad_input_and_cleared_on_a_crash(
    tmp_path, monkeypatch, error, kept
):
    """Bad input leaves OUT as it was; a crash while building must not leave a previous run's 75
    for a job script to read as "requeue me"."""
    from finetune.config import ConfigError
    from finetune.exit_status import EXIT_STATUS

    out = tmp_path / "out"
    out.mkdir()
    (out / EXIT_STATUS).write_text('{"exit_code": 75, "reason": "preempted"}\n')
    cfg = resolve({"output_dir": str(out)})

    def build(*args):
        raise ConfigError("--text_column: no such column") if error == "config" else error

    monkeypatch.setattr(run_module, "build_trainer", build)
    with pytest.raises(ConfigError if error == "config" else ValueError):
        run_module.run(cfg)
    assert (out / EXIT_STATUS).exists() == kept


@pytest.mark.parametrize("prefetch", [True, False])
def test_the_next_steps_label_tokens_ride_on_the_boundary_all_reduce(
    tmp_path, make_trainer, monkeypatch, prefetch
):
    """One all-reduce per step: the boundary's carries the next step's label tokens (counted on
    the prefetched batches), so the step's loss weighting needs no collective of its own."""
    import finetune.trainer as trainer_module

    t = make_trainer(tmp_path / "out", max_steps=5)
    if not prefetch:  # as on a CPU host (build.py): the next step made inline, counted all the same
        t.data._pool.shutdown()
        t.data._pool = None
    seen = []
    real = trainer_module.items_per_micro_batch
    monkeypatch.setattr(
        trainer_module,
        "items_per_micro_batch",
        lambda labels, micro, device, agreed=None: (
            seen.append((labels, agreed)) or real(labels, micro, device, agreed)
        ),
    )
    t.data.start()
    for _ in range(3):
        t._boundary()
        ahead = t.step_labels
        t._train_step()
        labels, agreed = seen[-1]
        assert agreed == ahead == labels > 0  # world size 1: this rank's count is the sum
        assert t.step_labels is None  # consumed: a step with no boundary before it asks anew
    t._train_step()  # (the bench calls it so) no boundary: the count is all-reduced itself
    assert seen[-1][1] is None
    t.data.close()
