"""Held-out eval sets in one process: the flags (a --validation_file beside a mixture, named
--eval_datasets, what is refused), each set as a single dataset, the seeded subset, a set with no
rows, and the metrics --metric_for_best_model may name. Trained through the CLI in
tests/e2e/test_eval_sets_runs.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from finetune.cli import parse_train_args
from finetune.config import ConfigError
from finetune.data.cache import prepare_eval_sets
from finetune.data.eval_sets import held_out, seeded_subset
from finetune.modeling import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO / "finetune" / "resources" / "data"


def _file(tmp_path: Path, name: str, rows: list[dict]) -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _mix(tmp_path) -> str:
    a = _file(tmp_path, "a.jsonl", [{"text": "the cat is old."}] * 4)
    b = _file(tmp_path, "b.jsonl", [{"body": "the dog is young."}] * 4)
    return json.dumps(
        [
            {"train_file": a, "weight": 2},
            {"train_file": b, "text_column": "body", "weight": 1, "validation_file": a},
        ]
    )


def test_a_validation_file_beside_a_mixture_is_the_runs_eval_set_and_no_source_is_split(tmp_path):
    held = _file(tmp_path, "held.jsonl", [{"text": "a held out row."}] * 3)
    cfg = parse_train_args(["--dataset_mixture", _mix(tmp_path), "--validation_file", held])
    (one,) = held_out(cfg.data)
    assert one.name is None and one.prefix == "eval_" and one.args.train_file == held
    assert one.args.validation_split_percentage == 0
    from finetune.data.mixture import sources

    for source in sources(cfg.data):  # their own splits and validation files are not used
        assert source.args.validation_split_percentage == 0
        assert source.args.validation_file is None


def test_named_sets_are_single_datasets_with_their_own_format_and_bound(tmp_path):
    a = _file(tmp_path, "a.jsonl", [{"text": "x."}])
    b = _file(tmp_path, "b.jsonl", [{"body": "y."}])
    sets = json.dumps(
        [
            {"name": "held", "validation_file": a},
            {"name": "other", "validation_file": b, "text_column": "body", "max_eval_samples": 5},
            {"name": "hub", "dataset_name": "org/data", "dataset_config_name": "en"},
        ]
    )
    cfg = parse_train_args(
        ["--train_file", a, "--eval_datasets", sets, "--metric_for_best_model", "other_loss"]
    )
    held, other, hub = held_out(cfg.data)
    assert cfg.data.validation_split_percentage == 0  # the training data is not split
    assert (held.name, held.args.train_file, held.args.text_column) == ("held", a, "text")
    assert (other.args.text_column, other.args.max_eval_samples) == ("body", 5)
    assert other.prefix == "eval_other_"
    assert hub.from_hub and (hub.args.dataset_name, hub.args.dataset_config_name) == (
        "org/data",
        "en",
    )
    assert cfg.train.metric_for_best_model == "other_loss"


@pytest.mark.parametrize(
    ("sets", "extra", "message"),
    [
        ([{"name": "a", "validation_file": "F"}] * 2, [], "duplicate name 'a'"),
        ([{"name": "eval loss", "validation_file": "F"}], [], "'name' must be letters"),
        ([{"name": "r/x", "validation_file": "F"}], [], "'name' must be letters"),
        ([{"validation_file": "F"}], [], "'name' must be letters"),
        ([{"name": "a"}], [], "give one of 'validation_file' or 'dataset_name'"),
        ([{"name": "a", "validation_file": "F", "weight": 1}], [], "unknown key 'weight'"),
        ([{"name": "a", "validation_file": "F", "max_eval_samples": 0}], [], "whole number > 0"),
        (
            [{"name": "a", "validation_file": "F"}],
            ["--validation_file", "F"],
            "Can't give both `--validation_file` and `--eval_datasets`",
        ),
        (
            [{"name": "a", "validation_file": "F"}],
            ["--metric_for_best_model", "b_loss"],
            "`--metric_for_best_model b_loss`: the evaluation writes eval_loss, eval_perplexity "
            "(and each --eval_datasets set's",
        ),
    ],
)
def test_bad_eval_sets_are_refused_naming_the_entry(tmp_path, sets, extra, message):
    train = _file(tmp_path, "t.jsonl", [{"text": "x."}])
    with pytest.raises(ConfigError) as e:
        parse_train_args(["--train_file", train, "--eval_datasets", json.dumps(sets), *extra])
    assert message in str(e.value)


def test_a_bounded_set_is_the_same_seeded_subset_every_time():
    import datasets

    ds = datasets.Dataset.from_dict({"x": list(range(100))})
    a, b = seeded_subset(ds, 10, 42), seeded_subset(ds, 10, 42)
    assert a["x"] == b["x"] == sorted(a["x"]) and len(set(a["x"])) == 10
    assert a["x"] != list(range(10))  # not the file's first rows
    assert seeded_subset(ds, 10, 7)["x"] != a["x"]
    assert seeded_subset(ds, 200, 42) is ds


def test_a_set_with_no_rows_to_evaluate_is_refused_by_name(tmp_path):
    train = _file(tmp_path, "t.jsonl", [{"text": "the cat is old."}] * 4)
    empty = _file(tmp_path, "e.jsonl", [{"text": ""}] * 3)
    sets = json.dumps([{"name": "blank", "validation_file": empty}])
    cfg = parse_train_args(
        ["--train_file", train, "--eval_datasets", sets]
        + ["--dataset_cache_dir", str(tmp_path / "cache")]
    )
    tok = load_tokenizer(cfg.model)
    with pytest.raises(ConfigError, match=r"--eval_datasets set blank \(.*e.jsonl\)"):
        prepare_eval_sets(cfg, tok, held_out(cfg.data))
    sets = json.dumps([{"name": "val", "validation_file": str(TEXT / "validation.jsonl")}])
    cfg = parse_train_args(
        ["--train_file", train, "--eval_datasets", sets, "--max_eval_samples", "7"]
        + ["--dataset_cache_dir", str(tmp_path / "cache")]
    )
    (val,) = prepare_eval_sets(cfg, tok, held_out(cfg.data)).values()
    assert len(val) == 7  # the top-level bound applies to a set without its own


def test_a_named_sets_missing_file_is_refused_before_anything_runs(tmp_path):
    train = _file(tmp_path, "t.jsonl", [{"text": "x."}])
    sets = json.dumps([{"name": "held", "validation_file": str(tmp_path / "gone.jsonl")}])
    with pytest.raises(ConfigError, match=r"--eval_datasets\[0\] \(held\): validation_file: file"):
        parse_train_args(["--train_file", train, "--eval_datasets", sets])


def test_a_datasets_validation_split_is_a_held_out_set(tmp_path):
    """dataset_name (a hub id, here a local folder datasets reads the same way): its validation
    split is the set; its train split is cut to a few rows and never used."""
    folder = tmp_path / "hub"
    folder.mkdir()
    rows = [json.loads(line) for line in (TEXT / "validation.jsonl").read_text().splitlines()]
    _file(folder, "train.jsonl", rows[:50])
    _file(folder, "validation.jsonl", rows[50:80])
    train = _file(tmp_path, "t.jsonl", rows[:8])
    cache = ["--dataset_cache_dir", str(tmp_path / "cache")]
    sets = json.dumps([{"name": "hub", "dataset_name": str(folder)}])
    named = parse_train_args(["--train_file", train, "--eval_datasets", sets, *cache])
    one = parse_train_args(
        ["--train_file", train, "--validation_dataset_name", str(folder), *cache]
    )
    tok = load_tokenizer(named.model)
    (hub,) = prepare_eval_sets(named, tok, held_out(named.data)).values()
    (held,) = prepare_eval_sets(one, tok, held_out(one.data)).values()
    assert len(hub) == len(held) == 30
    assert one.data.validation_split_percentage == 0


def test_a_set_is_every_row_of_its_file_unpacked_and_checked_like_a_mixture_source(tmp_path):
    a = _file(tmp_path, "a.jsonl", [{"text": "x."}])
    sets = json.dumps([{"name": "held", "validation_file": a}])
    flags = ["--train_file", a, "--eval_datasets", sets, "--max_train_samples", "3", "--packing"]
    (held,) = held_out(parse_train_args(flags).data)
    assert held.args.max_train_samples is None and held.args.packing is False
    pairs = json.dumps([{"name": "held", "validation_file": a, "chosen_column": "c"}])
    with pytest.raises(ConfigError, match="`--chosen_column` needs a preference"):
        parse_train_args(["--train_file", a, "--eval_datasets", pairs])
    chat = json.dumps([{"name": "held", "validation_file": a, "messages_column": "m"}])
    with pytest.raises(ConfigError, match="eval set held: `messages_column` is not a column"):
        parse_train_args(["--objective", "dpo", "--train_file", a, "--eval_datasets", chat])
    half = json.dumps([{"name": "held", "validation_file": a, "prompt_column": "q"}])
    with pytest.raises(ConfigError, match=r"--eval_datasets\[0\] \(held\): .*go together"):
        parse_train_args(["--train_file", a, "--eval_datasets", half])


def test_the_best_metric_may_watch_held_out_sets_when_the_training_data_is_not_split(tmp_path):
    a = _file(tmp_path, "a.jsonl", [{"text": "x."}])
    sets = json.dumps([{"name": "held", "validation_file": a}])
    cfg = parse_train_args(
        ["--train_file", a, "--eval_datasets", sets, "--validation_split_percentage", "0"]
        + ["--metric_for_best_model", "held_loss", "--eval_steps", "2"]
    )
    assert cfg.train.metric_for_best_model == "held_loss"
    orpo = parse_train_args(["--objective", "orpo", "--metric_for_best_model", "nll_loss"])
    assert orpo.train.metric_for_best_model == "nll_loss"
