"""The fault-site registry: every site the package names is registered, tested, and vice versa;
the FINETUNE_FAULT parser and ``fault_point`` (no processes)."""

from __future__ import annotations

import errno
import re
from pathlib import Path

import pytest

from finetune.io import faults, seams
from finetune.io.faults import (
    HANG,
    KINDS,
    SITES,
    FaultSpecError,
    InjectedFault,
    fault_point,
    parse,
)

from harness import (
    EXPECTED,
    EXPORT,
    EXPORT_SAMPLE,
    HANG_SAMPLE,
    HANG_SITES,
    REMOTE,
    long_cases,
    sampled_cases,
)

PACKAGE = Path(faults.__file__).resolve().parents[1]
CALL = re.compile(r"""fault_point\(\s*["']([^"']+)["']""")


def _sites_in_code() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "faults.py":
            continue
        text = path.read_text()
        for name in CALL.findall(text):
            found.setdefault(name, []).append(str(path.relative_to(PACKAGE.parent)))
        # Every call names its site with a literal, or this test could not see it.
        assert text.count("fault_point(") == len(CALL.findall(text)), path
    return found


def test_every_site_in_the_code_is_registered_and_every_registered_site_is_in_the_code():
    in_code = _sites_in_code()
    assert sorted(set(in_code) - set(SITES)) == [], (
        "fault_point() names a site missing from faults.SITES"
    )
    assert sorted(set(SITES) - set(in_code)) == [], "faults.SITES lists a site no code calls"


def test_the_sweep_knows_every_site():
    """A new site cannot be forgotten: the sweep has its documented outcome, the long form runs it
    on every rank that reaches it in every kind, and the sample covers it."""
    assert set(EXPECTED) | set(EXPORT) | set(REMOTE) == set(SITES)
    assert not set(EXPECTED) & set(EXPORT) and not (set(EXPECTED) | set(EXPORT)) & set(REMOTE)
    assert all(set(codes) == set(KINDS) for codes in EXPORT.values()) and set(EXPORT_SAMPLE) == set(
        EXPORT
    )
    sampled = [f for case in sampled_cases() for f in case.faults]
    assert {f.site for f in sampled} == set(EXPECTED)
    assert {f.kind for f in sampled} == {*KINDS, HANG}
    assert set(HANG_SAMPLE) <= set(HANG_SITES) <= set(EXPECTED)
    assert {f.rank for f in sampled} >= {0, 1}
    assert any(case.nprocs == 4 for case in sampled_cases())
    assert set(sampled_cases()) <= set(long_cases())
    singles = [
        case.faults[-1]
        for case in long_cases()
        if case.nprocs == 2 or EXPECTED[case.faults[-1].site].scenario == "reshape"
    ]
    for name, site in EXPECTED.items():
        assert {f.rank for f in singles if f.site == name} == (
            {0} if site.reached_by == "leader" else {0, 1}
        ), name
        hang = {HANG} if name in HANG_SITES else set()  # the sites polled with a deadline
        assert {f.kind for f in singles if f.site == name} == set(KINDS) | hang, name


def test_reliability_md_lists_every_site():
    doc = (PACKAGE.parent / "docs" / "RELIABILITY.md").read_text()
    assert [name for name in SITES if f"| `{name}` |" not in doc] == []


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("save.fsync:1", [("save.fsync", 1, None, "eio")]),
        ("save.fsync:1:4", [("save.fsync", 1, 4, "eio")]),
        ("save.fsync:0:kill", [("save.fsync", 0, None, "kill")]),
        (
            "save.fsync:0:3:enospc, commit.rename:0:error",
            [("save.fsync", 0, 3, "enospc"), ("commit.rename", 0, None, "error")],
        ),
        ("", []),
        # a site's former name still selects it
        (
            "layout.tidy:0, manager.history:1:kill",
            [
                ("staging.tidy", 0, None, "eio"),
                ("retention.history", 1, None, "kill"),
            ],
        ),
        ("layout.probe:1", [("sharing.probe", 1, None, "eio")]),
    ],
)
def test_parse(spec, expected):
    assert [(f.site, f.rank, f.step, f.kind) for f in parse(spec)] == expected


@pytest.mark.parametrize(
    "spec,why",
    [
        ("save.fsinc:1", "no fault site 'save.fsinc'"),
        ("save.fsync", "expected <site>:<rank>"),
        ("save.fsync:one", "invalid literal"),
        ("save.fsync:1:2:boom", "no fault kind 'boom'"),
        ("save.fsync:1:2:eio:extra", "expected <site>:<rank>"),
    ],
)
def test_a_malformed_spec_names_the_variable(spec, why):
    with pytest.raises(FaultSpecError, match=seams.FAULT) as e:
        parse(spec)
    assert why in str(e.value)


def test_fault_point_fires_only_for_its_site_rank_and_step(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv(seams.FAULT, "save.fsync:1:4")
    fault_point("save.fsync", 3)
    fault_point("save.snapshot", 4)
    with pytest.raises(OSError) as e:
        fault_point("save.fsync", 4)
    assert e.value.errno == errno.EIO and "save.fsync on rank 1 at step 4" in str(e.value)
    assert (
        "FINETUNE_FAULT: injecting eio at save.fsync on rank 1 at step 4 (t="
        in capsys.readouterr().err
    )
    monkeypatch.setenv("RANK", "0")
    fault_point("save.fsync", 4)


def test_fault_kinds(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)  # a plain process is rank 0
    monkeypatch.setenv(seams.FAULT, "commit.rename:0:enospc")
    with pytest.raises(OSError) as e:
        fault_point("commit.rename", 7)  # no step in the spec: every call
    assert e.value.errno == errno.ENOSPC
    monkeypatch.setenv(seams.FAULT, "commit.rename:0:error")
    with pytest.raises(InjectedFault):
        fault_point("commit.rename")
    assert not issubclass(InjectedFault, (OSError, ValueError))


def test_a_kill_is_sigkill(monkeypatch):
    killed = []

    def dying(seconds):
        raise SystemExit("killed")

    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    monkeypatch.setattr(faults.time, "sleep", dying)
    monkeypatch.setenv(seams.FAULT, "lease.acquire:0:kill")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit):
        fault_point("lease.acquire")
    assert killed == [(faults.os.getpid(), faults.signal.SIGKILL)]


def test_without_the_variable_nothing_happens_and_unknown_names_are_caught(monkeypatch):
    monkeypatch.delenv(seams.FAULT, raising=False)
    fault_point("no.such.site")  # free when no fault is asked for
    monkeypatch.setenv(seams.FAULT, "save.fsync:5")
    with pytest.raises(FaultSpecError, match="no.such.site"):
        fault_point("no.such.site")
