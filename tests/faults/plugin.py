"""A pytest plugin (loaded by tests/conftest.py): the fault sweep's long/sampled split and its
summary table.

``make check`` runs the sample (every site once, a few kill trials); ``make faults`` sets
FINETUNE_FAULTS_LONG=1 and runs everything marked ``faults``, including the ``faults_long`` cases.
After the run a table gives, per group, the cases, failures and the longest time from a fault (or
kill) to the last rank's exit; with FINETUNE_FAULTS_SUMMARY=<file> the same as JSON.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

LONG_ENV = "FINETUNE_FAULTS_LONG"
SUMMARY_ENV = "FINETUNE_FAULTS_SUMMARY"

_records: dict[str, dict] = {}


def pytest_collection_modifyitems(config, items):
    if os.environ.get(LONG_ENV) == "1":
        return
    long = [item for item in items if item.get_closest_marker("faults_long")]
    if long:
        config.hook.pytest_deselected(items=long)
        items[:] = [item for item in items if not item.get_closest_marker("faults_long")]


@pytest.fixture
def fault_record(request) -> dict:
    """The figures of this case for the summary table (the test adds time_to_exit_s). Carried in
    the test's report (user_properties), so the table also adds up cases run by xdist workers."""
    record = {"case": request.node.name, "group": request.node.originalname}
    request.node.user_properties.append(("fault_record", record))
    return record


def pytest_runtest_logreport(report):
    record = next((v for k, v in report.user_properties if k == "fault_record"), None)
    if record is None:
        return
    if report.when == "call" or (report.when == "setup" and not report.passed):
        _records[report.nodeid] = {
            **record,
            "outcome": report.outcome,
            "wall_s": round(report.duration, 1),
        }


def summary(records: list[dict]) -> dict:
    groups: dict[str, dict] = {}
    for rec in records:
        g = groups.setdefault(
            rec["group"], {"cases": 0, "failures": 0, "max_time_to_exit_s": 0.0, "wall_s": 0.0}
        )
        g["cases"] += 1
        g["failures"] += rec.get("outcome") != "passed"
        g["max_time_to_exit_s"] = max(g["max_time_to_exit_s"], rec.get("time_to_exit_s") or 0.0)
        g["wall_s"] = round(g["wall_s"] + rec.get("wall_s", 0.0), 1)
    total = {
        "cases": sum(g["cases"] for g in groups.values()),
        "failures": sum(g["failures"] for g in groups.values()),
        "max_time_to_exit_s": max((g["max_time_to_exit_s"] for g in groups.values()), default=0.0),
        "wall_s": round(sum(g["wall_s"] for g in groups.values()), 1),
    }
    return {
        "groups": groups,
        "total": total,
        "failed": [rec["case"] for rec in records if rec.get("outcome") != "passed"],
    }


def pytest_terminal_summary(terminalreporter):
    records = [rec for rec in _records.values() if "outcome" in rec]
    if not records:
        return
    table = summary(records)
    tr = terminalreporter
    tr.section("fault sweep")
    rows = [*table["groups"].items(), ("total", table["total"])]
    width = max(len(name) for name, _ in rows)
    tr.write_line(
        f"{'group':<{width}} {'cases':>6} {'failures':>9} {'max time to exit (s)':>21} "
        f"{'wall (s)':>9}"
    )
    for name, g in rows:
        tr.write_line(
            f"{name:<{width}} {g['cases']:>6} {g['failures']:>9} {g['max_time_to_exit_s']:>21.1f} "
            f"{g['wall_s']:>9.1f}"
        )
    for case in table["failed"]:
        tr.write_line(f"FAILED {case}")
    path = os.environ.get(SUMMARY_ENV)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({**table, "records": records}, indent=2) + "\n")
        tr.write_line(f"summary written to {path}")
