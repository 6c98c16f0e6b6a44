"""finetune.data.formats: the flags pick one format; the cache key and the config-file merge follow
the registry, so a format added there cannot reuse another's tokenized cache."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from finetune import run_config
from finetune.cli import parse_train_args
from finetune.config import ConfigError, DataArgs
from finetune.data import cache, formats
from finetune.modeling import load_tokenizer

CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(parse_train_args([]).model)


@pytest.fixture
def data(tmp_path) -> Path:
    path = tmp_path / "d.jsonl"
    rows = [
        {"text": f"row {i}", "body": f"other {i}", "q": f"q {i}", "a": f"a {i}", "messages": CHAT}
        for i in range(20)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _key(tok, data: Path, *flags: str, data_args: type[DataArgs] | None = None, **extra) -> str:
    cfg = parse_train_args(["--train_file", str(data), "--max_seq_length", "32", *flags])
    if data_args is not None:  # a flag DataArgs lacks: the same run, with that field added
        cfg = dataclasses.replace(cfg, data=data_args(**dataclasses.asdict(cfg.data), **extra))
    return cache.fingerprint(cfg, tok)


@pytest.mark.parametrize(
    "args, name",
    [
        (DataArgs(), "text"),
        (DataArgs(text_column="body"), "text"),
        (DataArgs(prompt_column="q", completion_column="a"), "prompt_completion"),
        (DataArgs(messages_column="messages"), "chat"),
        (DataArgs(messages_column="messages", prompt_column="q", completion_column="a"), "chat"),
    ],
)
def test_choose_picks_the_format_from_the_flags(args, name):
    fmt = formats.choose(args)
    assert (fmt.name, type(fmt)) == (name, formats.FORMATS[name])
    assert set(fmt.values) == set(fmt.flags)


def test_the_formats_columns_are_named_by_their_flags():
    assert formats.choose(DataArgs(text_column="body")).columns == {"text_column": "body"}
    assert formats.choose(DataArgs(prompt_column="q", completion_column="a")).columns == {
        "prompt_column": "q",
        "completion_column": "a",
    }
    assert formats.choose(DataArgs(messages_column="m")).columns == {"messages_column": "m"}


def test_a_changed_format_is_a_miss(tok, data):
    keys = {
        _key(tok, data),
        _key(tok, data, "--prompt_column", "q", "--completion_column", "a"),
        _key(tok, data, "--messages_column", "messages"),
    }
    assert len(keys) == 3


@pytest.mark.parametrize(
    "base, changed",
    [
        (["--text_column", "text"], ["--text_column", "body"]),
        (
            ["--prompt_column", "q", "--completion_column", "a"],
            ["--prompt_column", "text", "--completion_column", "a"],
        ),
        (["--messages_column", "messages"], ["--messages_column", "text"]),
    ],
)
def test_a_changed_flag_of_the_format_is_a_miss(tok, data, base, changed):
    assert _key(tok, data, *base) != _key(tok, data, *changed)


def test_another_formats_flag_is_not_in_the_key(tok, data):
    """--text_column means nothing to a prompt+completion run: changing it rebuilds nothing."""
    pc = ["--prompt_column", "q", "--completion_column", "a"]
    assert _key(tok, data, *pc) == _key(tok, data, *pc, "--text_column", "body")


# --- a format added to the registry ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _ShoutArgs(DataArgs):
    shout_column: str | None = None


class _Shout(formats.Format):
    """A throwaway format: the text upper-cased. Its flag names the same column a text run reads,
    so only its name and its own flag can tell its tokens from the text format's."""

    name = "shout"
    flags = ("shout_column",)
    selected_by = "shout_column"

    def encode(self, batch, tokenizer, max_len):
        column = self.values["shout_column"]
        return [formats.encode_text(tokenizer, str(t).upper(), max_len) for t in batch[column]]


@pytest.fixture
def shout(monkeypatch):
    monkeypatch.setitem(formats.FORMATS, _Shout.name, _Shout)
    return _Shout


def test_a_registered_format_is_chosen_by_its_flag(shout):
    assert isinstance(formats.choose(_ShoutArgs(shout_column="text")), shout)
    assert formats.choose(_ShoutArgs()).name == "text"


def test_a_registered_format_is_keyed_by_its_name_and_its_own_flags(tok, data, shout):
    """Fails if the fingerprint hashes a fixed list of flags instead of the chosen format's."""
    text = _key(tok, data, data_args=_ShoutArgs)
    shouted = _key(tok, data, data_args=_ShoutArgs, shout_column="text")
    assert shouted != text, "a new format reused the text format's cache"
    assert _key(tok, data, data_args=_ShoutArgs, shout_column="body") != shouted, (
        "the new format's flag is not in the key"
    )
    assert _key(tok, data, data_args=_ShoutArgs, shout_column="text") == shouted


def test_a_registered_format_is_tokenized_through_its_encode(tok, tmp_path, shout):
    from finetune.data import load_raw, tokenize

    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(3)))
    args = _ShoutArgs(train_file=str(path), shout_column="text", validation_split_percentage=0)
    train, _ = load_raw(args, seed=0)
    assert tokenize(train, tok, args, 32)[:]["input_ids"] == [
        formats.encode_text(tok, f"ROW {i}", 32)["input_ids"] for i in range(3)
    ]
    with pytest.raises(ConfigError, match="--shout_column: no column 'nope'"):
        load_raw(_ShoutArgs(train_file=str(path), shout_column="nope"), seed=0)


def test_a_registered_formats_flags_are_checked_with_no_other_code_changed(shout):
    """resolve's flag checks come from the registry: the new format's flag excludes the others'."""
    v = {"messages_column": None, "prompt_column": None, "completion_column": None}
    v |= {"text_column": "text", "shout_column": "text"}
    formats.check_flags(v)
    with pytest.raises(
        ConfigError, match=r"both `--prompt_column`/`--completion_column` and `--shout"
    ):
        formats.check_flags(v | {"prompt_column": "q", "completion_column": "a"})
    with pytest.raises(
        ConfigError, match="`--prompt_column` and `--completion_column` go together"
    ):
        formats.check_flags(v | {"shout_column": None, "completion_column": "a"})


# --- config files: a format on the command line replaces the file's ----------------------------


def test_the_formats_that_exclude_each_other_are_the_ones_a_flag_picks():
    pair = {"chosen_column", "rejected_column", "max_prompt_length"}
    pairs = [
        ({"messages_column"}, {"prompt_column", "completion_column"}),
        ({"messages_column"}, pair),
        ({"prompt_column", "completion_column"}, pair),
    ]
    assert formats.exclusive_flags() == pairs


@pytest.mark.parametrize(
    "from_file, given, kept",
    [
        ({"prompt_column": "q", "completion_column": "a"}, {"messages_column": "m"}, {}),
        ({"messages_column": "m"}, {"prompt_column": "q", "completion_column": "a"}, {}),
        # text_column has a default: it picks no format, so the file's chat format stays
        ({"messages_column": "m"}, {"text_column": "body"}, {"messages_column": "m"}),
        ({"text_column": "body"}, {"messages_column": "m"}, {"text_column": "body"}),
    ],
)
def test_a_config_files_format_gives_way_to_the_command_lines(from_file, given, kept):
    assert run_config.overridden(from_file, given) == kept


def test_a_registered_format_excludes_the_others_in_a_config_file(shout):
    assert run_config.overridden({"shout_column": "s"}, {"messages_column": "m"}) == {}
    from_file = {"prompt_column": "q", "completion_column": "a"}
    assert run_config.overridden(from_file, {"shout_column": "s"}) == {}
