"""Recovery in parts: from a fault (a replica's process killed, its pod deleted) to its replacement's first step.

Pure: what was gathered goes in, marks and parts come out (tests/e2e/e2elib.py
gathers; tests/e2e/test_e2e_faults.py prints and checks). Every mark is a unix
time on one clock, the test machine's, which the real node and its pods share:

- the fault: when the test's kill or delete returned;
- the pods' watch (`kubectl get pods -w`), timed as its events arrive: the old
  pod's container reported dead by the kubelet, the old pod gone, the
  replacement created, scheduled;
- the operator's log: the restart decided (a line per restart, drivers/cluster/rounds.py);
- the replacement's own log: its start-up milestones (kubetrain/trainer/events.py
  `startup`), from its process's start (/proc) to its first step.

Marks arrive from different observers, so only causal order is checked
(created, scheduled, the process, its milestones); a part between two
observers' marks may be off by an event's delivery (milliseconds).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from kubetrain.shared.launch import STARTUP_TAG  # no torch: the launch contract only

# Each kind of fault: the marks in the order they happen, and what the part ending at each one is.
# A trainer mark is `<role>.<milestone>`: role `agent` is a DDP pod's torchrun, `ddp` its rank.
_REPLACEMENT_START = [
    ("created", "replacement pod created"),
    ("scheduled", "scheduled"),
]
_PROCESS = [
    ("main", "interpreter + kubetrain's own imports"),
    ("imports", "the role's imports (torch, grpc)"),
    ("model", "model and data built"),
]
KINDS: dict[str, list[tuple[str, str]]] = {
    "worker": [
        ("fault", "fault"),
        ("stopped", "kubelet reports the container dead"),
        ("decided", "operator decides the restart"),
        ("gone", "failed pod deleted"),
        *_REPLACEMENT_START,
        ("worker.process", "sandbox and container started"),
        *[(f"worker.{m}", label) for m, label in _PROCESS],
        ("worker.registered", "registered with ps-0 (cursor back)"),
        ("worker.first_step", "first step"),
    ],
    "ps": [
        ("fault", "fault"),
        ("stopped", "kubelet reports the container dead"),
        ("decided", "operator decides the restart"),
        ("gone", "failed pod deleted"),
        *_REPLACEMENT_START,
        ("ps.process", "sandbox and container started"),
        *[(f"ps.{m}", label) for m, label in _PROCESS],
        ("ps.restored", "checkpoint restored"),
        ("ps.serving", "gRPC server listening"),
        ("workers_back", "every worker's calls answered again"),
        ("ps.first_step", "first step applied"),
    ],
    "ddp": [
        ("fault", "fault"),
        ("stopped", "old pod's ranks stop (SIGTERM, checkpoint)"),
        ("gone", "old pod removed"),
        *_REPLACEMENT_START,
        ("agent.process", "sandbox and container started"),
        ("agent.main", "torchrun agent: interpreter"),
        ("agent.imports", "torchrun agent: torch imported"),
        ("ddp.process", "agents' rendezvous, rank spawned"),
        *[(f"ddp.{m}", label) for m, label in _PROCESS],
        ("ddp.joined", "ranks' process group joined"),
        ("ddp.restored", "checkpoint loaded and broadcast"),
        ("ddp.first_step", "first step"),
    ],
    # A job with a standby worker (kubetrain/trainer/ps/standby.py): a killed worker's place goes to the standby,
    # a process started long before, with torch imported; the killed pod's replacement is not waited for.
    "standby": [
        ("fault", "fault"),
        ("handed_over", "ps-0 hands the place over (the killed process's connection closed)"),
        ("standby.placed", "the standby told its place"),
        ("standby.model", "model and data built"),
        ("standby.registered", "registered with ps-0 (cursor back)"),
        ("standby.first_step", "first step"),
    ],
}
# Marks a recovery may lack: a worker whose calls to a restarting shard happened to wait rather
# than fail has no retry to report.
OPTIONAL = {"workers_back"}
# Causal order, each mark after the one before it whatever observed it: what a test may assert.
CAUSAL = {
    "worker": ["fault", "created", "scheduled", "worker.process", "worker.imports", "worker.registered",
               "worker.first_step"],
    "ps": ["fault", "created", "scheduled", "ps.process", "ps.imports", "ps.restored", "ps.serving", "ps.first_step"],
    "ddp": ["fault", "created", "scheduled", "agent.process", "agent.imports", "ddp.process", "ddp.imports",
            "ddp.joined", "ddp.restored", "ddp.first_step"],
    "standby": ["fault", "handed_over", "standby.placed", "standby.registered", "standby.first_step"],
}


def kind_of(replica: str) -> str:
    """The breakdown's kind for a replica name: worker-1 -> worker, ps-0 -> ps, ddp-1 -> ddp."""
    kind = replica.rsplit("-", 1)[0]
    if kind not in KINDS:
        raise ValueError(f"no recovery breakdown for replica {replica!r}; kinds: {sorted(KINDS)}")
    return kind


# --- the replacement's own log ---------------------------------------------------------------------


def startup_records(log: str) -> list[dict[str, Any]]:
    """The start-up milestone records in a pod's log, in order (other lines, and broken ones, skipped)."""
    out = []
    for line in log.splitlines():
        _, tag, rest = line.partition(f"{STARTUP_TAG} ")
        if not tag:
            continue
        try:
            record = json.loads(rest)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("milestone"), str) and \
                isinstance(record.get("time"), (int, float)):
            out.append(record)
    return out


def trainer_marks(log: str) -> dict[str, float]:
    """`<role>.<milestone>` -> time, one process per role: the one that reached its first step
    first (a rank restarted in its pod leaves two), else the last one started."""
    by_pid: dict[Any, dict[str, float]] = {}
    roles: dict[Any, str] = {}
    for record in startup_records(log):
        pid = record.get("pid")
        by_pid.setdefault(pid, {}).setdefault(record["milestone"], float(record["time"]))
        if record["milestone"] == "main" and isinstance(record.get("role"), str):
            roles[pid] = record["role"]
    chosen: dict[str, dict[str, float]] = {}
    for pid, marks in by_pid.items():
        role = roles.get(pid, "?")
        best = chosen.get(role)
        if best is None:
            chosen[role] = marks
            continue
        mine, theirs = marks.get("first_step"), best.get("first_step")
        if (mine is not None and (theirs is None or mine < theirs)) or \
                (mine is None and theirs is None and marks.get("process", 0) > best.get("process", 0)):
            chosen[role] = marks
    return {f"{role}.{name}": t for role, marks in chosen.items() for name, t in marks.items()}


# --- the operator's log ----------------------------------------------------------------------------

ASCTIME_RESOLUTION = 0.001  # Python logging's asctime: milliseconds, truncated
_LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) \w+ [\w.]+: (.*)$")
"""A line of Python logging's "%(asctime)s %(levelname)s %(name)s: %(message)s" (operator and trainer)."""


def log_lines(log: str, after: float) -> list[tuple[float, str]]:
    """(unix time, message) of each logging line at or after `after` less a second (asctime: UTC in the
    pods, to the millisecond, on the machine's one clock; the second absorbs rounding)."""
    out = []
    for line in log.splitlines():
        match = _LOG_LINE.match(line.strip())
        if not match:
            continue
        when = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc).timestamp() \
            + int(match.group(2)) / 1000
        if when >= after - 1.0:
            out.append((when, match.group(3)))
    return out


def operator_marks(log: str, namespace: str, job: str, replica: str, after: float) -> dict[str, float]:
    """From the operator's log (Python logging's asctime, UTC in its pod): `decided`, the first
    restart of `replica` at or after `after` (unix s, less a second: asctime has ms, the clocks are
    one), and `created_logged`, its next pod created."""
    marks: dict[str, float] = {}
    decided = f"{namespace}/{job}: {replica} failed ("
    created = f"{namespace}/{job}: created pod {job}-{replica}"
    for when, message in log_lines(log, after):
        if "decided" not in marks and message.startswith(decided):
            marks["decided"] = when
        elif "decided" in marks and "created_logged" not in marks and message == created:
            marks["created_logged"] = when
    return marks


def handover_marks(ps0_log: str, worker: int, after: float) -> dict[str, float]:
    """`handed_over`: when ps-0's coordinator gave worker `worker`'s place to a standby, its first such
    line at or after `after` (coordinator.py logs it as the killed process's Stand call ends)."""
    line = f"worker {worker}'s process ended before it finished: a standby"
    # asctime truncates to the millisecond: a handover in the fault's own millisecond may read up to 1 ms
    # before the fault, and is the fault's time then (it cannot precede what caused it).
    times = [max(when, after) for when, message in log_lines(ps0_log, after)
             if message.startswith(line) and when >= after - ASCTIME_RESOLUTION]
    return {"handed_over": min(times)} if times else {}


def workers_back(worker_logs: Iterable[str], after: float) -> dict[str, float]:
    """`workers_back`: when the last of the workers had a call answered after retrying (transport.py's
    "answered after N retries" line), each worker's first such line after `after`; {} when one has none."""
    firsts = []
    for log in worker_logs:
        times = [when for when, message in log_lines(log, after) if ": answered after " in message and when >= after]
        if not times:
            return {}
        firsts.append(min(times))
    return {"workers_back": max(firsts)} if firsts else {}


# --- the pods' watch -------------------------------------------------------------------------------


def _terminated(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") in ("Failed", "Succeeded"):
        return True
    return any("terminated" in (s.get("state") or {}) for s in status.get("containerStatuses") or [])


def watch_marks(events: Iterable[tuple[float, str, dict[str, Any]]], old_uid: str) -> dict[str, float]:
    """From the watch's (arrival time, type, pod) of one pod name: `stopped` (the old pod's container
    reported terminated), `gone` (the old pod deleted), `created`, `scheduled`, `running` (the
    replacement: its first event, a node named, its container reported running)."""
    marks: dict[str, float] = {}
    new_uid = None
    for at, kind, pod in events:
        uid = (pod.get("metadata") or {}).get("uid")
        if uid == old_uid:
            if "stopped" not in marks and _terminated(pod):
                marks["stopped"] = at
            if kind == "DELETED":
                marks.setdefault("stopped", at)
                marks["gone"] = at
            continue
        if new_uid is None:
            if kind == "DELETED":
                continue
            new_uid = uid
            marks["created"] = at
        if uid != new_uid:
            continue  # a later incarnation still: the first replacement is the one timed
        if "scheduled" not in marks and (pod.get("spec") or {}).get("nodeName"):
            marks["scheduled"] = at
        running = any("running" in (s.get("state") or {}) for s in (pod.get("status") or {}).get("containerStatuses") or [])
        if "running" not in marks and running:
            marks["running"] = at
    return marks


def json_stream(text: str) -> tuple[list[Any], str]:
    """The whole JSON documents at the start of `text` (kubectl -o json prints them one after
    another, each on several lines), and what is left (a document not yet complete)."""
    decoder = json.JSONDecoder()
    out, i = [], 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return out, ""
        try:
            doc, i = decoder.raw_decode(text, i)
        except ValueError:
            return out, text[i:]
        out.append(doc)


# --- the breakdown -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    label: str
    mark: str
    seconds: float | None  # None: this mark or every one before it is missing


@dataclass(frozen=True)
class Breakdown:
    kind: str
    marks: dict[str, float]
    parts: list[Part]

    @property
    def total(self) -> float | None:
        """Fault to the replacement's first step, by its own log."""
        first, last = self.marks.get("fault"), self.marks.get(KINDS[self.kind][-1][0])
        return None if first is None or last is None else last - first

    @property
    def missing(self) -> list[str]:
        return [mark for mark, _ in KINDS[self.kind] if mark not in self.marks and mark not in OPTIONAL]

    def out_of_order(self) -> list[tuple[str, str]]:
        """Pairs of causally ordered marks (CAUSAL) found the other way round."""
        chain = [m for m in CAUSAL[self.kind] if m in self.marks]
        return [(a, b) for a, b in zip(chain, chain[1:]) if self.marks[b] < self.marks[a]]

    def largest(self) -> Part | None:
        timed = [p for p in self.parts if p.seconds is not None]
        return max(timed, key=lambda p: p.seconds) if timed else None

    def describe(self) -> str:
        total = f"{self.total:.2f} s" if self.total is not None else "?"
        parts = "; ".join(f"{p.label} {p.seconds:+.2f}" if p.seconds is not None else f"{p.label} ?"
                          for p in self.parts)
        return f"{self.kind} recovery {total}: {parts}"


def breakdown(kind: str, marks: dict[str, float]) -> Breakdown:
    """The parts between consecutive marks of the kind's sequence (a missing mark: its part is None,
    and the next part runs from the last mark present)."""
    parts, last = [], marks.get("fault")
    for mark, label in KINDS[kind][1:]:
        at = marks.get(mark)
        parts.append(Part(label, mark, None if at is None or last is None else at - last))
        if at is not None:
            last = at
    return Breakdown(kind, dict(marks), parts)
