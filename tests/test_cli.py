"""finetune.cli: flags → RunConfig, reconciliation with the DeepSpeed JSON, usage errors (exit 2)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from finetune.cli import (
    EMBEDDED_MAX_STEPS,
    EMBEDDED_PRESET,
    FALLBACKS,
    parse_train_args,
)
from finetune.config import CONFIGS_DIR, ConfigError, finalize_ds_config


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """Run from an empty directory as a single process, whatever launched pytest."""
    monkeypatch.chdir(tmp_path)
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def parse(*argv: str):
    return parse_train_args(list(argv))


def write_ds(tmp_path, cfg: dict, name: str = "ds.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return str(path)


def _base_ds(**extra) -> dict:
    cfg = json.loads((CONFIGS_DIR / "ds_zero3.json").read_text())
    cfg.update(extra)
    return cfg


def _on_cpu() -> bool:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu"


# --- batch size and world size -------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 4])
def test_train_batch_size_is_micro_times_accum_times_world(world, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    cfg = parse("--per_device_train_batch_size", "3", "--gradient_accumulation_steps", "5")
    assert cfg.world_size == world
    assert cfg.ds_config["train_batch_size"] == 3 * 5 * world
    assert cfg.ds_config["train_micro_batch_size_per_gpu"] == 3
    assert cfg.ds_config["gradient_accumulation_steps"] == 5
    assert (cfg.train.per_device_train_batch_size, cfg.train.gradient_accumulation_steps) == (3, 5)


def test_batch_size_defaults_when_unset():
    cfg = parse()
    assert cfg.world_size == 1
    assert cfg.ds_config["train_batch_size"] == FALLBACKS["per_device_train_batch_size"] == 8
    assert cfg.ds_config["gradient_accumulation_steps"] == 1


def test_explicit_train_batch_size_that_matches_is_accepted(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    ds = write_ds(tmp_path, _base_ds(train_batch_size=16))
    cfg = parse("--deepspeed_config", ds, "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2")
    assert cfg.ds_config["train_batch_size"] == 16


def test_explicit_train_batch_size_mismatch_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    ds = write_ds(tmp_path, _base_ds(train_batch_size=16))
    with pytest.raises(ConfigError) as e:
        parse("--deepspeed_config", ds, "--per_device_train_batch_size", "4")
    msg = str(e.value)
    assert "train_batch_size: 16" in msg and "--per_device_train_batch_size" in msg and "= 8" in msg


def test_json_micro_batch_used_when_flag_absent(tmp_path):
    ds = write_ds(tmp_path, _base_ds(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=3))
    cfg = parse("--deepspeed_config", ds)
    assert cfg.train.per_device_train_batch_size == 2 and cfg.train.gradient_accumulation_steps == 3
    assert cfg.ds_config["train_batch_size"] == 6


# --- optimizer values ------------------------------------------------------------------------

def test_learning_rate_flag_fills_auto_lr():
    cfg = parse("--learning_rate", "2e-4")
    assert cfg.train.learning_rate == 2e-4
    assert cfg.ds_config["optimizer"]["params"]["lr"] == 2e-4


def test_learning_rate_contradicting_json_lr_names_both(tmp_path):
    ds_cfg = _base_ds()
    ds_cfg["optimizer"]["params"]["lr"] = 1e-4
    ds = write_ds(tmp_path, ds_cfg)
    with pytest.raises(ConfigError) as e:
        parse("--deepspeed_config", ds, "--learning_rate", "3e-4")
    assert "--learning_rate" in str(e.value) and "optimizer.params.lr" in str(e.value)


def test_json_lr_wins_without_flag_even_over_embedded_preset(tmp_path):
    ds_cfg = _base_ds()
    ds_cfg["optimizer"]["params"]["lr"] = 1e-4
    cfg = parse("--deepspeed_config", write_ds(tmp_path, ds_cfg))
    # The preset is a default, not a flag: an explicit JSON value must not be reported as contradicting it.
    assert cfg.train.learning_rate == 1e-4


def test_json_scheduler_warmup_wins_over_embedded_preset(tmp_path):
    ds_cfg = _base_ds(scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 0, "warmup_max_lr": "auto"}})
    cfg = parse("--deepspeed_config", write_ds(tmp_path, ds_cfg))
    assert cfg.train.warmup_steps == 0
    with pytest.raises(ConfigError, match="--warmup_steps.*scheduler.params.warmup_num_steps"):
        parse("--deepspeed_config", write_ds(tmp_path, ds_cfg), "--warmup_steps", "3")


def test_betas_auto_filled_from_flags_and_fallbacks():
    cfg = parse("--adam_beta1", "0.8")
    assert cfg.ds_config["optimizer"]["params"]["betas"] == [0.8, 0.999]
    assert (cfg.train.adam_beta1, cfg.train.adam_beta2) == (0.8, 0.999)


def test_explicit_json_betas_win_without_flags(tmp_path):
    ds_cfg = _base_ds()
    ds_cfg["optimizer"]["params"]["betas"] = [0.9, 0.95]
    cfg = parse("--deepspeed_config", write_ds(tmp_path, ds_cfg))
    assert (cfg.train.adam_beta1, cfg.train.adam_beta2) == (0.9, 0.95)


def test_beta_flag_contradicting_json_betas_is_an_error(tmp_path):
    ds_cfg = _base_ds()
    ds_cfg["optimizer"]["params"]["betas"] = [0.9, 0.95]
    ds = write_ds(tmp_path, ds_cfg)
    with pytest.raises(ConfigError) as e:
        parse("--deepspeed_config", ds, "--adam_beta2", "0.99")
    assert "--adam_beta2" in str(e.value) and "optimizer.params.betas" in str(e.value)
    # Agreeing flags are fine.
    assert parse("--deepspeed_config", ds, "--adam_beta2", "0.95").train.adam_beta2 == 0.95


@pytest.mark.parametrize("name", ["ds_zero3.json", "ds_zero3_offload.json"])
def test_shipped_configs_resolve_every_auto(name):
    cfg = parse("--deepspeed_config", str(CONFIGS_DIR / name))
    final = finalize_ds_config(cfg.ds_config, 150, cfg.train.warmup_steps, cfg.train.learning_rate)
    assert "auto" not in json.dumps(final)
    assert final["zero_optimization"]["stage"] == 3


# --- precision ---------------------------------------------------------------------------

def test_bf16_flag_contradicting_json_fp16_is_an_error(tmp_path):
    ds = write_ds(tmp_path, _base_ds(fp16={"enabled": True}))
    with pytest.raises(ConfigError) as e:
        parse("--deepspeed_config", ds, "--bf16")
    assert "bf16" in str(e.value) and "fp16.enabled" in str(e.value)


def test_bf16_shorthand_is_named_in_the_contradiction(tmp_path):
    path = write_ds(tmp_path, _base_ds(fp16={"enabled": True}))
    with pytest.raises(ConfigError, match=r"`--bf16` contradicts `fp16.enabled: true`"):
        parse("--deepspeed_config", path, "--bf16")


def test_flag_contradicting_an_explicitly_disabled_section_is_an_error(tmp_path):
    path = write_ds(tmp_path, _base_ds(fp16={"enabled": False}))
    with pytest.raises(ConfigError, match=r"`--fp16` contradicts `fp16.enabled: false`"):
        parse("--deepspeed_config", path, "--fp16")


def test_half_auto_betas_take_the_flag_for_the_auto_half(tmp_path):
    ds = _base_ds()
    ds["optimizer"]["params"]["betas"] = ["auto", 0.95]
    cfg = parse("--deepspeed_config", write_ds(tmp_path, ds), "--adam_beta1", "0.8")
    assert cfg.ds_config["optimizer"]["params"]["betas"] == [0.8, 0.95]
    assert (cfg.train.adam_beta1, cfg.train.adam_beta2) == (0.8, 0.95)


def test_bf16_flag_and_precision_flag_disagreeing_is_an_error():
    with pytest.raises(ConfigError, match="--bf16.*--precision fp16"):
        parse("--bf16", "--precision", "fp16")


def test_json_fp16_enabled_sets_precision(tmp_path):
    cfg = parse("--deepspeed_config", write_ds(tmp_path, _base_ds(fp16={"enabled": True})))
    assert cfg.train.precision == "fp16"
    assert cfg.ds_config["fp16"]["enabled"] is True and cfg.ds_config["bf16"]["enabled"] is False


@pytest.mark.parametrize("flag, on, off", [("--bf16", "bf16", "fp16"), ("--fp16", "fp16", "bf16")])
def test_precision_flag_enables_exactly_one_section(flag, on, off):
    cfg = parse(flag)
    assert cfg.train.precision == on
    assert cfg.ds_config[on]["enabled"] is True and cfg.ds_config[off]["enabled"] is False


def test_auto_precision_on_cpu_is_fp32():
    if not _on_cpu():
        pytest.skip("needs a CPU-only DeepSpeed accelerator (auto picks bf16 on an accelerator)")
    cfg = parse()
    assert cfg.train.precision == "fp32"
    assert cfg.ds_config["bf16"]["enabled"] is False and cfg.ds_config["fp16"]["enabled"] is False


def test_auto_precision_follows_the_accelerator(monkeypatch):
    import finetune.cli

    monkeypatch.setattr(finetune.cli, "auto_precision", lambda: "bf16")
    cfg = parse()
    assert cfg.train.precision == "bf16"
    assert cfg.ds_config["bf16"]["enabled"] is True and cfg.ds_config["fp16"]["enabled"] is False


# --- embedded preset ------------------------------------------------------------------------

def test_no_flags_uses_embedded_preset():
    cfg = parse()
    assert cfg.uses_embedded_model and cfg.uses_embedded_data
    assert cfg.train.learning_rate == EMBEDDED_PRESET["learning_rate"] == 1e-3
    assert cfg.train.max_steps == EMBEDDED_MAX_STEPS == 150
    assert cfg.train.num_train_epochs is None
    assert cfg.data.max_seq_length == 128
    assert cfg.ds_config["optimizer"]["params"]["lr"] == 1e-3


def test_explicit_flags_override_embedded_preset():
    cfg = parse("--learning_rate", "2e-3", "--max_steps", "7", "--max_seq_length", "64", "--warmup_steps", "0")
    assert (cfg.train.learning_rate, cfg.train.max_steps, cfg.data.max_seq_length, cfg.train.warmup_steps) == \
        (2e-3, 7, 64, 0)


def test_epochs_flag_replaces_embedded_max_steps():
    cfg = parse("--num_train_epochs", "1")
    assert cfg.train.max_steps is None and cfg.train.num_train_epochs == 1.0


def test_train_file_with_embedded_model_trains_by_epochs(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"text": "a b c"}\n')
    cfg = parse("--train_file", "train.jsonl")
    assert cfg.uses_embedded_model and not cfg.uses_embedded_data
    assert cfg.train.max_steps is None
    assert cfg.train.num_train_epochs == 3.0
    assert cfg.train.learning_rate == 1e-3  # the model preset still applies


def test_hub_model_gets_generic_fallbacks():
    cfg = parse("--model_name_or_path", "org/some-model")
    assert not cfg.uses_embedded_model
    assert cfg.train.learning_rate == FALLBACKS["learning_rate"] == 5e-5
    assert cfg.data.max_seq_length == 512
    assert cfg.train.max_steps is None and cfg.train.num_train_epochs == 3.0


# --- bad input: every case a ConfigError naming the flag or file ---------------------------

def _setup_bad_input(tmp_path, case: str) -> None:
    if case == "xml":
        (tmp_path / "train.xml").write_text("<rows/>")
    elif case == "output_file":
        (tmp_path / "out").write_text("not a dir")
    elif case == "malformed_json":
        (tmp_path / "bad.json").write_text('{"train_batch_size": 8,}')
    (tmp_path / "train.jsonl").write_text('{"text": "a b c"}\n')


BAD_INPUTS = [
    ("steps_and_epochs", ["--max_steps", "5", "--num_train_epochs", "1"], ["--max_steps", "--num_train_epochs"]),
    ("micro_batch_0", ["--per_device_train_batch_size", "0"], ["--per_device_train_batch_size"]),
    ("grad_accum_0", ["--gradient_accumulation_steps", "0"], ["--gradient_accumulation_steps"]),
    ("max_steps_0", ["--max_steps", "0"], ["--max_steps"]),
    ("max_seq_length_neg", ["--max_seq_length", "-4"], ["--max_seq_length"]),
    ("save_steps_0", ["--save_checkpoint", "--save_steps", "0"], ["--save_steps"]),
    ("logging_steps_0", ["--logging_steps", "0"], ["--logging_steps"]),
    ("learning_rate_0", ["--learning_rate", "0"], ["--learning_rate"]),
    ("epochs_0", ["--num_train_epochs", "0"], ["--num_train_epochs"]),
    ("missing_train_file", ["--train_file", "nope.jsonl"], ["--train_file", "nope.jsonl"]),
    ("xml", ["--train_file", "train.xml"], ["--train_file", ".xml"]),
    ("missing_model_dir", ["--model_name_or_path", "./nope/model"], ["--model_name_or_path", "./nope/model"]),
    ("output_file", ["--output_dir", "out"], ["--output_dir"]),
    ("malformed_json", ["--deepspeed_config", "bad.json"], ["--deepspeed_config", "bad.json", "line 1"]),
    ("missing_ds_json", ["--deepspeed_config", "none.json"], ["--deepspeed_config", "none.json"]),
    ("prompt_without_completion", ["--train_file", "train.jsonl", "--prompt_column", "q"], ["--prompt_column", "--completion_column"]),
    ("dataset_and_train_file", ["--dataset_name", "org/data", "--train_file", "train.jsonl"], ["--dataset_name", "--train_file"]),
    ("save_steps_without_save", ["--save_steps", "10"], ["--save_steps", "--save_checkpoint"]),
    ("validation_split_100", ["--validation_split_percentage", "100"], ["--validation_split_percentage"]),
    ("preempt_sigkill", ["--preempt_signals", "SIGTERM,SIGKILL"], ["--preempt_signals", "SIGKILL"]),
    ("preempt_unknown", ["--preempt_signals", "USR9"], ["--preempt_signals", "USR9"]),
]
# argparse usage errors (SystemExit 2), not ConfigErrors: abbreviations are refused.
ABBREVIATED = [["--output", "out"], ["--save_check"]]


@pytest.mark.parametrize("case, argv, names", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_raises_config_error_naming_the_flag(case, argv, names, tmp_path):
    _setup_bad_input(tmp_path, case)
    with pytest.raises(ConfigError) as e:
        parse(*argv)
    for name in names:
        assert name in str(e.value), f"{name!r} not in {str(e.value)!r}"


# --- the CLI as a process ----------------------------------------------------------------

def _run_cli(args: list[str], cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["COLUMNS"] = "200"
    return subprocess.run([sys.executable, "-m", "finetune", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


SUBPROCESS_CASES = [c for c in BAD_INPUTS if c[0] in
                    ("steps_and_epochs", "micro_batch_0", "missing_train_file", "malformed_json")]


@pytest.mark.parametrize("case, argv, names", SUBPROCESS_CASES, ids=[c[0] for c in SUBPROCESS_CASES])
def test_cli_usage_error_exits_2_with_one_line(case, argv, names, tmp_path):
    _setup_bad_input(tmp_path, case)
    proc = _run_cli([*argv, "--output_dir", "run_out"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    last = [line for line in proc.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("finetune: error:"), proc.stderr
    assert names[0] in last
    assert proc.stderr.count("finetune: error:") == 1
    assert not (tmp_path / "run_out").exists()


def test_cli_help_lists_design_flags_with_defaults(tmp_path):
    proc = _run_cli(["--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # undo argparse's line wrapping
    design_flags = """
        model_name_or_path config_name tokenizer_name trust_remote_code
        dataset_name dataset_config_name train_file validation_file text_column prompt_column
        completion_column messages_column max_seq_length packing validation_split_percentage max_train_samples
        deepspeed_config per_device_train_batch_size per_device_eval_batch_size gradient_accumulation_steps
        learning_rate weight_decay lr_scheduler_type warmup_steps num_train_epochs max_steps seed
        gradient_checkpointing bf16 fp16 logging_steps eval_steps
        output_dir save_checkpoint save_steps save_total_limit save_consolidated resume_from_checkpoint on_save_error
    """.split()
    missing = [f for f in design_flags if not re.search(rf"--{f}\b", text)]
    assert not missing, f"flags missing from --help: {missing}"
    for default in ("(default: configs/ds_zero3.json)", "(default: 42)", "(default: continue)",
                    "(default: output)", "(default: linear)", "(default: 5)"):
        assert default in text, default
    assert "--local_rank" not in text  # accepted from the launcher, hidden from users


def test_launcher_local_rank_is_accepted():
    cfg = parse("--local_rank", "0", "--max_steps", "3")
    assert cfg.train.max_steps == 3


def test_preempt_signals_parse_names_with_or_without_sig_and_none():
    import signal

    from finetune.preemption import parse_signals

    assert parse_signals("SIGTERM,usr1") == (signal.SIGTERM, signal.SIGUSR1)
    assert parse_signals("none") == () == parse_signals("")
    assert parse("--preempt_signals", "SIGUSR2").ckpt.preempt_signals == "SIGUSR2"


@pytest.mark.parametrize("argv", ABBREVIATED)
def test_abbreviated_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    assert argv[0] in capsys.readouterr().err
