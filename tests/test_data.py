"""finetune.data: formats and masking, packing, collation, the resumable sampler, loading."""

from __future__ import annotations

import json

import pytest
import torch

from finetune.config import ConfigError, DataArgs
from finetune.data import (
    IGNORE,
    ResumableSampler,
    TrainData,
    collate,
    encode_chat,
    encode_prompt_completion,
    encode_text,
    eval_batches,
    load_raw,
    model_inputs,
    pack_concat,
)

EOS, PAD = 2, 3  # the embedded tokenizer's ids (finetune/resources/README.md)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from finetune.modeling import EMBEDDED_TOKENIZER_DIR

    t = AutoTokenizer.from_pretrained(str(EMBEDDED_TOKENIZER_DIR))
    assert (t.eos_token_id, t.pad_token_id) == (EOS, PAD)
    return t


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


# --- formats ---------------------------------------------------------------------------------


def test_encode_text_appends_eos_and_labels_everything(tok):
    out = encode_text(tok, "the cat sat on the mat", max_len=512)
    expected = ids(tok, "the cat sat on the mat") + [EOS]
    assert out == {"input_ids": expected, "labels": expected}


def test_encode_text_truncates_to_max_len(tok):
    full = ids(tok, "the cat sat on the mat") + [EOS]
    out = encode_text(tok, "the cat sat on the mat", max_len=5)
    assert out["input_ids"] == full[:5] and out["labels"] == full[:5]


def test_encode_prompt_completion_masks_exactly_the_prompt(tok):
    prompt, completion = "Question: what is red?\nAnswer:", " the apple"
    p, c = ids(tok, prompt), ids(tok, completion)
    out = encode_prompt_completion(tok, prompt, completion, max_len=512)
    assert out["input_ids"] == p + c + [EOS]
    assert out["labels"] == [IGNORE] * len(p) + c + [EOS]
    assert len(p) > 0 and len(c) > 0


def test_encode_prompt_completion_truncation_keeps_alignment(tok):
    prompt, completion = "Question: what is red?\nAnswer:", " the apple"
    p, c = ids(tok, prompt), ids(tok, completion)
    max_len = len(p) + 2
    out = encode_prompt_completion(tok, prompt, completion, max_len=max_len)
    assert out["input_ids"] == (p + c)[:max_len]
    assert out["labels"] == [IGNORE] * len(p) + c[:2]


CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "name a fruit"},
    {"role": "assistant", "content": "an apple"},
    {"role": "user", "content": "and a colour"},
    {"role": "assistant", "content": "green"},
]


def _labelled_runs(labels: list[int]) -> list[list[int]]:
    runs, cur = [], []
    for x in labels:
        if x == IGNORE:
            if cur:
                runs.append(cur)
            cur = []
        else:
            cur.append(x)
    return runs + ([cur] if cur else [])


def test_encode_chat_labels_only_assistant_turns(tok):
    out = encode_chat(tok, CHAT, max_len=512)
    rendered = tok.apply_chat_template(CHAT, tokenize=False)
    # The template: "<|role|>\n" + content, eos after assistant content, "\n" after every turn.
    assert rendered == (
        "<|system|>\nbe brief\n<|user|>\nname a fruit\n<|assistant|>\nan apple</s>\n"
        "<|user|>\nand a colour\n<|assistant|>\ngreen</s>\n"
    )
    assert out["input_ids"] == ids(tok, rendered)
    assert len(out["labels"]) == len(out["input_ids"])
    runs = _labelled_runs(out["labels"])
    assert len(runs) == 2
    for run, content in zip(runs, ("an apple", "green")):
        text = tok.decode(run)
        # Content and eos are trained on; the turn separator after eos may or may not be.
        assert text in (content + "</s>", content + "</s>\n"), text
        assert run[: len(ids(tok, content))] == ids(tok, content)
    labelled = tok.decode([x for x in out["labels"] if x != IGNORE])
    for masked in (
        "be brief",
        "name a fruit",
        "and a colour",
        "<|user|>",
        "<|system|>",
        "<|assistant|>",
    ):
        assert masked not in labelled
    # Every labelled position holds the same token as the input.
    assert all(lab in (IGNORE, i) for lab, i in zip(out["labels"], out["input_ids"]))


def test_encode_chat_truncates_ids_and_labels_together(tok):
    full = encode_chat(tok, CHAT, max_len=512)
    cut = encode_chat(tok, CHAT, max_len=25)
    assert cut == {"input_ids": full["input_ids"][:25], "labels": full["labels"][:25]}


# --- packing and collation -------------------------------------------------------------------


def test_concat_packing_makes_full_blocks_with_aligned_labels():
    import datasets

    rows = [
        {
            "input_ids": list(range(100 * r, 100 * r + n)),
            "labels": [IGNORE] * 2 + list(range(100 * r + 2, 100 * r + n)),
        }
        for r, n in enumerate([5, 7, 3, 9])
    ]  # 24 tokens
    ds = datasets.Dataset.from_list(rows)
    packed, stats = pack_concat(ds, max_len=10)
    assert stats == {"strategy": "concat", "blocks": 2, "tokens": 24, "efficiency": 1.0}
    assert len(packed) == 2
    flat_ids = [x for r in rows for x in r["input_ids"]]
    flat_labels = [x for r in rows for x in r["labels"]]
    assert [len(b) for b in packed["input_ids"]] == [10, 10]
    assert [x for b in packed["input_ids"] for x in b] == flat_ids[:20]
    assert [x for b in packed["labels"] for x in b] == flat_labels[:20]


def test_concat_packing_with_too_little_data_is_a_config_error():
    import datasets

    ds = datasets.Dataset.from_list([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}])
    with pytest.raises(ConfigError, match="--packing.*--max_seq_length 8"):
        pack_concat(ds, max_len=8)


def test_collate_pads_ids_labels_and_mask():
    batch = collate(
        [{"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7]}, {"input_ids": [8], "labels": [8]}],
        pad_id=PAD,
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, PAD, PAD]]
    assert batch["labels"].tolist() == [[IGNORE, 6, 7], [8, IGNORE, IGNORE]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert all(t.dtype == torch.long for t in batch.values())
    inputs, tokens, rows = model_inputs(batch)
    assert (tokens, rows) == (4, 2)
    assert set(inputs) == {"input_ids", "labels", "attention_mask"}


# --- ResumableSampler ------------------------------------------------------------------------


def _ranks(n: int, world: int, seed: int = 0) -> list[ResumableSampler]:
    return [ResumableSampler(n, world, r, seed) for r in range(world)]


def _take_all(samplers, per_rank):
    """One step: every rank takes; returns the list of per-rank index lists (or None at epoch
    end)."""
    got = [s.take(per_rank) for s in samplers]
    assert all(g is None for g in got) or all(g is not None for g in got)
    return None if got[0] is None else got


def test_sampler_is_deterministic_per_seed_and_epoch():
    a, b = ResumableSampler(50, 1, 0, seed=7), ResumableSampler(50, 1, 0, seed=7)
    assert a.epoch_order(0) == b.epoch_order(0)
    assert a.epoch_order(0) != a.epoch_order(1)
    assert a.epoch_order(0) != ResumableSampler(50, 1, 0, seed=8).epoch_order(0)
    assert sorted(a.epoch_order(0)) == list(range(50))


def test_sampler_ranks_are_disjoint_and_cover_the_trimmed_order():
    n, world = 23, 3  # 23 % 3 == 2 samples trimmed so every rank gets the same count
    samplers = _ranks(n, world)
    order = samplers[0].epoch_order(0)
    assert len(order) == 21
    per_rank = [[] for _ in range(world)]
    while (step := _take_all(samplers, 1)) is not None:
        for r, idx in enumerate(step):
            per_rank[r].extend(idx)
    assert [len(p) for p in per_rank] == [7, 7, 7]
    assert set.intersection(*map(set, per_rank)) == set()
    assert sorted(x for p in per_rank for x in p) == sorted(order)


def test_sampler_next_epoch_gives_a_different_order():
    s = ResumableSampler(16, 1, 0, seed=1)
    first = s.take(16)
    assert s.take(1) is None
    s.next_epoch()
    second = s.take(16)
    assert sorted(first) == sorted(second) and first != second
    assert s.state_dict()["epoch"] == 1


def test_sampler_resume_mid_epoch_matches_uninterrupted():
    n, world, per_rank = 40, 2, 3
    straight = _ranks(n, world)
    interrupted = _ranks(n, world)
    for _ in range(2):
        _take_all(straight, per_rank)
        _take_all(interrupted, per_rank)
    # as a checkpoint stores it
    saved = [json.loads(json.dumps(s.state_dict())) for s in interrupted]
    resumed = _ranks(n, world)
    for s, sd in zip(resumed, saved):
        s.load_state_dict(sd)
    for _ in range(4):
        assert _take_all(resumed, per_rank) == _take_all(straight, per_rank)


def test_sampler_resume_on_other_world_size_continues_global_position():
    n, per_rank = 48, 2
    old = _ranks(n, 2)
    seen = []
    for _ in range(3):  # 3 steps × 2 per rank × 2 ranks = 12 global samples
        for idx in _take_all(old, per_rank):
            seen.extend(idx)
    sd = old[0].state_dict()
    assert sd["consumed"] == 12 and all(s.state_dict() == sd for s in old)  # the state is global
    new = _ranks(n, 3)
    for s in new:
        s.load_state_dict(sd)
    order = new[0].epoch_order(0)
    after = []
    while (step := _take_all(new, per_rank)) is not None:
        for idx in step:
            after.extend(idx)
    assert sorted(seen) == sorted(order[:12])
    assert sorted(after) == sorted(order[12:])
    assert len(set(seen + after)) == len(seen + after) == n  # nothing repeated or skipped


def test_sampler_refuses_state_from_other_data():
    s = ResumableSampler(10, 1, 0, seed=0)
    with pytest.raises(ConfigError, match="--resume_from_checkpoint"):
        s.load_state_dict({"epoch": 0, "consumed": 0, "seed": 0, "num_samples": 11})


# --- TrainData and eval batches ------------------------------------------------------------


def _rows(n: int) -> list[dict]:
    return [
        {"input_ids": [10 + i] * (1 + i % 3), "labels": [10 + i] * (1 + i % 3)} for i in range(n)
    ]


def test_train_data_yields_grad_accum_micro_batches_and_rolls_epoch():
    data = TrainData(
        _rows(10), ResumableSampler(10, 1, 0, seed=3), micro_batch=2, grad_accum=2, pad_id=PAD
    )
    assert data.steps_per_epoch == 2
    seen = []
    for _ in range(2):
        step = data.next_step()
        assert len(step) == 2 and all(b["input_ids"].shape[0] == 2 for b in step)
        seen.extend(int(b["input_ids"][i, 0]) - 10 for b in step for i in range(2))
    assert data.sampler.state.epoch == 0 and data.epoch_float == 1.0
    assert len(set(seen)) == 8
    step = data.next_step()  # 2 samples left over: not a full step, so the epoch rolls
    assert data.sampler.state.epoch == 1 and data.sampler.state.consumed == 4
    assert data.epoch_float == 1.5
    assert [
        int(b["input_ids"][i, 0]) - 10 for b in step for i in range(2)
    ] == data.sampler.epoch_order(1)[:4]


def test_train_data_too_small_for_one_step_is_a_config_error():
    with pytest.raises(ConfigError, match="--per_device_train_batch_size"):
        TrainData(
            _rows(3), ResumableSampler(3, 2, 0, seed=0), micro_batch=2, grad_accum=1, pad_id=PAD
        )


@pytest.mark.parametrize("n, world, batch", [(5, 2, 2), (5, 3, 1), (4, 2, 2), (7, 4, 3)])
def test_eval_batches_same_count_on_every_rank_with_filler_marked(n, world, batch):
    rows = _rows(n)
    per_rank = [list(eval_batches(rows, batch, world, r, PAD)) for r in range(world)]
    assert len({len(b) for b in per_rank}) == 1  # every rank runs the same number of forwards
    real = [
        int(x) - 10
        for batches in per_rank
        for b, is_real in batches
        if is_real
        for x, m in zip(b["input_ids"][:, 0], b["attention_mask"][:, 0])
        if m
    ]
    assert sorted(real) == list(range(n))  # each sample evaluated exactly once
    assert all(b["input_ids"].shape[0] <= batch for batches in per_rank for b, _ in batches)


def test_eval_batches_uneven_split_has_one_filler():
    r0 = list(eval_batches(_rows(5), 2, 2, 0, PAD))
    r1 = list(eval_batches(_rows(5), 2, 2, 1, PAD))
    assert [real for _, real in r0] == [True, True]
    assert [real for _, real in r1] == [True, False]
    assert r1[1][0]["input_ids"].shape[0] >= 1  # the filler is still a real forward pass


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_eval_batches_are_pinned_on_request_and_otherwise_the_same():
    plain = list(eval_batches(_rows(5), 2, 2, 1, PAD))
    pinned = list(eval_batches(_rows(5), 2, 2, 1, PAD, pin_memory=True))
    assert all(v.is_pinned() for b, _ in pinned for v in b.values())
    assert [r for _, r in plain] == [r for _, r in pinned]
    assert all(torch.equal(a[k], b[k]) for (a, _), (b, _) in zip(plain, pinned) for k in a)


# --- load_raw --------------------------------------------------------------------------------

TEXTS = [f"row number {i}" for i in range(20)]


def _write(tmp_path, fmt: str):
    path = tmp_path / f"train.{fmt}"
    if fmt == "jsonl":
        path.write_text(
            "".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(TEXTS))
        )
    elif fmt == "csv":
        path.write_text("text,n\n" + "".join(f"{t},{i}\n" for i, t in enumerate(TEXTS)))
    elif fmt == "parquet":
        import pandas as pd

        pd.DataFrame({"text": TEXTS, "n": range(20)}).to_parquet(path)
    elif fmt == "txt":
        path.write_text("".join(t + "\n" for t in TEXTS))
    return str(path)


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet", "txt"])
def test_load_raw_reads_each_format(fmt, tmp_path):
    train, evalset = load_raw(
        DataArgs(train_file=_write(tmp_path, fmt), validation_split_percentage=0), seed=0
    )
    assert evalset is None
    assert list(train["text"]) == TEXTS


def test_load_raw_unknown_column_lists_available(tmp_path):
    args = DataArgs(
        train_file=_write(tmp_path, "jsonl"), text_column="body", validation_split_percentage=0
    )
    with pytest.raises(ConfigError) as e:
        load_raw(args, seed=0)
    msg = str(e.value)
    assert "--text_column" in msg and "'body'" in msg and "text, n" in msg


def test_load_raw_prompt_columns_checked(tmp_path):
    args = DataArgs(
        train_file=_write(tmp_path, "jsonl"), prompt_column="text", completion_column="answer"
    )
    with pytest.raises(
        ConfigError, match="--completion_column: no column 'answer'.*available: text, n"
    ):
        load_raw(args, seed=0)


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "txt"])
def test_load_raw_empty_file_is_a_config_error(fmt, tmp_path):
    path = tmp_path / f"empty.{fmt}"
    path.write_text("")
    with pytest.raises(ConfigError) as e:
        load_raw(DataArgs(train_file=str(path)), seed=0)
    assert "--train_file" in str(e.value) and str(path) in str(e.value)


def test_load_raw_validation_split_sizes(tmp_path):
    train, evalset = load_raw(
        DataArgs(train_file=_write(tmp_path, "jsonl"), validation_split_percentage=10), seed=0
    )
    assert (len(train), len(evalset)) == (18, 2)
    assert sorted(list(train["text"]) + list(evalset["text"])) == sorted(TEXTS)
    again, _ = load_raw(
        DataArgs(train_file=_write(tmp_path, "jsonl"), validation_split_percentage=10), seed=0
    )
    assert list(again["text"]) == list(train["text"])  # the split is seeded


def test_load_raw_validation_file_is_used_instead_of_a_split(tmp_path):
    val = tmp_path / "val.jsonl"
    val.write_text('{"text": "held out", "n": 0}\n')
    train, evalset = load_raw(
        DataArgs(train_file=_write(tmp_path, "jsonl"), validation_file=str(val)), seed=0
    )
    assert len(train) == 20 and list(evalset["text"]) == ["held out"]


def test_load_raw_max_train_samples(tmp_path):
    args = DataArgs(
        train_file=_write(tmp_path, "jsonl"), validation_split_percentage=0, max_train_samples=5
    )
    train, _ = load_raw(args, seed=0)
    assert list(train["text"]) == TEXTS[:5]


# --- per-step cost and equivalence with the original sampler --------------------------------


def _reference_take(
    n: int, world: int, rank: int, seed: int, epoch: int, consumed: int, per_rank: int
):
    """The sampler as it was first written (the whole permutation rebuilt at every step): the
    order every existing checkpoint's data position refers to."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    order = order[: len(order) - len(order) % world]
    end = consumed + per_rank * world
    return None if end > len(order) else order[consumed:end][rank::world]


@pytest.mark.parametrize(
    "n,world,per_rank,seed", [(103, 1, 4, 0), (103, 2, 3, 7), (1000, 4, 8, 42), (17, 3, 1, 5)]
)
def test_sampler_order_and_slices_match_the_original_for_any_state(n, world, per_rank, seed):
    for epoch in (0, 1, 3):
        for consumed in range(0, n, max(1, per_rank * world)):
            for rank in range(world):
                s = ResumableSampler(n, world, rank, seed)
                s.load_state_dict(
                    {"epoch": epoch, "consumed": consumed, "seed": seed, "num_samples": n}
                )
                assert s.take(per_rank) == _reference_take(
                    n, world, rank, seed, epoch, consumed, per_rank
                )


def test_sampler_take_is_o_batch_at_10m_samples():
    import time

    s = ResumableSampler(10_000_000, 8, 3, seed=0)
    s.take(16)  # the epoch's permutation: once per epoch
    start = time.perf_counter()
    for _ in range(1000):
        assert len(s.take(16)) == 16
    elapsed = time.perf_counter() - start
    assert elapsed < 0.5, f"1,000 steps took {elapsed:.3f} s"
    assert s.state.consumed == 1001 * 16 * 8


# --- prefetch ---------------------------------------------------------------------------------


def _same_batches(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


def test_prefetched_steps_equal_unprefetched_ones_across_epochs():
    plain = TrainData(
        _rows(23),
        ResumableSampler(23, 2, 1, seed=4),
        micro_batch=2,
        grad_accum=3,
        pad_id=PAD,
        prefetch=False,
    )
    ahead = TrainData(
        _rows(23), ResumableSampler(23, 2, 1, seed=4), micro_batch=2, grad_accum=3, pad_id=PAD
    )
    ahead.start()
    for _ in range(9):  # 1 step per epoch: every step rolls the epoch
        assert ahead.ready() is None
        assert _same_batches(plain.next_step(), ahead.next_step())
        assert plain.sampler.state_dict() == ahead.sampler.state_dict()
    ahead.close()


def test_prefetch_never_counts_a_step_not_handed_out_and_is_dropped_on_reload():
    data = TrainData(
        _rows(40), ResumableSampler(40, 1, 0, seed=2), micro_batch=2, grad_accum=1, pad_id=PAD
    )
    data.next_step()
    data.ready()  # step 2 is prepared now, but not consumed
    assert data.sampler.state_dict()["consumed"] == 2
    saved = data.sampler.state_dict()
    data.next_step()
    data.sampler.load_state_dict(saved)  # a resume: the prefetched step 3 must not be used
    again = data.next_step()
    fresh = TrainData(
        _rows(40),
        ResumableSampler(40, 1, 0, seed=2),
        micro_batch=2,
        grad_accum=1,
        pad_id=PAD,
        prefetch=False,
    )
    fresh.next_step()
    assert _same_batches(again, fresh.next_step())
    data.close()


class _FailingRows(list):
    def __getitem__(self, i):
        if i == 5:
            raise OSError(5, "bad sector")
        return list.__getitem__(self, i)


def test_a_prefetch_failure_is_raised_by_the_step_that_needed_it():
    rows = _FailingRows(_rows(12))
    data = TrainData(
        rows, ResumableSampler(12, 1, 0, seed=0), micro_batch=1, grad_accum=1, pad_id=PAD
    )
    order = data.sampler.epoch_order(0)
    data.start()
    for _ in range(order.index(5)):
        assert data.ready() is None
        data.next_step()
    assert isinstance(data.ready(), OSError)
    with pytest.raises(OSError, match="bad sector"):
        data.next_step()
    data.close()


# --- bad rows named before tokenizing ----------------------------------------------------------


def _chat_file(tmp_path, rows: list) -> str:
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    return str(path)


SHORT_CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]


@pytest.mark.parametrize(
    "column, write",
    [
        ("text", lambda tmp: _write(tmp, "jsonl")),  # plain strings
        ("messages", lambda tmp: _chat_file(tmp, [["hi", "hello"]] * 3)),  # a list, not of messages
    ],
    ids=["strings", "list_of_strings"],
)
def test_load_raw_chat_column_that_is_not_messages_names_it(column, write, tmp_path):
    args = DataArgs(
        train_file=write(tmp_path), messages_column=column, validation_split_percentage=0
    )
    with pytest.raises(
        ConfigError, match=rf"--messages_column: column '{column}' must hold lists of .*role"
    ):
        load_raw(args, seed=0)


def test_a_later_row_that_is_not_messages_is_named_while_tokenizing(tok, tmp_path):
    from finetune.data import tokenize

    args = DataArgs(
        train_file=_chat_file(tmp_path, [SHORT_CHAT, SHORT_CHAT, "not a chat"]),
        messages_column="messages",
        validation_split_percentage=0,
    )
    train, _ = load_raw(args, seed=0)
    with pytest.raises(ConfigError, match=r"--messages_column: .*'not a chat'"):
        tokenize(train, tok, args, 64)


def test_messages_as_a_json_string_are_read(tok, tmp_path):
    from finetune.data import tokenize

    path = tmp_path / "chat.csv"
    path.write_text('messages\n"' + json.dumps(SHORT_CHAT).replace('"', '""') + '"\n')
    args = DataArgs(train_file=str(path), messages_column="messages", validation_split_percentage=0)
    train, _ = load_raw(args, seed=0)
    assert len(tokenize(train, tok, args, 64)) == 1


def test_nothing_to_learn_names_max_seq_length_when_prompts_fill_it(tok, tmp_path):
    from finetune.data.load import nothing_to_learn

    path = tmp_path / "pc.jsonl"
    path.write_text(
        "".join(
            json.dumps({"q": "a rather long question about cats", "a": "yes"}) + "\n"
            for _ in range(3)
        )
    )
    args = DataArgs(
        train_file=str(path),
        prompt_column="q",
        completion_column="a",
        validation_split_percentage=0,
    )
    train, _ = load_raw(args, seed=0)
    assert nothing_to_learn(args, tok, train, 4).startswith(
        "--max_seq_length 4: in every training example the prompt"
    )


def test_nothing_to_learn_names_the_data_when_no_length_would_help(tok, tmp_path):
    from finetune.data.load import nothing_to_learn

    args = DataArgs(
        train_file=_chat_file(tmp_path, [SHORT_CHAT[:1]] * 3),
        messages_column="messages",
        validation_split_percentage=0,
    )
    train, _ = load_raw(args, seed=0)
    assert nothing_to_learn(args, tok, train, 512) == (
        "--train_file: no training example has a token to learn from (chats with no assistant turn)"
    )
