"""The process side of `import kubetrain`: one session per process, made at the first call.

A script run by kubetrain (`spec.script`) finds its job in the environment
the plan gives every replica (KUBETRAIN_JOB_FILE, KUBETRAIN_CHECKPOINT_DIR,
KUBETRAIN_METRICS_PORT, ...) and, in mode DDP, its rank in torchrun's
(RANK, LOCAL_RANK, WORLD_SIZE). The session holds the same `JobCheckpoints`
and `ProgressReporter` the built-in loops use, so a script's checkpoints,
progress, metrics and faults are kubetrain's own.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kubetrain.shared.launch import CHECKPOINT_DIR_VAR, JOB_FILE_VAR, fault_armed, group_rank, rank_replica

from .context import ReplicaContext
from .session import JobCheckpoints, ProgressReporter, number
from .errors import EXIT_TRANSIENT, TrainerError, TransientError
from .events import EventLog
from .metrics import TrainerMetrics

# Types `torch.load(weights_only=True)` reads back; anything else in a saved
# state would be written fine and then refuse to load at the next start.
PLAIN = (int, float, bool, str, bytes, type(None))
# How deep a saved state may nest: a state deeper than this is almost surely a
# cycle or a mistake, and walking it must not hit Python's recursion limit.
MAX_STATE_DEPTH = 64


class NotUnderKubetrain(RuntimeError):
    """The process was not started by kubetrain (`kubetrain run` or the operator)."""


@dataclasses.dataclass
class Rank:
    """This process's place in a DDP group (torchrun's environment); rank 0 of 1 otherwise."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "Rank":
        try:
            world = int(env.get("WORLD_SIZE", "1"))
            return cls(int(env.get("RANK", "0")), int(env.get("LOCAL_RANK", "0")), world,
                       int(env.get("LOCAL_WORLD_SIZE", str(world))))
        except ValueError as err:
            raise NotUnderKubetrain(f"torchrun environment: {err}") from None

    @property
    def nodes(self) -> int:
        """Nodes (pods) of the group: torchrun runs LOCAL_WORLD_SIZE ranks on each."""
        return max(1, self.world_size // max(1, self.local_world_size))


class Session:
    """The job as one process of a script sees it."""

    def __init__(self, environ: Mapping[str, str]):
        if not environ.get(JOB_FILE_VAR):
            raise NotUnderKubetrain(
                "kubetrain: this process was not started by kubetrain (KUBETRAIN_JOB_FILE is not set); run the "
                "script through a TrainingJob with spec.script: `kubetrain run job.yaml` or `kubectl apply -f job.yaml`"
            )
        try:
            ctx = ReplicaContext.from_env(environ=environ)
        except TrainerError as err:
            raise NotUnderKubetrain(f"kubetrain: {err}") from None
        self.rank = Rank.from_env(environ)
        if ctx.spec.mode == "DDP" or "RANK" in environ:
            # A fault-tolerant group is a torchrun group of its own: its RANK is the rank in the group.
            in_group = group_rank(environ) if ctx.spec.fault_tolerant else None
            replica = rank_replica(in_group if in_group is not None else self.rank.rank)
            ctx = dataclasses.replace(ctx, replica=replica, role="ddp", index=self.rank.rank,
                                      fault_step=ctx.fault_step if fault_armed(environ, replica) else None,
                                      fault_save=ctx.fault_save if fault_armed(environ, replica) else None)
        self.ctx = ctx
        self.metrics = TrainerMetrics(ctx)
        self.events = EventLog(ctx.run_dir, ctx.replica)
        # Saves are written in the background, as the built-in loops' are: the
        # script's next step runs while the file is written and verified.
        self.checkpoints = JobCheckpoints(ctx, self.metrics, self.events, reader=self.rank.local_rank == 0,
                                          writer=self.rank.rank == 0, nodes=self.rank.nodes)
        self.reporter = ProgressReporter(ctx, self.metrics, self.events)
        self.metrics.process_starts_total.inc()
        port = ctx.metrics_port
        self.metrics.serve(port + self.rank.local_rank if port else 0, ctx.listen_address)
        self.events.write("start", step=0, pid=os.getpid(), rank=self.rank.rank, world_size=self.rank.world_size)
        atexit.register(self._at_exit)
        _report_kubetrain_errors()

    def restore(self, template: dict[str, Any] | None = None) -> tuple[Any, int]:
        if template is not None and not isinstance(template, dict):
            raise TypeError(f"kubetrain.restore: template must be a dict (the structure saved), got "
                            f"{type(template).__name__}")
        if self.rank.world_size > 1:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(
                    "kubetrain.restore(): in a DDP job call it after torch.distributed.init_process_group(): "
                    "the ranks agree on the newest checkpoint any node holds, so that every rank gets the same one"
                )
            found = self.checkpoints.restore(None, dist.get_world_size(), dist.get_rank(),
                                             self.checkpoints.load_local(), template=template)
        else:
            found = self.checkpoints.restore(template=template)
        if found is None:
            return None, 0
        step, state, _ = found
        self.reporter.start_window(step)  # the step gauge too
        return state, step

    def save(self, state: Any, step: int, wait: bool = False) -> None:
        check_state(state)
        self.checkpoints.save(_step(step, "save"), state)
        if wait:
            self.checkpoints.wait()

    def report(self, step: int, total_steps: int | None, values: dict[str, Any]) -> None:
        step = _step(step, "report")
        if total_steps is not None:
            total_steps = _step(total_steps, "report", "total_steps")
        floats = {name: number(name, value) for name, value in values.items()}
        self.reporter.report(step, total_steps, **floats)  # type: ignore[arg-type]  # metrics' names, all floats

    def close(self) -> None:
        """The last save durable (TransientError if it failed); the last reported step in the event log."""
        try:
            self.checkpoints.wait()
        finally:
            self.reporter.flush()
            self.metrics.close()
            self.events.close()

    def _at_exit(self) -> None:
        """At the interpreter's exit: a last save that failed in the background fails the process.

        The script has returned (its `save` returned after the copy into
        memory), so nothing else would tell the job that its newest checkpoint
        is missing. Exiting with 75 (transient) makes the restart policy run
        it again from the newest durable checkpoint. An exception raised here
        would not change the exit code, hence os._exit (after flushing).
        """
        try:
            self.close()
        except TransientError as err:
            print(f"kubetrain: {err}; exiting with {EXIT_TRANSIENT} so that the job resumes from the newest "
                  "durable checkpoint", file=sys.stderr)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_TRANSIENT)


def _report_kubetrain_errors() -> None:
    """An uncaught kubetrain error in the script ends it as a built-in loop's would: one line, its exit code.

    A sharded save on a volume per node, a restore without a template: the
    message says what to change, and the exit code says whether retrying can
    help (2 and 3 are permanent, so the job fails at once instead of
    restarting until its backoff limit). Any other exception keeps Python's
    own traceback and exit code 1: it is the script's own.
    """
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: Any) -> None:
        if not isinstance(error, TrainerError):
            previous(kind, error, tb)
            return
        print(f"kubetrain: {error}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(error.exit_code)

    sys.excepthook = hook


def _step(value: Any, call: str, name: str = "step") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        item = getattr(value, "item", None)
        value = item() if callable(item) else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TypeError(f"kubetrain.{call}: {name} must be a non-negative integer, got {value!r}")
    return value


def check_state(state: Any) -> None:
    """Refuse, before writing, a state that `torch.load(weights_only=True)` would not read back."""
    import torch

    if not isinstance(state, dict):
        raise TypeError(f"kubetrain.save: state must be a dict (of tensors and plain values), got {type(state).__name__}")

    def walk(value: Any, path: str, depth: int) -> None:
        if depth > MAX_STATE_DEPTH:
            raise TypeError(f"kubetrain.save: state{path} nests deeper than {MAX_STATE_DEPTH} levels")
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, (str, int)):
                    raise TypeError(f"kubetrain.save: state{path} has a key of type {type(key).__name__}; "
                                    "use strings or integers")
                walk(item, f"{path}[{key!r}]", depth + 1)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, f"{path}[{i}]", depth + 1)
        elif not isinstance(value, (torch.Tensor, torch.Size, torch.dtype, torch.device) + PLAIN):
            raise TypeError(
                f"kubetrain.save: state{path} is a {type(value).__name__}; a checkpoint holds tensors, numbers, "
                "strings and dicts or lists of them (torch.load(weights_only=True) reads nothing else back); "
                "for a model or optimizer save its state_dict()"
            )

    walk(state, "", 0)


_lock = threading.Lock()
_session: Session | None = None


def session() -> Session:
    """This process's session, made at the first call."""
    global _session
    with _lock:
        if _session is None:
            _session = Session(os.environ)
        return _session


def checkpoint_dir() -> Path:
    """The job's durable directory for this process (KUBETRAIN_CHECKPOINT_DIR), created if missing."""
    raw = os.environ.get(CHECKPOINT_DIR_VAR)
    if not raw:
        raise NotUnderKubetrain(
            "kubetrain.checkpoint_dir(): KUBETRAIN_CHECKPOINT_DIR is not set; run the script through a "
            "TrainingJob with spec.script (`kubetrain run job.yaml`)"
        )
    path = Path(raw)
    path.mkdir(parents=True, exist_ok=True)
    return path
