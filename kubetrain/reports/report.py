"""build_report: the Markdown comparison report (with PNG plots) of finished run directories."""

from __future__ import annotations

import json
import time
from pathlib import Path
from collections.abc import Sequence
from typing import Any

from kubetrain.drivers.local.summary import SUMMARY_KEYS
from . import plots
from .runs import ReportError, RunData, load_run

# The summary.json figures the table compares (name, mode and state are in the runs table).
FIGURES = tuple(k for k in SUMMARY_KEYS if k not in ("name", "mode", "state"))
REPORT = "report.md"


def _number(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def ratio(value: Any, base: Any) -> float | None:
    """value / base, or None where either is missing or the base is zero."""
    if not isinstance(value, (int, float)) or not isinstance(base, (int, float)) or isinstance(value, bool) or not base:
        return None
    return value / base


def _labels(paths: list[Path]) -> list[str]:
    """The run directories' names, made unique."""
    labels: list[str] = []
    for path in paths:
        label, n = path.name, 2
        while label in labels:
            label, n = f"{path.name}-{n}", n + 1
        labels.append(label)
    return labels


def bytes_per_step(run: RunData) -> dict[str, float | None]:
    steps = run.summary.get("steps") or 0
    raw = sum(r.get("raw_gradient_bytes", 0) or 0 for r in run.results.values())
    compressed = sum(r.get("compressed_gradient_bytes", 0) or 0 for r in run.results.values())
    sent = run.summary.get("bytes_sent")
    if not steps:
        return {"network sent": None, "gradients raw": None, "gradients compressed": None}
    return {
        "network sent": sent / steps if sent is not None else None,
        "gradients raw": raw / steps,
        "gradients compressed": compressed / steps,
    }


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def build_report(run_dirs: Sequence[Path | RunData], out: Path) -> Path:
    """Write `out/report.md` and its PNG plots comparing the runs (ratios to the first); returns the report's path.

    A run is a local run directory, or a RunData read already (a cluster job: cluster.cluster_run). Raises
    ReportError naming the directory when one is not a finished run.
    """
    runs = _load_runs(run_dirs)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    summary, table = _summary_section(runs)
    per_step = {r.label: bytes_per_step(r) for r in runs}
    figures = _plot(runs, per_step, out)
    lines = [*_runs_section(runs), *summary, *_bytes_section(per_step), *PLOTS_SECTION,
             *_recovery_section(runs, out, figures)]
    report = out / REPORT
    report.write_text("\n".join(lines))
    (out / "report.json").write_text(json.dumps({
        "runs": [{"label": r.label, "path": str(r.path), "summary": r.summary, "bytes_per_step": per_step[r.label],
                  "recoveries": [{**rec.__dict__, "steps_lost": rec.steps_lost} for rec in r.recoveries]}
                 for r in runs],
        "table": table,
        "plots": sorted(figures),
    }, indent=2) + "\n")
    return report


def _load_runs(run_dirs: Sequence[Path | RunData]) -> list[RunData]:
    """The runs, each labelled by its directory's name (made unique); ReportError for one that is not a run."""
    if not run_dirs:
        raise ReportError("no run directory given")
    paths = [r.path if isinstance(r, RunData) else Path(r) for r in run_dirs]
    return [r if isinstance(r, RunData) else load_run(p, label)
            for r, p, label in zip(run_dirs, paths, _labels(paths))]


def _runs_section(runs: list[RunData]) -> list[str]:
    """The title, what the figures mean, and which runs are compared."""
    return [
        "# kubetrain comparison report",
        "",
        f"{len(runs)} run(s), written {time.strftime('%Y-%m-%d %H:%M:%S %Z')}. Ratios are to the first run, "
        f"`{runs[0].label}`. Figures are in base units (seconds, bytes); throughput is samples per second of all "
        "workers together.",
        "",
        "## Runs",
        "",
        *_table(
            ["run", "job", "mode", "compression", "state", "run directory"],
            [[r.label, r.job.name, r.job.spec.mode, r.compression, str(r.summary.get("state")), f"`{r.path}`"]
             for r in runs],
        ),
        "",
    ]


def _summary_section(runs: list[RunData]) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """The summary figures of every run and their ratios to the first: as Markdown, and as report.json's table."""
    first = runs[0]
    header = ["figure", *(r.label for r in runs), *(f"{r.label} / {first.label}" for r in runs[1:])]
    rows = []
    table: dict[str, dict[str, Any]] = {}
    for key in FIGURES:
        values = [r.summary.get(key) for r in runs]
        ratios = [ratio(v, values[0]) for v in values[1:]]
        rows.append([key, *map(_number, values), *("-" if q is None else f"{q:.3f}" for q in ratios)])
        table[key] = {"values": dict(zip((r.label for r in runs), values)),
                      "ratios": dict(zip((r.label for r in runs[1:]), ratios))}
    return ["## Summary", "", *_table(header, rows), ""], table


def _bytes_section(per_step: dict[str, dict[str, float | None]]) -> list[str]:
    return ["## Bytes per step", "",
            *_table(["run", "network bytes sent / step", "raw gradient bytes / step",
                     "compressed gradient bytes / step"],
                    [[label, *(_number(v) for v in figures.values())] for label, figures in per_step.items()]),
            ""]


def _plot(runs: list[RunData], per_step: dict[str, dict[str, float | None]], out: Path) -> dict[str, Any]:
    """The plots every report has, written into `out`, by file name."""
    return {
        "loss.png": plots.loss(runs, out / "loss.png"),
        "accuracy.png": plots.accuracy(runs, out / "accuracy.png"),
        "throughput.png": plots.throughput(runs, out / "throughput.png"),
        "bytes_per_step.png": plots.bytes_per_step(
            runs, {name: [per_step[r.label][name] for r in runs] for name in next(iter(per_step.values()))},
            out / "bytes_per_step.png",
        ),
    }


PLOTS_SECTION = [
    "## Plots",
    "",
    "Training loss of the chief replica against steps and against wall time:",
    "",
    "![loss](loss.png)",
    "",
    "Accuracy on the eval split (a parameter-server job evaluates once, at its end):",
    "",
    "![accuracy](accuracy.png)",
    "",
    "![throughput](throughput.png)",
    "",
    "![bytes per step](bytes_per_step.png)",
    "",
]


def _recovery_section(runs: list[RunData], out: Path, figures: dict[str, Any]) -> list[str]:
    """Every restart of every run, and the recovery plot (added to `figures`) when there was one."""
    lines = ["## Restarts and recovery", ""]
    recoveries = [(r, rec) for r in runs for rec in r.recoveries]
    if not recoveries:
        return lines + ["No replica restarted.", ""]
    figures["recovery.png"] = plots.recoveries(runs, out / "recovery.png")
    lines += _table(
        ["run", "replica", "reason", "exit code", "failed at step", "resumed from step", "steps lost",
         "recovery seconds"],
        [[r.label, rec.replica, rec.reason, _number(rec.exit_code), _number(rec.failed_step),
          _number(rec.resumed_step), _number(rec.steps_lost), _number(rec.recovery_seconds)]
         for r, rec in recoveries],
    )
    return lines + ["", "Recovery time: from the supervisor seeing the failure to the first training step of the "
                    "restarted replica (backoff, process start, checkpoint load included).", "",
                    "![recovery](recovery.png)", ""]
