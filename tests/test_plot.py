"""finetune.plot: reading a run folder (metrics, events, manifests), the PNG it draws,
`finetune plot`, and the trainer's background Plotter (never blocks, never raises, one warning)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from finetune import plot
from finetune.config import ConfigError

mpimg = pytest.importorskip("matplotlib.image", reason="matplotlib is not installed")
np = pytest.importorskip("numpy")

REPO = Path(__file__).resolve().parents[1]
# tab:blue/orange/red
BLUE, ORANGE, RED = (0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E), (0xD6, 0x27, 0x28)


def train_row(step: int, loss: float) -> dict:
    return {
        "step": step,
        "epoch": step / 100,
        "loss": loss,
        "lr": 1e-3 * min(1.0, step / 50),
        "grad_norm": 1.0,
        "tokens_per_s": 9000.0 + 500 * (step % 7),
        "data_ms": 0.05,
        "samples_seen": 16 * step,
        "tokens_seen": 600 * step,
        "skipped_steps": 0,
        "loss_scale": None,
    }


def eval_row(step: int, loss: float) -> dict:
    return {"step": step, "eval_loss": loss, "eval_perplexity": 2.718**loss, "eval_tokens": 7818}


def write_run(out: Path, rows: int = 150, events: bool = True) -> Path:
    """A run of ``rows`` train rows (every 2 steps) that was preempted at step 120 and resumed from
    the checkpoint at 100 (rows 102-120 written twice), with a torn last line; checkpoints at 100
    and 200 in events.jsonl, and a manifest folder at the last step that events.jsonl lacks."""
    out.mkdir(parents=True, exist_ok=True)
    last = 2 * rows
    lines = [eval_row(0, 6.3)]
    lines += [train_row(s, 6.0 * 0.99**s + 1.0 + 0.1 * (s % 3)) for s in range(2, 121, 2)]
    # after the resume
    lines += [train_row(s, 6.0 * 0.99**s + 1.0) for s in range(102, last + 1, 2)]
    lines += [eval_row(s, 6.0 * 0.99**s + 1.1) for s in range(50, last + 1, 50)]
    text = "".join(json.dumps(r) + "\n" for r in lines) + '{"step": 9999, "loss": 1.'  # torn
    (out / "metrics.jsonl").write_text(text)
    if events:
        ev = [
            {"event": "start", "step": 0, "run_name": "synthetic", "world_size": 2},
            {"event": "checkpoint", "step": 100, "tag": "global_step100", "consolidated": False},
            {"event": "preempted", "step": 120, "signal": "SIGTERM"},
            {"event": "resume", "step": 100, "from": "global_step100"},
            {"event": "save_failed", "step": 150, "error": "disk full"},
            # step from its tag
            {"event": "checkpoint", "tag": "global_step200", "consolidated": True},
            {"event": "teleported", "step": 5},
        ]
        stamped = [{"time": "2025-01-01T00:00:00+00:00", "run_id": "r1", **e} for e in ev]
        (out / "events.jsonl").write_text(
            "".join(json.dumps(e) + "\n" for e in stamped) + "not json\n"
        )
    (out / f"global_step{last}").mkdir()
    (out / f"global_step{last}" / "manifest.json").write_text(
        json.dumps({"tag": f"global_step{last}", "files": {}})
    )
    (out / "global_step7").mkdir()  # no manifest: not committed
    return out


def pixels_near(img, rgb, tol=0.08) -> int:
    return int((np.abs(img[..., :3] - np.array(rgb) / 255).max(axis=-1) < tol).sum())


def assert_plot(path: Path) -> np.ndarray:
    img = mpimg.imread(path)
    assert img.shape[:2] == (900, 1200)  # 12x9 inches at 100 dpi
    assert img[..., :3].std() > 0.05
    assert len(np.unique((img[..., :3] * 255).astype(np.uint8).reshape(-1, 3), axis=0)) > 50
    return img


# --- reading -----------------------------------------------------------------------------------


def test_load_run_keeps_the_last_row_per_step_and_unions_checkpoints(tmp_path):
    run = plot.load_run(write_run(tmp_path / "out"))
    steps = [r["step"] for r in run.train]
    assert steps == sorted(set(steps)) and steps[0] == 2 and steps[-1] == 300 and len(steps) == 150
    # the resumed row
    assert run.train[steps.index(110)]["loss"] == pytest.approx(6.0 * 0.99**110 + 1.0)
    assert [r["step"] for r in run.evals] == [0, 50, 100, 150, 200, 250, 300]
    assert run.marks == {
        "checkpoint": [100, 200, 300],
        "resume": [100],
        "preempted": [120],
        "save_failed": [150],
    }
    assert run.run_name == "synthetic" and run.name == "out"


def test_without_events_jsonl_checkpoints_come_from_manifests(tmp_path):
    run = plot.load_run(write_run(tmp_path / "out", rows=40, events=False))
    assert run.marks == {"checkpoint": [80], "resume": [], "preempted": [], "save_failed": []}
    assert run.run_name is None


def test_no_metrics_or_no_rows_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no metrics.jsonl"):
        plot.render(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 3, "loss": nu\n{"step": 4, "loss": null}\n')
    with pytest.raises(ConfigError, match="no train or eval rows"):
        plot.render(tmp_path)
    assert not (tmp_path / "plots").exists()


def test_ema_is_bias_corrected_and_follows_a_constant():
    assert plot.ema([2.0, 2.0, 2.0], span=10) == pytest.approx([2.0, 2.0, 2.0])
    smoothed = plot.ema([0.0] * 50 + [1.0] * 50, span=5)
    assert 0 < smoothed[51] < smoothed[60] < 1.0


# --- the image ---------------------------------------------------------------------------------


def test_render_draws_a_readable_png_atomically(tmp_path):
    out = write_run(tmp_path / "out")
    path = plot.render(out)
    assert path == out / "plots" / "training.png"
    assert [p.name for p in path.parent.iterdir()] == ["training.png"]  # no temp file left
    img = assert_plot(path)
    top = img[: img.shape[0] // 2]  # the loss panel: the curves are there
    assert pixels_near(top, BLUE) > 1000 and pixels_near(top, ORANGE) > 100
    assert pixels_near(img, RED) > 100  # the preemption line


def test_render_copes_with_eval_rows_only_and_bad_values(tmp_path):
    rows = [
        eval_row(0, 6.0),
        {"step": 5, "loss": float("nan")},
        {"step": "x", "loss": 1.0},
        {"step": 6, "loss": "a"},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert_plot(plot.render(tmp_path, tmp_path / "deep" / "er" / "x.png"))


def test_a_preference_runs_reward_margins_get_their_own_panel(tmp_path):
    rows = [{"step": s, "loss": 0.69 - s / 100, "rewards/margins": s / 10} for s in range(1, 40)]
    rows.append({"step": 39, "eval_loss": 0.6, "eval_rewards/margins": 2.0})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fig = plot._draw(plot.load_run(tmp_path))
    labels = [ax.get_ylabel() for ax in fig.axes]
    assert labels[1].startswith("reward margin") and len(labels) == 4
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    assert len(plot._draw(plot.load_run(plain)).axes) == 3


def test_the_demo_run_renders(tmp_path):
    """The repository's real 2-rank run, copied first (it may be being regenerated)."""
    demo = REPO / "output" / "demo"
    if not (demo / "metrics.jsonl").is_file():
        pytest.skip("output/demo has no metrics.jsonl (run `make demo`)")
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "metrics.jsonl").write_bytes((demo / "metrics.jsonl").read_bytes())
    assert_plot(plot.render(tmp_path / "demo"))


# --- `finetune plot` ---------------------------------------------------------------------------


def test_main_writes_the_file_and_says_what_it_drew(tmp_path, capsys):
    out = write_run(tmp_path / "out")
    assert plot.main([str(out), "-o", str(tmp_path / "x.png")]) == 0
    assert (
        capsys.readouterr().out.strip()
        == f"Wrote {tmp_path / 'x.png'} (150 train rows, 7 eval rows, 3 checkpoints)"
    )
    assert_plot(tmp_path / "x.png")


def test_main_reports_an_unwritable_destination_with_exit_1(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert (
        plot.main([str(write_run(tmp_path / "out")), "-o", str(tmp_path / "file" / "x.png")]) == 1
    )
    assert "was not written" in capsys.readouterr().err


def test_cli_plot_subcommand(tmp_path):
    from finetune.cli import COMMANDS

    if "plot" not in COMMANDS:
        pytest.skip("not wired yet")
    out = write_run(tmp_path / "out")
    done = subprocess.run(
        [sys.executable, "-m", "finetune", "plot", str(out), "-o", str(tmp_path / "x.png")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "Wrote" in done.stdout and "150 train rows" in done.stdout
    assert_plot(tmp_path / "x.png")
    missing = subprocess.run(
        [sys.executable, "-m", "finetune", "plot", str(tmp_path / "nothing")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1


# --- Plotter -----------------------------------------------------------------------------------


@pytest.fixture
def warnings(monkeypatch):
    """finetune's logger warnings, whatever another test did to its handlers."""
    got: list[str] = []
    monkeypatch.setattr(plot.dist.logger, "warning", lambda msg, *args: got.append(msg % args))
    return got


@pytest.fixture
def slow_render(monkeypatch):
    """plot.render blocked until ``gate`` is set; ``calls`` counts renders started."""
    gate, calls = threading.Event(), []

    def render(output_dir, dest=None):
        calls.append(time.perf_counter())
        gate.wait(10)
        return Path(dest)

    monkeypatch.setattr(plot, "render", render)
    return gate, calls


def test_request_never_waits_and_coalesces_to_one_more_render(tmp_path, slow_render):
    gate, calls = slow_render
    p = plot.Plotter(tmp_path)
    for _ in range(20):
        t0 = time.perf_counter()
        p.request()
        assert time.perf_counter() - t0 < 0.05
    time.sleep(0.1)
    assert len(calls) == 1  # the first render still runs; the 19 others are one pending
    gate.set()
    p.close(timeout=5)
    assert len(calls) == 2 and p.renders == 2


def test_renders_start_min_interval_apart_except_the_last(tmp_path, slow_render):
    gate, calls = slow_render
    gate.set()
    p = plot.Plotter(tmp_path, min_interval_s=0.5)
    p.request()
    time.sleep(0.1)
    p.request()  # pending: starts 0.5 s after the first
    time.sleep(0.8)
    p.request()  # pending again; close() draws it now
    t0 = time.perf_counter()
    p.close(timeout=5)
    assert time.perf_counter() - t0 < 0.3
    assert len(calls) == 3 and calls[1] - calls[0] >= 0.5


def test_close_gives_up_after_its_timeout_with_a_warning(tmp_path, slow_render, warnings):
    p = plot.Plotter(tmp_path)
    t0 = time.perf_counter()
    p.close(timeout=0.2)
    assert time.perf_counter() - t0 < 2
    assert len(warnings) == 1 and "did not finish within" in warnings[0]
    slow_render[0].set()


def test_a_failing_render_warns_once_and_turns_plotting_off(tmp_path, warnings):
    (tmp_path / "file").write_text("")
    p = plot.Plotter(write_run(tmp_path / "out", rows=20), dest=tmp_path / "file" / "training.png")
    for _ in range(3):
        p.request()
        time.sleep(0.5)
    p.close(timeout=10)
    assert p.disabled and p.renders == 0
    assert len(warnings) == 1 and "plotting" in warnings[0] and "no more plots" in warnings[0]


def test_nothing_to_plot_yet_is_not_a_failure(tmp_path, warnings):
    p = plot.Plotter(tmp_path)
    p.request()
    write_run(tmp_path, rows=20)
    p.close(timeout=30)
    assert warnings == [] and p.renders >= 1
    assert_plot(tmp_path / "plots" / "training.png")


def test_long_runs_are_thinned_for_drawing_after_smoothing_on_every_row():
    from finetune.plot import MAX_POINTS, _thin, ema

    steps = list(range(1, 3 * MAX_POINTS + 2))
    values = [float(s % 7) for s in steps]
    smooth = ema(values, 50)
    x, raw, drawn = _thin(steps, values, smooth)
    assert len(x) == len(raw) == len(drawn) <= MAX_POINTS
    # the smoothed values are the full series' own
    assert x[0] == 1 and drawn[-1] == smooth[::4][-1]
    assert _thin(steps[:10], values[:10]) == (steps[:10], values[:10])


def test_main_refuses_a_bucket_in_one_line_with_exit_2(capsys):
    from finetune.plot import main

    assert main(["s3://bucket/prefix"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("finetune: error: s3://bucket/prefix: a bucket holds checkpoints")
    assert err.count("\n") == 1
