"""Bad input as a user meets it: `python -m finetune …` (one plain process, no launcher) given one
mistake exits 2 with one line `finetune: error: …` naming the flag or file, prints no traceback,
leaves --output_dir (or export's OUT) as it found it, and stops before the heavy work: the
DeepSpeed engine is never built.

One row of CASES per mistake: an id, the argv, what the error line must name, and optionally a
setup that writes files first. In argv, setup and the expected names, `{tmp}` is the case's own
folder, `{out}` the output folder watched (`--output_dir {out}` is added to training cases that
give none), `{llama}` / `{gpt2}` tiny models, `{text}` / `{chat}` / `{pc}` data files (a text
column; chat `messages`; CSV `question`, `answer`) and `{ckpt}` a copy of a 1-step checkpoint
of `{llama}`, made once for the module.

Not a case: `--packing` with `--messages_column` is supported (chats are tokenized, then packed).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import child_env

pytestmark = pytest.mark.e2e

CASE_TIMEOUT = 120  # a hang is a failure, not a slow pass
MAX_SECONDS = 60  # bad input is found before the heavy work: most cases take 1-8 s
ERROR_LINE = re.compile(r"^finetune(?: \w+)?: error: ")
# the trainer's line right after deepspeed.initialize
ENGINE_BUILT = re.compile(r"\] model: [\d,]+ parameters")
RANK_FILE = "zero_pp_rank_0_mp_rank_00_optim_states.pt"


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]
    names: tuple[str, ...]  # each must appear in the error line
    setup: Callable[[Path, dict], None] | None = None
    known_bug: str | None = None  # why it fails today: an xfail(strict) that turns red once fixed


# --- setups: each writes what its case needs under the case's folder -------------------------


def _write(name: str, text: str) -> Callable[[Path, dict], None]:
    def setup(tmp: Path, ctx: dict) -> None:
        (tmp / name).write_text(text)

    return setup


def _ds(cfg: dict) -> Callable[[Path, dict], None]:
    """A DeepSpeed JSON at {tmp}/ds.json."""
    return _write("ds.json", json.dumps(cfg))


def _zero3(**extra) -> dict:
    return {"zero_optimization": {"stage": 3}, **extra}


def _model_copy(without: str) -> Callable[[Path, dict], None]:
    """{tmp}/model: the tiny llama without one of its files."""

    def setup(tmp: Path, ctx: dict) -> None:
        shutil.copytree(ctx["llama"], tmp / "model")
        (tmp / "model" / without).unlink()

    return setup


def _other_vocab_model(tmp: Path, ctx: dict) -> None:
    """{tmp}/model: the tiny llama's architecture with a vocabulary of 1024 (the checkpoint's:
    513)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ctx["llama"])
    config.vocab_size = 1024
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp / "model")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(ctx["llama"]) / f, tmp / "model" / f)


def _damage_rank_file(tmp: Path, ctx: dict) -> None:
    path = Path(ctx["ckpt"]) / RANK_FILE
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum finds it
    path.write_bytes(bytes(data))


def _non_empty_out(tmp: Path, ctx: dict) -> None:
    (tmp / "out").mkdir()
    (tmp / "out" / "keep.txt").write_text("mine")


def _previous_run_out(tmp: Path, ctx: dict) -> None:
    _non_empty_out(tmp, ctx)
    (tmp / "out" / "exit_status.json").write_text('{"exit_code": 0, "reason": "finished"}\n')


def _latest_dir(tmp: Path, ctx: dict) -> None:
    (tmp / "out" / "latest").mkdir(parents=True)


def _not_a_checkpoint(tmp: Path, ctx: dict) -> None:
    (tmp / "folder").mkdir()
    (tmp / "folder" / "notes.txt").write_text("not a checkpoint")


def _header_only_csv(tmp: Path, ctx: dict) -> None:
    (tmp / "header.csv").write_text("text\n")


CASES = [
    # the model
    Case(
        "model_path_missing",
        ("--model_name_or_path", "{tmp}/no/such/model"),
        ("--model_name_or_path", "{tmp}/no/such/model"),
    ),
    Case(
        "hub_id_while_offline",
        ("--model_name_or_path", "nosuch-org/nosuch-model"),
        ("--model_name_or_path", "nosuch-org/nosuch-model", "offline"),
    ),
    Case(
        "model_folder_without_weights",
        ("--model_name_or_path", "{tmp}/model"),
        ("--model_name_or_path", "{tmp}/model", "no weights", "--config_name"),
        _model_copy("model.safetensors"),
    ),
    Case(
        "model_folder_without_config",
        ("--model_name_or_path", "{tmp}/model"),
        ("--model_name_or_path", "{tmp}/model", "config.json"),
        _model_copy("config.json"),
    ),
    Case(
        "model_path_is_a_file",
        ("--model_name_or_path", "{tmp}/ds.json"),
        ("--model_name_or_path", "{tmp}/ds.json"),
        _ds(_zero3()),
    ),
    Case(
        "tokenizer_without_chat_template",
        (
            "--model_name_or_path",
            "{tmp}/model",
            "--train_file",
            "{chat}",
            "--messages_column",
            "messages",
        ),
        ("--messages_column", "chat template"),
        _model_copy("chat_template.jinja"),
    ),
    # the DeepSpeed JSON
    Case(
        "ds_missing",
        ("--deepspeed_config", "{tmp}/nope.json"),
        ("--deepspeed_config", "{tmp}/nope.json"),
    ),
    Case(
        "ds_malformed",
        ("--deepspeed_config", "{tmp}/ds.json"),
        ("--deepspeed_config", "{tmp}/ds.json", "line 3 column"),
        _write(
            "ds.json", '{\n  "zero_optimization": {"stage": 3},\n  "fp16": {enabled: true}\n}\n'
        ),
    ),
    Case(
        "ds_not_an_object",
        ("--deepspeed_config", "{tmp}/ds.json"),
        ("--deepspeed_config", "{tmp}/ds.json", "object"),
        _write("ds.json", "[3]"),
    ),
    Case(
        "ds_micro_batch_not_a_number",
        ("--deepspeed_config", "{tmp}/ds.json"),
        ("--deepspeed_config", "`train_micro_batch_size_per_gpu`", "{tmp}/ds.json", '"eight"'),
        _ds(_zero3(train_micro_batch_size_per_gpu="eight")),
    ),
    Case(
        "ds_grad_accum_zero",
        ("--deepspeed_config", "{tmp}/ds.json"),
        ("`gradient_accumulation_steps`", "positive"),
        _ds(_zero3(gradient_accumulation_steps=0)),
    ),
    Case(
        "ds_section_not_an_object",
        ("--deepspeed_config", "{tmp}/ds.json"),
        ("`optimizer`", "{tmp}/ds.json", "object"),
        _ds(_zero3(optimizer="adam")),
    ),
    Case(
        "ds_betas_not_a_pair",
        ("--deepspeed_config", "{tmp}/ds.json"),
        ("`optimizer.params.betas`", "{tmp}/ds.json"),
        _ds(_zero3(optimizer={"type": "AdamW", "params": {"betas": 0.9}})),
    ),
    Case(
        "ds_zero_value_wrong_type",
        ("--deepspeed_config", "{tmp}/ds.json"),
        ("`zero_optimization.overlap_comm`", "{tmp}/ds.json", '"maybe"'),
        _ds({"zero_optimization": {"stage": 3, "overlap_comm": "maybe"}}),
    ),
    Case(
        "ds_precision_enabled_not_a_bool",
        ("--deepspeed_config", "{tmp}/ds.json"),
        ("`bf16.enabled`", '"yes"'),
        _ds(_zero3(bf16={"enabled": "yes"})),
    ),
    Case(
        "ds_nvme_optimizer_with_checkpoints",
        ("--deepspeed_config", "{tmp}/ds.json", "--save_checkpoint"),
        (
            "`zero_optimization.offload_optimizer.device: nvme`",
            "{tmp}/ds.json",
            "--save_checkpoint",
            "Adam's moments",
        ),
        _ds(
            {
                "zero_optimization": {
                    "stage": 3,
                    "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"},
                }
            }
        ),
    ),
    Case(
        "ds_zero_stage_2",
        ("--deepspeed_config", "{tmp}/ds.json"),
        ("--deepspeed_config", "{tmp}/ds.json", "zero_optimization.stage: 2", "stage 3"),
        _ds({"zero_optimization": {"stage": 2}}),
    ),
    Case(
        "ds_without_zero",
        ("--deepspeed_config", "{tmp}/ds.json"),
        ("{tmp}/ds.json", "zero_optimization.stage"),
        _ds({"train_micro_batch_size_per_gpu": "auto"}),
    ),
    Case(
        "ds_auto_nothing_fills",
        ("--deepspeed_config", "{tmp}/ds.json"),
        ("--deepspeed_config", "zero_optimization.reduce_bucket_size", '"auto"'),
        _ds({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}),
    ),
    Case(
        "ds_contradicts_flag",
        ("--deepspeed_config", "{tmp}/ds.json", "--per_device_train_batch_size", "2"),
        ("--per_device_train_batch_size 2", "train_micro_batch_size_per_gpu", "{tmp}/ds.json"),
        _ds(_zero3(train_micro_batch_size_per_gpu=4)),
    ),
    # the data
    Case(
        "train_file_missing",
        ("--train_file", "{tmp}/nope.jsonl"),
        ("--train_file", "{tmp}/nope.jsonl"),
    ),
    Case(
        "train_file_unknown_type",
        ("--train_file", "{tmp}/rows.xml"),
        ("--train_file", ".xml"),
        _write("rows.xml", "<rows/>"),
    ),
    Case(
        "unknown_text_column",
        ("--train_file", "{text}", "--text_column", "body"),
        ("--text_column", "'body'", "available: text"),
    ),
    Case(
        "unknown_prompt_column",
        ("--train_file", "{pc}", "--prompt_column", "q", "--completion_column", "answer"),
        ("--prompt_column", "'q'", "available: question, answer"),
    ),
    Case(
        "empty_train_file",
        ("--train_file", "{tmp}/empty.jsonl"),
        ("--train_file", "{tmp}/empty.jsonl", "empty"),
        _write("empty.jsonl", ""),
    ),
    Case(
        "csv_with_no_rows",
        ("--train_file", "{tmp}/header.csv"),
        ("--train_file", "{tmp}/header.csv"),
        _header_only_csv,
    ),
    Case(
        "every_prompt_longer_than_max_seq_length",
        (
            "--train_file",
            "{pc}",
            "--prompt_column",
            "question",
            "--completion_column",
            "answer",
            "--max_seq_length",
            "4",
        ),
        ("--max_seq_length 4",),
    ),
    Case(
        "chat_column_not_messages",
        ("--train_file", "{text}", "--messages_column", "text"),
        ("--messages_column", "'text'", "role"),
    ),
    Case(
        "dataset_while_offline",
        ("--dataset_name", "nosuch-org/nosuch-data"),
        ("--dataset_name", "nosuch-org/nosuch-data"),
    ),
    # found after the run started (data read): an existing --output_dir is left as it was
    Case(
        "late_error_keeps_existing_output_dir",
        ("--train_file", "{text}", "--text_column", "body"),
        ("--text_column",),
        _non_empty_out,
    ),
    Case(
        "late_error_keeps_previous_exit_status",
        ("--train_file", "{text}", "--text_column", "body"),
        ("--text_column",),
        _previous_run_out,
    ),
    # numbers
    Case(
        "batch_size_0", ("--per_device_train_batch_size", "0"), ("--per_device_train_batch_size",)
    ),
    Case(
        "grad_accum_negative",
        ("--gradient_accumulation_steps", "-2"),
        ("--gradient_accumulation_steps",),
    ),
    Case("max_steps_0", ("--max_steps", "0"), ("--max_steps",)),
    Case("epochs_0", ("--num_train_epochs", "0"), ("--num_train_epochs",)),
    Case("save_steps_0", ("--save_checkpoint", "--save_steps", "0"), ("--save_steps",)),
    Case(
        "save_total_limit_0",
        ("--save_checkpoint", "--save_total_limit", "0"),
        ("--save_total_limit",),
    ),
    Case(
        "shard_size_0",
        ("--save_checkpoint", "--save_consolidated", "--max_shard_size", "0"),
        ("--max_shard_size",),
    ),
    Case(
        "async_save_without_save_checkpoint",
        ("--async_save",),
        ("--async_save", "--save_checkpoint"),
    ),
    Case(
        "remote_output_dir_unsupported_scheme",
        ("--save_checkpoint", "--remote_output_dir", "gs://bucket/run"),
        ("--remote_output_dir", "gs://"),
    ),
    Case(
        "remote_output_dir_without_a_bucket",
        ("--save_checkpoint", "--remote_output_dir", "s3:///run"),
        ("--remote_output_dir", "no bucket name"),
    ),
    Case(
        "remote_output_dir_without_save_checkpoint",
        ("--remote_output_dir", "s3://bucket/run"),
        ("--remote_output_dir", "--save_checkpoint"),
    ),
    Case("ddp_timeout_0", ("--ddp_timeout", "0"), ("--ddp_timeout",)),
    Case("lora_flag_without_use_peft", ("--lora_r", "8"), ("--lora_r", "--use_peft")),
    Case("lora_r_0", ("--use_peft", "--lora_r", "0"), ("--lora_r",)),
    Case(
        "lora_target_not_in_model",
        ("--model_name_or_path", "{llama}", "--use_peft", "--lora_target_modules", "qq_proj"),
        ("--lora_target_modules", "qq_proj"),
    ),
    Case("max_seq_length_1", ("--max_seq_length", "1"), ("--max_seq_length",)),
    Case("learning_rate_not_a_number", ("--learning_rate", "fast"), ("--learning_rate", "'fast'")),
    # paths, resume
    Case(
        "output_dir_is_a_file",
        ("--output_dir", "{out}"),
        ("--output_dir", "{out}"),
        _write("out", "a file"),
    ),
    Case(
        "latest_is_a_directory",
        ("--output_dir", "{out}"),
        ("--output_dir", "{out}/latest"),
        _latest_dir,
    ),
    Case(
        "resume_from_missing_folder",
        ("--resume_from_checkpoint", "{tmp}/nothing"),
        ("--resume_from_checkpoint", "{tmp}/nothing"),
    ),
    Case(
        "resume_from_not_a_checkpoint",
        ("--resume_from_checkpoint", "{tmp}/folder"),
        ("--resume_from_checkpoint", "{tmp}/folder", "not a checkpoint"),
        _not_a_checkpoint,
    ),
    Case(
        "resume_latest_with_nothing_saved",
        ("--resume_from_checkpoint", "latest"),
        ("--resume_from_checkpoint latest", "{out}"),
    ),
    Case(
        "resume_other_architecture",
        ("--model_name_or_path", "{gpt2}", "--resume_from_checkpoint", "{ckpt}"),
        ("--resume_from_checkpoint", "{ckpt}", "--model_name_or_path", "model_type llama vs gpt2"),
    ),
    Case(
        "resume_other_vocabulary",
        ("--model_name_or_path", "{tmp}/model", "--resume_from_checkpoint", "{ckpt}"),
        ("--resume_from_checkpoint", "{ckpt}", "vocab_size 513 vs 1024"),
        _other_vocab_model,
    ),
    Case(
        "resume_full_checkpoint_with_use_peft",
        ("--model_name_or_path", "{llama}", "--use_peft", "--resume_from_checkpoint", "{ckpt}"),
        ("--use_peft", "{ckpt}", "full fine-tuning"),
    ),
    # contradictory flags
    Case(
        "steps_and_epochs",
        ("--max_steps", "3", "--num_train_epochs", "1"),
        ("--max_steps", "--num_train_epochs"),
    ),
    Case("bf16_and_fp16", ("--bf16", "--fp16"), ("--fp16", "--bf16")),
    Case(
        "bf16_and_precision_fp32", ("--bf16", "--precision", "fp32"), ("--bf16", "--precision fp32")
    ),
    Case(
        "messages_and_prompt_columns",
        (
            "--train_file",
            "{pc}",
            "--messages_column",
            "m",
            "--prompt_column",
            "question",
            "--completion_column",
            "answer",
        ),
        ("--messages_column", "--prompt_column"),
    ),
    # the command line itself
    Case(
        "unknown_command", ("exprot", "{tmp}/ckpt", "{out}"), ("'exprot'", "did you mean export?")
    ),
    Case(
        "unknown_flag_close_match",
        ("--learning_rat", "1e-4"),
        ("--learning_rat", "did you mean --learning_rate?"),
    ),
    Case("abbreviated_flag", ("--output", "{out}"), ("--output", "did you mean --output_dir?")),
    # export and verify
    Case(
        "export_into_non_empty_dir",
        ("export", "{ckpt}", "{out}"),
        ("{out}", "not an empty directory"),
        _non_empty_out,
    ),
    Case(
        "export_of_damaged_checkpoint",
        ("export", "{ckpt}", "{out}"),
        (RANK_FILE, "{ckpt}"),
        _damage_rank_file,
    ),
    Case(
        "export_of_not_a_checkpoint",
        ("export", "{tmp}/folder", "{out}"),
        ("{tmp}/folder", "not a checkpoint"),
        _not_a_checkpoint,
    ),
    Case(
        "merge_lora_of_a_full_checkpoint",
        ("export", "{ckpt}", "{out}", "--merge_lora"),
        ("--merge_lora", "{ckpt}", "not a LoRA checkpoint"),
    ),
    Case(
        "verify_not_a_checkpoint",
        ("verify", "{tmp}/folder"),
        ("{tmp}/folder", "not a checkpoint"),
        _not_a_checkpoint,
    ),
    # schedules and kernels
    Case(
        "scheduler_argument_of_another_scheduler",
        ("--lr_scheduler_type", "cosine", "--lr_scheduler_kwargs", '{{"min_lr_rate": 0.1}}'),
        ("--lr_scheduler_kwargs", "min_lr_rate", "--lr_scheduler_type cosine"),
    ),
    Case(
        "cosine_with_min_lr_without_its_floor",
        ("--lr_scheduler_type", "cosine_with_min_lr"),
        ("cosine_with_min_lr", "min_lr", "--lr_scheduler_kwargs"),
    ),
    Case(
        "warmup_stable_decay_without_decay_steps",
        ("--lr_scheduler_type", "warmup_stable_decay", "--lr_scheduler_kwargs", "{{}}"),
        ("warmup_stable_decay", "num_decay_steps"),
    ),
    Case(
        "scheduler_kwargs_not_json",
        ("--lr_scheduler_kwargs", "{{min_lr: 1"),
        ("--lr_scheduler_kwargs", "JSON"),
    ),
    Case(
        "warmup_steps_and_ratio",
        ("--warmup_steps", "5", "--warmup_ratio", "0.1"),
        ("--warmup_steps", "--warmup_ratio"),
    ),
    Case("warmup_steps_not_whole", ("--warmup_steps", "2.5"), ("--warmup_steps", "2.5")),
    Case("warmup_ratio_of_one", ("--warmup_ratio", "1"), ("--warmup_ratio", "[0, 1)")),
    Case(
        "flash_attention_without_its_package",
        ("--attn_implementation", "flash_attention_2"),
        ("--attn_implementation flash_attention_2", "flash_attn"),
    ),
    Case(
        "unknown_attention_kernel",
        ("--attn_implementation", "fastest"),
        ("--attn_implementation", "fastest", "sdpa"),
    ),
    Case(
        "liger_without_its_package",
        ("--use_liger_kernel",),
        ("--use_liger_kernel", "liger-kernel"),
    ),
    Case("neftune_alpha_zero", ("--neftune_noise_alpha", "0"), ("--neftune_noise_alpha",)),
]
SUBCOMMANDS = ("export", "verify", "exprot")


@pytest.fixture(scope="module")
def trained_checkpoint(tiny_models, tmp_path_factory) -> Path:
    """A 1-step, 1-process checkpoint of the tiny llama (copied by each case that uses it)."""
    root = tmp_path_factory.mktemp("bad_inputs_ckpt")
    cmd = [
        sys.executable,
        "-m",
        "finetune",
        "--model_name_or_path",
        str(tiny_models["llama"]),
        "--max_steps",
        "1",
        "--save_checkpoint",
        "--output_dir",
        str(root / "run"),
        "--max_train_samples",
        "16",
        "--max_eval_samples",
        "4",
        "--max_seq_length",
        "32",
        "--per_device_train_batch_size",
        "2",
    ]
    proc = subprocess.run(
        cmd, cwd=root, env=child_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return root / "run" / "global_step1"


def _snapshot(path: Path):
    """What is at ``path``: None, a file's bytes, or a folder's {relative path: bytes}."""
    if not path.exists():
        return None
    if path.is_file():
        return path.read_bytes()
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def _params(cases: list[Case]) -> list:
    """One pytest param per case; a known bug is an xfail(strict), so its fix turns the case red."""
    return [
        pytest.param(
            c,
            id=c.id,
            marks=[pytest.mark.xfail(reason=c.known_bug, strict=True)] if c.known_bug else [],
        )
        for c in cases
    ]


@pytest.mark.parametrize("case", _params(CASES))
def test_bad_input_exits_2_naming_it_before_any_work(
    case: Case, tmp_path, tiny_models, data_files, request
):
    ctx = {
        "tmp": tmp_path,
        "out": tmp_path / "out",
        "llama": tiny_models["llama"],
        "gpt2": tiny_models["gpt2"],
        "text": data_files["text_jsonl"],
        "chat": data_files["chat_jsonl"],
        "pc": data_files["pc_csv"],
    }
    if any("{ckpt}" in a for a in case.argv):
        ctx["ckpt"] = tmp_path / "ckpt" / "global_step1"
        shutil.copytree(request.getfixturevalue("trained_checkpoint"), ctx["ckpt"])
    if case.setup is not None:
        case.setup(tmp_path, ctx)
    argv = [a.format(**ctx) for a in case.argv]
    if argv[0] not in SUBCOMMANDS:
        if "--output_dir" not in argv:
            argv += ["--output_dir", str(ctx["out"])]
        if "--max_steps" not in argv and "--num_train_epochs" not in argv:
            argv += ["--max_steps", "1"]  # should a case start training after all, it stops soon
    before = _snapshot(ctx["out"])

    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "finetune", *argv],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=CASE_TIMEOUT,
    )
    seconds = time.monotonic() - start
    request.node.user_properties.append(("seconds", round(seconds, 2)))

    output = proc.stdout + proc.stderr
    where = f"\n$ finetune {' '.join(argv)}\n{output[-3000:]}"
    assert proc.returncode == 2, f"exit {proc.returncode}{where}"
    assert "Traceback" not in output, where
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines and ERROR_LINE.match(lines[-1]), f"last line is not the error{where}"
    assert sum(bool(ERROR_LINE.match(line)) for line in lines) == 1, (
        f"the error is printed more than once{where}"
    )
    for name in case.names:
        name = name.format(**ctx)
        assert name in lines[-1], f"{name!r} not named in {lines[-1]!r}"
    assert _snapshot(ctx["out"]) == before, f"{ctx['out']} changed{where}"
    assert not ENGINE_BUILT.search(output), f"the engine was built before the error{where}"
    assert seconds < MAX_SECONDS, f"took {seconds:.1f} s{where}"


def test_the_table_has_30_cases_with_unique_ids():
    assert len(CASES) >= 30
    assert len({c.id for c in CASES}) == len(CASES)
