"""Generate the embedded default resources that let ``finetune`` run offline.

Why
---
With no arguments, ``finetune`` trains a tiny Llama model on a tiny synthetic
dataset so that the whole pipeline (tokenizer, model, DeepSpeed ZeRO-3, eval)
can be exercised on a laptop CPU without any hub download.  Everything it
needs lives next to this file and is produced by this script:

* ``data/train.jsonl`` / ``data/validation.jsonl`` -- one ``{"text": ...}``
  object per line, rendered from a few English templates with a small, closed
  vocabulary ("mia has 3 red apples. she gives 1 to tom. ...").  The structure
  repeats, so a model with ~0.4M parameters learns it in ~150 steps.  Rows are
  de-duplicated before the split, so no validation row is a copy of a train row.
* ``data/preference_train.jsonl`` / ``data/preference_validation.jsonl`` -- a
  preference set for DPO-style training in TRL's explicit-prompt format, one
  ``{"prompt": ..., "chosen": ..., "rejected": ...}`` object per line, from the
  same vocabulary.  ``chosen`` is the correct continuation of ``prompt`` (the
  right sum/difference, the place walked to, the colour liked), ``rejected`` a
  plausible wrong one (off by one, the old place, another colour).  Prompts end
  without a space and completions start with one, so the tokenized prompt is a
  prefix of the tokenized prompt+completion; ``main`` asserts this, and the
  length bound, for every row.  Rows are unique by prompt before the split, so
  no validation prompt (hence no validation row) is also in train.  Built with
  their own seed and ``Random`` after the text data and the tokenizer, and never
  fed to the tokenizer, so the existing files do not change.
* ``tokenizer/`` -- a byte-level BPE (``tokenizers``) trained on the train
  split, wrapped in ``transformers.PreTrainedTokenizerFast`` and written with
  ``save_pretrained`` so ``AutoTokenizer.from_pretrained(dir)`` works offline.
* ``model/config.json`` + ``model/generation_config.json`` -- a tiny
  ``LlamaConfig``.  No weights are shipped: the model is built with
  ``AutoModelForCausalLM.from_config`` under a fixed seed at run time.

Tokenizer choices
-----------------
* Special tokens: ``<unk>``=0, ``<s>``=1 (bos), ``</s>``=2 (eos), ``<pad>``=3,
  then ``<|system|>``, ``<|user|>``, ``<|assistant|>`` (4, 5, 6) which are
  registered as special tokens so they always tokenize atomically.
* ``tokenizer(text)`` adds NO bos/eos (GPT-2 style byte-level tokenizer with no
  template post-processor).  Training code is expected to append ``</s>``
  itself when the encoded text does not already end with it.
* The chat template renders ``<|role|>\\ncontent\\n`` for user/system turns and
  ``<|assistant|>\\ncontent</s>\\n`` for assistant turns;
  ``add_generation_prompt=True`` appends ``<|assistant|>\\n``.

How
---
Run from the repository root (re-runnable, deterministic: fixed seeds, sorted
output; re-running rewrites identical files)::

    python -m finetune.resources.build
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA_DIR = HERE / "data"
TOKENIZER_DIR = HERE / "tokenizer"
MODEL_DIR = HERE / "model"

SEED = 1234
N_TRAIN = 2000
N_VALIDATION = 200
PREFERENCE_SEED = 4321
N_PREFERENCE_TRAIN = 1000
N_PREFERENCE_VALIDATION = 100
MAX_PREFERENCE_TOKENS = 40  # prompt + longer completion, in tokens
VOCAB_SIZE = 1024
MAX_LENGTH = 512

UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{%- if message['role'] == 'assistant' -%}{{ eos_token }}{%- endif -%}"
    "{{ '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)

NAMES = {
    "mia": "she",
    "tom": "he",
    "sam": "he",
    "lily": "she",
    "ben": "he",
    "anna": "she",
    "max": "he",
    "zoe": "she",
    "leo": "he",
    "emma": "she",
}
COLORS = ["red", "blue", "green", "yellow", "white", "black"]
THINGS = ["apples", "balls", "books", "cups", "hats", "stars", "pens", "cakes"]
PLACES = ["park", "shop", "school", "garden", "kitchen", "library", "house"]
ANIMALS = {
    "cat": ("sleep", "sleeps", "house"),
    "dog": ("run", "runs", "park"),
    "bird": ("sing", "sings", "tree"),
    "fish": ("swim", "swims", "pond"),
    "frog": ("jump", "jumps", "pond"),
    "duck": ("swim", "swims", "lake"),
    "horse": ("run", "runs", "field"),
    "cow": ("eat", "eats", "field"),
}
ADJECTIVES = ["small", "big", "happy", "old", "young", "fast", "slow"]


def _give(rng: random.Random) -> str:
    a, b = rng.sample(sorted(NAMES), 2)
    n = rng.randint(2, 9)
    k = rng.randint(1, n - 1)
    color, thing = rng.choice(COLORS), rng.choice(THINGS)
    return (
        f"{a} has {n} {color} {thing}. {NAMES[a]} gives {k} to {b}. "
        f"now {a} has {n - k} {color} {thing}."
    )


def _get(rng: random.Random) -> str:
    a, b = rng.sample(sorted(NAMES), 2)
    n, k = rng.randint(1, 9), rng.randint(1, 9)
    thing = rng.choice(THINGS)
    return f"{a} has {n} {thing}. {b} gives {a} {k} more. now {a} has {n + k} {thing}."


def _move(rng: random.Random) -> str:
    a = rng.choice(sorted(NAMES))
    p1, p2 = rng.sample(PLACES, 2)
    return (
        f"{a} is in the {p1}. then {NAMES[a]} walks to the {p2}. where is {a}? {a} is in the {p2}."
    )


def _animal(rng: random.Random) -> str:
    animal = rng.choice(sorted(ANIMALS))
    verb, verbs, home = ANIMALS[animal]
    adj = rng.choice(ADJECTIVES)
    return (
        f"the {animal} is {adj}. the {animal} likes to {verb}. "
        f"every day the {adj} {animal} {verbs} in the {home}."
    )


def _count(rng: random.Random) -> str:
    a = rng.choice(sorted(NAMES))
    start = rng.randint(1, 12)
    stop = start + rng.randint(3, 6)
    numbers = ", ".join(str(i) for i in range(start, stop + 1))
    return f"{a} counts from {start} to {stop}: {numbers}."


def _likes(rng: random.Random) -> str:
    a = rng.choice(sorted(NAMES))
    color, thing = rng.choice(COLORS), rng.choice(THINGS)[:-1]
    return (
        f"{a} likes {color}. {NAMES[a]} has a {color} {thing}. "
        f"{NAMES[a]} says: i like my {color} {thing}."
    )


TEMPLATES = [_give, _get, _move, _animal, _count, _likes]


def make_row(rng: random.Random) -> str:
    """One row = two template sentences groups (~30-50 tokens)."""
    return " ".join(rng.choice(TEMPLATES)(rng) for _ in range(2))


def make_splits(seed: int = SEED) -> tuple[list[str], list[str]]:
    """Unique rows, shuffled, split: validation never repeats a train row."""
    rng = random.Random(seed)
    rows: dict[str, None] = {}
    while len(rows) < N_TRAIN + N_VALIDATION:
        rows.setdefault(make_row(rng), None)
    ordered = list(rows)
    rng.shuffle(ordered)
    return ordered[:N_TRAIN], ordered[N_TRAIN:]


def _pref_get(rng: random.Random) -> tuple[str, str, str]:
    """Addition: the right total vs. one off by one or the unchanged count."""
    a, b = rng.sample(sorted(NAMES), 2)
    n, k = rng.randint(1, 9), rng.randint(1, 9)
    thing = rng.choice(THINGS)
    wrong = rng.choice([n + k - 1, n + k + 1, n])
    return (
        f"{a} has {n} {thing}. {b} gives {a} {k} more.",
        f" now {a} has {n + k} {thing}.",
        f" now {a} has {wrong} {thing}.",
    )


def _pref_give(rng: random.Random) -> tuple[str, str, str]:
    """Subtraction: the right rest vs. one off by one, the start count or the sum."""
    a, b = rng.sample(sorted(NAMES), 2)
    n = rng.randint(2, 9)
    k = rng.randint(1, n - 1)
    color, thing = rng.choice(COLORS), rng.choice(THINGS)
    wrong = rng.choice([n - k - 1, n - k + 1, n, n + k])
    return (
        f"{a} has {n} {color} {thing}. {NAMES[a]} gives {k} to {b}.",
        f" now {a} has {n - k} {color} {thing}.",
        f" now {a} has {wrong} {color} {thing}.",
    )


def _pref_move(rng: random.Random) -> tuple[str, str, str]:
    """Where someone is: the place walked to vs. the place left (or another)."""
    a = rng.choice(sorted(NAMES))
    p1, p2 = rng.sample(PLACES, 2)
    wrong = p1 if rng.random() < 0.5 else rng.choice([p for p in PLACES if p not in (p1, p2)])
    return (
        f"{a} is in the {p1}. then {NAMES[a]} walks to the {p2}. where is {a}?",
        f" {a} is in the {p2}.",
        f" {a} is in the {wrong}.",
    )


def _pref_likes(rng: random.Random) -> tuple[str, str, str]:
    """Colour consistency: the colour of the thing held vs. another colour."""
    a = rng.choice(sorted(NAMES))
    color, thing = rng.choice(COLORS), rng.choice(THINGS)[:-1]
    wrong = rng.choice([c for c in COLORS if c != color])
    return (
        f"{a} likes {color}. {NAMES[a]} has a {color} {thing}. {NAMES[a]} says:",
        f" i like my {color} {thing}.",
        f" i like my {wrong} {thing}.",
    )


PREFERENCE_TEMPLATES = [_pref_get, _pref_give, _pref_move, _pref_likes]

PreferenceRow = dict[str, str]


def make_preference_splits(
    seed: int = PREFERENCE_SEED,
) -> tuple[list[PreferenceRow], list[PreferenceRow]]:
    """Rows unique by prompt, shuffled, split: no validation prompt is in train.

    Own ``Random`` so the text splits above are unaffected."""
    rng = random.Random(seed)
    rows: dict[str, PreferenceRow] = {}
    while len(rows) < N_PREFERENCE_TRAIN + N_PREFERENCE_VALIDATION:
        prompt, chosen, rejected = rng.choice(PREFERENCE_TEMPLATES)(rng)
        _require(chosen != rejected, "chosen equals rejected", prompt)
        rows.setdefault(prompt, {"prompt": prompt, "chosen": chosen, "rejected": rejected})
    ordered = list(rows.values())
    rng.shuffle(ordered)
    return ordered[:N_PREFERENCE_TRAIN], ordered[N_PREFERENCE_TRAIN:]


def _require(ok: bool, what: str, row: object) -> None:
    """A generated row that breaks a rule stops the build (an explicit raise: ``python -O``
    keeps it)."""
    if not ok:
        raise ValueError(f"preference data: {what}: {row!r}")


def check_preference_rows(tokenizer, rows: list[PreferenceRow]) -> tuple[int, int]:
    """Check, per row: chosen != rejected, prompt has no trailing space and each
    completion starts with one, ``tok(prompt)`` is a prefix of ``tok(prompt +
    completion)``, and prompt + completion fits in ``MAX_PREFERENCE_TOKENS``.
    Returns the (min, max) token length of prompt + completion."""
    lengths = []
    for row in rows:
        prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
        _require(chosen != rejected, "chosen equals rejected", row)
        _require(bool(prompt) and not prompt[-1].isspace(), "a prompt ends with a space", row)
        prompt_ids = tokenizer(prompt)["input_ids"]
        for completion in (chosen, rejected):
            spaced = completion.startswith(" ") and not completion[1:2].isspace()
            _require(spaced, "a completion does not start with one space", row)
            full_ids = tokenizer(prompt + completion)["input_ids"]
            prefix = full_ids[: len(prompt_ids)] == prompt_ids
            _require(prefix, "the tokenized prompt is not a prefix of prompt + completion", row)
            _require(len(full_ids) > len(prompt_ids), "an empty completion", row)
            _require(len(full_ids) <= MAX_PREFERENCE_TOKENS, "a row too long", row)
            lengths.append(len(full_ids))
    return min(lengths), max(lengths)


def write_jsonl(path: Path, texts: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for text in texts:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")


def write_rows_jsonl(path: Path, rows: list[dict[str, str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def train_bpe(texts: list[str]):
    """Byte-level BPE from ``tokenizers``; special tokens get ids 0..6."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[UNK, BOS, EOS, PAD, *ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def build_tokenizer(texts: list[str], out_dir: Path):
    """Wrap the BPE in PreTrainedTokenizerFast and ``save_pretrained`` it."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(texts),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        extra_special_tokens=list(ROLE_TOKENS),
        model_max_length=MAX_LENGTH,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def build_model_config(tokenizer, out_dir: Path):
    """Tiny Llama config matching the tokenizer; no weights are written."""
    from transformers import GenerationConfig, LlamaConfig

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_LENGTH,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out_dir))
    GenerationConfig.from_model_config(config).save_pretrained(str(out_dir))
    return config


def main() -> None:
    train, validation = make_splits()
    write_jsonl(DATA_DIR / "train.jsonl", train)
    write_jsonl(DATA_DIR / "validation.jsonl", validation)
    tokenizer = build_tokenizer(train, TOKENIZER_DIR)
    config = build_model_config(tokenizer, MODEL_DIR)
    # preference data: after the tokenizer (never trained on it), checked with the saved one
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    pref_train, pref_validation = make_preference_splits()
    seen = {tuple(r.values()) for r in pref_train}
    overlap = [r for r in pref_validation if tuple(r.values()) in seen]
    _require(not overlap, "validation rows also in train", overlap[:1])
    lo, hi = check_preference_rows(saved, pref_train + pref_validation)
    write_rows_jsonl(DATA_DIR / "preference_train.jsonl", pref_train)
    write_rows_jsonl(DATA_DIR / "preference_validation.jsonl", pref_validation)
    print(f"train rows: {len(train)}, validation rows: {len(validation)}")
    print(
        f"preference train rows: {len(pref_train)}, validation rows: {len(pref_validation)}, "
        f"prompt+completion {lo}-{hi} tokens"
    )
    print(f"tokenizer: {len(tokenizer)} tokens -> {TOKENIZER_DIR}")
    print(f"model config: vocab_size={config.vocab_size} -> {MODEL_DIR}")


if __name__ == "__main__":
    main()
