"""`finetune ls OUT`: output dirs built with real manifests (OutputDir.commit, as a save does) and
a real metrics.jsonl; no DeepSpeed launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone

import pytest
import torch

from finetune import cli, listing
from finetune.checkpoint_format.manifest import MANIFEST, read_manifest
from finetune.checkpoint_format.outdir import STAGING, OutputDir
from finetune.io.durable import hash_file

WORLD = 2
KEYS = {
    "tag",
    "step",
    "committed_at",
    "bytes",
    "world_size",
    "sequence_parallel_size",
    "train_loss",
    "eval_loss",
    "consolidated",
    "status",
    "problems",
    "latest",
    "writer_s",
}


def commit(
    out,
    step: int,
    world: int = WORLD,
    ranks: list[int] | None = None,
    consolidated: bool = False,
    **identity,
):
    """A checkpoint committed the way a save commits it: files staged, manifest, rename,
    `latest`."""
    storage, tag = OutputDir(out), f"global_step{step}"
    staged = storage.root / STAGING / tag
    staged.mkdir(parents=True)
    for r in range(world) if ranks is None else ranks:
        for name in (
            f"zero_pp_rank_{r}_mp_rank_00_model_states.pt",
            f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
            f"rng_state_{r}.pt",
        ):
            # verify --verify reads the opcodes
            torch.save({"step": step, "data": torch.arange(64)}, staged / name)
    (staged / "config.json").write_text("{}")
    (staged / "trainer_state.json").write_text(
        json.dumps({"global_step": step, "world_size": world})
    )
    files = {p.name: hash_file(p) for p in staged.iterdir()}
    storage.commit(
        tag, files, world, {}, ranks, {"commit_seq": step, "consolidated": consolidated, **identity}
    )
    return out / tag


def write_metrics(out, rows: list[dict], torn: bool = False) -> None:
    lines = [json.dumps(r) for r in rows] + (['{"step": 9, "lo'] if torn else [])
    (out / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))


@pytest.fixture
def run(tmp_path):
    """An output dir of a finished run: checkpoints at steps 2, 4, 10 (latest), metrics logged
    at 3, 4 (twice: a resumed run re-logged it), 8 and an eval at 4."""
    out = tmp_path / "out"
    for step in (2, 4, 10):
        commit(out, step)
    write_metrics(
        out,
        [
            {"step": 3, "loss": 3.0},
            {"step": 4, "loss": 9.0},
            {"step": 4, "eval_loss": 2.5},
            {"step": 4, "loss": 2.0},
            {"step": 8, "loss": 1.0},
        ],
    )
    return out


def ls(capsys, *argv) -> tuple[int, str]:
    code = listing.main([str(a) for a in argv])
    return code, capsys.readouterr().out


def rows_of(text: str) -> dict[str, str]:
    """Table lines by step (the second column)."""
    found = {}
    for line in text.splitlines():
        cells = line[1:].split()
        if cells and cells[0].isdigit():
            found[cells[0]] = line
    return found


def test_rows_are_sorted_by_step_and_latest_is_marked(run, capsys):
    code, out = ls(capsys, run)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:2] == ["step", "committed"]
    rows = rows_of(out)
    assert list(rows) == ["2", "4", "10"]
    assert [r.startswith("*") for r in rows.values()] == [False, False, True]
    assert all("ok (sizes)" in r and "  2  " in r for r in rows.values())  # world size 2
    disk = " ".join(
        line.strip()
        for line in lines[next(i for i, x in enumerate(lines) if x.startswith("disk: ")) :]
    )
    assert "3 checkpoint folder(s) (3 committed);" in disk and f"free on {run}'s filesystem" in disk
    assert all(len(line) <= listing.WIDTH for line in lines)


def test_losses_are_the_rows_at_or_last_before_each_step(run):
    found = {c.step: c for c in listing.collect(run).checkpoints}
    assert (found[2].train_loss, found[2].eval_loss) == (None, None)  # nothing logged by step 2
    # the later of two rows at one step
    assert (found[4].train_loss, found[4].eval_loss) == (2.0, 2.5)
    assert (found[10].train_loss, found[10].train_loss_step, found[10].eval_loss_step) == (
        1.0,
        8,
        4,
    )
    cells = listing._cells(found[10])
    assert cells[5:7] == ["1.0000@8", "2.5000@4"] and listing._cells(found[2])[5:7] == ["-", "-"]


def test_each_checkpoint_shows_the_seconds_its_files_took_to_write(run, capsys):
    """From the checkpoint events a run appends to events.jsonl: the last one of a tag wins (a
    later save of the same step is the folder there), an event without the field shows "-"."""
    events = [
        {"event": "checkpoint", "step": 2, "tag": "global_step2"},  # before the field existed
        {"event": "checkpoint", "step": 4, "tag": "global_step4", "writer_s": 9.0},
        {"event": "save_behind", "step": 4, "writer_s": 5.0},  # not a checkpoint's
        {"event": "checkpoint", "step": 4, "tag": "global_step4", "writer_s": 12.34},
        # the writer's own seconds, pacing excluded, where the event has them
        {
            "event": "checkpoint",
            "step": 10,
            "tag": "global_step10",
            "writer_s": 7.0,
            "writer_busy_s": 0.5,
        },
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + '{"ev')
    found = {c.step: c.writer_s for c in listing.collect(run).checkpoints}
    assert found == {2: None, 4: 12.34, 10: 0.5}
    code, out = ls(capsys, run)
    header = out.splitlines()[0]
    assert code == 0 and " write " in header
    at = header.index(" write ") + len(" write")  # right-aligned under its header
    rows = rows_of(out)
    assert [rows[s][:at].split()[-1] for s in ("2", "4", "10")] == ["-", "12.3s", "0.5s"]


def test_json_is_one_object_with_the_documented_keys(run, capsys):
    code, out = ls(capsys, run, "--json")
    data = json.loads(out)  # nothing else on stdout
    assert code == 0
    assert {
        "output_dir",
        "latest",
        "checkpoints",
        "notes",
        "free_bytes",
        "checkpoint_bytes",
    } <= set(data)
    assert data["latest"] == "global_step10" and data["notes"] == []
    assert [c["step"] for c in data["checkpoints"]] == [2, 4, 10]
    assert all(KEYS <= set(c) for c in data["checkpoints"])
    assert [c["latest"] for c in data["checkpoints"]] == [False, False, True]
    assert data["checkpoint_bytes"] == sum(c["bytes"] for c in data["checkpoints"]) > 0
    assert data["free_bytes"] > 0 and data["checkpoints"][0]["consolidated"] is False
    assert data["checkpoints"][1]["bytes"] == read_manifest(run / "global_step4")["total_bytes"]


def test_committed_at_is_recorded_in_the_manifest_in_utc(run):
    stamp = datetime.fromisoformat(read_manifest(run / "global_step10")["committed_at"])
    assert stamp.utcoffset() == timedelta(0) and abs(
        datetime.now(timezone.utc) - stamp
    ) < timedelta(minutes=5)
    assert listing.collect(run).checkpoints[-1].committed_at == stamp.isoformat()


def test_older_manifests_fall_back_to_the_manifests_mtime(run):
    path = run / "global_step2" / MANIFEST
    manifest = read_manifest(run / "global_step2")
    del manifest["committed_at"]
    path.write_text(json.dumps(manifest))
    when = datetime(2024, 3, 1, 12, 30, tzinfo=timezone.utc)
    os.utime(path, (when.timestamp(), when.timestamp()))
    assert listing.collect(run).checkpoints[0].committed_at == "2024-03-01T12:30:00+00:00"


def test_verify_finds_a_flipped_byte_that_sizes_miss_and_still_exits_0(run, capsys):
    path = run / "global_step4" / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    assert "ok (sizes)" in rows_of(ls(capsys, run)[1])["4"]
    code, out = ls(capsys, run, "--verify")
    rows = rows_of(out)
    assert code == 0
    assert rows["4"].endswith("  DAMAGED (below)")  # too long for the table: in full below it
    assert "ok (checksums)" in rows["2"] and "ok (checksums)" in rows["10"]
    below = out.splitlines()
    assert (
        below[below.index("global_step4: 1 problem(s)") + 1]
        == "  - zero_pp_rank_1_mp_rank_00_model_states.pt: checksum mismatch (corrupted)"
    )
    assert all(len(line) <= listing.WIDTH for line in rows.values())
    damaged = json.loads(ls(capsys, run, "--verify", "--json")[1])["checkpoints"][1]
    assert damaged["status"].startswith("DAMAGED") and "checksum mismatch" in damaged["problems"][0]


def test_leftovers_uncommitted_folders_and_torn_metrics_are_noted(run, capsys):
    (run / STAGING / "global_step12").mkdir(parents=True)
    (run / STAGING / "global_step12" / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(
        b"x" * 10
    )
    (run / "global_step6").mkdir()
    (run / "global_step6" / "rng_state_0.pt").write_bytes(b"x" * 100)
    write_metrics(run, [{"step": 4, "loss": 2.0}], torn=True)
    code, out = ls(capsys, run)
    assert code == 0
    assert rows_of(out)["6"].endswith("  uncommitted")
    notes = [line for line in out.splitlines() if line.startswith("note: ")]
    assert any(
        n.startswith(f"note: {STAGING}/global_step12: left by a crashed save") for n in notes
    )
    assert any(n.startswith("note: global_step6: no readable manifest.json") for n in notes)
    assert any("metrics.jsonl: 1 torn line(s)" in n for n in notes)
    data = listing.collect(run)
    assert [c.step for c in data.checkpoints] == [2, 4, 6, 10] and data.checkpoints[2].bytes == 100


def test_set_aside_checkpoints_are_noted_with_their_size(run):
    (run / ".abandoned").mkdir()
    os.rename(run / "global_step4", run / ".abandoned" / "global_step4-resumed")
    found = listing.collect(run)
    assert [c.step for c in found.checkpoints] == [2, 10]
    assert any(n.startswith(".abandoned: 1 checkpoint(s) set aside") for n in found.notes)


def test_node_local_checkpoints_show_the_ranks_held_here(tmp_path, capsys):
    out = tmp_path / "out"
    commit(out, 5, world=4, ranks=[2, 3])
    code, text = ls(capsys, out, "--verify")
    assert code == 0
    row = rows_of(text)["5"]
    assert " 2/4 " in row and "ok (checksums)" in row
    assert "rank(s) 2-3 of 4" in text


def test_the_ranks_sharing_each_row_are_shown_beside_the_world_size(tmp_path, capsys):
    out = tmp_path / "out"
    commit(out, 2)
    commit(out, 4, world=4, sequence_parallel_size=2)
    code, text = ls(capsys, out)
    rows = rows_of(text)
    assert code == 0 and " 4 sp2 " in rows["4"] and " sp" not in rows["2"]
    code, text = ls(capsys, out, "--json")
    assert [c["sequence_parallel_size"] for c in json.loads(text)["checkpoints"]] == [1, 2]


def test_a_run_without_checkpoints_lists_nothing_but_its_disk(tmp_path, capsys):
    write_metrics(tmp_path, [{"step": 1, "loss": 1.0}])
    code, out = ls(capsys, tmp_path)
    assert code == 0 and out.startswith("no checkpoints") and "0 checkpoint folder(s)" in out


@pytest.mark.parametrize("what", ["empty", "missing", "checkpoint"])
def test_not_an_output_dir_exits_2_with_one_line_naming_it(
    tmp_path, run, capsys, monkeypatch, what
):
    target = {
        "empty": tmp_path / "empty",
        "missing": tmp_path / "nope",
        "checkpoint": run / "global_step4",
    }[what]
    if what == "empty":
        target.mkdir()
    monkeypatch.setitem(cli.COMMANDS, "ls", listing.main)  # the real CLI's error path, wired or not
    assert cli.main(["ls", str(target)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith(f"finetune: error: {target}: ")


def test_unknown_flag_is_a_usage_error(run, capsys):
    with pytest.raises(SystemExit) as e:
        listing.main([str(run), "--verif"])
    # no abbreviations; a suggestion
    assert e.value.code == 2 and "--verify" in capsys.readouterr().err


@pytest.mark.skipif("ls" not in cli.COMMANDS, reason="finetune ls not wired yet")
def test_the_cli_lists_and_refuses_as_a_user_runs_it(run, tmp_path):
    def finetune(*args):
        return subprocess.run(
            [sys.executable, "-m", "finetune", "ls", *map(str, args)],
            capture_output=True,
            text=True,
            timeout=120,
        )

    listed = finetune(run, "--json")
    assert listed.returncode == 0 and json.loads(listed.stdout)["latest"] == "global_step10"
    (tmp_path / "empty").mkdir()
    refused = finetune(tmp_path / "empty")
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.strip().splitlines() == [
        f"finetune: error: {tmp_path / 'empty'}: not a finetune output dir "
        "(no checkpoints, metrics.jsonl, latest or exit_status.json)"
    ]


def test_a_malformed_manifest_is_one_damaged_row_not_a_crash(run):
    (run / "global_step2" / MANIFEST).write_text(json.dumps({"world_size": "two", "files": {}}))
    (run / "global_step4" / MANIFEST).write_text("[]")
    found = listing.collect(run).checkpoints
    assert (
        found[0].status.startswith("DAMAGED: manifest.json: malformed")
        and found[1].status == "uncommitted"
    )
    assert found[2].status == "ok (sizes)"


def test_a_cached_universal_conversion_is_noted_with_its_size(run):
    from finetune.weights.universal import write_universal_manifest

    target = run / "global_step10" / "universal" / "zero" / "w"
    target.mkdir(parents=True)
    (target / "fp32.pt").write_bytes(b"x" * 2000)
    write_universal_manifest(run / "global_step10" / "universal", None)
    assert (
        "global_step10/universal: a universal conversion (for resuming on another world size), "
        "2.0 kB; not in the sizes above" in listing.collect(run).notes
    )
