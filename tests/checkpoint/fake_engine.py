"""A real Checkpointer in one process (world size 1) on a fake DeepSpeed engine, for the unit tests
of the save, its commit, retention and the resume (tests/checkpoint, tests/checkpoint_format,
tests/faults/test_regressions.py). A test module imports the fixtures it uses by name
(``tiny_module``; ``_fake_engines_model_is_not_checked``, autouse) so that pytest finds them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from finetune.checkpoint_format.outdir import STAGING, OutputDir
from finetune.io.durable import hash_file

if TYPE_CHECKING:  # imported where used: a test of the writer alone need not load the rest
    from finetune.checkpoint.checkpointer import Checkpointer
    from finetune.checkpoint.resume import ResumePlan
    from finetune.checkpoint.writer import Files
    from finetune.checkpoint_format.state import TrainingState
    from finetune.config import RunConfig


class Inner:
    """DeepSpeed's checkpoint engine as GuardedWriter wraps it: makedirs and save come from the
    writer; only this setting is read from the engine it wraps."""

    zipfile_serialization = True


class FakeEngine:
    """What the Checkpointer needs of DeepSpeed's engine: save_checkpoint through
    checkpoint_engine."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.checkpoint_engine = Inner()

    def save_checkpoint(self, save_dir: str, tag: str, save_latest: bool) -> None:
        folder = f"{save_dir}/{tag}"
        self.checkpoint_engine.makedirs(folder, exist_ok=True)
        for kind in ("model", "optim"):
            self.checkpoint_engine.save(
                {"x": torch.ones(64)}, f"{folder}/zero_pp_rank_0_mp_rank_00_{kind}_states.pt"
            )


class FakeTokenizer:
    def save_pretrained(self, folder: str | Path) -> tuple[str, str]:
        path = f"{folder}/tokenizer.json"
        with open(path, "w") as f:
            f.write("{}")
        # transformers lists files it may not write
        return (path, f"{folder}/special_tokens_map.json")


class FakeSampler:
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        self.loaded = sd


@pytest.fixture(scope="module")
def tiny_module() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=32, n_positions=16))


@pytest.fixture(autouse=True)
def _fake_engines_model_is_not_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake engine saves a tiny GPT-2 while the flags name the embedded model: a resume's
    architecture check (tested in test_modeling) would rightly refuse every checkpoint here."""
    monkeypatch.setattr(
        "finetune.checkpoint.resume.check_checkpoint_model", lambda folder, args: None
    )


def make_cfg(out: Path, **flags: object) -> RunConfig:
    from finetune.resolve import resolve

    return resolve({"output_dir": str(out), "save_checkpoint": True, **flags}, world_size=1)


def make_manager(
    cfg: RunConfig, module: torch.nn.Module, run_id: str = "run1", **kw: object
) -> tuple[Checkpointer, TrainingState, ResumePlan | None]:
    """A Checkpointer over cfg's output dir, its resume planned first (``kw``: more of its
    arguments); returns it, its progress state and the plan."""
    from finetune.checkpoint.checkpointer import Checkpointer
    from finetune.checkpoint.resume import Resumer
    from finetune.checkpoint.staging import Layout
    from finetune.checkpoint_format.state import TrainingState

    storage = OutputDir(cfg.ckpt.output_dir)
    plan = Resumer(cfg, storage).plan_resume()
    progress = TrainingState()
    manager = Checkpointer(
        storage,
        cfg.ckpt,
        Layout([[0]], False),
        engine=FakeEngine(module),
        states={"progress": progress, "sampler": FakeSampler()},
        tokenizer=FakeTokenizer(),
        run_info={"args": {}},
        run_id=run_id,
        plan=plan,
        **kw,
    )
    return manager, progress, plan


def run_saves(manager: Checkpointer, progress: TrainingState, steps: list[int]) -> None:
    for step in steps:
        progress.global_step = step
        manager.save(step)


def stage(storage: OutputDir, tag: str, payload: bytes = b"weights") -> Files:
    """A save's staged folder with one rank file, as the engine leaves it before the commit."""
    folder = storage.root / STAGING / tag
    folder.mkdir(parents=True)
    (folder / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(payload)
    return {
        "zero_pp_rank_0_mp_rank_00_model_states.pt": hash_file(
            folder / "zero_pp_rank_0_mp_rank_00_model_states.pt"
        )
    }
