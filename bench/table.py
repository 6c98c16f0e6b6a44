"""Render bench/results/latest.json (bench/run_all.py) as markdown, into docs/BENCHMARKS.md and \
README.md.

    .venv/bin/python bench/table.py [bench/results/latest.json] [--print] [--check]

Rewrites what lies between ``<!-- bench:begin -->`` and ``<!-- bench:end -->`` in both files (the
markers must be there). docs/BENCHMARKS.md gets the run's machine, versions and date lines, then
the table of measures: one row per measure (and sub-measure) with what it measures, its goal, the
last figure (ratio = ours / baseline), whether it met the goal, the machine and date it was
measured on, and the command that reruns it. The README gets one line for the run and a compact
table (measure, what, ours, baseline, baseline name, ratio, goal, met). ``--print`` prints the
BENCHMARKS.md block instead of writing; ``--check`` exits 1 when the files do not hold what the
JSON renders to. bench/run_all.py calls ``update_docs`` at the end of a full run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
DOCS = (REPO / "docs" / "BENCHMARKS.md", REPO / "README.md")


def num(x: float | bool | None) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return str(x)
    ax = abs(x)
    if ax == 0:
        return "0"
    if ax >= 1000:
        return f"{x:,.0f}"
    if ax >= 100:
        return f"{x:.0f}"
    if ax >= 10:
        return f"{x:.1f}"
    if ax >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}" if ax >= 0.01 else f"{x:.2g}"


def goal(text: str) -> str:
    return text.replace(">=", "≥").replace("<=", "≤")


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def rows(result: dict) -> list[tuple[str, dict]]:
    out = []
    for key in sorted(
        (k for k in result if k[:1] == "P" and k[1:].isdigit()), key=lambda k: int(k[1:])
    ):
        out.append((key, result[key]))
        for sub, e in (result[key].get("sub") or {}).items():
            out.append((sub, e))
    return out


def table(result: dict) -> str:
    lines = [
        "| measure | what | ours | baseline | baseline is | ratio | goal | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, e in rows(result):
        if "error" in e:
            lines.append(
                f"| {key} | {_cell(e.get('what', ''))} | – | – | – | – | "
                f"{goal(e.get('goal', ''))} | {'not run' if e.get('skipped') else 'error'}: "
                f"{_cell(e['error'].splitlines()[0][:160])} |"
            )
            continue
        met = "yes" if e["met"] else ("no" if e["met"] is not None else "–")
        unit = e.get("unit", "")
        lines.append(
            f"| {key} | {_cell(e['what'])} | {num(e['ours'])} {_cell(unit)} | "
            f"{num(e['baseline'])} | {_cell(e['baseline_name'])} | **{num(e['ratio'])}** | "
            f"{goal(e['goal'])} | {met} |"
        )
    return "\n".join(lines)


def measured_on(result: dict) -> str:
    """The machine and date of a run, short enough for a table cell."""
    m = result["machine"]
    return f"{m['cores']} × {m['cpu_model']}, {m['accelerator']}, {result['date'][:10]}"


def measures_table(result: dict) -> str:
    """docs/BENCHMARKS.md's table: what each measure is, its goal, its last figure, where and
    when it was measured, and how to rerun it."""
    lines = [
        "| measure | what it measures | goal | last figure (ours / baseline) | met "
        "| measured on | rerun |",
        "|---|---|---|---|---|---|---|",
    ]
    where = _cell(measured_on(result))
    for key, e in rows(result):
        rerun = f"`bench/run_all.py --only {key}`"
        if "error" in e:
            why = _cell(e["error"].splitlines()[0][:160])  # a skipped one says "not run: …"
            lines.append(
                f"| {key} | {_cell(e.get('what', ''))} | {goal(e.get('goal', ''))} | "
                f"{why if e.get('skipped') else 'error: ' + why} | – | {where} | {rerun} |"
            )
            continue
        met = "yes" if e["met"] else ("no" if e["met"] is not None else "–")
        figure = (
            f"**{num(e['ratio'])}** = {num(e['ours'])} / {num(e['baseline'])} "
            f"{_cell(e.get('unit', ''))}; baseline: {_cell(e['baseline_name'])}"
        )
        lines.append(
            f"| {key} | {_cell(e['what'])} | {goal(e['goal'])} | {figure} | {met} | {where} | "
            f"{rerun} |"
        )
    return "\n".join(lines)


def header(result: dict, short: bool = False) -> str:
    m, v = result["machine"], result["versions"]
    disk = m.get("bench_dir_disk", {})
    where = f"{disk.get('fstype', '?')} on {disk.get('device', '?')}" + (
        ""
        if disk.get("rotational") is None
        else (", rotational" if disk["rotational"] else ", non-rotational")
    )
    commit = (v.get("finetune_commit") or "?")[:10] + (
        " + uncommitted changes" if v.get("finetune_dirty") else ""
    )
    total = result.get("total_wall_s")
    machine = f"{m['cores']} × {m['cpu_model']}, {m['ram_gib']} GiB RAM, {m['accelerator']}" + (
        f", {m['virtualization']} guest"
        if m.get("virtualization") and m["virtualization"] != "none"
        else ""
    )
    if short:
        return (
            f"`make bench`, {result['date'][:10]}, finetune {commit}: {machine}; "
            f"bench dir on {where}; "
            f"page cache warm; {num(total / 60) if total else '?'} min in all."
        )
    lines = [
        f"- **Run:** {result['date']} (`{result.get('command', 'bench/run_all.py')}`, "
        f"mode {result.get('mode')}), "
        f"{num(total / 60) if total else '?'} min in all",
        f"- **Machine:** {machine}; load average {m.get('loadavg_at_start')} at the start, "
        f"{m.get('loadavg_at_end')} at the end",
        f"- **Bench directory:** `{disk.get('path')}`, {where}"
        + (f", {disk['size_gb']} GB" if "size_gb" in disk else ""),
        f"- **Versions:** finetune {commit}, Python {v.get('python')}, torch {v.get('torch')}, "
        f"deepspeed {v.get('deepspeed')}, transformers {v.get('transformers')}, "
        f"datasets {v.get('datasets')}",
        f"- **Page cache:** {result.get('page_cache', 'warm')}",
    ]
    return "\n".join(lines)


def block(result: dict, short: bool) -> str:
    """The README's block (``short``: one line and the compact table) or BENCHMARKS.md's."""
    if short:
        return f"{header(result, short=True)}\n\n{table(result)}\n"
    return f"{header(result)}\n\n{measures_table(result)}\n"


def replace_block(text: str, new: str, path: Path) -> str:
    if BEGIN not in text or END not in text:
        raise ValueError(f"{path}: no {BEGIN} … {END} markers")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{new}{END}{tail}"


def update_docs(result: dict, paths: tuple[Path, ...] = DOCS, write: bool = True) -> list[Path]:
    """Rewrite the marked block of each file; the files that changed (or would)."""
    changed = []
    for path in paths:
        text = path.read_text()
        new = replace_block(text, block(result, short=path.name == "README.md"), path)
        if new != text:
            changed.append(path)
            if write:
                path.write_text(new)
    return changed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="?", default=str(REPO / "bench" / "results" / "latest.json"))
    ap.add_argument(
        "--print", action="store_true", help="print the block instead of writing the files"
    )
    ap.add_argument(
        "--check", action="store_true", help="exit 1 if the files are not up to date with the JSON"
    )
    a = ap.parse_args()
    result = json.loads(Path(a.json).read_text())
    if a.print:
        print(block(result, short=False))
        return 0
    changed = update_docs(result, write=not a.check)
    for p in changed:
        print(("out of date: " if a.check else "updated ") + str(p))
    return 1 if a.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
