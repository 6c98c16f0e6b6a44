"""finetune.data.cache: tokenize once, reuse on restart, miss on any change, publish atomically."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from finetune.cli import parse_train_args
from finetune.data import cache
from finetune.data.formats import encode_prompt_completion
from finetune.data.load import load_raw
from finetune.modeling import load_tokenizer

from conftest import TOKENIZER_DIR


def _rows(n: int) -> list[dict]:
    return [{"q": f"question {i}: what is {i} plus {i}?", "a": f"it is {2 * i}."} for i in range(n)]


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(tmp_path: Path, data: Path, *extra: str):
    return parse_train_args(
        [
            "--train_file",
            str(data),
            "--prompt_column",
            "q",
            "--completion_column",
            "a",
            "--dataset_cache_dir",
            str(tmp_path / "cache"),
            "--output_dir",
            str(tmp_path / "out"),
            "--max_seq_length",
            "32",
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(parse_train_args([]).model)


@pytest.fixture
def count_tokenize(monkeypatch):
    calls = []
    real = cache.tokenize

    def counting(*args, **kwargs):
        calls.append(args[0].num_rows)
        return real(*args, **kwargs)

    monkeypatch.setattr(cache, "tokenize", counting)
    return calls


def test_second_prepare_is_a_hit_and_the_rows_equal_a_fresh_tokenization(
    tmp_path, tok, count_tokenize
):
    data = _write(tmp_path / "d.jsonl", _rows(300))
    cfg = _cfg(tmp_path, data)
    train, evalset = cache.prepare(cfg, tok)
    assert len(count_tokenize) == 2  # train and the split-off eval set
    train2, evalset2 = cache.prepare(cfg, tok)
    assert len(count_tokenize) == 2, "a restart tokenized again"
    assert train2[:] == train[:] and evalset2[:] == evalset[:]
    raw_train, _ = load_raw(cfg.data, cfg.train.seed)
    expected = [encode_prompt_completion(tok, r["q"], r["a"], 32) for r in raw_train]
    assert [dict(input_ids=r["input_ids"], labels=r["labels"]) for r in train2] == expected
    entries = [p.name for p in (tmp_path / "cache" / cache.SUBDIR).iterdir()]
    assert len(entries) == 1 and not entries[0].startswith(cache.TMP_PREFIX)


def test_the_cached_set_is_memory_mapped(tmp_path, tok):
    train, _ = cache.prepare(_cfg(tmp_path, _write(tmp_path / "d.jsonl", _rows(50))), tok)
    assert train.cache_files and all(
        str(tmp_path / "cache") in f["filename"] for f in train.cache_files
    )


@pytest.mark.parametrize(
    "extra",
    [
        ["--max_seq_length", "31"],
        ["--packing"],
        ["--completion_column", "b"],
        ["--validation_split_percentage", "10"],
        ["--max_train_samples", "100"],
        ["--seed", "7"],
    ],
)
def test_a_changed_flag_is_a_miss(tmp_path, tok, extra):
    data = _write(tmp_path / "d.jsonl", [{**r, "b": r["a"]} for r in _rows(300)])
    # Later flags win in argparse: the base flags followed by the one changed.
    assert cache.fingerprint(_cfg(tmp_path, data, *extra), tok) != cache.fingerprint(
        _cfg(tmp_path, data), tok
    )


def test_a_file_rewritten_with_the_same_size_and_mtime_is_a_miss(tmp_path, tok, count_tokenize):
    data = _write(tmp_path / "d.jsonl", _rows(300))
    cfg = _cfg(tmp_path, data)
    before = cache.prepare(cfg, tok)[0][0]
    stat = data.stat()
    text = data.read_text().replace("question 0:", "question 9:", 1)  # same length
    data.write_text(text)
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # as `cp -p` or rsync -t would leave it
    assert data.stat().st_size == stat.st_size and data.stat().st_mtime_ns == stat.st_mtime_ns
    calls = len(count_tokenize)
    cache.prepare(cfg, tok)
    assert len(count_tokenize) > calls, "stale hit on changed data"
    assert before is not None


def test_a_changed_tokenizer_is_a_miss(tmp_path, tok):
    from transformers import AutoTokenizer

    cfg = _cfg(tmp_path, _write(tmp_path / "d.jsonl", _rows(20)))
    same = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    assert cache.fingerprint(cfg, same) == cache.fingerprint(cfg, tok)
    other = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    other.chat_template = "{{ messages[0]['content'] }}"
    assert cache.fingerprint(cfg, other) != cache.fingerprint(cfg, tok)
    grown = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    grown.add_tokens(["<new_token>"])
    assert cache.fingerprint(cfg, grown) != cache.fingerprint(cfg, tok)


def test_packing_is_cached_too(tmp_path, tok, count_tokenize):
    cfg = _cfg(tmp_path, _write(tmp_path / "d.jsonl", _rows(300)), "--packing")
    train, _ = cache.prepare(cfg, tok)
    # whole examples in blocks of up to 32, position ids restarting at each example
    assert all(len(r) <= 32 for r in train["input_ids"])
    assert all(
        len(p) == len(r) and p[0] == 0 for p, r in zip(train["position_ids"], train["input_ids"])
    )
    calls = len(count_tokenize)
    assert (
        cache.prepare(cfg, tok)[0]["input_ids"] == train["input_ids"]
        and len(count_tokenize) == calls
    )


def test_bad_input_is_a_config_error_and_leaves_no_entry(tmp_path, tok):
    from finetune.config import ConfigError

    cfg = parse_train_args(
        [
            "--train_file",
            str(_write(tmp_path / "d.jsonl", _rows(20))),
            "--text_column",
            "nope",
            "--dataset_cache_dir",
            str(tmp_path / "cache"),
        ]
    )
    with pytest.raises(ConfigError, match="--text_column"):
        cache.prepare(cfg, tok)
    assert list((tmp_path / "cache" / cache.SUBDIR).iterdir()) == []


def _build_then_hang(cfg_argv: list[str], ready: str) -> None:
    """A leader killed mid-build: writes part of an entry's temporary folder, then waits for
    SIGKILL."""
    cfg = parse_train_args(cfg_argv)
    tokenizer = load_tokenizer(cfg.model)

    def slow_build(cfg, tokenizer, tmp):
        (tmp / "train").mkdir(parents=True)
        (tmp / "train" / "data-00000-of-00001.arrow").write_bytes(b"\0" * 1000)  # half written
        Path(ready).touch()
        time.sleep(600)

    cache._build = slow_build
    cache.ensure(cfg, tokenizer, cache.cache_root(cfg), cache.fingerprint(cfg, tokenizer))


def test_a_killed_build_leaves_nothing_a_later_run_reads(tmp_path, tok):
    data = _write(tmp_path / "d.jsonl", _rows(200))
    argv = [
        "--train_file",
        str(data),
        "--prompt_column",
        "q",
        "--completion_column",
        "a",
        "--dataset_cache_dir",
        str(tmp_path / "cache"),
        "--max_seq_length",
        "32",
    ]
    ready = tmp_path / "ready"
    proc = multiprocessing.get_context("spawn").Process(
        target=_build_then_hang, args=(argv, str(ready))
    )
    proc.start()
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert time.monotonic() < deadline and proc.is_alive(), "the build never started"
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    root = tmp_path / "cache" / cache.SUBDIR
    # only the abandoned build
    assert [p.name.startswith(cache.TMP_PREFIX) for p in root.iterdir()] == [True]
    train, _ = cache.prepare(parse_train_args(argv), tok)
    assert len(train) > 0 and all(len(r) > 0 for r in train["input_ids"])
    assert [p.name.startswith(cache.TMP_PREFIX) for p in root.iterdir()] == [False], (
        "abandoned build not removed"
    )


def _ensure_in_process(argv: list[str], out: str) -> None:
    cfg = parse_train_args(argv)
    tokenizer = load_tokenizer(cfg.model)
    report = cache.ensure(cfg, tokenizer, cache.cache_root(cfg), cache.fingerprint(cfg, tokenizer))
    Path(out).write_text(json.dumps(report))


def test_two_builders_at_once_on_one_cache_publish_one_complete_entry(tmp_path, tok):
    data = _write(tmp_path / "d.jsonl", _rows(3000))
    argv = [
        "--train_file",
        str(data),
        "--prompt_column",
        "q",
        "--completion_column",
        "a",
        "--dataset_cache_dir",
        str(tmp_path / "cache"),
        "--max_seq_length",
        "32",
    ]
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_ensure_in_process, args=(argv, str(tmp_path / f"r{i}.json")))
        for i in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0
    root = tmp_path / "cache" / cache.SUBDIR
    assert len(list(root.iterdir())) == 1, list(root.iterdir())
    train, _ = cache.prepare(parse_train_args(argv), tok)
    raw_train, _ = load_raw(parse_train_args(argv).data, 42)
    assert len(train) == len(raw_train)


def test_a_dataset_name_is_keyed_by_datasets_fingerprint_of_what_it_loaded(
    tmp_path, tok, count_tokenize
):
    """--dataset_name (a hub id; here a local folder, which load_dataset takes the same way)."""
    folder = tmp_path / "ds"
    folder.mkdir()
    _write(folder / "train.jsonl", _rows(200))
    argv = [
        "--dataset_name",
        str(folder),
        "--prompt_column",
        "q",
        "--completion_column",
        "a",
        "--dataset_cache_dir",
        str(tmp_path / "cache"),
        "--max_seq_length",
        "32",
    ]
    train, _ = cache.prepare(parse_train_args(argv), tok)
    calls = len(count_tokenize)
    assert (
        cache.prepare(parse_train_args(argv), tok)[0][:] == train[:]
        and len(count_tokenize) == calls
    )
    # new data under the same name: datasets' fingerprint moves
    _write(folder / "train.jsonl", _rows(300))
    assert len(cache.prepare(parse_train_args(argv), tok)[0]) == 285 != len(train)
    assert len(count_tokenize) > calls
