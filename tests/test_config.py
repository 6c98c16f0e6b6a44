"""finetune.config and finetune.resolve: flag values → RunConfig (``resolve``), flag ↔ DeepSpeed
JSON reconciliation, "auto" resolution, validation errors naming the flag, JSON loading. No argparse
here: see test_cli."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from finetune import ds_config
from finetune.config import (
    CONFIGS_DIR,
    DEFAULT_DDP_TIMEOUT,
    DEFAULT_DS_CONFIG,
    EMBEDDED_MAX_STEPS,
    EMBEDDED_PRESET,
    FALLBACKS,
    LEGACY_TIMEOUT_ENV,
    ConfigError,
    flag_defaults,
    precision_shorthand,
    resolve_ddp_timeout,
)
from finetune.config.checkpoint import size_bytes
from finetune.ds_config import (
    finalize_ds_config,
    load_ds_json,
    reconcile,
    resolve_config_path,
    zero_stage,
)
from finetune.resolve import resolve
from finetune.sources import looks_local

from conftest import base_ds as _base_ds
from conftest import write_ds

PATH = "ds.json"  # only used in messages


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """Run from an empty directory as a single process, whatever launched pytest."""
    monkeypatch.chdir(tmp_path)
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", LEGACY_TIMEOUT_ENV):
        monkeypatch.delenv(var, raising=False)


def run(precision_flag: str | None = None, world_size: int = 1, **values):
    return resolve(values, precision_flag, world_size=world_size)


def _on_cpu() -> bool:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu"


# --- reconcile -------------------------------------------------------------------------------


@pytest.mark.parametrize("json_value", ["auto", None], ids=["auto", "absent"])
def test_reconcile_flag_fills_auto_or_absent_and_is_written(json_value):
    cfg = {} if json_value is None else {"optimizer": {"params": {"lr": json_value}}}
    value = reconcile("learning_rate", 3e-4, cfg, "optimizer.params.lr", 5e-5, PATH)
    assert value == 3e-4
    assert cfg["optimizer"]["params"]["lr"] == 3e-4


@pytest.mark.parametrize("json_value", ["auto", None], ids=["auto", "absent"])
def test_reconcile_fallback_when_no_flag(json_value):
    cfg = {} if json_value is None else {"gradient_clipping": json_value}
    value = reconcile("max_grad_norm", None, cfg, "gradient_clipping", 1.0, PATH)
    assert value == 1.0
    assert cfg["gradient_clipping"] == 1.0


def test_reconcile_write_false_leaves_absent_key_absent_but_fills_auto():
    absent: dict = {"scheduler": {"params": {}}}
    assert (
        reconcile(
            "warmup_steps", 7, absent, "scheduler.params.warmup_num_steps", 0, PATH, write=False
        )
        == 7
    )
    assert "warmup_num_steps" not in absent["scheduler"]["params"]
    auto = {"scheduler": {"params": {"warmup_num_steps": "auto"}}}
    assert (
        reconcile(
            "warmup_steps", 7, auto, "scheduler.params.warmup_num_steps", 0, PATH, write=False
        )
        == 7
    )
    assert auto["scheduler"]["params"]["warmup_num_steps"] == 7


def test_reconcile_explicit_json_wins_without_flag():
    cfg = {"train_micro_batch_size_per_gpu": 4}
    value = reconcile(
        "per_device_train_batch_size", None, cfg, "train_micro_batch_size_per_gpu", 8, PATH
    )
    assert value == 4
    assert cfg == {"train_micro_batch_size_per_gpu": 4}


def test_reconcile_equal_values_agree_across_int_and_float():
    cfg = {"optimizer": {"params": {"weight_decay": 0}}}
    assert reconcile("weight_decay", 0.0, cfg, "optimizer.params.weight_decay", 0.0, PATH) == 0


def test_reconcile_contradiction_names_flag_and_key():
    cfg = {"optimizer": {"params": {"lr": 1e-4}}}
    with pytest.raises(ConfigError) as e:
        reconcile("learning_rate", 3e-4, cfg, "optimizer.params.lr", 5e-5, "my/ds.json")
    msg = str(e.value)
    assert "--learning_rate" in msg and "optimizer.params.lr" in msg and "my/ds.json" in msg
    assert cfg["optimizer"]["params"]["lr"] == 1e-4  # the JSON is not overwritten on error


# --- finalize_ds_config ------------------------------------------------------------------------


def test_finalize_fills_scheduler_autos_without_mutating_input():
    cfg = {
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "total_num_steps": "auto",
                "warmup_num_steps": "auto",
                "warmup_max_lr": "auto",
                "warmup_min_lr": "auto",
            },
        }
    }
    out = finalize_ds_config(cfg, total_steps=100, warmup_steps=10, learning_rate=3e-4)
    assert out["scheduler"]["params"] == {
        "total_num_steps": 100,
        "warmup_num_steps": 10,
        "warmup_max_lr": 3e-4,
        "warmup_min_lr": 0.0,
    }
    assert cfg["scheduler"]["params"]["total_num_steps"] == "auto"


def test_finalize_keeps_explicit_scheduler_values():
    cfg = {
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 1e-3}}
    }
    out = finalize_ds_config(cfg, total_steps=100, warmup_steps=10, learning_rate=3e-4)
    assert out["scheduler"]["params"] == {"warmup_num_steps": 5, "warmup_max_lr": 1e-3}


@pytest.mark.parametrize(
    "cfg, key",
    [
        (
            {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"}},
            "zero_optimization.stage3_prefetch_bucket_size",
        ),
        ({"train_micro_batch_size_per_gpu": "auto"}, "train_micro_batch_size_per_gpu"),
        ({"optimizer": {"params": {"betas": ["auto", 0.999]}}}, "optimizer.params.betas"),
    ],
    ids=["nested", "top-level", "inside-list"],
)
def test_finalize_leftover_auto_names_key(cfg, key):
    with pytest.raises(ConfigError) as e:
        finalize_ds_config(cfg, total_steps=10, warmup_steps=0, learning_rate=1e-3)
    assert key in str(e.value)
    assert "--deepspeed_config" in str(e.value)


# --- load_ds_json / resolve_config_path ------------------------------------------------------


def test_load_ds_json_reads_object(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    cfg = load_ds_json(str(p))
    assert cfg == {"zero_optimization": {"stage": 2}}
    assert zero_stage(cfg) == 2 and zero_stage({}) == 0


def test_load_ds_json_malformed_reports_line_and_column(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('{\n  "train_batch_size": 8,\n  "fp16": {enabled: true}\n}\n')
    with pytest.raises(ConfigError) as e:
        load_ds_json(str(p))
    msg = str(e.value)
    assert msg.startswith("--deepspeed_config:")
    assert str(p) in msg
    assert "line 3 column 12" in msg


def test_load_ds_json_rejects_non_object(tmp_path):
    p = tmp_path / "list.json"
    p.write_text("[1, 2]")
    with pytest.raises(
        ConfigError, match=r"--deepspeed_config: .* must hold a JSON object, not list"
    ):
        load_ds_json(str(p))


def test_load_ds_json_missing_file(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError) as e:
        load_ds_json(str(missing))
    assert (
        "--deepspeed_config" in str(e.value)
        and "not found" in str(e.value)
        and str(missing) in str(e.value)
    )


def test_default_config_resolves_from_another_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = resolve_config_path(DEFAULT_DS_CONFIG)
    assert p == CONFIGS_DIR / "ds_zero3.json" and p.is_file()
    assert zero_stage(load_ds_json(DEFAULT_DS_CONFIG)) == 3


def test_config_in_cwd_takes_precedence_over_repo_copy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "ds_zero3.json").write_text('{"zero_optimization": {"stage": 1}}')
    assert (
        resolve_config_path(DEFAULT_DS_CONFIG).resolve()
        == (tmp_path / "configs" / "ds_zero3.json").resolve()
    )
    assert zero_stage(load_ds_json(DEFAULT_DS_CONFIG)) == 1


def test_unknown_file_under_configs_is_not_found(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="--deepspeed_config: file not found: configs/nope.json"):
        resolve_config_path("configs/nope.json")


# --- resolve: the values dict ------------------------------------------------------------------


def test_resolve_fills_absent_flags_with_defaults_and_leaves_values_alone():
    values = {"max_steps": 3}
    cfg = resolve(values, world_size=1)
    assert values == {"max_steps": 3}
    assert cfg.train.max_steps == 3 and cfg.train.seed == flag_defaults()["seed"] == 42
    assert cfg.ckpt.output_dir == "output"


def test_resolve_refuses_unknown_flags():
    with pytest.raises(ConfigError, match="unknown flag.*--no_such_flag"):
        run(no_such_flag=1)


def test_resolve_world_size_defaults_to_the_launchers(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    cfg = resolve({})
    assert cfg.world_size == 3 and cfg.ds_config["train_batch_size"] == 3 * 8


# --- batch size and world size -------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
def test_train_batch_size_is_micro_times_accum_times_world(world):
    cfg = run(world_size=world, per_device_train_batch_size=3, gradient_accumulation_steps=5)
    assert cfg.world_size == world
    assert cfg.ds_config["train_batch_size"] == 3 * 5 * world
    assert cfg.ds_config["train_micro_batch_size_per_gpu"] == 3
    assert cfg.ds_config["gradient_accumulation_steps"] == 5
    assert (cfg.train.per_device_train_batch_size, cfg.train.gradient_accumulation_steps) == (3, 5)


def test_batch_size_defaults_when_unset():
    cfg = run()
    assert cfg.world_size == 1
    assert cfg.ds_config["train_batch_size"] == FALLBACKS["per_device_train_batch_size"] == 8
    assert cfg.ds_config["gradient_accumulation_steps"] == 1


def test_explicit_train_batch_size_that_matches_is_accepted(tmp_path):
    ds = write_ds(tmp_path, _base_ds(train_batch_size=16))
    cfg = run(
        world_size=2,
        deepspeed_config=ds,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
    )
    assert cfg.ds_config["train_batch_size"] == 16


def test_explicit_train_batch_size_mismatch_is_an_error(tmp_path):
    ds = write_ds(tmp_path, _base_ds(train_batch_size=16))
    with pytest.raises(ConfigError) as e:
        run(world_size=2, deepspeed_config=ds, per_device_train_batch_size=4)
    msg = str(e.value)
    assert "train_batch_size: 16" in msg and "--per_device_train_batch_size" in msg and "= 8" in msg


def test_json_micro_batch_used_when_flag_absent(tmp_path):
    ds = write_ds(
        tmp_path, _base_ds(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=3)
    )
    cfg = run(deepspeed_config=ds)
    assert cfg.train.per_device_train_batch_size == 2 and cfg.train.gradient_accumulation_steps == 3
    assert cfg.ds_config["train_batch_size"] == 6


# --- optimizer values ------------------------------------------------------------------------


def test_learning_rate_flag_fills_auto_lr():
    cfg = run(learning_rate=2e-4)
    assert cfg.train.learning_rate == 2e-4
    assert cfg.ds_config["optimizer"]["params"]["lr"] == 2e-4


def test_learning_rate_contradicting_json_lr_names_both(tmp_path):
    ds_cfg = _base_ds()
    ds_cfg["optimizer"]["params"]["lr"] = 1e-4
    with pytest.raises(ConfigError) as e:
        run(deepspeed_config=write_ds(tmp_path, ds_cfg), learning_rate=3e-4)
    assert "--learning_rate" in str(e.value) and "optimizer.params.lr" in str(e.value)


def test_json_lr_wins_without_flag_even_over_embedded_preset(tmp_path):
    ds_cfg = _base_ds()
    ds_cfg["optimizer"]["params"]["lr"] = 1e-4
    cfg = run(deepspeed_config=write_ds(tmp_path, ds_cfg))
    # The preset is a default, not a flag: an explicit JSON value must not be reported as
    # contradicting it.
    assert cfg.train.learning_rate == 1e-4


def test_json_scheduler_warmup_wins_over_embedded_preset(tmp_path):
    ds_cfg = _base_ds(
        scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 0, "warmup_max_lr": "auto"}}
    )
    cfg = run(deepspeed_config=write_ds(tmp_path, ds_cfg))
    assert cfg.train.warmup_steps == 0
    with pytest.raises(ConfigError, match="--warmup_steps.*scheduler.params.warmup_num_steps"):
        run(deepspeed_config=write_ds(tmp_path, ds_cfg), warmup_steps=3)


def test_betas_auto_filled_from_flags_and_fallbacks():
    cfg = run(adam_beta1=0.8)
    assert cfg.ds_config["optimizer"]["params"]["betas"] == [0.8, 0.999]
    assert (cfg.train.adam_beta1, cfg.train.adam_beta2) == (0.8, 0.999)


def test_explicit_json_betas_win_without_flags(tmp_path):
    ds_cfg = _base_ds()
    ds_cfg["optimizer"]["params"]["betas"] = [0.9, 0.95]
    cfg = run(deepspeed_config=write_ds(tmp_path, ds_cfg))
    assert (cfg.train.adam_beta1, cfg.train.adam_beta2) == (0.9, 0.95)


def test_beta_flag_contradicting_json_betas_is_an_error(tmp_path):
    ds_cfg = _base_ds()
    ds_cfg["optimizer"]["params"]["betas"] = [0.9, 0.95]
    ds = write_ds(tmp_path, ds_cfg)
    with pytest.raises(ConfigError) as e:
        run(deepspeed_config=ds, adam_beta2=0.99)
    assert "--adam_beta2" in str(e.value) and "optimizer.params.betas" in str(e.value)
    # Agreeing flags are fine.
    assert run(deepspeed_config=ds, adam_beta2=0.95).train.adam_beta2 == 0.95


def test_half_auto_betas_take_the_flag_for_the_auto_half(tmp_path):
    ds = _base_ds()
    ds["optimizer"]["params"]["betas"] = ["auto", 0.95]
    cfg = run(deepspeed_config=write_ds(tmp_path, ds), adam_beta1=0.8)
    assert cfg.ds_config["optimizer"]["params"]["betas"] == [0.8, 0.95]
    assert (cfg.train.adam_beta1, cfg.train.adam_beta2) == (0.8, 0.95)


@pytest.mark.parametrize("name", ["ds_zero3.json", "ds_zero3_offload.json"])
def test_shipped_configs_resolve_every_auto(name):
    cfg = run(deepspeed_config=str(CONFIGS_DIR / name))
    final = finalize_ds_config(cfg.ds_config, 150, cfg.train.warmup_steps, cfg.train.learning_rate)
    assert "auto" not in json.dumps(final)
    assert final["zero_optimization"]["stage"] == 3


# --- precision ---------------------------------------------------------------------------


def test_precision_shorthand_names_the_flag_that_set_it():
    assert precision_shorthand("auto", None) == ("auto", "precision auto")
    assert precision_shorthand("fp16", None) == ("fp16", "precision fp16")
    assert precision_shorthand("auto", "bf16") == ("bf16", "bf16")
    assert precision_shorthand("bf16", "bf16") == ("bf16", "bf16")
    with pytest.raises(ConfigError, match=r"Can't give both `--bf16` and `--precision fp16`"):
        precision_shorthand("fp16", "bf16")


def test_bf16_contradicting_json_fp16_names_the_shorthand(tmp_path):
    ds = write_ds(tmp_path, _base_ds(fp16={"enabled": True}))
    with pytest.raises(ConfigError, match=r"`--bf16` contradicts `fp16.enabled: true`"):
        run("bf16", deepspeed_config=ds, precision="bf16")
    with pytest.raises(ConfigError, match=r"`--precision bf16` contradicts `fp16.enabled: true`"):
        run(deepspeed_config=ds, precision="bf16")


def test_flag_contradicting_an_explicitly_disabled_section_is_an_error(tmp_path):
    ds = write_ds(tmp_path, _base_ds(fp16={"enabled": False}))
    with pytest.raises(ConfigError, match=r"`--fp16` contradicts `fp16.enabled: false`"):
        run("fp16", deepspeed_config=ds, precision="fp16")


def test_json_enabling_both_halves_is_an_error(tmp_path):
    ds = write_ds(tmp_path, _base_ds(fp16={"enabled": True}, bf16={"enabled": True}))
    with pytest.raises(ConfigError, match="--deepspeed_config: .* enables both bf16 and fp16"):
        run(deepspeed_config=ds)


def test_json_fp16_enabled_sets_precision(tmp_path):
    cfg = run(deepspeed_config=write_ds(tmp_path, _base_ds(fp16={"enabled": True})))
    assert cfg.train.precision == "fp16"
    assert cfg.ds_config["fp16"]["enabled"] is True and cfg.ds_config["bf16"]["enabled"] is False


@pytest.mark.parametrize("on, off", [("bf16", "fp16"), ("fp16", "bf16")])
def test_precision_enables_exactly_one_section(on, off):
    cfg = run(precision=on)
    assert cfg.train.precision == on
    assert cfg.ds_config[on]["enabled"] is True and cfg.ds_config[off]["enabled"] is False


def test_auto_precision_on_cpu_is_fp32():
    if not _on_cpu():
        pytest.skip("needs a CPU-only DeepSpeed accelerator (auto picks bf16 on an accelerator)")
    cfg = run()
    assert cfg.train.precision == "fp32"
    assert cfg.ds_config["bf16"]["enabled"] is False and cfg.ds_config["fp16"]["enabled"] is False


def test_auto_precision_follows_the_accelerator(monkeypatch):
    monkeypatch.setattr(ds_config, "auto_precision", lambda: "bf16")
    cfg = run()
    assert cfg.train.precision == "bf16"
    assert cfg.ds_config["bf16"]["enabled"] is True and cfg.ds_config["fp16"]["enabled"] is False


# --- embedded preset ------------------------------------------------------------------------


def test_no_flags_uses_embedded_preset():
    cfg = run()
    assert cfg.uses_embedded_model and cfg.uses_embedded_data
    assert cfg.train.learning_rate == EMBEDDED_PRESET["learning_rate"] == 1e-3
    assert cfg.train.max_steps == EMBEDDED_MAX_STEPS == 150
    assert cfg.train.num_train_epochs is None
    assert cfg.data.max_seq_length == 128
    assert cfg.ds_config["optimizer"]["params"]["lr"] == 1e-3


def test_explicit_flags_override_embedded_preset():
    cfg = run(learning_rate=2e-3, max_steps=7, max_seq_length=64, warmup_steps=0)
    assert (
        cfg.train.learning_rate,
        cfg.train.max_steps,
        cfg.data.max_seq_length,
        cfg.train.warmup_steps,
    ) == (2e-3, 7, 64, 0)


def test_epochs_flag_replaces_embedded_max_steps():
    cfg = run(num_train_epochs=1.0)
    assert cfg.train.max_steps is None and cfg.train.num_train_epochs == 1.0


def test_train_file_with_embedded_model_trains_by_epochs(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"text": "a b c"}\n')
    cfg = run(train_file="train.jsonl")
    assert cfg.uses_embedded_model and not cfg.uses_embedded_data
    assert cfg.train.max_steps is None
    assert cfg.train.num_train_epochs == 3.0
    assert cfg.train.learning_rate == 1e-3  # the model preset still applies


def test_hub_model_gets_generic_fallbacks(monkeypatch):
    import huggingface_hub.constants

    # an uncached id is downloaded later
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    cfg = run(model_name_or_path="org/some-model")
    assert not cfg.uses_embedded_model
    assert cfg.train.learning_rate == FALLBACKS["learning_rate"] == 5e-5
    assert cfg.data.max_seq_length == 512
    assert cfg.train.max_steps is None and cfg.train.num_train_epochs == 3.0


@pytest.mark.parametrize(
    "name, local",
    [
        ("gpt2", False),
        ("org/model", False),
        ("./model", True),
        ("/abs/model", True),
        ("~/model", True),
        ("a/b/c", True),
    ],
)
def test_looks_local_tells_hub_ids_from_paths(name, local):
    assert looks_local(name) is local


# --- --ddp_timeout and --ignore_unverified_checkpoints ------------------------------------------


def test_new_flags_default_to_900_seconds_and_off():
    cfg = run()
    assert cfg.train.ddp_timeout == DEFAULT_DDP_TIMEOUT == 900
    assert cfg.ckpt.ignore_unverified_checkpoints is False


def test_ddp_timeout_flag_is_kept():
    assert run(ddp_timeout=10).train.ddp_timeout == 10
    assert run(ddp_timeout=7200).train.ddp_timeout == 7200


def test_ignore_unverified_checkpoints_with_auto():
    cfg = run(ignore_unverified_checkpoints=True, resume_from_checkpoint="auto")
    assert (
        cfg.ckpt.ignore_unverified_checkpoints is True and cfg.ckpt.resume_from_checkpoint == "auto"
    )


def test_legacy_timeout_env_is_minutes_and_the_flag_wins(monkeypatch):
    monkeypatch.setenv(LEGACY_TIMEOUT_ENV, "45")
    assert resolve_ddp_timeout(None) == 45 * 60
    assert run().train.ddp_timeout == 2700
    assert run(ddp_timeout=120).train.ddp_timeout == 120


@pytest.mark.parametrize("minutes", ["0", "-3", "half an hour", ""])
def test_bad_legacy_timeout_env_names_the_variable(minutes, monkeypatch):
    monkeypatch.setenv(LEGACY_TIMEOUT_ENV, minutes)
    with pytest.raises(ConfigError, match=rf"\${LEGACY_TIMEOUT_ENV} .*--ddp_timeout"):
        run()


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
    (
        "steps_and_epochs",
        dict(max_steps=5, num_train_epochs=1.0),
        ["--max_steps", "--num_train_epochs"],
    ),
    ("micro_batch_0", dict(per_device_train_batch_size=0), ["--per_device_train_batch_size"]),
    ("grad_accum_0", dict(gradient_accumulation_steps=0), ["--gradient_accumulation_steps"]),
    ("max_steps_0", dict(max_steps=0), ["--max_steps"]),
    ("max_seq_length_neg", dict(max_seq_length=-4), ["--max_seq_length"]),
    ("save_steps_0", dict(save_checkpoint=True, save_steps=0), ["--save_steps"]),
    ("logging_steps_0", dict(logging_steps=0), ["--logging_steps"]),
    ("learning_rate_0", dict(learning_rate=0.0), ["--learning_rate"]),
    ("epochs_0", dict(num_train_epochs=0.0), ["--num_train_epochs"]),
    ("weight_decay_neg", dict(weight_decay=-0.1), ["--weight_decay", "negative"]),
    ("missing_train_file", dict(train_file="nope.jsonl"), ["--train_file", "nope.jsonl"]),
    ("xml", dict(train_file="train.xml"), ["--train_file", ".xml"]),
    (
        "missing_model_dir",
        dict(model_name_or_path="./nope/model"),
        ["--model_name_or_path", "./nope/model"],
    ),
    ("output_file", dict(output_dir="out"), ["--output_dir"]),
    (
        "malformed_json",
        dict(deepspeed_config="bad.json"),
        ["--deepspeed_config", "bad.json", "line 1"],
    ),
    ("missing_ds_json", dict(deepspeed_config="none.json"), ["--deepspeed_config", "none.json"]),
    (
        "prompt_without_completion",
        dict(train_file="train.jsonl", prompt_column="q"),
        ["--prompt_column", "--completion_column"],
    ),
    (
        "dataset_and_train_file",
        dict(dataset_name="org/data", train_file="train.jsonl"),
        ["--dataset_name", "--train_file"],
    ),
    ("save_steps_without_save", dict(save_steps=10), ["--save_steps", "--save_checkpoint"]),
    (
        "validation_split_100",
        dict(validation_split_percentage=100),
        ["--validation_split_percentage"],
    ),
    ("max_shard_size_junk", dict(max_shard_size="lots"), ["--max_shard_size", "'lots'"]),
    ("preempt_sigkill", dict(preempt_signals="SIGTERM,SIGKILL"), ["--preempt_signals", "SIGKILL"]),
    ("preempt_unknown", dict(preempt_signals="USR9"), ["--preempt_signals", "USR9"]),
    ("ddp_timeout_5", dict(ddp_timeout=5), ["--ddp_timeout", "at least 10", "got 5"]),
    ("ddp_timeout_0", dict(ddp_timeout=0), ["--ddp_timeout"]),
    (
        "ignore_unverified_without_resume",
        dict(ignore_unverified_checkpoints=True),
        ["--ignore_unverified_checkpoints", "--resume_from_checkpoint auto"],
    ),
    (
        "ignore_unverified_with_latest",
        dict(ignore_unverified_checkpoints=True, resume_from_checkpoint="latest"),
        ["--ignore_unverified_checkpoints", "--resume_from_checkpoint auto"],
    ),
]


@pytest.mark.parametrize("case, values, names", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_raises_config_error_naming_the_flag(case, values, names, tmp_path):
    _setup_bad_input(tmp_path, case)
    with pytest.raises(ConfigError) as e:
        resolve(values, world_size=1)
    for name in names:
        assert name in str(e.value), f"{name!r} not in {str(e.value)!r}"


# --- the DeepSpeed JSON: what it can get wrong, each named with its key --------------------------

DS_BAD = [
    (
        "zero_stage_2",
        {"zero_optimization": {"stage": 2}},
        ["zero_optimization.stage: 2", "stage 3"],
    ),
    (
        "zero_stage_string",
        {"zero_optimization": {"stage": "three"}},
        ['zero_optimization.stage: "three"'],
    ),
    (
        "no_zero_section",
        {"train_micro_batch_size_per_gpu": "auto"},
        ["no `zero_optimization.stage`"],
    ),
    (
        "micro_batch_string",
        {"train_micro_batch_size_per_gpu": "eight"},
        ["`train_micro_batch_size_per_gpu`", "positive integer", '"eight"'],
    ),
    (
        "micro_batch_fraction",
        {"train_micro_batch_size_per_gpu": 2.5},
        ["`train_micro_batch_size_per_gpu`"],
    ),
    (
        "grad_accum_0",
        {"gradient_accumulation_steps": 0},
        ["`gradient_accumulation_steps`", "positive"],
    ),
    ("clipping_negative", {"gradient_clipping": -1}, ["`gradient_clipping`", "non-negative"]),
    (
        "lr_string",
        {"optimizer": {"type": "AdamW", "params": {"lr": "fast"}}},
        ["`optimizer.params.lr`", '"fast"'],
    ),
    (
        "betas_scalar",
        {"optimizer": {"type": "AdamW", "params": {"betas": 0.9}}},
        ["`optimizer.params.betas`"],
    ),
    ("optimizer_string", {"optimizer": "adam"}, ["`optimizer`", "object", '"adam"']),
    (
        "scheduler_params_list",
        {"scheduler": {"type": "WarmupLR", "params": []}},
        ["`scheduler.params`", "object"],
    ),
    ("bf16_enabled_yes", {"bf16": {"enabled": "yes"}}, ["`bf16.enabled`", '"yes"']),
    ("bf16_enabled_1", {"bf16": {"enabled": 1}}, ["`bf16.enabled`"]),
    ("tensorboard_string", {"tensorboard": "on"}, ["`tensorboard`", "object"]),
    (
        "zero_auto_nothing_fills",
        {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}},
        ['"auto" for zero_optimization.reduce_bucket_size'],
    ),
    (
        "zero_bool_wrong_type",
        {"zero_optimization": {"stage": 3, "overlap_comm": "maybe"}},
        ["`zero_optimization.overlap_comm`", '"maybe"'],
    ),
    (
        "zero_nested_enum",
        {"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}},
        ["`zero_optimization.offload_param.device`", '"gpu"'],
    ),
    (
        "zero_unknown_key",
        {"zero_optimization": {"stage": 3, "bogus_key": 1}},
        ["`zero_optimization.bogus_key`"],
    ),
]


@pytest.mark.parametrize("case, changes, names", DS_BAD, ids=[c[0] for c in DS_BAD])
def test_bad_deepspeed_json_is_named_while_resolving(case, changes, names, tmp_path):
    """Found while the flags are resolved (one process, before any work), not as a traceback from
    deepspeed.initialize or as a silently different run (stage 2, "yes" read as not enabled)."""
    cfg = {"zero_optimization": {"stage": 3}} if case != "no_zero_section" else {}
    cfg.update(changes)
    path = write_ds(tmp_path, cfg)
    with pytest.raises(ConfigError) as e:
        run(deepspeed_config=path)
    message = str(e.value)
    assert message.startswith("--deepspeed_config") and path in message, message
    for name in names:
        assert name in message, f"{name!r} not in {message!r}"


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS_DIR.glob("*.json")))
def test_every_shipped_deepspeed_config_passes_deepspeeds_own_parser(name):
    cfg = run(deepspeed_config=str(CONFIGS_DIR / name))
    assert cfg.ds_config["zero_optimization"]["stage"] == 3


def test_scheduler_step_counts_may_stay_auto_until_the_run_is_built(tmp_path):
    sched = {
        "type": "WarmupDecayLR",
        "params": {
            k: "auto"
            for k in ("total_num_steps", "warmup_num_steps", "warmup_max_lr", "warmup_min_lr")
        },
    }
    cfg = run(deepspeed_config=write_ds(tmp_path, _base_ds(scheduler=sched)))
    assert cfg.ds_config["scheduler"]["params"]["total_num_steps"] == "auto"


# --- model sources and resume paths, checked before anything starts ------------------------------


def _model_dir(tmp_path, *files: str):
    folder = tmp_path / "model"
    folder.mkdir()
    for f in files:
        (folder / f).write_text("{}")
    return str(folder)


@pytest.mark.parametrize(
    "files, names",
    [
        ((), ["--model_name_or_path", "no config.json"]),
        (("config.json",), ["--model_name_or_path", "no weights", "--config_name"]),
    ],
    ids=["no_config", "no_weights"],
)
def test_model_folder_that_cannot_load_is_named(files, names, tmp_path):
    folder = _model_dir(tmp_path, *files)
    with pytest.raises(ConfigError) as e:
        run(model_name_or_path=folder)
    assert folder in str(e.value) and all(n in str(e.value) for n in names), str(e.value)


@pytest.mark.parametrize(
    "weights", ["model.safetensors", "model-00001-of-00002.safetensors", "pytorch_model.bin"]
)
def test_model_folder_with_weights_in_any_layout_is_accepted(weights, tmp_path):
    assert run(
        model_name_or_path=_model_dir(tmp_path, "config.json", weights)
    ).model.model_name_or_path


def test_config_name_folder_needs_no_weights(tmp_path):
    assert run(config_name=_model_dir(tmp_path, "config.json")).model.config_name


def test_hub_id_not_cached_while_offline_is_named(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(
        ConfigError, match=r"--model_name_or_path: nosuch-org/nosuch-model .*offline"
    ):
        run(model_name_or_path="nosuch-org/nosuch-model")
    with pytest.raises(ConfigError, match=r"--tokenizer_name: nosuch-org/tok .*offline"):
        run(tokenizer_name="nosuch-org/tok")


def test_malformed_hub_id_is_named():
    with pytest.raises(
        ConfigError, match=r"--model_name_or_path: bad id! is neither a folder nor a hub id"
    ):
        run(model_name_or_path="bad id!")


def test_resume_path_that_is_no_checkpoint_is_named_before_the_run(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"--resume_from_checkpoint: .*notes: not a checkpoint"):
        run(resume_from_checkpoint=str(tmp_path / "notes"))
    with pytest.raises(ConfigError, match=r"--resume_from_checkpoint: .*gone: no such folder"):
        run(resume_from_checkpoint=str(tmp_path / "gone"))
    assert run(resume_from_checkpoint="auto").ckpt.resume_from_checkpoint == "auto"


def test_max_seq_length_1_leaves_nothing_to_predict():
    with pytest.raises(ConfigError, match=r"`--max_seq_length` must be at least 2"):
        run(max_seq_length=1)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.builds(
            lambda value, unit, space, case: f"{value}{space}{getattr(unit, case)()}",
            st.one_of(
                st.integers(0, 10**6).map(str),
                st.floats(0, 1e4, allow_nan=False).map(lambda x: f"{x:.3f}"),
            ),
            st.sampled_from(["TB", "GB", "MB", "KB", "XB", "B", "G"]),
            st.sampled_from(["", " "]),
            st.sampled_from(["upper", "lower"]),
        ),
        st.text(max_size=8),
    )
)
def test_a_size_is_parsed_as_huggingface_hub_parses_it(text):
    """--max_shard_size: the same bytes (or the same refusal) as the parser save_pretrained uses,
    without importing it (0.1 s of every export)."""
    from huggingface_hub.serialization._base import parse_size_to_int

    def parse(fn):
        try:
            return fn(text)
        except ValueError:
            return "refused"

    assert parse(size_bytes) == parse(parse_size_to_int)
