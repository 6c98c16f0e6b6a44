"""--config run.yaml|json: keys are flag names, the command line wins, bad keys and types are named
(exit 2); OUT/run_config.yaml round-trips to the same configuration. The examples in
configs/examples parse; the tiny-model run of one is in tests/distributed/test_config_files.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from finetune import run_config
from finetune.cli import parse_train_args
from finetune.config import LEGACY_TIMEOUT_ENV, ConfigError

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "configs" / "examples").glob("*.yaml"))


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", LEGACY_TIMEOUT_ENV):
        monkeypatch.delenv(var, raising=False)


def config_file(tmp_path: Path, text: str, name: str = "run.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_file_values_reach_the_config_and_flags_override_them(tmp_path):
    path = config_file(
        tmp_path,
        "learning_rate: 2.0e-4\nmax_steps: 7\nsave_checkpoint: true\n"
        "output_dir: from_file\nlr_scheduler_type: cosine\n",
    )
    cfg = parse_train_args(["--config", path, "--max_steps", "9"])
    assert (cfg.train.learning_rate, cfg.train.max_steps, cfg.ckpt.save_checkpoint) == (
        2e-4,
        9,
        True,
    )
    assert (cfg.ckpt.output_dir, cfg.train.lr_scheduler_type) == ("from_file", "cosine")


def test_a_flag_replaces_the_files_value_of_the_flag_it_excludes(tmp_path):
    path = config_file(tmp_path, "num_train_epochs: 3\nprompt_column: q\ncompletion_column: a\n")
    cfg = parse_train_args(["--config", path, "--max_steps", "4"])
    assert (cfg.train.max_steps, cfg.train.num_train_epochs) == (4, None)
    path = config_file(tmp_path, "max_steps: 4\n")
    assert parse_train_args(["--config", path, "--num_train_epochs", "1"]).train.max_steps is None
    # Both exclusive flags on the command line are still an error.
    with pytest.raises(ConfigError, match="Can't give both `--max_steps` and `--num_train_epochs`"):
        parse_train_args(["--config", path, "--num_train_epochs", "1", "--max_steps", "2"])


def test_json_files_work_the_same(tmp_path):
    path = config_file(tmp_path, '{"max_steps": 3, "packing": true}', "run.json")
    cfg = parse_train_args(["--config", path])
    assert (cfg.train.max_steps, cfg.data.packing) == (3, True)


def test_yaml_exponent_without_a_dot_is_still_a_number(tmp_path):
    # YAML 1.1 (PyYAML) reads 1e-5 as a string; every HF recipe writes learning rates like that.
    cfg = parse_train_args(["--config", config_file(tmp_path, "learning_rate: 1e-5\n")])
    assert cfg.train.learning_rate == 1e-5


@pytest.mark.parametrize(
    "text, message",
    [
        ("learning_rat: 1.0e-4\n", r"unknown key `learning_rat`; did you mean `learning_rate`\?"),
        ("bf16: true\n", r"unknown key `bf16` \(use precision: bf16\)"),
        (
            "frobnicate: 1\n",
            r"unknown key `frobnicate` \(keys are the training flags' names, without --\)",
        ),
        ("--max_steps: 3\n", r"unknown key `--max_steps`; did you mean `max_steps`\?"),
        ("max_steps: ten\n", r"`max_steps` must be an integer, got 'ten' \(a string\)"),
        ("max_steps: 2.5\n", r"`max_steps` must be an integer, got 2.5 \(a number\)"),
        ("learning_rate: fast\n", r"`learning_rate` must be a number, got 'fast' \(a string\)"),
        (
            "packing: yes please\n",
            r"`packing` must be true or false, got 'yes please' \(a string\)",
        ),
        ("packing: null\n", r"`packing` must be true or false, got null"),
        ("text_column: [a, b]\n", r"`text_column` must be a string, got \['a', 'b'\] \(a list\)"),
        (
            "lr_scheduler_type: wsd\n",
            r"`lr_scheduler_type` must be one of linear, cosine, constant, constant_with_warmup, "
            r"cosine_with_min_lr, warmup_stable_decay, got 'wsd'",
        ),
        ("- max_steps\n", r"must hold a mapping of flag names to values, got list"),
        ("max_steps: [\n", r"not valid YAML: while parsing"),
    ],
)
def test_bad_files_name_the_key_and_what_was_expected(tmp_path, text, message):
    path = config_file(tmp_path, text)
    with pytest.raises(ConfigError, match=r"--config \S*run.yaml: " + message):
        parse_train_args(["--config", path])


def test_missing_or_foreign_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="--config: file not found: nope.yaml"):
        parse_train_args(["--config", "nope.yaml"])
    with pytest.raises(
        ConfigError, match=r"--config .*run.toml: must be a .yaml, .yml or .json file"
    ):
        parse_train_args(["--config", config_file(tmp_path, "x = 1", "run.toml")])


def test_unknown_key_exits_2_with_one_line_before_any_work(tmp_path):
    path = config_file(tmp_path, "save_steps: 5\nmax_step: 3\n")
    r = subprocess.run(
        [sys.executable, "-m", "finetune", "--config", path, "--output_dir", "out"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"finetune: error: --config {path}: unknown key `max_step`; did you mean `max_steps`?"
    ]
    assert not (tmp_path / "out").exists()


def test_written_run_config_resolves_to_the_same_configuration(tmp_path):
    cfg = parse_train_args(
        [
            "--max_steps",
            "5",
            "--learning_rate",
            "3e-4",
            "--save_checkpoint",
            "--no_plot",
            "--output_dir",
            str(tmp_path / "out"),
            "--report_to",
            "csv",
            "--save_total_limit",
            "2",
        ]
    )
    (tmp_path / "out").mkdir()
    path = run_config.write(cfg, cfg.ckpt.output_dir, "test")
    text = path.read_text()
    assert text.startswith("# finetune test: the resolved configuration") and "\n# train\n" in text
    again = parse_train_args(["--config", str(path)])
    assert again.to_json_dict() == cfg.to_json_dict()
    assert again.ds_config == cfg.ds_config


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid_config_files(example):
    values = run_config.load(str(example))
    assert values, f"{example} is empty"
    assert example.read_text().startswith("#"), f"{example} should say what it is for in a comment"


def test_the_examples_promised_in_the_docs_exist():
    assert {p.name for p in EXAMPLES} >= {
        "llama-1b-sft.yaml",
        "chat-sft.yaml",
        "7b-offload.yaml",
        "slurm.yaml",
        "llama-8b-lora.yaml",
    }
