"""console.quiet: the known per-rank noise of our dependencies is filtered at the default level,
nothing else is, and --log_level info|debug filters nothing. The launched run's console is
checked in tests/distributed/test_run_surface.py."""

from __future__ import annotations

import logging
import warnings

import pytest

from finetune import console

DEPRECATED = (
    "`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
    "`torch.distributed.all_gather_single` instead."
)
PEFT_READS = (
    "`is_gradient_checkpointing` is deprecated and will be removed in v6. "
    "Use `is_activation_checkpointing` instead."
)
ACCELERATOR = (
    "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
)


@pytest.fixture
def ds_logger(monkeypatch):
    # quiet() sets them for child processes
    for var in ("TRANSFORMERS_VERBOSITY", "DATASETS_VERBOSITY"):
        monkeypatch.setenv(var, "warning")
    logger = logging.getLogger("DeepSpeed")
    level, filters = logger.level, list(logger.filters)
    yield logger
    logger.setLevel(level)
    logger.filters[:] = filters


def shown(level: str) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        console.quiet([], level=level)
        warnings.warn(DEPRECATED, FutureWarning, stacklevel=1)
        warnings.warn(PEFT_READS, FutureWarning, stacklevel=1)
        warnings.warn(
            "`torch.load` with weights_only=False is deprecated", FutureWarning, stacklevel=1
        )
    return [str(w.message) for w in caught]


def test_the_deprecated_collective_and_peft_warnings_are_filtered_and_others_are_not(ds_logger):
    assert shown("warning") == ["`torch.load` with weights_only=False is deprecated"]
    assert shown("info") == [
        DEPRECATED,
        PEFT_READS,
        "`torch.load` with weights_only=False is deprecated",
    ]


@pytest.mark.parametrize(
    "rank, level, kept", [("0", "warning", True), ("1", "warning", False), ("1", "info", True)]
)
def test_deepspeed_per_process_warning_shows_once_from_rank_0(
    ds_logger, monkeypatch, rank, level, kept
):
    monkeypatch.setenv("RANK", rank)
    console.quiet([], level=level)
    record = ds_logger.makeRecord("DeepSpeed", logging.WARNING, __file__, 1, ACCELERATOR, (), None)
    assert ds_logger.filter(record) is kept
    other = ds_logger.makeRecord(
        "DeepSpeed", logging.WARNING, __file__, 1, "Config parameter x is deprecated", (), None
    )
    assert ds_logger.filter(other)  # any other DeepSpeed warning, from any rank


def test_level_comes_from_the_command_line_before_parsing():
    assert console._level_from_argv(["--max_steps", "3", "--log_level", "debug"]) == "debug"
    assert console._level_from_argv(["--log_level=info"]) == "info"
    assert console._level_from_argv([]) == "warning"


def test_only_deepspeeds_build_notice_is_swallowed(capsys):
    with console.swallow_build_notice():
        print("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
        print("something else DeepSpeed says")
    assert capsys.readouterr().out == "something else DeepSpeed says\n"
