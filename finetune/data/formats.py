"""Data formats: which columns a row is read from, and which of its tokens are trained on.

One class per format, registered in FORMATS (torchtune's transforms are the model): the columns it
reads, a check on the raw data, and a batch encoder. ``choose`` is the only place that picks one
from the flags. Each format lists the flags that configure it, and an instance holds those values
and nothing else: the cache fingerprint hashes the format's name and exactly those values, so a
new format (or a new flag of one) is a new key, never a stale hit on another format's tokens.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

from finetune.config import ConfigError, DataArgs

IGNORE = -100  # label value the loss skips


def label_tokens(inputs: dict) -> int:
    """The tokens a micro-batch's loss is taken over (the model shifts labels: a row's first label
    is never a target; a sequence-parallel shard's ``shift_labels`` are shifted already). Read on
    the host copy: no device sync."""
    if "shift_labels" in inputs:
        return int((inputs["shift_labels"] != IGNORE).sum())
    return int((inputs["labels"][..., 1:] != IGNORE).sum())


# The columns a tokenized set's tokens are counted from, and how often each feeds the model: a
# preference pair's prompt twice (once with each completion).
TOKEN_COLUMNS = {"input_ids": 1}
PAIR_TOKEN_COLUMNS = {"prompt_ids": 2, "chosen_ids": 1, "rejected_ids": 1}


def token_columns(columns) -> dict[str, int]:
    """Those of a tokenized set with these columns (or a row with these keys)."""
    return TOKEN_COLUMNS if "input_ids" in columns else PAIR_TOKEN_COLUMNS


def row_tokens(row: dict) -> int:
    """The tokens a tokenized row feeds the model."""
    return sum(n * len(row[name]) for name, n in token_columns(row).items())


DEFAULT = "text"  # the format when no other one's flag is set


class Format:
    """A data format. Subclasses set the class attributes, implement ``encode`` and are registered
    with ``@register``; the checks are optional."""

    name: ClassVar[str]
    flags: ClassVar[tuple[str, ...]]  # the DataArgs fields that configure it: the cache key's share
    # The flag whose value (when set) picks this format; the default format needs none.
    selected_by: ClassVar[str | None] = None
    # The flags given all or none (None: all of ``flags``).
    together: ClassVar[tuple[str, ...] | None] = None
    empty_rows: ClassVar[str] = "empty rows"  # a row with nothing to learn from, in errors
    # The int32 sequence columns ``encode`` writes (the tokenized set's columns).
    features: ClassVar[tuple[str, ...]] = ("input_ids", "labels")
    pairs: ClassVar[bool] = False  # rows are preference pairs (a prompt, chosen and rejected)

    def __init__(self, args: DataArgs):
        self.values: dict[str, Any] = {flag: getattr(args, flag) for flag in self.flags}

    @property
    def columns(self) -> dict[str, str]:
        """The dataset columns it reads, by the flag naming each; override if a flag is not one."""
        return dict(self.values)

    def check(self, ds) -> None:
        """Raise ConfigError (naming the flag) on raw data it cannot encode; ``ds`` has the columns.

        Runs before tokenizing, so a bad file fails in seconds rather than in a map's worker."""

    def check_tokenizer(self, tokenizer) -> None:
        """Raise ConfigError on a tokenizer it cannot use, before any row is tokenized."""

    def encode(self, batch: dict[str, list], tokenizer, max_len: int) -> list[dict[str, list[int]]]:
        """A batch of raw rows (column → values) → each row's {"input_ids", "labels"}, at most
        ``max_len`` long; rows left with no label are kept (the caller drops them)."""
        raise NotImplementedError

    def keeps(self, row: dict[str, list[int]]) -> bool:
        """Whether an encoded row is worth training on: a label after the first token (the model
        shifts labels, so a row's first label is never a target)."""
        return any(x != IGNORE for x in row["labels"][1:])


FORMATS: dict[str, type[Format]] = {}


_F = TypeVar("_F", bound=type[Format])


def register(cls: _F) -> _F:
    """Class decorator: add a format to FORMATS. Registration order is ``choose``'s precedence."""
    FORMATS[cls.name] = cls
    return cls


def choose(args: DataArgs) -> Format:
    """The first registered format whose selecting flag is set, else the default (text)."""
    for cls in FORMATS.values():
        if cls.selected_by and getattr(args, cls.selected_by):
            return cls(args)
    return FORMATS[DEFAULT](args)


def exclusive_flags() -> list[tuple[set[str], set[str]]]:
    """Pairs of flag sets that pick different formats: one given on the command line drops the
    other from a config file. The default format is in no pair: its flag has a default value, so
    it picks nothing, and a file's chat or prompt format outlives a `--text_column` given on the
    command line."""
    picking = [cls for name, cls in FORMATS.items() if name != DEFAULT]
    return [(set(a.flags), set(b.flags)) for a, b in itertools.combinations(picking, 2)]


def check_flags(values: Mapping[str, Any]) -> None:
    """The format flags' values alone (no data read), from the registry: a format's flags go
    together, and no two formats' flags are given at once (the default format's flag has a default
    value, so it picks nothing). Raises ConfigError naming the flags."""
    picking = [cls for name, cls in FORMATS.items() if name != DEFAULT]
    for cls in picking:
        together = cls.flags if cls.together is None else cls.together
        given = [f for f in together if values.get(f)]
        if given and len(given) < len(together):
            names = [f"`--{f}`" for f in together]
            both = "both" if len(names) == 2 else "all"
            raise ConfigError(
                f"{', '.join(names[:-1])} and {names[-1]} go together: give {both} or neither"
            )
    chosen = [cls for cls in picking if any(values.get(f) for f in cls.flags)]
    if len(chosen) > 1:
        a, b = ("/".join(f"`--{f}`" for f in cls.flags) for cls in chosen[:2])
        raise ConfigError(f"Can't give both {a} and {b}")


# --- the formats -----------------------------------------------------------------------------
# Prompts, completions and texts are tokenized a batch at a time (one call into the Rust
# tokenizer); the ids are the same as one call per row. eos is read once per batch: each
# attribute read goes through the tokenizer's __getattr__.


@register
class Chat(Format):
    """Chat messages rendered by the tokenizer's chat template; only assistant turns trained on."""

    name = "chat"
    flags = ("messages_column",)
    selected_by = "messages_column"
    empty_rows = "chats with no assistant turn"

    def check(self, ds) -> None:
        column = self.values["messages_column"]
        if len(ds):
            messages(ds[0][column], column)  # the first row's shape; later ones fail in tokenizing

    def check_tokenizer(self, tokenizer) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                "--messages_column: the tokenizer has no chat template "
                "(pass --tokenizer_name with one)"
            )

    def encode(self, batch: dict[str, list], tokenizer, max_len: int) -> list[dict[str, list[int]]]:
        column = self.values["messages_column"]
        return [encode_chat(tokenizer, messages(m, column), max_len) for m in batch[column]]


@register
class PromptCompletion(Format):
    """A prompt and its completion; the prompt is masked from the loss."""

    name = "prompt_completion"
    flags = ("prompt_column", "completion_column")
    selected_by = "prompt_column"

    def encode(self, batch: dict[str, list], tokenizer, max_len: int) -> list[dict[str, list[int]]]:
        eos = tokenizer.eos_token_id
        prompts = _batch_ids(tokenizer, batch[self.values["prompt_column"]], True)
        completions = _batch_ids(tokenizer, batch[self.values["completion_column"]], False)
        return [_prompt_completion(eos, p, c, max_len) for p, c in zip(prompts, completions)]


@register
class Text(Format):
    """Plain text, every token trained on."""

    name = DEFAULT
    flags = ("text_column",)

    def encode(self, batch: dict[str, list], tokenizer, max_len: int) -> list[dict[str, list[int]]]:
        eos = tokenizer.eos_token_id
        texts = _batch_ids(tokenizer, batch[self.values["text_column"]], True)
        return [_text(eos, ids, max_len) for ids in texts]


# --- encoding one row ------------------------------------------------------------------------


def _batch_ids(tokenizer, texts: list, special: bool) -> list[list[int]]:
    return tokenizer([str(t or "") for t in texts], add_special_tokens=special)["input_ids"]


def _ids(tokenizer, text: str, special: bool) -> list[int]:
    return tokenizer(text, add_special_tokens=special)["input_ids"]


def _with_eos(eos: int | None, ids: list[int]) -> list[int]:
    return ids + [eos] if eos is not None and (not ids or ids[-1] != eos) else ids


def encode_text(tokenizer, text: Any, max_len: int) -> dict:
    return _text(tokenizer.eos_token_id, _ids(tokenizer, str(text or ""), True), max_len)


def _text(eos: int | None, ids: list[int], max_len: int) -> dict:
    ids = _with_eos(eos, ids)[:max_len]
    return {"input_ids": ids, "labels": list(ids)}


def encode_prompt_completion(tokenizer, prompt: Any, completion: Any, max_len: int) -> dict:
    return _prompt_completion(
        tokenizer.eos_token_id,
        _ids(tokenizer, str(prompt or ""), True),
        _ids(tokenizer, str(completion or ""), False),
        max_len,
    )


def _prompt_completion(eos: int | None, p: list[int], c: list[int], max_len: int) -> dict:
    if p and p[-1] == eos:
        p = p[:-1]  # tokenizers that append eos themselves: eos belongs after the completion
    c = _with_eos(eos, c)
    ids = (p + c)[:max_len]
    labels = ([IGNORE] * len(p) + c)[:max_len]
    return {"input_ids": ids, "labels": labels}


def messages(value: Any, column: str, flag: str | None = "messages_column") -> list[dict]:
    """A row's conversation: a list of {"role", "content"} messages (CSV and some exports carry it
    as a JSON string). Anything else is bad input naming the column (and ``flag``, the flag that
    named it, if one did), not a traceback from the template."""
    messages = value
    if isinstance(value, str):
        try:
            messages = json.loads(value)
        except ValueError:
            messages = None
    if not isinstance(messages, (list, tuple)) or not all(
        isinstance(m, dict) and "role" in m and "content" in m for m in messages
    ):
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise ConfigError(
            f"{f'--{flag}: ' if flag else ''}column '{column}' must hold lists of "
            f'{{"role", "content"}} messages, found {shown}'
        )
    return list(messages)


def encode_chat(tokenizer, messages: list[dict], max_len: int) -> dict:
    """Render with the chat template; train only on the assistant turns.

    Each assistant turn's span is the text between the render of the conversation before it
    (with the generation prompt) and the render including it; tokens whose characters start in
    such a span are labelled, the rest are masked.
    """

    def render(msgs: list[dict], gen: bool) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    full = render(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m.get("role") == "assistant":
            start = len(render(messages[:i], True)) if i else 0
            spans.append((start, len(render(messages[: i + 1], False))))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    labels = [
        tok if any(s <= off[0] < e for s, e in spans) else IGNORE
        for tok, off in zip(ids, enc["offset_mapping"])
    ]
    return {"input_ids": ids[:max_len], "labels": labels[:max_len]}
