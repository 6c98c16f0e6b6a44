"""--dataset_mixture: the entries' checks (resolve, the CLI as a process), the sampler's order
(weights, seed, a resume on another world size, a source's epochs, O(batch) steps), per-source
token accounting through TrainData, and the listing's reading of it."""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest
import torch

from finetune.config import ConfigError
from finetune.data.mixture import sources, tokens_by_source
from finetune.data.mixture_sampler import CHUNK, MixtureSampler, MixtureState
from finetune.data.sampler import TrainData
from finetune.resolve import resolve

from conftest import run_cli


def _stream(sampler: MixtureSampler, steps: int, per_rank: int) -> list[int]:
    return [i for _ in range(steps) for i in sampler.take(per_rank)]


# --- the order ---------------------------------------------------------------------------------


def test_a_3_to_1_mixture_draws_each_source_within_3_percent_over_4000_samples():
    s = MixtureSampler([500, 700], [3, 1], world_size=1, rank=0, seed=0)
    rows = _stream(s, 250, 16)
    assert len(rows) == 4000
    counts = Counter(s.source_of(r) for r in rows)
    assert abs(counts[0] / 4000 - 0.75) <= 0.03, counts
    assert abs(counts[1] / 4000 - 0.25) <= 0.03, counts
    assert s.state.draws == (counts[0], counts[1]) and s.state.position == 4000


def test_same_seed_same_order_other_seed_other_order():
    a = _stream(MixtureSampler([300, 100], [1, 1], 1, 0, seed=7), 20, 8)
    b = _stream(MixtureSampler([300, 100], [1, 1], 1, 0, seed=7), 20, 8)
    c = _stream(MixtureSampler([300, 100], [1, 1], 1, 0, seed=8), 20, 8)
    assert a == b
    assert a != c


def test_a_resume_on_another_world_size_continues_the_global_order():
    """The concatenation of what every rank gets per step equals one uninterrupted 1-rank stream,
    across a checkpoint taken mid-epoch by 2 ranks and resumed by 3 (and across a chunk edge)."""
    sizes, weights, seed = [37, 1000, 211], [2, 5, 1], 3
    ref = _stream(MixtureSampler(sizes, weights, 1, 0, seed), 700, 12)  # 8,400 > 2 chunks
    two = [MixtureSampler(sizes, weights, 2, r, seed) for r in range(2)]
    got = []
    for _ in range(150):  # 1,800 samples: not an epoch's end, not a chunk's
        parts = [s.take(6) for s in two]
        got += [parts[r][i] for i in range(6) for r in range(2)]  # dealt round-robin
    saved = json.loads(json.dumps(two[0].state_dict()))  # as trainer_state.json holds it
    assert two[1].state_dict() == saved
    three = [MixtureSampler(sizes, weights, 3, r, seed) for r in range(3)]
    for s in three:
        s.load_state_dict(saved)
    while len(got) < len(ref):
        parts = [s.take(4) for s in three]
        got += [parts[r][i] for i in range(4) for r in range(3)]
    assert got == ref


def test_a_source_that_runs_out_starts_its_next_epoch_in_a_new_order():
    s = MixtureSampler([10, 10_000], [1, 1], 1, 0, seed=1)
    small = [r for r in _stream(s, 100, 8) if s.source_of(r) == 0]
    assert len(small) > 40  # ~400: several of its epochs
    epochs = [small[i : i + 10] for i in range(0, 40, 10)]
    assert all(sorted(e) == list(range(10)) for e in epochs)  # each epoch: every row once
    assert len({tuple(e) for e in epochs}) == 4  # each in its own order


def test_one_step_costs_o_batch_at_10m_rows_per_source():
    s = MixtureSampler([10_000_000, 3_000_000], [1, 1], world_size=512, rank=7, seed=0)
    s.take(4)  # each source's first permutation: once per source epoch
    start = time.perf_counter()
    for _ in range(200):  # 409,600 samples: 100 chunks drawn on the way
        assert len(s.take(4)) == 4
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0, f"200 steps took {elapsed:.3f} s"
    assert s.state.position == 201 * 4 * 512
    assert len(s._chunks) <= 5 and len(s._perms) <= 4  # bounded caches


def test_plan_is_pure_and_a_state_from_anywhere_plans_the_same():
    s = MixtureSampler([50, 60], [1, 2], 1, 0, seed=4)
    ref = _stream(s, 3 * CHUNK // 16, 16)
    again = MixtureSampler([50, 60], [1, 2], 1, 0, seed=4)
    st, _ = again.plan(MixtureState(epoch_len=110, draws=(0, 0)), 16 * 100)
    after, rows = again.plan(st, 16)
    assert rows == ref[1600:1616]


def test_a_checkpoint_of_another_mixture_or_of_one_dataset_is_refused():
    s = MixtureSampler([50, 60], [1, 2], 1, 0, seed=4, names=["a", "b"])
    other = MixtureSampler([50, 60], [1, 3], 1, 0, seed=4, names=["a", "b"]).state_dict()
    with pytest.raises(ConfigError, match="weights"):
        s.load_state_dict(other)
    with pytest.raises(ConfigError, match="one dataset"):
        s.load_state_dict({"epoch": 0, "consumed": 8, "seed": 4, "num_samples": 110})


def test_train_data_counts_each_sources_tokens_of_the_step_it_hands_out():
    rows = [{"input_ids": [1] * (1 + i % 3), "labels": [1] * (1 + i % 3)} for i in range(30)]
    s = MixtureSampler([10, 20], [1, 1], 1, 0, seed=0, names=["a", "b"])
    data = TrainData(rows, s, micro_batch=2, grad_accum=2, pad_id=0, prefetch=True)
    data.start()
    try:
        for _ in range(5):
            before = s.state.position
            _, idx = s.plan(s.state, 4)
            batches = data.next_step()
            assert s.state.position == before + 4
            want = [0, 0]
            for i in idx:
                want[s.source_of(i)] += len(rows[i]["input_ids"])
            assert data.source_tokens == want
            assert sum(want) == sum(int(b["attention_mask"].sum()) for b in batches)
    finally:
        data.close()
    assert data.epoch_float == pytest.approx(20 / 30)


# --- the entries -------------------------------------------------------------------------------


@pytest.fixture
def files(tmp_path):
    for name in ("a", "b"):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps({"text": name}) + "\n")
    (tmp_path / "c.csv").write_text("q,a\nx,y\n")
    return tmp_path


def test_entries_resolve_to_single_datasets_with_names_and_weights(files):
    mix = [
        {"train_file": str(files / "a.jsonl"), "weight": 3},
        {
            "train_file": str(files / "c.csv"),
            "weight": 1,
            "name": "qa",
            "prompt_column": "q",
            "completion_column": "a",
        },
    ]
    cfg = resolve({"dataset_mixture": json.dumps(mix), "max_seq_length": 64}, world_size=1)
    assert not cfg.uses_embedded_data
    got = sources(cfg.data)
    assert [(s.name, s.weight) for s in got] == [("a", 3.0), ("qa", 1.0)]
    assert got[0].args.train_file == str(files / "a.jsonl") and got[0].args.max_seq_length == 64
    assert (got[1].args.prompt_column, got[1].args.text_column) == ("q", "text")
    assert all(s.args.dataset_mixture is None for s in got)
    # A --config file's list resolves the same (and is what run_config.yaml writes back).
    again = resolve({"dataset_mixture": cfg.data.dataset_mixture}, world_size=1)
    assert again.data.dataset_mixture == cfg.data.dataset_mixture


BAD = [
    ("unknown_key", [{"train_file": "a.jsonl", "wieght": 1}], "[0]: unknown key 'wieght'"),
    ("missing_file", [{"train_file": "nope.jsonl", "weight": 1}], "[0] (nope): train_file: file"),
    ("weight_0", [{"train_file": "a.jsonl", "weight": 0}], "[0]: 'weight' must be a number > 0"),
    ("weight_neg", [{"train_file": "a.jsonl", "weight": -1}], "[0]: 'weight' must be"),
    ("weight_text", [{"train_file": "a.jsonl", "weight": "x"}], "[0]: 'weight' must be"),
    ("no_weight", [{"train_file": "a.jsonl"}], "[0]: 'weight' is missing"),
    (
        "duplicate",
        [
            {"train_file": "a.jsonl", "weight": 1},
            {"train_file": "b.jsonl", "weight": 1, "name": "a"},
        ],
        "[1]: duplicate name 'a'",
    ),
    ("empty", [], "`--dataset_mixture` is empty"),
    ("no_data", [{"weight": 1}], "[0]: give one of 'train_file' or 'dataset_name'"),
    (
        "two_formats",
        [{"train_file": "a.jsonl", "weight": 1, "prompt_column": "q"}],
        "[0] (a): ",
    ),
]


@pytest.mark.parametrize("case, mix, message", BAD, ids=[c[0] for c in BAD])
def test_a_bad_entry_is_named(case, mix, message, files, monkeypatch):
    monkeypatch.chdir(files)
    with pytest.raises(ConfigError) as e:
        resolve({"dataset_mixture": mix}, world_size=1)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("flag", ["train_file", "dataset_name"])
def test_a_mixture_with_a_single_dataset_flag_is_refused(flag, files, monkeypatch):
    monkeypatch.chdir(files)
    mix = [{"train_file": "a.jsonl", "weight": 1}]
    with pytest.raises(ConfigError, match=f"Can't give both `--dataset_mixture` and `--{flag}`"):
        resolve({"dataset_mixture": mix, flag: "a.jsonl"}, world_size=1)


CLI_BAD = [
    ("unknown_key", '[{"train_file": "a.jsonl", "wieght": 1}]', [], "[0]: unknown key 'wieght'"),
    ("missing_file", '[{"train_file": "x.jsonl", "weight": 1}]', [], "x.jsonl"),
    ("weight_0", '[{"train_file": "a.jsonl", "weight": 0}]', [], "'weight'"),
    (
        "duplicate",
        '[{"train_file": "a.jsonl", "weight": 1}, {"train_file": "a.jsonl", "weight": 2}]',
        [],
        "duplicate name 'a'",
    ),
    ("empty", "[]", [], "is empty"),
    ("not_json", "[{", [], "not valid JSON"),
    (
        "with_train_file",
        '[{"train_file": "a.jsonl", "weight": 1}]',
        ["--train_file", "b.jsonl"],
        "`--train_file`",
    ),
]


@pytest.mark.parametrize("case, mix, extra, name", CLI_BAD, ids=[c[0] for c in CLI_BAD])
def test_cli_bad_mixture_exits_2_with_one_line_and_writes_nothing(case, mix, extra, name, files):
    proc = run_cli(["--dataset_mixture", mix, *extra, "--output_dir", "run_out"], files)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("finetune: error:") and name in lines[-1], proc.stderr
    assert proc.stderr.count("finetune: error:") == 1
    assert not (files / "run_out").exists()


def test_cli_bad_entry_in_a_config_file_exits_2(files):
    (files / "run.yaml").write_text(
        "dataset_mixture:\n  - train_file: a.jsonl\n    weight: 1\n  - train_file: b.jsonl\n"
        "    weight: 2\n    text_colum: text\n"
    )
    proc = run_cli(["--config", "run.yaml", "--output_dir", "run_out"], files)
    assert proc.returncode == 2, proc.stderr
    assert "--dataset_mixture[1]: unknown key 'text_colum'" in proc.stderr
    assert not (files / "run_out").exists()


# --- accounting ---------------------------------------------------------------------------------


def test_tokens_by_source_reads_a_checkpoint_state_and_old_ones_have_none():
    state = {
        "sampler": {"sources": {"a": 10, "b": 20}},
        "tokens_seen_by_source": {"a": 3, "b": 1},
        "window": {"source_tokens": [5, 0]},  # since the last logged row
    }
    assert tokens_by_source(state) == {"a": 8, "b": 1}
    assert tokens_by_source({"tokens_seen": 4, "sampler": {"epoch": 0}}) is None


def test_an_old_trainer_state_loads_with_the_new_fields_defaulted():
    from finetune.checkpoint_format.state import LogWindow, TrainingState

    st = TrainingState.from_state_dict({"global_step": 3, "window": {"tokens": 5}})
    assert st.tokens_seen_by_source == {} and st.window.source_tokens == []
    w = LogWindow(tokens=5, source_tokens=[2, 3])
    assert w.summed(w.world_sums()).source_tokens == [2, 3]
    assert torch.tensor(LogWindow().world_sums()).numel() == 3


# --- each source cached as one dataset ----------------------------------------------------------


def test_each_source_is_its_own_cache_entry_and_a_shared_source_is_a_hit(tmp_path, monkeypatch):
    """Two mixtures sharing a source: the second tokenizes only its new source; the concatenated
    set has every source's rows at the sampler's offsets, and the eval sets are concatenated."""
    from finetune.cli import parse_train_args
    from finetune.data import cache
    from finetune.data.mixture_sampler import prepare_mixture, token_count
    from finetune.modeling import load_tokenizer

    calls = []
    real = cache.tokenize
    monkeypatch.setattr(
        cache, "tokenize", lambda *a, **k: calls.append(a[0].num_rows) or real(*a, **k)
    )
    for name, n in (("a", 60), ("b", 40), ("c", 20)):
        rows = [json.dumps({"text": f"{name} row {i} says {i * i}"}) for i in range(n)]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(rows) + "\n")

    def mix(*names):
        entries = [{"train_file": str(tmp_path / f"{n}.jsonl"), "weight": 1} for n in names]
        return parse_train_args(
            ["--dataset_mixture", json.dumps(entries), "--max_seq_length", "32"]
            + ["--dataset_cache_dir", str(tmp_path / "cache"), "--output_dir", str(tmp_path / "o")]
        )

    first = mix("a", "b")
    tok = load_tokenizer(first.model)
    train, evalset, sampler = prepare_mixture(first, tok, world_size=1, rank=0)
    assert len(calls) == 4  # each source's train and split-off eval set
    assert sampler.names == ["a", "b"] and sampler.sizes == [57, 38]  # 5% held out of each
    assert len(train) == 95 and len(evalset) == 5
    assert token_count(train) == sum(len(r) for r in train["input_ids"])
    a_rows = train.select(range(57))["input_ids"]
    b_rows = train.select(range(57, 95))["input_ids"]
    assert tok.decode(a_rows[0]).startswith("a row") and tok.decode(b_rows[0]).startswith("b row")
    _, _, again = prepare_mixture(mix("a", "c"), tok, world_size=1, rank=0)
    assert len(calls) == 6  # only c's two sets: a's entry is shared
    assert len(list((tmp_path / "cache" / cache.SUBDIR).iterdir())) == 3
    assert again.sizes[0] == 57


def test_run_config_yaml_runs_the_same_mixture_again(files):
    from finetune import run_config
    from finetune.cli import parse_train_args

    mix = [
        {"train_file": str(files / "a.jsonl"), "weight": 3},
        {"train_file": str(files / "b.jsonl"), "weight": 1},
    ]
    cfg = parse_train_args(["--dataset_mixture", json.dumps(mix), "--output_dir", str(files / "o")])
    path = run_config.write(cfg, str(files), "test")
    again = parse_train_args(["--config", str(path)])
    assert again.to_json_dict() == cfg.to_json_dict()
    assert [s.name for s in sources(again.data)] == ["a", "b"]


def test_a_command_line_dataset_replaces_a_files_mixture_and_the_other_way_round():
    from finetune.run_config import overridden

    mix = [{"train_file": "a.jsonl", "weight": 1}]
    assert overridden({"dataset_mixture": mix, "seed": 1}, {"train_file": "x"}) == {"seed": 1}
    assert overridden({"dataset_name": "d", "seed": 1}, {"dataset_mixture": "[]"}) == {"seed": 1}


def test_a_sources_data_error_names_its_entry(tmp_path):
    from finetune.cli import parse_train_args
    from finetune.data.mixture_sampler import prepare_mixture
    from finetune.modeling import load_tokenizer

    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "one two"}) + "\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"q": "x", "a": "y"}) + "\n")
    mix = [
        {"train_file": str(tmp_path / "a.jsonl"), "weight": 1},
        {"train_file": str(tmp_path / "b.jsonl"), "weight": 1, "prompt_column": "question"}
        | {"completion_column": "a"},
    ]
    cfg = parse_train_args(
        ["--dataset_mixture", json.dumps(mix), "--dataset_cache_dir", str(tmp_path / "c")]
    )
    with pytest.raises(ConfigError, match=r"--dataset_mixture\[1\] \(b\): --prompt_column: no"):
        prepare_mixture(cfg, load_tokenizer(cfg.model), world_size=1, rank=0)
