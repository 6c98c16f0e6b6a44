"""finetune.cli: argv → the dict ``resolve.resolve`` takes, the --bf16/--fp16 shorthand, --help, and
usage errors as the process reports them (exit 2, one line). Resolution itself: test_config."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from finetune.cli import build_train_parser, parse_train_args
from finetune.config import LEGACY_TIMEOUT_ENV, ConfigError, flag_defaults

from conftest import base_ds as _base_ds
from conftest import run_cli, write_ds


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """Run from an empty directory as a single process, whatever launched pytest."""
    monkeypatch.chdir(tmp_path)
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", LEGACY_TIMEOUT_ENV):
        monkeypatch.delenv(var, raising=False)


def parse(*argv: str):
    return parse_train_args(list(argv))


# --- argv → values ---------------------------------------------------------------------------


def test_parser_has_a_flag_for_every_config_field_and_leaves_out_the_ones_not_given():
    parser = build_train_parser()
    dests = {a.dest for a in parser._actions}
    assert set(flag_defaults()) <= dests
    # Absent, not defaulted: a --config file's value must show through where no flag is given.
    assert vars(parser.parse_args([])) == {}
    assert parse().train == type(parse().train)(**{k: v for k, v in vars(parse().train).items()})


def test_every_switch_has_a_no_form_that_wins_over_the_config_file(tmp_path):
    (tmp_path / "run.yaml").write_text("save_checkpoint: true\npacking: true\nplot: true\n")
    cfg = parse("--config", str(tmp_path / "run.yaml"), "--no_packing", "--no_plot")
    assert (cfg.ckpt.save_checkpoint, cfg.data.packing, cfg.train.plot) == (True, False, False)
    assert parse().train.plot is True and parse("--no_plot").train.plot is False


def test_flags_reach_the_config_with_their_types(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = parse(
        "--per_device_train_batch_size",
        "3",
        "--gradient_accumulation_steps",
        "5",
        "--learning_rate",
        "2e-4",
        "--num_train_epochs",
        "1.5",
        "--packing",
    )
    assert cfg.world_size == 2 and cfg.ds_config["train_batch_size"] == 3 * 5 * 2
    assert (
        cfg.train.per_device_train_batch_size,
        cfg.train.learning_rate,
        cfg.train.num_train_epochs,
    ) == (3, 2e-4, 1.5)
    assert cfg.data.packing is True


def test_new_flags_defaults():
    cfg = parse()
    assert cfg.train.ddp_timeout == 900
    assert cfg.ckpt.ignore_unverified_checkpoints is False


def test_new_flags_parse():
    cfg = parse(
        "--ddp_timeout", "60", "--resume_from_checkpoint", "auto", "--ignore_unverified_checkpoints"
    )
    assert cfg.train.ddp_timeout == 60 and isinstance(cfg.train.ddp_timeout, int)
    assert cfg.ckpt.ignore_unverified_checkpoints is True


def test_ddp_timeout_below_10_names_the_flag():
    with pytest.raises(ConfigError, match=r"`--ddp_timeout` must be at least 10 seconds, got 5"):
        parse("--ddp_timeout", "5")


def test_ddp_timeout_must_be_whole_seconds(capsys):
    with pytest.raises(SystemExit) as e:
        parse("--ddp_timeout", "1.5")
    assert e.value.code == 2
    assert "--ddp_timeout" in capsys.readouterr().err


def test_launcher_local_rank_is_accepted():
    cfg = parse("--local_rank", "0", "--max_steps", "3")
    assert cfg.train.max_steps == 3


def test_preempt_signals_parse_names_with_or_without_sig_and_none():
    import signal

    from finetune.preemption import parse_signals

    assert parse_signals("SIGTERM,usr1") == (signal.SIGTERM, signal.SIGUSR1)
    assert parse_signals("none") == () == parse_signals("")
    assert parse("--preempt_signals", "SIGUSR2").ckpt.preempt_signals == "SIGUSR2"


# argparse usage errors (SystemExit 2), not ConfigErrors: abbreviations are refused.
ABBREVIATED = [["--output", "out"], ["--save_check"], ["--ddp", "60"]]


@pytest.mark.parametrize("argv", ABBREVIATED)
def test_abbreviated_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    assert argv[0] in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, hint",
    [
        (["--learning_rat", "1e-4"], "; did you mean --learning_rate?"),
        (["--learning_rat=1e-4"], "; did you mean --learning_rate?"),
        (["--output", "out"], "; did you mean --output_dir?"),
        (
            ["--learning_rat", "1", "--outptu_dir", "x"],
            "; did you mean --learning_rate (for --learning_rat), --output_dir (for --outptu_dir)?",
        ),
    ],
    ids=["flag_value", "flag_equals", "abbreviation", "two"],
)
def test_unknown_flag_suggests_the_close_one(argv, hint, capsys):
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("finetune: error: unrecognized arguments: ") and last.endswith(hint), (
        last
    )


def test_unknown_flag_far_from_every_flag_gets_no_suggestion(capsys):
    with pytest.raises(SystemExit):
        parse("--zzzzzz")
    assert capsys.readouterr().err.strip().endswith("unrecognized arguments: --zzzzzz")


def test_unknown_command_is_named_with_the_close_one():
    from finetune.cli import _command

    with pytest.raises(
        ConfigError,
        match=r"unknown command 'exprot' \(did you mean export\?\); "
        r"commands: env, export, ls, plot, train, verify",
    ):
        _command(["exprot", "ckpt", "out"])
    argv = ["export", "ckpt", "out"]
    assert _command(argv) == "export" and argv == ["ckpt", "out"]
    assert _command(["--max_steps", "3"]) == "train" and _command([]) == "train"


# --- the --bf16/--fp16 shorthand ------------------------------------------------------------


def test_bf16_and_fp16_together_are_refused(capsys):
    """Not the last one silently winning (then "fp16: this machine can't" named the wrong thing)."""
    with pytest.raises(SystemExit) as e:
        parse("--bf16", "--fp16")
    assert e.value.code == 2
    assert "argument --fp16: not allowed with argument --bf16" in capsys.readouterr().err


@pytest.mark.parametrize("flag, on, off", [("--bf16", "bf16", "fp16"), ("--fp16", "fp16", "bf16")])
def test_precision_shorthand_enables_exactly_one_section(flag, on, off):
    cfg = parse(flag)
    assert cfg.train.precision == on
    assert cfg.ds_config[on]["enabled"] is True and cfg.ds_config[off]["enabled"] is False


def test_bf16_flag_and_precision_flag_disagreeing_is_an_error():
    with pytest.raises(ConfigError, match="--bf16.*--precision fp16"):
        parse("--bf16", "--precision", "fp16")


def test_bf16_shorthand_is_named_in_the_contradiction(tmp_path):
    path = write_ds(tmp_path, _base_ds(fp16={"enabled": True}))
    with pytest.raises(ConfigError, match=r"`--bf16` contradicts `fp16.enabled: true`"):
        parse("--deepspeed_config", path, "--bf16")


def test_precision_flag_is_named_in_the_contradiction(tmp_path):
    path = write_ds(tmp_path, _base_ds(fp16={"enabled": False}))
    with pytest.raises(ConfigError, match=r"`--precision fp16` contradicts `fp16.enabled: false`"):
        parse("--deepspeed_config", path, "--precision", "fp16")


# --- the CLI as a process ----------------------------------------------------------------


SUBPROCESS_CASES = [
    ("steps_and_epochs", ["--max_steps", "5", "--num_train_epochs", "1"], "--max_steps"),
    ("micro_batch_0", ["--per_device_train_batch_size", "0"], "--per_device_train_batch_size"),
    ("missing_train_file", ["--train_file", "nope.jsonl"], "--train_file"),
    ("malformed_json", ["--deepspeed_config", "bad.json"], "--deepspeed_config"),
    ("ddp_timeout_5", ["--ddp_timeout", "5"], "--ddp_timeout"),
]


@pytest.mark.parametrize("case, argv, name", SUBPROCESS_CASES, ids=[c[0] for c in SUBPROCESS_CASES])
def test_cli_usage_error_exits_2_with_one_line(case, argv, name, tmp_path):
    (tmp_path / "bad.json").write_text('{"train_batch_size": 8,}')
    proc = run_cli([*argv, "--output_dir", "run_out"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    last = [line for line in proc.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("finetune: error:"), proc.stderr
    assert name in last
    assert proc.stderr.count("finetune: error:") == 1
    assert not (tmp_path / "run_out").exists()


def test_cli_help_lists_design_flags_with_defaults(tmp_path):
    proc = run_cli(["--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # undo argparse's line wrapping
    design_flags = """
        model_name_or_path config_name tokenizer_name trust_remote_code
        dataset_name dataset_config_name train_file validation_file text_column prompt_column
        completion_column messages_column max_seq_length packing validation_split_percentage
        max_train_samples
        deepspeed_config per_device_train_batch_size per_device_eval_batch_size
        gradient_accumulation_steps
        learning_rate weight_decay lr_scheduler_type warmup_steps num_train_epochs max_steps seed
        gradient_checkpointing bf16 fp16 logging_steps eval_steps
        output_dir save_checkpoint save_steps save_total_limit save_consolidated
        resume_from_checkpoint on_save_error
        ddp_timeout ignore_unverified_checkpoints
    """.split()
    missing = [f for f in design_flags if not re.search(rf"--{f}\b", text)]
    assert not missing, f"flags missing from --help: {missing}"
    for default in (
        "(default: configs/ds_zero3.json)",
        "(default: 42)",
        "(default: continue)",
        "(default: output)",
        "(default: linear)",
        "(default: 5)",
        "before the run fails (default 900).",
        "OUT/.abandoned, not deleted",
    ):
        assert default in text, default
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "--local_rank" not in text  # accepted from the launcher, hidden from users


@pytest.mark.parametrize(
    "body,code",
    [
        ("1 / 0", 1),
        ("sys.exit('usage: bad')", 1),
        ("raise KeyboardInterrupt", 130),
        ("return 75", 75),
    ],
)
def test_entry_leaves_without_interpreter_teardown_whatever_main_does(body, code):
    # Teardown can abort a rank with SIGABRT (gloo's threads at finalisation): CI once saw a
    # crashing rank exit -6 where 1 is documented. An atexit handler shows whether teardown ran.
    script = (
        "import atexit, sys\nfrom finetune import cli\n"
        "atexit.register(lambda: print('teardown ran', flush=True))\n"
        f"def boom():\n    {body}\ncli.main = boom\ncli.entry()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == code, proc.stderr
    assert "teardown ran" not in proc.stdout
    if code == 1:
        assert "ZeroDivisionError" in proc.stderr or "usage: bad" in proc.stderr


@pytest.mark.parametrize("argv", [["--help"], ["--learning_rate", "x"], ["--max_steps", "0"]])
def test_help_and_flag_errors_come_before_torch_is_imported(argv):
    """`finetune --help` and a mistyped flag answer in a fraction of a second: torch (~3 s to
    import) is loaded only once the flags are good."""
    code = (
        "import sys\n"
        "from finetune import cli\n"
        "try:\n"
        f"    code = cli.main({argv!r})\n"
        "except SystemExit as e:\n"
        "    code = e.code\n"
        "print(code, 'torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-2:] == ["0" if argv == ["--help"] else "2", "False"], (
        proc.stdout[-500:] + proc.stderr[-2000:]
    )
