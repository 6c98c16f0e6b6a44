"""The docs agree with the code: README.md and docs/*.md name only flags and commands that exist,
their relative links resolve, the repository paths they cite exist, they cite no issue numbers,
docs/FLAGS.md is what scripts/gen_flags_doc.py generates now, and the README fits on a screen.

Fast (a few `python -m finetune CMD --help` subprocesses); no training.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from functools import cache, lru_cache
from pathlib import Path

import pytest

from conftest import REPO

DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
README_MAX_LINES = 160

# A flag as the docs write it: `--name`, `--name_with_underscores`, `--name-with-dashes` (whole, so
# `--gpus-per-node` is one flag, not `--gpus`). Placeholders such as `--no_NAME` are not matched.
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_]+(?:-[a-z0-9_]+)*(?![\w-])")

# Flags of other tools that the docs mention, each with the tool it belongs to. A flag of a file in
# this repository (scripts/launch.sh, bench/*.py, …) is also checked to appear in that file.
OTHER_TOOLS: dict[str, str] = {
    # DeepSpeed's launcher (`deepspeed …`)
    "--num_gpus": "deepspeed launcher",
    "--module": "deepspeed launcher",
    # torchrun
    "--nproc_per_node": "torchrun",
    # accelerate launch
    "--multi_gpu": "accelerate launch",
    "--num_processes": "accelerate launch",
    # SLURM: sbatch / srun / scancel
    "--gpus-per-node": "sbatch/srun",
    "--gpus-per-task": "srun",
    "--gpu-bind": "srun",
    "--ntasks-per-node": "sbatch/srun",
    "--nodes": "sbatch",
    "--requeue": "sbatch",
    "--signal": "sbatch/scancel",
    "--full": "scancel",
    # pip
    "--index-url": "pip",
    "--no-build-isolation": "pip",
    # DeepSpeed's zero_to_fp32.py
    "--safe_serialization": "DeepSpeed zero_to_fp32.py",
    # scripts/launch.sh's wrapper options (its header)
    "--launcher": "scripts/launch.sh",  # and DeepSpeed launcher's (`deepspeed --launcher openmpi`)
    "--nproc": "scripts/launch.sh",
    "--nnodes": "scripts/launch.sh",
    "--node_rank": "scripts/launch.sh",
    "--master_addr": "scripts/launch.sh",
    "--hostfile": "scripts/launch.sh",
    "--offline": "scripts/launch.sh",
    # the benchmark scripts (docs/BENCHMARKS.md)
    "--only": "bench/run_all.py",
    "--smoke": "bench/run_all.py",
    "--out": "bench/run_all.py",
    "--steps": "bench/train/train_throughput.py",
    "--wait_quiet": "bench/train/train_throughput.py",
    "--shape": "bench/train/train_throughput.py",
    "--long_rows": "bench/train/train_throughput.py",
    "--setting": "bench/train/train_throughput.py",
    "--repeats": "bench/data/data_path.py",
    "--precompute_ref": "bench/train/trl_pref_run.py",
    "--rows": "bench/data/data_path.py",
    "--finetune_src": "bench/data/data_path.py",
    "--rounds": "bench/data/packing.py",
    "--before": "bench/save/save_io.py",
    "--saves": "bench/save/save_io.py",
    "--checkpoint": "bench/remote/remote_upload.py",
}


def _load_generator():
    spec = importlib.util.spec_from_file_location(
        "gen_flags_doc", REPO / "scripts" / "gen_flags_doc.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def generator():
    """The generator, each `--help` subprocess run once per session (render and the tests share
    them)."""
    module = _load_generator()
    module.subcommand_help = lru_cache(maxsize=None)(module.subcommand_help)
    return module


@cache
def subcommand_helps() -> dict[str, str]:
    gen = generator()
    return {command: gen.subcommand_help(command) for command in gen.subcommands()}


def train_flags() -> set[str]:
    """Every option string of the training parser, hidden ones (--local_rank, --no_X) included."""
    from finetune.cli import build_train_parser

    return {s for action in build_train_parser()._actions for s in action.option_strings}


def subcommand_flags() -> set[str]:
    return {m.group(0) for text in subcommand_helps().values() for m in FLAG.finditer(text)}


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _code(text: str) -> list[str]:
    """The text of a markdown file's fenced code blocks (comments dropped) and inline code spans."""
    out = []
    for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.M | re.S):
        out += [re.sub(r"(^|\s)#.*", "", line) for line in block.splitlines()]
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.M | re.S)
    out += re.findall(r"`([^`\n]+)`", prose)
    return out


# --- (1) docs/FLAGS.md is current -------------------------------------------------------------


def test_flags_doc_is_what_the_generator_writes():
    doc = REPO / "docs" / "FLAGS.md"
    assert doc.exists(), "docs/FLAGS.md is missing: run `python scripts/gen_flags_doc.py`"
    assert doc.read_text() == generator().render(), (
        "docs/FLAGS.md is stale (a flag or its help changed): run `python scripts/gen_flags_doc.py`"
    )


def test_flags_doc_check_mode_names_the_fix(tmp_path, monkeypatch, capsys):
    gen = _load_generator()
    monkeypatch.setattr(gen, "DOC", tmp_path / "docs" / "FLAGS.md")
    monkeypatch.setattr(gen, "REPO", tmp_path)
    monkeypatch.setattr(gen, "render", lambda: "# Flags\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "FLAGS.md").write_text("# Flags, old\n")
    assert gen.main(["--check"]) == 1
    assert "python scripts/gen_flags_doc.py" in capsys.readouterr().err
    assert gen.main([]) == 0 and (tmp_path / "docs" / "FLAGS.md").read_text() == "# Flags\n"
    assert gen.main(["--check"]) == 0


def test_flags_doc_has_a_row_for_every_visible_train_flag_and_each_subcommand():
    from finetune.cli import build_train_parser

    text = (REPO / "docs" / "FLAGS.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `-")]
    for action in build_train_parser()._actions:
        if action.help == argparse.SUPPRESS:
            continue
        assert any(f"`{action.option_strings[0]}`" in row for row in rows), action.option_strings
    for command in subcommand_helps():
        assert f"## `finetune {command}`" in text, command
    # nothing of this machine
    assert "/work/" not in text and "/home/" not in text and str(REPO) not in text


# --- (2) every flag the docs mention exists ----------------------------------------------------


def test_every_flag_mentioned_in_the_docs_exists():
    known = train_flags() | subcommand_flags() | set(OTHER_TOOLS)
    unknown = {}
    for doc in DOCS:
        if doc.name == "FLAGS.md":
            continue  # generated from the parsers themselves
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for m in FLAG.finditer(line):
                if m.group(0) not in known:
                    unknown.setdefault(m.group(0), []).append(f"{_rel(doc)}:{n}")
    assert not unknown, (
        "flags in the docs that neither finetune (train or a subcommand) nor the allow-list of "
        "other tools' flags in tests/test_docs.py knows: "
        + "; ".join(f"{flag} ({', '.join(where[:3])})" for flag, where in sorted(unknown.items()))
    )


def test_allow_listed_flags_are_mentioned_and_those_of_repo_tools_exist_there():
    text = "\n".join(doc.read_text() for doc in DOCS)
    mentioned = {m.group(0) for m in FLAG.finditer(text)}
    assert not set(OTHER_TOOLS) - mentioned, (
        "allow-list entries no doc mentions any more: remove them",
        sorted(set(OTHER_TOOLS) - mentioned),
    )
    for flag, tool in OTHER_TOOLS.items():
        if not re.fullmatch(r"(bench|scripts)/\S+", tool):
            continue  # another program's flag: nothing here to look in
        path = REPO / tool
        assert path.is_file(), f"{flag}: {tool} does not exist (moved? update OTHER_TOOLS)"
        assert re.search(rf"{re.escape(flag)}\b", path.read_text()), f"{flag} is not in {tool}"


# --- (3) every `finetune COMMAND` the docs mention exists ----------------------------------------


def test_every_subcommand_mentioned_in_the_docs_exists():
    from finetune.cli import COMMANDS

    command = re.compile(r"(?<![\w./[-])finetune ([a-z][a-z_-]*)\b")
    unknown = []
    for doc in DOCS:
        for code in _code(doc.read_text()):
            unknown += [
                f"finetune {m.group(1)} ({_rel(doc)})"
                for m in command.finditer(code)
                if m.group(1) not in COMMANDS
            ]
    assert not unknown, f"commands that finetune.cli.COMMANDS does not have: {sorted(set(unknown))}"


# --- (4) the README fits on a screen (or two) ----------------------------------------------------


def test_readme_is_short():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail "
        "into docs/ and link to it"
    )


# --- (5) relative links resolve ----------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, flags=re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_relative_links_point_at_files_and_headings_that_exist():
    broken = []
    for doc in DOCS:
        text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                broken.append(f"{_rel(doc)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(
                    f"{_rel(doc)}: {target} (no heading with that anchor in {_rel(dest)})"
                )
    assert not broken, broken


def test_slugs_follow_github():
    assert slug("Shell wrapper: `scripts/launch.sh`") == "shell-wrapper-scriptslaunchsh"
    assert slug("Exit codes") == "exit-codes"
    assert slug("11. `--async_save` keeps every promise above") == (
        "11---async_save-keeps-every-promise-above"
    )


# --- (6) the docs say what is, not when it happened, and cite paths that exist -------------------

# An issue number as a doc would cite one: "issue 24", "issues 3 and 4", "(issue", "issue #12".
# History belongs in git; a doc describes the product as it is.
ISSUE = re.compile(r"\bissues? #?\d+|\(issue\b|\bissue #", re.IGNORECASE)

# A path of this repository wherever a doc cites it (prose, a code span, a link's target written
# from the root): it starts at one of these folders and runs to the next space, quote, bracket,
# comma, semicolon or colon (`tests/x.py::test_y` is tests/x.py). Placeholders and globs
# (`tests/faults/test_*.py`, `bench/<name>.py`) are not checked; relative links such as
# `../finetune/x.py` are the link test's (5).
REPO_PATH = re.compile(r"(?<![\w./-])(?:finetune|tests|bench|scripts)/[^\s`'\"()\[\],;:]*")
PLACEHOLDER = re.compile(r"[*?<>{}]")
# written by `make bench`, not part of the repository
GENERATED = ("bench/results",)


def test_the_docs_cite_no_issue_numbers() -> None:
    cited = [
        f"{_rel(doc)}:{n}: {m.group(0)!r}"
        for doc in DOCS
        for n, line in enumerate(doc.read_text().splitlines(), 1)
        for m in ISSUE.finditer(line)
    ]
    assert not cited, (
        "docs cite issue numbers (say what the product does; history belongs in git): "
        + "; ".join(cited)
    )


def repo_paths(text: str) -> list[str]:
    """The repository paths a doc's text cites, as written (a sentence's final period dropped)."""
    found = (m.group(0).rstrip(".") for m in REPO_PATH.finditer(text))
    return [p for p in found if not PLACEHOLDER.search(p)]


def test_repo_paths_are_found_in_text_and_code() -> None:
    text = (
        "`finetune/checkpoint_format/policy.py` keeps it (tests/checkpoint/test_at_rest.py).\n"
        "see tests/x.py::test_y, `bench/<name>.py`, tests/faults/test_*.py, OUT/finetune/x,\n"
        "[a](../finetune/io/faults.py) and bench/run_all.py."
    )
    assert repo_paths(text) == [
        "finetune/checkpoint_format/policy.py",
        "tests/checkpoint/test_at_rest.py",
        "tests/x.py",
        "bench/run_all.py",
    ]


def test_every_repository_path_the_docs_cite_exists() -> None:
    missing = [
        f"{_rel(doc)}:{n}: {path}"
        for doc in DOCS
        for n, line in enumerate(doc.read_text().splitlines(), 1)
        for path in repo_paths(line)
        if not path.startswith(GENERATED) and not (REPO / path).exists()
    ]
    assert not missing, f"paths cited in the docs that do not exist (moved or renamed?): {missing}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
