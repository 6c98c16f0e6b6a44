"""finetune.config: flag ↔ DeepSpeed JSON reconciliation, "auto" resolution, JSON loading."""

from __future__ import annotations

import json

import pytest

from finetune.config import (
    CONFIGS_DIR,
    DEFAULT_DS_CONFIG,
    ConfigError,
    finalize_ds_config,
    load_ds_json,
    reconcile,
    resolve_config_path,
    zero_stage,
)

PATH = "ds.json"  # only used in messages


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
    assert reconcile("warmup_steps", 7, absent, "scheduler.params.warmup_num_steps", 0, PATH, write=False) == 7
    assert "warmup_num_steps" not in absent["scheduler"]["params"]
    auto = {"scheduler": {"params": {"warmup_num_steps": "auto"}}}
    assert reconcile("warmup_steps", 7, auto, "scheduler.params.warmup_num_steps", 0, PATH, write=False) == 7
    assert auto["scheduler"]["params"]["warmup_num_steps"] == 7


def test_reconcile_explicit_json_wins_without_flag():
    cfg = {"train_micro_batch_size_per_gpu": 4}
    value = reconcile("per_device_train_batch_size", None, cfg, "train_micro_batch_size_per_gpu", 8, PATH)
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
    cfg = {"scheduler": {"type": "WarmupDecayLR",
                         "params": {"total_num_steps": "auto", "warmup_num_steps": "auto",
                                    "warmup_max_lr": "auto", "warmup_min_lr": "auto"}}}
    out = finalize_ds_config(cfg, total_steps=100, warmup_steps=10, learning_rate=3e-4)
    assert out["scheduler"]["params"] == {"total_num_steps": 100, "warmup_num_steps": 10,
                                          "warmup_max_lr": 3e-4, "warmup_min_lr": 0.0}
    assert cfg["scheduler"]["params"]["total_num_steps"] == "auto"


def test_finalize_keeps_explicit_scheduler_values():
    cfg = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 1e-3}}}
    out = finalize_ds_config(cfg, total_steps=100, warmup_steps=10, learning_rate=3e-4)
    assert out["scheduler"]["params"] == {"warmup_num_steps": 5, "warmup_max_lr": 1e-3}


@pytest.mark.parametrize("cfg, key", [
    ({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"}},
     "zero_optimization.stage3_prefetch_bucket_size"),
    ({"train_micro_batch_size_per_gpu": "auto"}, "train_micro_batch_size_per_gpu"),
    ({"optimizer": {"params": {"betas": ["auto", 0.999]}}}, "optimizer.params.betas"),
], ids=["nested", "top-level", "inside-list"])
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
    with pytest.raises(ConfigError, match=r"--deepspeed_config: .* must hold a JSON object, not list"):
        load_ds_json(str(p))


def test_load_ds_json_missing_file(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError) as e:
        load_ds_json(str(missing))
    assert "--deepspeed_config" in str(e.value) and "not found" in str(e.value) and str(missing) in str(e.value)


def test_default_config_resolves_from_another_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = resolve_config_path(DEFAULT_DS_CONFIG)
    assert p == CONFIGS_DIR / "ds_zero3.json" and p.is_file()
    assert zero_stage(load_ds_json(DEFAULT_DS_CONFIG)) == 3


def test_config_in_cwd_takes_precedence_over_repo_copy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "ds_zero3.json").write_text('{"zero_optimization": {"stage": 1}}')
    assert resolve_config_path(DEFAULT_DS_CONFIG).resolve() == (tmp_path / "configs" / "ds_zero3.json").resolve()
    assert zero_stage(load_ds_json(DEFAULT_DS_CONFIG)) == 1


def test_unknown_file_under_configs_is_not_found(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="--deepspeed_config: file not found: configs/nope.json"):
        resolve_config_path("configs/nope.json")
