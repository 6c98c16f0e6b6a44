"""Preference objectives in one process: the pairs' format (text and conversational, truncation and
what is dropped), their micro-batches, the losses' weighting, the flags' checks and the reference's
resume rules. TRL's own trainers are compared end to end in tests/e2e/test_preference_runs.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from finetune.cli import parse_train_args
from finetune.config import ConfigError
from finetune.data.formats import IGNORE, choose
from finetune.data.load import load_raw, tokenize
from finetune.data.preference import collate_pairs
from finetune.modeling import load_tokenizer
from finetune.objectives import STATS, Objective, token_logps
from finetune.reference import check_resume, record

PAIR = {"prompt": "zoe has 4 pens. tom gives zoe 6 more.", "chosen": " now zoe has 10 pens."}
PAIR["rejected"] = " now zoe has 9 pens."


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(parse_train_args([]).model)


def _file(tmp_path: Path, rows: list[dict]) -> str:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _encode(tok, tmp_path, rows, *flags):
    cfg = parse_train_args(
        ["--objective", "dpo", "--train_file", _file(tmp_path, rows)]
        + ["--validation_split_percentage", "0", *flags]
    )
    train, _ = load_raw(cfg.data, 0)
    return tokenize(train, tok, cfg.data, cfg.data.max_seq_length), cfg


def test_a_text_pair_splits_where_the_prompt_ends_and_each_completion_ends_with_eos(tok, tmp_path):
    ds, cfg = _encode(tok, tmp_path, [PAIR])
    assert choose(cfg.data).name == "preference"
    row = ds[0]
    prompt = tok(PAIR["prompt"])["input_ids"]
    assert row["prompt_ids"] == prompt
    assert row["chosen_ids"] == tok(PAIR["prompt"] + PAIR["chosen"])["input_ids"][len(prompt) :] + [
        tok.eos_token_id
    ]
    assert row["chosen_ids"][-1] == row["rejected_ids"][-1] == tok.eos_token_id
    assert row["chosen_ids"] != row["rejected_ids"]


def test_truncation_keeps_the_prompts_end_and_the_completions_start_and_drops_what_is_empty(
    tok, tmp_path
):
    same = {**PAIR, "rejected": PAIR["chosen"]}
    long = {**PAIR, "prompt": " ".join(["the cat is old."] * 20)}
    ds, _ = _encode(tok, tmp_path, [PAIR, same, long], "--max_seq_length", "24")
    # the identical pair is dropped; the long prompt fills all 24 tokens: no completion left
    assert len(ds) == 1
    full, _ = _encode(
        tok, tmp_path, [PAIR, long], "--max_seq_length", "16", "--max_prompt_length", "8"
    )
    whole, _ = _encode(tok, tmp_path, [PAIR, long], "--max_seq_length", "512")
    assert len(full) == 2
    for row, untruncated in zip(full, whole):
        assert row["prompt_ids"] == untruncated["prompt_ids"][-8:]
        for side in ("chosen_ids", "rejected_ids"):
            assert row[side] == untruncated[side][: 16 - 8]


def test_conversational_pairs_take_their_shared_messages_as_the_prompt(tok, tmp_path):
    user = {"role": "user", "content": PAIR["prompt"]}
    row = {
        "chosen": [user, {"role": "assistant", "content": PAIR["chosen"]}],
        "rejected": [user, {"role": "assistant", "content": PAIR["rejected"]}],
    }
    ds, _ = _encode(tok, tmp_path, [row])
    rendered = tok.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
    prompt = tok(rendered, add_special_tokens=False)["input_ids"]
    assert ds[0]["prompt_ids"] == prompt
    chosen = tok.apply_chat_template(row["chosen"], tokenize=False)
    assert ds[0]["chosen_ids"] == tok(chosen, add_special_tokens=False)["input_ids"][len(prompt) :]


def test_a_micro_batch_of_pairs_is_one_forward_of_chosen_then_rejected_rows():
    rows = [
        {"prompt_ids": [5, 6, 7], "chosen_ids": [8, 9], "rejected_ids": [10]},
        {"prompt_ids": [5], "chosen_ids": [11], "rejected_ids": [12, 13, 14]},
    ]
    b = collate_pairs(rows, pad_id=3)
    assert b["input_ids"].tolist() == [
        [5, 6, 7, 8, 9],
        [5, 11, 3, 3, 3],
        [5, 6, 7, 10, 3],
        [5, 12, 13, 14, 3],
    ]
    assert b["labels"][0].tolist() == [IGNORE, IGNORE, IGNORE, 8, 9]
    assert b["labels"][3].tolist() == [IGNORE, 12, 13, 14, IGNORE]
    assert b["attention_mask"].sum().item() == 5 + 2 + 4 + 4 == b["num_tokens"].item()
    assert b["num_rows"].item() == 2


def _batch(pairs: int, width: int, seed: int) -> tuple[torch.Tensor, dict]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 50, (2 * pairs, width), generator=g)
    mask = torch.ones_like(ids)
    mask[:, width - 2 :] = torch.randint(0, 2, (2 * pairs, 2), generator=g).sort(-1, True).values
    labels = ids.masked_fill(mask == 0, IGNORE)
    labels[:, :3] = IGNORE  # a three-token prompt
    logits = torch.randn(2 * pairs, width, 50, generator=g, requires_grad=True)
    return logits, {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("name", ["dpo", "ipo", "simpo", "orpo"])
def test_a_steps_loss_is_the_pairs_mean_however_micro_batches_split_them(name):
    """Four pairs as one micro-batch, and as two of two (each loss halved, as DeepSpeed divides by
    the accumulation steps): the same loss and gradients. ORPO's NLL, given the step's tokens per
    micro-batch (``items``), is token-weighted across them."""
    objective = Objective(name, beta=0.2, simpo_gamma=0.5 if name == "simpo" else None)
    logits, batch = _batch(4, 9, seed=1)
    reference = (torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64))
    whole, stats = objective.loss(logits, batch, reference if objective.needs_reference else None)
    (grad_whole,) = torch.autograd.grad(whole, logits)

    tokens = objective.nll_tokens(batch)
    parts, grads, sums = 0.0, torch.zeros_like(logits), torch.zeros(len(STATS), dtype=torch.float64)
    for half in (slice(0, 2), slice(2, 4)):
        rows = torch.cat([torch.arange(8)[half], torch.arange(8)[4:][half]])
        sub = {k: v[rows] for k, v in batch.items()}
        ref = tuple(r[half] for r in reference) if objective.needs_reference else None
        loss, part = objective.loss(logits[rows], sub, ref, items=tokens / 2 if tokens else None)
        (grad,) = torch.autograd.grad(loss / 2, logits)
        parts, grads, sums = parts + loss.item() / 2, grads + grad, sums + part
    assert parts == pytest.approx(whole.item(), rel=1e-6)
    torch.testing.assert_close(grads, grad_whole, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(sums, stats, rtol=1e-6, atol=1e-9)


def test_token_logps_are_the_log_softmax_of_each_label_after_the_shift():
    logits, batch = _batch(1, 6, seed=2)
    logps, mask = token_logps(logits, batch["labels"])
    expect = torch.log_softmax(logits[:, :-1].float(), -1)
    target = batch["labels"][:, 1:]
    picked = expect.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (target != IGNORE)
    torch.testing.assert_close(logps, picked)
    assert mask.tolist() == (target != IGNORE).tolist()


@pytest.mark.parametrize(
    ("flags", "names"),
    [
        (["--beta", "0.2"], "`--beta` needs a preference `--objective`"),
        (["--chosen_column", "good"], "`--chosen_column` needs a preference"),
        (["--objective", "dpo", "--reference", "none"], "`--reference none` cannot give one"),
        (["--objective", "orpo", "--reference", "precompute"], "`--reference` must be none"),
        (["--objective", "dpo", "--packing"], "`--packing` does not work with `--objective dpo`"),
        (["--objective", "ipo", "--simpo_gamma", "1"], "`--simpo_gamma` is SimPO's"),
        (["--objective", "dpo", "--beta", "0"], "`--beta` must be positive"),
        (["--objective", "simpo", "--messages_column", "m"], "`--messages_column` is not a column"),
        (
            ["--objective", "dpo", "--metric_for_best_model", "perplexity"],
            "the evaluation writes eval_loss, eval_rewards/chosen",
        ),
        (
            ["--metric_for_best_model", "rewards/accuracies"],
            "writes eval_loss, eval_perplexity under `--objective sft`",
        ),
    ],
)
def test_bad_preference_flags_are_refused_naming_the_flag(flags, names):
    with pytest.raises(ConfigError, match=None) as e:
        parse_train_args(flags)
    assert names in str(e.value)


def test_each_objective_gets_trls_defaults():
    dpo = parse_train_args(["--objective", "dpo"]).preference
    assert (dpo.beta, dpo.reference, dpo.simpo_gamma) == (0.1, "precompute", None)
    simpo = parse_train_args(["--objective", "simpo"]).preference
    assert (simpo.beta, simpo.reference, simpo.simpo_gamma) == (0.1, "none", 0.5)
    assert parse_train_args(["--objective", "orpo"]).preference.reference == "none"
    cfg = parse_train_args(["--objective", "dpo", "--metric_for_best_model", "rewards/accuracies"])
    assert cfg.train.metric_for_best_model == "rewards/accuracies"


def test_a_resume_keeps_the_objective_the_reference_and_its_weights(tmp_path):
    cfg = parse_train_args(["--objective", "dpo"])
    weights = {"source": "m", "fingerprint": {"method": "config+seed", "seed": 42}}
    saved = {"reference": record(cfg, weights)}
    check_resume(tmp_path, saved, cfg, record(cfg, weights))  # the same: no error
    other = {"source": "m", "fingerprint": {"method": "config+seed", "seed": 7}}
    with pytest.raises(ConfigError, match="--model_name_or_path: .* reference"):
        check_resume(tmp_path, saved, cfg, record(cfg, other))
    ipo = parse_train_args(["--objective", "ipo"])
    with pytest.raises(ConfigError, match="--objective: .* dpo, this run has ipo"):
        check_resume(tmp_path, saved, ipo, record(ipo, weights))
    live = parse_train_args(["--objective", "dpo", "--reference", "live"])
    with pytest.raises(ConfigError, match="--reference: .* precompute, this run has live"):
        check_resume(tmp_path, saved, live, record(live, weights))
    sft = parse_train_args([])
    with pytest.raises(ConfigError, match="--objective: .* sft, this run has dpo"):
        check_resume(tmp_path, {}, cfg, record(cfg, weights))
    check_resume(tmp_path, {}, sft, None)


def test_a_pair_set_missing_a_column_is_refused_naming_its_flag(tmp_path):
    no_rejected = [{k: v for k, v in PAIR.items() if k != "rejected"}]
    cfg = parse_train_args(["--objective", "dpo", "--train_file", _file(tmp_path, no_rejected)])
    with pytest.raises(ConfigError, match="--rejected_column: no column 'rejected'"):
        load_raw(cfg.data, 0)
    no_prompt = [{k: v for k, v in PAIR.items() if k != "prompt"}]
    cfg = parse_train_args(["--objective", "dpo", "--train_file", _file(tmp_path, no_prompt)])
    with pytest.raises(ConfigError, match="text pairs need a 'prompt' column"):
        load_raw(cfg.data, 0)


def test_a_mixtures_sources_are_pairs_and_count_each_pairs_tokens(tok, tmp_path):
    from finetune.data.formats import row_tokens
    from finetune.data.mixture_sampler import token_count

    ds, _ = _encode(tok, tmp_path, [PAIR] * 3)
    assert (
        token_count(ds)
        == sum(row_tokens(r) for r in ds)
        == 3 * collate_pairs([ds[0]], 0)["num_tokens"].item()
    )
    mix = json.dumps([{"train_file": "a.jsonl", "text_column": "t", "weight": 1}])
    with pytest.raises(ConfigError, match="source .*: `text_column` is not a column"):
        parse_train_args(["--objective", "dpo", "--dataset_mixture", mix])
    mix = json.dumps([{"train_file": "a.jsonl", "chosen_column": "good", "weight": 1}])
    with pytest.raises(ConfigError, match="`--chosen_column` needs a preference"):
        parse_train_args(["--dataset_mixture", mix])


def test_text_that_starts_with_a_bracket_is_text_and_messages_as_json_text_are_messages(
    tok, tmp_path
):
    bracket = {**PAIR, "chosen": " [10] pens.", "rejected": " [9] pens."}
    ds, _ = _encode(tok, tmp_path, [bracket])
    assert tok.decode(ds[0]["chosen_ids"]).startswith(" [10]")
    user = {"role": "user", "content": PAIR["prompt"]}
    as_json = {
        side: json.dumps([user, {"role": "assistant", "content": PAIR[side]}])
        for side in ("chosen", "rejected")
    }
    listed = {side: json.loads(text) for side, text in as_json.items()}
    a, _ = _encode(tok, tmp_path, [as_json])
    b, _ = _encode(tok, tmp_path, [listed])
    assert a[0] == b[0]


def test_what_is_not_messages_stays_text_and_an_unscored_completion_is_dropped(tok, tmp_path):
    from finetune.data.preference import Preference, _conversational

    assert not _conversational("[]") and not _conversational([])
    assert not _conversational('[{"name": "x"}]')  # structured output, not messages
    assert _conversational([{"role": "user", "content": "hi"}])
    fmt = Preference(parse_train_args(["--objective", "dpo"]).data)
    assert not fmt.keeps({"prompt_ids": [], "chosen_ids": [2], "rejected_ids": [5, 2]})
    assert fmt.keeps({"prompt_ids": [], "chosen_ids": [4, 2], "rejected_ids": [5, 2]})
    assert fmt.keeps({"prompt_ids": [7], "chosen_ids": [2], "rejected_ids": [5]})


def test_a_resume_keeps_the_precision_the_reference_was_computed_in(tmp_path):
    cfg = parse_train_args(["--objective", "dpo"])
    weights = {"source": "m", "fingerprint": {"seed": 42}}
    saved = {"reference": record(cfg, weights)}
    bf16 = parse_train_args(["--objective", "dpo", "--precision", "fp32"])
    check_resume(tmp_path, saved, bf16, record(bf16, weights))  # auto = fp32 here: the same
    changed = {"reference": {**record(cfg, weights), "precision": "bf16"}}
    with pytest.raises(ConfigError, match="--precision: .* bf16, this run has fp32"):
        check_resume(tmp_path, changed, cfg, record(cfg, weights))
