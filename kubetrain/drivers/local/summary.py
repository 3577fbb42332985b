"""summary.json: the figures of a finished run, built from the replicas' results files."""

from __future__ import annotations

from typing import Any

from kubetrain.api import TrainingJob
from kubetrain.engine.plan import chief

SUMMARY_KEYS = (
    "name", "mode", "state", "steps", "epochs", "eval_accuracy", "eval_loss", "eval_perplexity", "baseline_eval_loss",
    "final_train_loss", "samples_per_second", "wall_seconds", "restarts",
    "bytes_sent", "bytes_received", "compression_ratio",
)  # fmt: skip


FINE_TUNING_KEYS = ("eval_perplexity", "baseline_eval_loss")
"""Shown only where they are measured (model causal-lm)."""


def build_summary(
    job: TrainingJob,
    results: dict[str, dict[str, Any]],
    state: str,
    wall_seconds: float,
    restarts: int,
    reason: str = "",
    message: str = "",
) -> dict[str, Any]:
    """Figures in base units; None where the run did not produce one (a failed run)."""
    head = results.get(chief(job), {})
    if not head and job.spec.fault_tolerant:
        # The chief's group was replaced and stopped before its end: the group that went furthest speaks.
        head = max((r for name, r in results.items() if name.startswith("ddp-")),
                   key=lambda r: r.get("steps") or 0, default={})
    # The global step of a parameter-server job is counted by the shards.
    steps = results.get("ps-0", {}).get("steps") if job.spec.mode == "ParameterServer" else None
    data_replicas = [r for name, r in results.items() if not name.startswith("ps-")]
    raw = sum(r.get("raw_gradient_bytes", 0) or 0 for r in results.values())
    compressed = sum(r.get("compressed_gradient_bytes", 0) or 0 for r in results.values())
    summary: dict[str, Any] = {
        "name": job.name,
        "mode": job.spec.mode,
        "state": state,
        "steps": steps if steps is not None else head.get("steps"),
        "epochs": head.get("epochs"),
        "eval_accuracy": head.get("eval_accuracy"),
        "eval_loss": head.get("eval_loss"),
        "eval_perplexity": head.get("eval_perplexity"),
        "baseline_eval_loss": head.get("baseline_eval_loss"),
        "final_train_loss": head.get("final_train_loss"),
        "samples_per_second": sum(r.get("samples_per_second", 0.0) or 0.0 for r in data_replicas) or None,
        "wall_seconds": round(wall_seconds, 3),
        "restarts": restarts,
        "bytes_sent": sum(r.get("bytes_sent", 0) or 0 for r in results.values()),
        "bytes_received": sum(r.get("bytes_received", 0) or 0 for r in results.values()),
        "compression_ratio": round(raw / compressed, 4) if compressed else 1.0,
    }
    if head.get("metrics"):
        summary["metrics"] = head["metrics"]  # what a script reported beyond loss and eval figures
    if state != "Succeeded":
        summary["reason"] = reason
        summary["message"] = message
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    def fmt(key: str, value: Any) -> str:
        if value is None:
            return "-"
        if key in ("eval_accuracy", "eval_loss", "eval_perplexity", "baseline_eval_loss", "final_train_loss"):
            return f"{value:.4f}"
        if key == "samples_per_second":
            return f"{value:,.0f}"
        if key.startswith("bytes_"):
            return f"{value:,}"
        return str(value)

    shown = {k: v for k, v in summary.items() if v is not None or k not in FINE_TUNING_KEYS}
    width = max(len(k) for k in shown)
    return "\n".join(f"  {k.ljust(width)}  {fmt(k, v)}" for k, v in shown.items())
