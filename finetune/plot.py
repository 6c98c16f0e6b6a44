"""Loss plots: OUT/plots/training.png from OUT/metrics.jsonl, OUT/events.jsonl and the
committed checkpoints.

Three panels sharing the step axis: loss (train raw and smoothed, eval), learning rate, tokens/s
(a preference objective's run adds its reward margins, train and eval, under the loss); every
committed checkpoint, resume, preemption and failed save is a vertical line in each panel.
The image is 1200x900 px (12x9 inches at 100 dpi).

``render`` is the one drawing function; ``finetune plot OUT`` (``main``) calls it once, the
trainer's ``Plotter`` calls it on a background thread on rank 0. matplotlib is imported inside
``_draw``, never at module import (the training start does not pay for it), and only through its
object-oriented API (``Figure`` + ``FigureCanvasAgg``): pyplot keeps global state and is not safe
off the main thread.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from finetune import distributed as dist
from finetune import metrics
from finetune.checkpoint_format.manifest import read_manifest
from finetune.checkpoint_format.outdir import OutputDir, step_of
from finetune.commands import Parser
from finetune.config import ConfigError
from finetune.io.remote import is_remote
from finetune.metrics import METRICS, read_metrics

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

DEFAULT_DEST = Path("plots") / "training.png"  # under OUT
_TOTALS = ("eval_tokens", "eval_pairs")  # the whole evaluation's counts, not a named set's
FIGSIZE = (12.0, 9.0)  # inches; at DPI: 1200x900 px
DPI = 100
MAX_POINTS = 5000  # per drawn series (see _thin)
LOG_LOSS_SPAN = 10**1.5  # a loss axis spanning more than 1.5 decades is drawn log-scale

# Vertical markers: (label, colour, line style, line width, marker at the loss panel's top edge).
MARKS = {
    "checkpoint": ("checkpoint", "0.6", "-", 0.8, None),
    "resume": ("resume", "tab:green", "--", 1.6, ">"),
    "preempted": ("preempted", "tab:red", ":", 1.8, "X"),
    "save_failed": ("save failed", "tab:purple", "-.", 1.6, "D"),
}


@dataclass
class Run:
    """What one output dir has to plot, rows sorted by step with one row per step and kind."""

    name: str  # the output dir's folder name
    train: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    marks: dict[str, list[int]] = field(default_factory=dict)  # MARKS key -> steps
    run_name: str | None = None  # from the last "start" event


# --- reading -----------------------------------------------------------------------------------


def load_run(output_dir: str | os.PathLike) -> Run:
    """Metrics, events and checkpoints of ``output_dir``; ConfigError when there
    is nothing to plot."""
    out = Path(output_dir)
    if not (out / METRICS).is_file():
        raise ConfigError(
            f"{out}: no metrics.jsonl (not a run's output dir, or no step logged yet)"
        )
    rows = read_metrics(str(out))
    train = _last_per_step(r for r in rows if _num(r, "loss") is not None)
    evals = _last_per_step(r for r in rows if _num(r, "eval_loss") is not None)
    if not train and not evals:
        raise ConfigError(f"{out / 'metrics.jsonl'}: no train or eval rows to plot")
    events = read_events(out)
    marks = {kind: sorted({e["step"] for e in events if e["event"] == kind}) for kind in MARKS}
    marks["checkpoint"] = sorted(set(marks["checkpoint"]) | set(_committed_steps(out)))
    starts = [e for e in events if e["event"] == "start" and isinstance(e.get("run_name"), str)]
    return Run(out.resolve().name, train, evals, marks, starts[-1]["run_name"] if starts else None)


def read_events(output_dir: str | os.PathLike) -> list[dict]:
    """OUT/events.jsonl's events to mark, in file order: an unknown kind or a row without an
    integer step is skipped. A checkpoint event without a step takes its tag's."""
    events = []
    for event in metrics.read_events(output_dir):
        if event.get("event") not in (*MARKS, "start", "end"):
            continue
        if event["event"] == "checkpoint" and not _is_int(event.get("step")):
            event["step"] = step_of(str(event.get("tag", "")))
        if _is_int(event.get("step")):
            events.append(event)
    return events


def _committed_steps(out: Path) -> list[int]:
    """Steps of the checkpoint folders with a manifest (committed), for runs
    without events.jsonl."""
    return [step_of(tag) for tag in OutputDir(out).tags() if read_manifest(out / tag) is not None]


def _last_per_step(rows: Iterable[dict]) -> list[dict]:
    """Sorted by step, the last row written for each step (a resumed run may repeat one)."""
    by_step = {r["step"]: r for r in rows if _is_int(r.get("step"))}
    return [by_step[s] for s in sorted(by_step)]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(row: dict, key: str) -> float | None:
    """row[key] as a finite float, else None (absent, null, NaN, a string)."""
    v = row.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], v) for r in rows if (v := _num(r, key)) is not None]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _thin(steps: list, *series: list) -> tuple[list, ...]:
    """Every k-th point, so that at most MAX_POINTS are drawn: a 1,200-pixel-wide panel shows no
    more, and drawing 200,000 rows took 4 s of rank 0's GIL (smoothing is computed on every row
    before thinning, so the EMA curve is exact)."""
    k = max(1, math.ceil(len(steps) / MAX_POINTS))
    return (steps[::k], *(s[::k] for s in series))


def ema(values: list[float], span: float) -> list[float]:
    """Exponential moving average, bias-corrected (TensorBoard's smoothing): the first points
    are not pulled towards zero."""
    beta = 1.0 - 2.0 / (span + 1.0)
    out = []
    avg = 0.0
    for i, v in enumerate(values, 1):
        avg = beta * avg + (1.0 - beta) * v
        out.append(avg / (1.0 - beta**i))
    return out


def ema_span(n: int) -> int:
    """~4% of the rows, from 2 to 100: smooths 30 rows a little, 10,000 well, and lags a fast
    early drop by at most ~100 rows (the raw curve is drawn too)."""
    return min(100, max(2, round(n / 25)))


# --- drawing -----------------------------------------------------------------------------------


def render(output_dir: str | os.PathLike, dest: str | os.PathLike | None = None) -> Path:
    """Draw ``output_dir``'s run to ``dest`` (default OUT/plots/training.png),
    atomically; the path."""
    run = load_run(output_dir)
    return write_png(run, Path(dest) if dest is not None else Path(output_dir) / DEFAULT_DEST)


def write_png(run: Run, dest: Path) -> Path:
    """A temp file beside ``dest``, then one rename: a reader never sees half a PNG."""
    fig = _draw(run)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            fig.savefig(f, format="png", dpi=DPI)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def _draw(run: Run) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    # a preference objective's run: its reward margins under the loss
    pairs = any("rewards/margins" in r for r in run.train + run.evals)
    heights = (3, 1.2, 1.2, 1.2) if pairs else (3, 1.2, 1.2)
    loss_ax, *axes = fig.subplots(len(heights), 1, sharex=True, height_ratios=heights)
    if pairs:
        margin_ax = axes.pop(0)
        _line_panel(margin_ax, run.train, "rewards/margins", "reward margin", "tab:green", True)
        e_steps, e_margin = _series(run.evals, "eval_rewards/margins")
        margin_ax.plot(e_steps, e_margin, color="tab:orange", lw=1.5, marker="o", ms=4)
    lr_ax, tps_ax = axes
    handles = _loss_panel(loss_ax, run)
    _line_panel(lr_ax, run.train, "lr", "learning rate", "tab:brown", smooth=False)
    _line_panel(tps_ax, run.train, "tokens_per_s", "tokens/s", "tab:cyan", smooth=True)
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    handles += _marks(fig.axes, run)
    for ax in fig.axes:
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelsize=10)
    tps_ax.set_xlabel("step", fontsize=11)
    fig.legend(handles=handles, loc="outside right upper", fontsize=10, frameon=False)
    fig.suptitle(_title(run), fontsize=13)
    return fig


def _loss_panel(ax: Axes, run: Run) -> list[Artist]:
    """Train loss raw (thin) and smoothed (thick), eval loss; the legend handles."""
    handles = []
    steps, loss = _series(run.train, "loss")
    if loss:
        span = ema_span(len(loss))
        x, raw, smooth = _thin(steps, loss, ema(loss, span))
        handles += ax.plot(x, raw, color="tab:blue", lw=0.8, alpha=0.35, label="train loss")
        handles += ax.plot(
            x, smooth, color="tab:blue", lw=2.2, label=f"train loss, EMA\n(span {span} rows)"
        )
    e_steps, e_loss = _series(run.evals, "eval_loss")
    if e_loss:
        marker = "o" if len(e_loss) <= 60 else None  # hundreds of markers would hide the line
        handles += ax.plot(
            e_steps, e_loss, color="tab:orange", lw=1.5, marker=marker, ms=5, label="eval loss"
        )
    # --eval_datasets: each set's own loss, dashed (a set is known by its own count of tokens or
    # pairs: eval_<name>_tokens, eval_<name>_pairs)
    counts = {k for r in run.evals for k in r if k.startswith("eval_") and k not in _TOTALS}
    sets = {k.rsplit("_", 1)[0] for k in counts if k.endswith(("_tokens", "_pairs"))}
    named = sorted(f"{s}_loss" for s in sets)
    for key in named:
        n_steps, n_loss = _series(run.evals, key)
        handles += ax.plot(n_steps, n_loss, lw=1.2, ls="--", marker=".", label=key)
        e_loss = e_loss + n_loss
    values = [v for v in loss + e_loss if v > 0]
    if values and max(values) / min(values) > LOG_LOSS_SPAN:
        ax.set_yscale("log")
    ax.set_ylabel("loss" + (" (log scale)" if ax.get_yscale() == "log" else ""), fontsize=11)
    return handles


def _line_panel(ax: Axes, rows: list[dict], key: str, label: str, color: str, smooth: bool) -> None:
    """One series; with ``smooth``, raw (thin, light) under its EMA (thick), as
    in the loss panel."""
    steps, values = _series(rows, key)
    if not values:
        ax.text(
            0.5,
            0.5,
            f"no {label} logged yet",
            transform=ax.transAxes,
            ha="center",
            va="center",
            color="0.5",
        )
    elif smooth:
        x, raw, smoothed = _thin(steps, values, ema(values, ema_span(len(values))))
        ax.plot(x, raw, color=color, lw=0.8, alpha=0.4)
        ax.plot(x, smoothed, color=color, lw=2.0)
        label += "\n(EMA thick)"
    else:
        ax.plot(*_thin(steps, values), color=color, lw=1.5)
    ax.set_ylabel(label, fontsize=11)


def _marks(axes: list[Axes], run: Run) -> list[Artist]:
    """Each MARKS kind as vertical lines in every panel (markers on the top panel's upper edge);
    one legend handle per kind present."""
    from matplotlib.lines import Line2D

    handles = []
    for kind, (label, color, style, width, marker) in MARKS.items():
        steps = run.marks.get(kind, [])
        if not steps:
            continue
        for ax in axes:  # one collection per panel, however many checkpoints
            ax.vlines(
                steps,
                0,
                1,
                transform=ax.get_xaxis_transform(),
                colors=color,
                linestyles=style,
                linewidths=width,
                zorder=0.5,
            )
        if marker:
            axes[0].plot(
                steps,
                [1.0] * len(steps),
                ls="none",
                marker=marker,
                color=color,
                ms=8,
                clip_on=False,
                transform=axes[0].get_xaxis_transform(),
                zorder=3,
            )
        handles.append(
            Line2D(
                [],
                [],
                color=color,
                ls=style,
                lw=max(width, 1.2),
                marker=marker,
                ms=7,
                label=f"{label} ({len(steps)})",
            )
        )
    return handles


def _title(run: Run) -> str:
    head = run.name if run.run_name in (None, "", run.name) else f"{run.name} — {run.run_name}"
    parts = []
    steps, loss = _series(run.train, "loss")
    if loss:
        parts.append(
            f"final train loss {loss[-1]:.4f} (EMA "
            f"{ema(loss, ema_span(len(loss)))[-1]:.4f}, step {steps[-1]})"
        )
    if run.evals and (loss := _num(run.evals[-1], "eval_loss")) is not None:
        parts.append(f"final eval loss {loss:.4f} (step {run.evals[-1]['step']})")
    return head + ("\n" + "   ·   ".join(parts) if parts else "")


# --- `finetune plot` ---------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    p = Parser(
        prog="finetune plot",
        description="Draw a run's loss, learning rate and throughput, with its checkpoints, "
        "resumes and preemptions, as a 1200x900 PNG. Exit 2 when OUT has no metrics to plot.",
    )
    p.add_argument(
        "output_dir",
        metavar="OUT",
        help="A run's output dir (reads metrics.jsonl, events.jsonl and "
        "the committed checkpoints' manifests).",
    )
    p.add_argument(
        "-o",
        "--output",
        metavar="FILE.png",
        default=None,
        help=f"Where to write the PNG (default: OUT/{DEFAULT_DEST}).",
    )
    ns = p.parse_args(argv)
    if is_remote(ns.output_dir):  # metrics.jsonl and events.jsonl stay in OUT, never copied
        print(
            f"finetune: error: {ns.output_dir}: a bucket holds checkpoints, not a run's metrics; "
            "plot the run's local output dir",
            file=sys.stderr,
        )
        return 2
    run = load_run(ns.output_dir)
    dest = Path(ns.output) if ns.output else Path(ns.output_dir) / DEFAULT_DEST
    try:
        write_png(run, dest)
    except OSError as e:  # a full disk, a file where the folder should be
        print(f"finetune: error: plot failed, {dest} was not written: {e}", file=sys.stderr)
        return 1
    print(
        f"Wrote {dest} ({len(run.train)} train rows, {len(run.evals)} eval rows, "
        f"{len(run.marks['checkpoint'])} checkpoints)"
    )
    return 0


# --- during training ---------------------------------------------------------------------------


class Plotter:
    """Rank 0's OUT/plots/training.png, redrawn on a daemon thread while training runs.

    ``request()`` never waits: it starts a render, or, while one runs, asks for one more after it
    (requests coalesce; never more than one pending). Renders start at least ``min_interval_s``
    apart, except the last one (``close``): drawing holds the GIL for much of its 0.2-0.4 s, slowing
    the training loop's Python while it runs, so a run that logs every step must not redraw every
    step. The first failure of any kind is logged once and turns plotting off for the run: a plot
    is never worth a training step.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        dest: str | os.PathLike | None = None,
        min_interval_s: float = 10.0,
    ):
        self.output_dir = Path(output_dir)
        self.dest = Path(dest) if dest is not None else self.output_dir / DEFAULT_DEST
        self.min_interval_s = min_interval_s
        self.renders = 0  # finished renders
        self.disabled = False
        self._lock = threading.Lock()
        self._running = False  # a thread is rendering, or about to
        self._again = False  # a request came during that render
        self._thread: threading.Thread | None = None
        self._last_start = -math.inf  # time.monotonic() of the last render's start
        self._closing = threading.Event()  # cuts the wait between renders short

    def request(self) -> None:
        with self._lock:
            if self.disabled:
                return
            if self._running:
                self._again = True
                return
            self._running = True
        try:
            self._thread = threading.Thread(target=self._loop, name="finetune-plot", daemon=True)
            self._thread.start()
        except RuntimeError as e:  # "can't start new thread": out of threads or memory
            self._fail(e)

    def close(self, timeout: float = 30.0) -> None:
        """One last render with every row written so far, waited for at most ``timeout`` seconds."""
        self._closing.set()
        self.request()
        thread = self._thread
        if thread is None or self.disabled:
            return
        thread.join(timeout)
        if thread.is_alive():
            dist.logger.warning(
                "the final plot did not finish within %g s; %s may show an earlier step",
                timeout,
                self.dest,
            )
        with self._lock:
            self.disabled = True  # no render after close

    def _loop(self) -> None:
        while True:
            self._closing.wait(max(0.0, self._last_start + self.min_interval_s - time.monotonic()))
            with self._lock:  # this render covers every request made so far
                self._again = False
            self._last_start = time.monotonic()
            if not self._render_once():
                return
            with self._lock:  # the same critical section as request()'s check: no request is lost
                if not self._again or self.disabled:
                    self._running = False
                    return

    def _render_once(self) -> bool:
        """One render; False once plotting is off."""
        start = time.perf_counter()
        try:
            render(self.output_dir, self.dest)
        except ConfigError as e:  # no metrics.jsonl or no row yet: nothing to draw, not a failure
            dist.logger.debug("not plotting yet: %s", e)
            return True
        # Anything else: a missing matplotlib (ImportError), a full disk (OSError),
        # a row the drawing chokes on (ValueError, TypeError), a matplotlib bug.
        # None of it may reach training.
        except Exception as e:  # noqa: BLE001 -- logged once, and plotting is off for the run
            self._fail(e)
            return False
        self.renders += 1
        dist.logger.debug("plotted %s in %.2f s", self.dest, time.perf_counter() - start)
        return True

    def _fail(self, e: BaseException) -> None:
        with self._lock:
            first = not self.disabled
            self.disabled = True
            self._running = False
        if first:
            dist.logger.warning(
                "plotting %s failed (%s: %s); no more plots this run",
                self.dest,
                type(e).__name__,
                e,
            )
