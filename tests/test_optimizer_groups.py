"""The optimizer's parameter groups (build.group_layout): one group when nothing decays, the decayed
matrices apart from biases and norm weights otherwise, and a resume keeps its checkpoint's layout
(tests/distributed/test_checkpoint.py resumes both bit for bit; the pre-reshape fixture, which
records none, resumes with two)."""

from __future__ import annotations

import torch

from finetune.build import DECAY_SPLIT, GROUPS_KEY, ONE_GROUP, _param_groups, group_layout


def test_a_fresh_run_has_one_group_unless_weights_decay():
    assert group_layout(0.0, None) == ONE_GROUP
    assert group_layout(0.01, None) == DECAY_SPLIT


def test_a_resume_keeps_the_layout_of_its_checkpoint():
    assert group_layout(0.01, {GROUPS_KEY: ONE_GROUP}) == ONE_GROUP
    assert group_layout(0.0, {GROUPS_KEY: DECAY_SPLIT}) == DECAY_SPLIT
    # a checkpoint that records no layout was trained with two groups
    assert group_layout(0.0, {"global_step": 2}) == DECAY_SPLIT


def test_every_trainable_parameter_is_in_exactly_one_group():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    model[2].weight.requires_grad_(False)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}

    (one,) = _param_groups(model, 0.0, ONE_GROUP)
    assert {id(p) for p in one["params"]} == trainable and len(one["params"]) == len(trainable)
    assert one["weight_decay"] == 0.0

    decay, no_decay = _param_groups(model, 0.1, DECAY_SPLIT)
    assert [id(p) for p in decay["params"]] == [id(model[0].weight)]
    assert {id(p) for p in no_decay["params"]} == trainable - {id(model[0].weight)}
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
