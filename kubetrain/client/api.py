"""What the client's two backends share: the job as the typed status, the events, the errors, the interface.

`Job` is the status model of kubetrain/api/status.py with the job's name,
namespace and mode beside it: what `kubectl get tj -o yaml` shows under
`status`, typed. Errors are exceptions that name the job and the field; an
API error never reaches the caller as the API's own dump.
"""

from __future__ import annotations

import abc
import builtins  # the classes below have a method named list
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kubetrain.api import InvalidSpec, TrainingJob
from kubetrain.api.status import JobStatus, read_status

TERMINAL = ("Succeeded", "Failed")


class ClientError(Exception):
    """Something the client cannot do; the message names the job and what to do about it."""


class InvalidManifest(ClientError):
    """A manifest that does not validate: `problems` holds one line per problem, as `kubetrain validate` prints."""

    def __init__(self, err: InvalidSpec | str, source: str = ""):
        if isinstance(err, InvalidSpec):
            where = f"{err.source}: " if err.source else (f"{source}: " if source else "")
            self.problems = [f"{where}{p}" for p in err.problems]
        else:
            self.problems = [f"{source}: {err}" if source else err]
        super().__init__("\n".join(self.problems))


class JobNotFound(ClientError, LookupError):
    """No job of that name (in that namespace, or under that runs directory)."""


class JobExists(ClientError):
    """A job of that name exists already."""


class Forbidden(ClientError, PermissionError):
    """The API server refused the call for this user (RBAC): docs/client.md#permissions lists what the client needs."""


class WaitTimeout(ClientError, TimeoutError):
    """`wait` ran out of time; `job` is the job as last seen."""

    def __init__(self, message: str, job: "Job"):
        super().__init__(message)
        self.job = job


class JobEnded(ClientError):
    """The job ended in a state `wait` was not waiting for; `job` is the job as it ended."""

    def __init__(self, message: str, job: "Job"):
        super().__init__(message)
        self.job = job


@dataclass(repr=False)
class Job(JobStatus):
    """A TrainingJob as its typed status (`.state`, `.progress.step`, `.restarts`, `.conditions`,
    `.last_checkpoint`, ...: kubetrain/api/status.py), with its name, namespace and mode."""

    name: str = ""
    namespace: str = ""
    mode: str = ""

    @classmethod
    def of(cls, name: str, namespace: str, mode: str, status: JobStatus | dict[str, Any] | None) -> "Job":
        typed = status if isinstance(status, JobStatus) else read_status(status)
        return cls(name=name, namespace=namespace, mode=mode,
                   **{f.name: getattr(typed, f.name) for f in fields(JobStatus)})

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL

    @property
    def condition(self) -> Any:
        """The condition of the current state (its reason and message say why), or None."""
        return next((c for c in self.conditions if c.type == self.state and c.status == "True"), None)

    def __repr__(self) -> str:
        p = self.progress
        step = f"{p.step}/{p.total_steps if p.total_steps else '?'}" if p is not None else "0/?"
        loss = f", loss={p.loss:.4g}" if p is not None and p.loss is not None else ""
        return (f"Job(name={self.name!r}, mode={self.mode!r}, state={self.state!r}, step={step}{loss}, "
                f"restarts={self.restarts})")


@dataclass(frozen=True)
class Event:
    """One event of a job: what the engine decided (Restarted, Suspended, Succeeded, ...)."""

    time: str  # RFC 3339
    type: str  # Normal | Warning
    reason: str
    message: str
    count: int = 1


class Backend(abc.ABC):
    """One way of running jobs: a cluster (client/cluster_backend.py) or this machine (client/rundir_backend.py)."""

    where: str  # "namespace NS" or "runs directory DIR", for messages

    @abc.abstractmethod
    def create(self, job: TrainingJob, doc: dict[str, Any], code_dir: Path | None) -> str: ...

    @abc.abstractmethod
    def get(self, name: str) -> Job: ...

    @abc.abstractmethod
    def list(self) -> list[Job]: ...

    @abc.abstractmethod
    def watch(self, name: str, timeout: float | None) -> Iterator[Job]:
        """The job now, then at every change, until `timeout` seconds have passed (None: for ever)."""

    @abc.abstractmethod
    def logs(self, name: str, replica: str | None, follow: bool) -> Iterator[str]: ...

    @abc.abstractmethod
    def events(self, name: str) -> builtins.list[Event]: ...

    @abc.abstractmethod
    def scale(self, name: str, replicas: int) -> None: ...

    @abc.abstractmethod
    def suspend(self, name: str) -> None: ...

    @abc.abstractmethod
    def resume(self, name: str) -> None: ...

    @abc.abstractmethod
    def delete(self, name: str) -> None: ...

    @abc.abstractmethod
    def export(self, name: str, path: Path | str, fmt: str = "torch", merge_lora: bool = False) -> Path | str: ...

    @abc.abstractmethod
    def spec(self, name: str) -> TrainingJob:
        """The job's manifest, defaults filled in."""


def prefixed(replica: str, line: str, prefix: bool) -> str:
    """A log line as `logs` yields it: `[replica] line` when lines of several replicas are mixed."""
    return f"[{replica}] {line}" if prefix else line


def unknown_replica(name: str, replica: str, replicas: Sequence[str]) -> ClientError:
    return ClientError(f"{name}: no replica {replica!r}; this job has {', '.join(replicas)}")
