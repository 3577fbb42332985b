"""`python -m kubetrain.trainer script`: runs the user's own command as a replica (spec.script).

The replica's process is this small supervisor (no torch) and the user's
command is its child: it runs the command in the script's working directory
with the job's environment, passes SIGTERM and SIGINT on (a pod's deletion, a
suspend, a local stop), and exits with the command's own code (128+N when a
signal N killed it), so the restart policy sees what the script did. When the
command succeeds it writes the replica's results, and in a pod its
termination message, from what the script reported (`kubetrain.report`) and
the last checkpoint it saved: the job's final status and summary come from
there, as for the built-in loops.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kubetrain.shared.exitcodes import shell_code
from kubetrain.shared.launch import (
    CHECKPOINT_DIR_VAR, CODE_DIR_VAR, JOB_FILE_VAR, RUN_DIR_VAR, TERMINATION_LOG_VAR, group_rank, rank_replica,
)

from .context import ReplicaContext
from .errors import EXIT_OK, ConfigError
from .events import read_events, write_result

log = logging.getLogger(__name__)

# Set by the plan for the trainer's own `python -m`, where the repository's
# operator/ folder must not shadow the standard library. A user's script needs
# the opposite: `python train.py` imports the modules beside train.py.
DROPPED_ENV = ("PYTHONSAFEPATH",)
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Paths the plan may give relative to where the replica started (a local run
# directory such as runs/<name>); the script runs elsewhere (its workingDir).
PATH_VARS = (JOB_FILE_VAR, RUN_DIR_VAR, CHECKPOINT_DIR_VAR, TERMINATION_LOG_VAR)


def working_dir(ctx: ReplicaContext, environ: dict[str, str]) -> Path | None:
    """Where the command runs: workingDir, against the manifest's directory locally; None: stay here."""
    script = ctx.spec.script
    assert script is not None
    code_dir = environ.get(CODE_DIR_VAR)
    if code_dir:
        where = Path(code_dir) / script.working_dir if script.working_dir else Path(code_dir)
    elif script.working_dir:
        where = Path(script.working_dir)
    else:
        return None  # a pod: the container's working directory (the image's, or workingDir)
    if not where.is_dir():
        raise ConfigError(f"spec.script.workingDir: {where} is not a directory")
    return where


def command(ctx: ReplicaContext, python: str = sys.executable) -> list[str]:
    """The user's argv; `python` is this interpreter (it has torch and kubetrain)."""
    script = ctx.spec.script
    assert script is not None
    argv = [*script.command, *script.args]
    if argv[0] == "python":
        argv[0] = python
    return argv


def results(ctx: ReplicaContext, replica: str, wall_seconds: float) -> dict[str, Any]:
    """The replica's results from its own event log: the last reported step and values, the last checkpoint."""
    last: dict[str, Any] = {}
    checkpoint: dict[str, Any] = {}
    total = None
    for event in read_events(Path(ctx.run_dir) / "metrics" / f"{replica}.jsonl"):
        kind = event.get("event")
        if kind == "train":
            last = event
            total = event.get("total_steps", total)
        elif kind == "checkpoint":
            checkpoint = event
    reserved = {"time", "event", "replica", "step", "total_steps", "samples_per_second", "steps_per_second"}
    values = {k: v for k, v in last.items() if k not in reserved}
    out: dict[str, Any] = {
        "steps": last.get("step", 0),
        "total_steps": total,
        "final_train_loss": values.pop("loss", None),
        "eval_accuracy": values.pop("eval_accuracy", None),
        "eval_loss": values.pop("eval_loss", None),
        "samples_per_second": last.get("samples_per_second"),
        "steps_per_second": last.get("steps_per_second"),
        "metrics": values,
        "wall_seconds": wall_seconds,
        "bytes_sent": 0,
        "bytes_received": 0,
    }
    if checkpoint:
        out["checkpoint_step"] = checkpoint.get("step")
        out["checkpoint_time"] = checkpoint.get("time")
    return out


def run_script(ctx: ReplicaContext) -> int:
    """Run the user's command to its end; returns its exit code (128+N for signal N)."""
    started = time.monotonic()
    environ = dict(os.environ)
    cwd = working_dir(ctx, environ)
    argv = command(ctx)
    env = {k: v for k, v in environ.items() if k not in DROPPED_ENV}
    for name in PATH_VARS:
        if env.get(name):
            env[name] = os.path.abspath(env[name])
    # Handlers first: a SIGTERM that lands while the child starts is passed on
    # once it runs, not lost (the pod would then wait out its grace period).
    children: list[subprocess.Popen] = []
    pending: list[int] = []

    def forward(signum: int, frame: object) -> None:
        if children:
            children[0].send_signal(signum)
        else:
            pending.append(signum)

    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, forward)
    try:
        child = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise ConfigError(f"spec.script.command[0]: {argv[0]!r} not found (working directory "
                          f"{cwd or os.getcwd()})") from None
    except PermissionError:
        raise ConfigError(f"spec.script.command[0]: {argv[0]!r} is not executable") from None
    children.append(child)
    for signum in pending:
        child.send_signal(signum)
    code = child.wait()
    if code < 0:
        return shell_code(code)
    if code != EXIT_OK:
        return code
    rank = int(environ.get("RANK", "0"))  # in a fault-tolerant group: the rank in the group
    if ctx.spec.mode == "DDP":
        in_group = group_rank(environ) if ctx.spec.fault_tolerant else None
        replica = rank_replica(in_group if in_group is not None else rank)
    else:
        replica = ctx.replica
    # One process per pod speaks in its termination message: rank 0's (ranks share the file).
    write_result(ctx.run_dir, replica, results(ctx, replica, time.monotonic() - started),
                 termination_log=ctx.termination_log if rank == 0 else None)
    return EXIT_OK
