"""Learning-rate schedules: the flags' checks, and through the CLI the lr of every step equal to
transformers' schedule function's, across a resume."""

from __future__ import annotations

import inspect
import json
import math

import pytest

from finetune.build import warmup_steps
from finetune.config import SCHEDULER_KWARGS, SCHEDULERS, ConfigError
from finetune.resolve import resolve


def test_each_schedules_arguments_are_transformers_own():
    from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION, SchedulerType

    assert set(SCHEDULER_KWARGS) == set(SCHEDULERS)
    for name, ours in SCHEDULER_KWARGS.items():
        params = inspect.signature(TYPE_TO_SCHEDULER_FUNCTION[SchedulerType(name)]).parameters
        theirs = set(params) - {"optimizer", "num_warmup_steps", "num_training_steps", "last_epoch"}
        assert set(ours) == theirs, name


def _resolve(**flags):
    return resolve(flags, world_size=1)


def test_warmup_as_a_ratio_or_steps():
    assert _resolve(warmup_ratio=0.1).train.warmup_steps == 0.1
    assert _resolve(warmup_steps=0.25).train.warmup_steps == 0.25
    assert _resolve(warmup_steps=20.0).train.warmup_steps == 20
    assert warmup_steps(0.1, 95) == 10  # rounded up, as transformers' get_warmup_steps
    assert warmup_steps(0.0, 95) == 0 and warmup_steps(7, 95) == 7


@pytest.mark.parametrize(
    "flags,names",
    [
        (dict(lr_scheduler_kwargs='{"min_lr": 1e-5}'), ["min_lr", "linear"]),
        (
            dict(
                lr_scheduler_type="cosine_with_min_lr",
                lr_scheduler_kwargs={"min_lr": 1, "min_lr_rate": 0.1},
            ),
            ["exactly one of min_lr, min_lr_rate"],
        ),
        (
            dict(lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 2}),
            ["min_lr_rate", "[0, 1]"],
        ),
        (
            dict(
                lr_scheduler_type="warmup_stable_decay",
                lr_scheduler_kwargs={"num_decay_steps": 1.5},
            ),
            ["num_decay_steps", "whole number"],
        ),
        (dict(lr_scheduler_kwargs="[1, 2]"), ["JSON dict"]),
        (dict(warmup_ratio=-0.1), ["--warmup_ratio"]),
    ],
)
def test_bad_schedule_flags_name_the_flag(flags, names):
    with pytest.raises(ConfigError) as e:
        _resolve(**flags)
    for name in names:
        assert name in str(e.value)


def test_a_deepspeed_scheduler_section_refuses_scheduler_kwargs(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": "auto",
                "zero_optimization": {"stage": 3},
                "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}},
            }
        )
    )
    with pytest.raises(ConfigError, match="scheduler section"):
        _resolve(
            deepspeed_config=str(ds),
            lr_scheduler_type="cosine",
            lr_scheduler_kwargs={"num_cycles": 0.5},
        )


def _expected_lrs(name, kwargs, warmup, total, lr) -> list[float]:
    """transformers' schedule, stepped as the optimizer steps: the lr each step trains with."""
    import torch
    from transformers import get_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = get_scheduler(name, opt, warmup, total, scheduler_specific_kwargs=kwargs)
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


SCHEDULES = [
    ("cosine_with_min_lr", {"min_lr_rate": 0.1}, ("--warmup_ratio", "0.2")),
    ("warmup_stable_decay", {"num_decay_steps": 4, "min_lr_ratio": 0.1}, ("--warmup_steps", "0.2")),
]


@pytest.mark.e2e
@pytest.mark.parametrize("name,kwargs,warmup", SCHEDULES, ids=[s[0] for s in SCHEDULES])
def test_every_steps_lr_is_transformers_schedule_across_a_resume(
    tmp_path, run_finetune, name, kwargs, warmup
):
    total, lr = 10, 1e-3
    flags = (
        "--lr_scheduler_type",
        name,
        "--lr_scheduler_kwargs",
        json.dumps(kwargs),
        *warmup,
        "--max_steps",
        str(total),
        "--logging_steps",
        "1",
        "--learning_rate",
        str(lr),
        "--save_checkpoint",
        "--save_steps",
        "5",
        "--validation_split_percentage",
        "0",
    )
    full = run_finetune(*flags, launcher="python", nprocs=1, out_dir=tmp_path / "full")
    assert full.returncode == 0, full.output[-3000:]
    resumed = run_finetune(
        *flags,
        "--resume_from_checkpoint",
        str(tmp_path / "full" / "global_step5"),
        launcher="python",
        nprocs=1,
        out_dir=tmp_path / "resumed",
    )
    assert resumed.returncode == 0, resumed.output[-3000:]
    want = _expected_lrs(name, kwargs, math.ceil(0.2 * total), total, lr)
    got = {r["step"]: r["lr"] for r in full.train_rows()}
    assert [got[s] for s in range(1, total + 1)] == pytest.approx(want, rel=1e-6)
    after = {r["step"]: r["lr"] for r in resumed.train_rows()}
    assert sorted(after) == list(range(6, total + 1))
    assert [after[s] for s in range(6, total + 1)] == pytest.approx(want[5:], rel=1e-6)
    assert want[-1] < want[total // 2]  # the schedule decays: not a constant compared to itself
