"""The replica's own record of a run: JSONL events as they happen and one results file at the end."""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kubetrain.shared.files import atomic_write
from kubetrain.shared.launch import STARTUP_TAG

log = logging.getLogger(__name__)


def _plain(value: Any) -> Any:
    """JSON-safe values: NaN and infinities (an empty eval split) become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


class EventLog:
    """Appends `{"time", "event", "replica", ...}` lines to run_dir/metrics/<replica>.jsonl.

    Each line is flushed when written, so a killed process loses none of the
    lines before its death. Safe to use from the checkpoint writer thread.
    """

    def __init__(self, run_dir: str | Path, replica: str):
        self.replica = replica
        self.path = Path(run_dir) / "metrics" / f"{replica}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, event: str, **fields: Any) -> None:
        record = {"time": time.time(), "event": event, "replica": self.replica, **_plain(fields)}
        line = json.dumps(record, allow_nan=False) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """Every whole event line of a replica's log; a line cut by a kill, or not JSON, is skipped."""
    out = []
    try:
        with open(path, "rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    break  # still being written, or cut by a kill
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict):
                    out.append(event)
    except FileNotFoundError:
        return []
    return out


# What a pod's termination message carries (the kubelet keeps at most 4 KiB of it).
TERMINATION_KEYS = ("steps", "global_step", "final_train_loss", "eval_accuracy", "eval_loss", "eval_perplexity",
                    "checkpoint_step", "checkpoint_time", "samples_per_second", "wall_seconds", "metrics")
# The kubelet keeps at most 4096 bytes of a termination message; a message cut
# there is no JSON and would lose every figure. A script's reported values go
# last and are dropped, name by name, until the rest fits.
TERMINATION_MESSAGE_BYTES = 4096


def termination_message(result: dict[str, Any]) -> str:
    """The headline figures of `result` as JSON of at most TERMINATION_MESSAGE_BYTES bytes."""
    plain = _plain(result)
    summary = {k: plain[k] for k in TERMINATION_KEYS if plain.get(k) is not None}
    metrics = {k: v for k, v in (summary.pop("metrics", None) or {}).items() if isinstance(v, (int, float))}
    while True:
        if metrics:
            summary["metrics"] = metrics
        text = json.dumps(summary, allow_nan=False, separators=(",", ":"))
        if len(text.encode()) <= TERMINATION_MESSAGE_BYTES or not metrics:
            return text
        metrics = dict(list(metrics.items())[:-1])
        summary.pop("metrics")


def write_result(run_dir: str | Path, replica: str, result: dict[str, Any],
                 termination_log: str | Path | None = None) -> Path:
    """Write run_dir/results/<replica>.json atomically (kubetrain.shared.files.atomic_write).

    With `termination_log` (in a pod: /dev/termination-log), the headline
    figures also go there, where the kubelet hands them to the operator in the
    container's terminated state: the job's final status needs no scrape.
    """
    if termination_log is not None:
        try:
            Path(termination_log).write_text(termination_message(result), encoding="utf-8")
        except OSError as err:  # only the status's final figures are lost: not worth failing the run
            log.warning("cannot write the termination message to %s: %s", termination_log, err)
    path = Path(run_dir) / "results" / f"{replica}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(_plain(result), indent=2, allow_nan=False) + "\n")
    return path


# --- start-up milestones ---------------------------------------------------------------
#
# How long a replacement replica takes from its container's start to its first
# step, in parts: the interpreter, the imports (torch), the model and data, the
# connection to its peers (a worker's registration, a shard's restore, a rank's
# rendezvous), the checkpoint, the first step. Each milestone is one line on
# stderr, which the pod's log keeps (a PS worker has no volume for an event
# log), read by tests/e2e (helpers/recovery.py) to break a recovery down.

_STARTUP_SEEN: set[str] = set()
# A forked process (a DDP rank forked from its agent, kubetrain/trainer/ddp/agent.py) is a new process: its
# milestones start again from its own `process`.
os.register_at_fork(after_in_child=_STARTUP_SEEN.clear)


def process_start_time() -> float:
    """When this process was started (exec'd), in unix seconds, to the kernel's clock tick (10 ms).

    /proc/self/stat's start time counts ticks since boot (CLOCK_BOOTTIME), so
    the process's age is that clock now minus it; the wall clock now minus the
    age is the start. /proc/stat's `btime` would do the same to a whole second
    only. time.time() now where /proc is missing (not Linux).
    """
    try:
        stat = open("/proc/self/stat", "rb").read().decode()
        # The command name (field 2) may hold spaces and parentheses: fields count after its last ')'.
        ticks = int(stat.rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - max(0.0, age)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


def startup(milestone: str, **fields: Any) -> None:
    """Record a start-up milestone of this process, once per process and name (a loop may call it
    every step): one flushed line on stderr. The first milestone of a process is preceded by
    `process`, the process's own start time."""
    if milestone in _STARTUP_SEEN:
        return
    now = time.time()
    lines = []
    if not _STARTUP_SEEN:
        _STARTUP_SEEN.add("process")
        lines.append({"milestone": "process", "time": round(process_start_time(), 3), "pid": os.getpid()})
    _STARTUP_SEEN.add(milestone)
    lines.append({"milestone": milestone, "time": round(now, 3), "pid": os.getpid(), **_plain(fields)})
    try:
        for record in lines:
            sys.stderr.write(f"{STARTUP_TAG} {json.dumps(record, allow_nan=False)}\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed: the milestones are only for measuring
        pass
