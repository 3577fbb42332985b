"""One progress display for a local job: a bar on a terminal, plain periodic lines elsewhere.

It reads the replicas' JSONL event files incrementally (the same events the
trainers write in a cluster) and shows step, loss, samples/s and the ETA the
job engine computed (`engine/eta.py`, the status's `progress.etaSeconds`).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from kubetrain.engine.eta import format_eta


class JsonlTail:
    """Reads the lines appended to a file since the last call; keeps a partial last line."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.partial = b""

    def read(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line cut by a kill
        return out


@dataclass
class JobProgress:
    """What the job has done so far, folded from the replicas' events."""

    step: int = 0
    total_steps: int | None = None
    loss: float | None = None
    eval_accuracy: float | None = None
    eval_loss: float | None = None
    eval_perplexity: float | None = None
    checkpoint_step: int | None = None
    samples_per_second: dict[str, float] = field(default_factory=dict)
    steps_per_second: float | None = None  # a script's, when it reports no samples
    last_step_time: float = field(default_factory=time.monotonic)
    quorum: int | None = None  # fault-tolerant DDP: replica groups in the newest quorum any group reported
    quorum_time: float = 0.0
    set_aside: list[tuple[float, str, str]] = field(default_factory=list)
    """(time, replica, "checkpoint: reason") of each checkpoint a restore set aside."""

    def fold(self, replica: str, event: dict[str, Any]) -> None:
        if "total_steps" in event and event["total_steps"]:
            self.total_steps = int(event["total_steps"])
        kind = event.get("event")
        if kind == "train":
            step = int(event.get("step", 0))
            if step > self.step:
                self.step = step
                self.last_step_time = time.monotonic()
            if event.get("loss") is not None:
                self.loss = float(event["loss"])
            if event.get("samples_per_second") is not None:
                self.samples_per_second[replica] = float(event["samples_per_second"])
            if event.get("steps_per_second") is not None:
                self.steps_per_second = float(event["steps_per_second"])
        elif kind == "quorum" and event.get("participants") is not None:
            # Every group reports the quorums it takes part in; the newest speaks for the job.
            when = float(event.get("time", 0.0))
            if when >= self.quorum_time:
                self.quorum, self.quorum_time = int(event["participants"]), when
        elif kind == "eval":
            for name in ("eval_accuracy", "eval_loss", "eval_perplexity"):
                if isinstance(event.get(name), (int, float)) and math.isfinite(event[name]):
                    setattr(self, name, float(event[name]))
        elif kind == "checkpoint_set_aside":
            self.set_aside.append((float(event.get("time", 0.0)), replica,
                                   f"{event.get('checkpoint')}: {event.get('reason')}"))
        elif kind == "checkpoint" and event.get("step") is not None:
            self.checkpoint_step = max(self.checkpoint_step or 0, int(event["step"]))
        elif kind in ("start", "resume") and event.get("step") is not None and not replica.startswith("worker-"):
            # A worker's own step counts its batches, not the job's updates (its train events carry those).
            self.step = max(self.step, int(event["step"]))

    @property
    def throughput(self) -> float:
        return sum(self.samples_per_second.values())


class ProgressDisplay:
    """Renders JobProgress: redraws one line on a terminal, prints a line every `every` s elsewhere."""

    def __init__(self, out: TextIO, name: str, tty: bool | None = None, every: float = 5.0):
        self.out = out
        self.name = name
        self.tty = out.isatty() if tty is None else tty
        self.every = every
        self.last_print = 0.0
        self.last_line = ""
        self.drawn = False

    def line(self, p: JobProgress, eta: float | None = None) -> str:
        """The line for `p`; `eta`: the engine's seconds to the end (status.progress.etaSeconds)."""
        total = p.total_steps
        loss = f"{p.loss:.4f}" if p.loss is not None else "-"
        speed = (f"{p.steps_per_second:,.1f} steps/s" if not p.throughput and p.steps_per_second
                 else f"{p.throughput:,.0f} samples/s")
        parts = [f"step {p.step}/{total if total else '?'}", f"loss {loss}", speed, f"ETA {format_eta(eta)}"]
        if p.eval_accuracy is not None:
            parts.insert(2, f"acc {p.eval_accuracy:.3f}")
        if self.tty and total:
            width = 24
            filled = int(width * min(1.0, p.step / total))
            bar = "#" * filled + "." * (width - filled)
            return f"{self.name} [{bar}] " + "  ".join(parts)
        return f"{self.name}: " + ", ".join(parts)

    def update(self, p: JobProgress, force: bool = False, eta: float | None = None) -> None:
        if not p.step and not force:
            return  # nothing to show before the first step
        now = time.monotonic()
        if self.tty:
            self.out.write("\r\x1b[2K" + self.line(p, eta))
            self.out.flush()
            self.drawn = True
        elif force or now - self.last_print >= self.every:
            line = self.line(p, eta)
            if line != self.last_line:
                self.out.write(line + "\n")
                self.out.flush()
                self.last_line = line
            self.last_print = now

    def message(self, text: str) -> None:
        """A log line that must not be overwritten by the bar."""
        if self.tty and self.drawn:
            self.out.write("\r\x1b[2K")
        self.out.write(text.rstrip("\n") + "\n")
        self.out.flush()

    def close(self) -> None:
        if self.tty and self.drawn:
            self.out.write("\n")
            self.out.flush()
            self.drawn = False
