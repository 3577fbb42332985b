"""The PNG plots of a comparison report, drawn with matplotlib (headless, no torch)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: reports are written by CLIs and CI
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

from .runs import RunData  # noqa: E402

DPI = 110


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _restarts(ax: Axes, run: RunData, color: str, against_time: bool) -> None:
    """Mark each restart: a dotted line where the replica failed."""
    for r in run.recoveries:
        x = r.failed_at - run.start_time if against_time else r.failed_step
        if x is not None:
            ax.axvline(x, color=color, linestyle=":", linewidth=1)


def _broken(points: list[tuple[int, float, float]]) -> list[tuple[float, float, float]]:
    """The points with a gap (NaN) where the step goes back: a restart resumed from an older checkpoint."""
    out: list[tuple[float, float, float]] = []
    for point in points:
        if out and point[0] <= out[-1][0]:
            out.append((math.nan, math.nan, math.nan))
        out.append(point)
    return out


def _curves(runs: list[RunData], path: Path, title: str, ylabel: str,
            points: Callable[[RunData], list[tuple[int, float, float]]], logy: bool = False) -> Path:
    """One figure, two panels: the quantity against steps and against wall time, one line per run."""
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    for i, run in enumerate(runs):
        color = f"C{i}"
        data = _broken(points(run))
        marker = "o" if len(data) < 20 else None
        if data:
            by_step.plot([p[0] for p in data], [p[2] for p in data], color=color, marker=marker, label=run.label)
            by_time.plot([p[1] for p in data], [p[2] for p in data], color=color, marker=marker, label=run.label)
        _restarts(by_step, run, color, against_time=False)
        _restarts(by_time, run, color, against_time=True)
    for ax, xlabel in ((by_step, "step"), (by_time, "wall time since start (s)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if logy:
            ax.set_yscale("log")
    by_step.legend()
    fig.suptitle(title + ("  (dotted: a replica failed and restarted)" if any(r.recoveries for r in runs) else ""))
    return _save(fig, path)


def loss(runs: list[RunData], path: Path) -> Path:
    return _curves(runs, path, "Training loss of the chief replica", "loss",
                   lambda r: r.series("train", "loss"), logy=True)


def accuracy(runs: list[RunData], path: Path) -> Path:
    return _curves(runs, path, "Accuracy on the eval split", "eval accuracy",
                   lambda r: r.series("eval", "eval_accuracy"))


def throughput(runs: list[RunData], path: Path, bins: int = 40) -> Path:
    """Samples/s against wall time, in bins of one width for all runs (1/bins of the longest run)."""
    ends = [p[-1][0] for p in (r.sample_points() for r in runs) if p]
    width = max(ends) / bins if ends else 1.0
    fig, ax = plt.subplots(figsize=(11, 4))
    for i, run in enumerate(runs):
        points = run.throughput(width)
        ax.plot([t for t, _ in points], [v for _, v in points], color=f"C{i}", label=run.label)
        _restarts(ax, run, f"C{i}", against_time=True)
    ax.set_xlabel("wall time since start (s)")
    ax.set_ylabel("samples/s (all workers)")
    ax.set_title(f"Training throughput ({width:.2g} s bins)")
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def bytes_per_step(runs: list[RunData], rows: dict[str, list[float | None]], path: Path) -> Path:
    """Grouped bars: network and gradient bytes per training step, one group per run."""
    fig, ax = plt.subplots(figsize=(11, 4))
    width = 0.8 / max(1, len(rows))
    for j, (name, values) in enumerate(rows.items()):
        xs = [i + (j - (len(rows) - 1) / 2) * width for i in range(len(runs))]
        heights = [v or 0.0 for v in values]
        bars = ax.bar(xs, heights, width, label=name, color=f"C{j}")
        ax.bar_label(bars, labels=[_human_bytes(v) for v in values], fontsize=8)
    ax.set_xticks(range(len(runs)), [r.label for r in runs])
    ax.set_ylabel("bytes per step")
    ax.set_title("Bytes per training step")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def recoveries(runs: list[RunData], path: Path) -> Path:
    """Recovery time of every restart (failure to the first step of the new process), per run."""
    fig, ax = plt.subplots(figsize=(11, 4))
    labels, heights, colors = [], [], []
    for i, run in enumerate(runs):
        for n, r in enumerate(run.recoveries, 1):
            labels.append(f"{run.label}\n{r.replica} #{n}")
            heights.append(r.recovery_seconds or 0.0)
            colors.append(f"C{i}")
    bars = ax.bar(range(len(heights)), heights, 0.6, color=colors)
    ax.set_xlim(-0.8, max(len(heights), 2) - 0.2)
    texts = []
    for run in runs:
        for r in run.recoveries:
            lost = f", {r.steps_lost} steps lost" if r.steps_lost is not None else ""
            texts.append(("never trained again" if r.recovery_seconds is None else f"{r.recovery_seconds:.1f} s") + lost)
    ax.bar_label(bars, labels=texts, fontsize=8)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("seconds from failure to training again")
    ax.set_title("Restarts and recovery times")
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def _human_bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(value) < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return ""
