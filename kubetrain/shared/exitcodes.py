"""The exit codes of every replica, defined once: the trainer exits with them, the policies read them.

A supervisor (the local backend, the operator's restart policy, torchrun)
decides from the exit code alone whether a failure is worth a retry: 2 and 3
are permanent, 75 and 128+N are retried; 76 is a worker's release at a resize. A user's script (spec.script) speaks
the same language: its own exit code is the replica's.

A process killed by signal N exits 128+N in the shell's convention, which is also a container's
exit code in Kubernetes; Python's `Popen.returncode` says -N instead. `shell_code` is the one
place that turns the one into the other, `killed_by` the one place that reads N back.
"""

from __future__ import annotations

import signal

SIGNAL_BASE = 128
"""A process killed by signal N exits SIGNAL_BASE + N (the shell's, and a container's, convention)."""


def signaled(signum: int) -> int:
    """The exit code of a process killed by signal `signum`: 128+N."""
    return SIGNAL_BASE + int(signum)


def shell_code(returncode: int) -> int:
    """An exit code in the shell's convention: Popen's -N (killed by signal N) becomes 128+N, others stay."""
    return signaled(-returncode) if returncode < 0 else returncode


def killed_by(code: int) -> int | None:
    """The signal that killed a process that exited `code` (shell convention, or Popen's -N); None if none did."""
    if code < 0:
        return -code
    return code - SIGNAL_BASE if code > SIGNAL_BASE else None


def signal_name(signum: int) -> str:
    """SIGKILL, SIGTERM, ...; `signal N` for a number with no name here."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


EXIT_OK = 0
EXIT_CONFIG = 2
"""The configuration cannot work (a bad field, a changed spec): retrying will not help."""
EXIT_LOAD = 3
"""The data or the model could not be loaded (a missing file, a bad entry point)."""
EXIT_TRANSIENT = 75
"""A failure that may pass (a peer not up yet, a port still taken): retried."""
EXIT_RELEASED = 76
"""A parameter-server worker that ps-0 released at a resize (its index at or past the job's new
size): no failure, no success. The engine deletes its pod, and starts it again, with no restart
counted, only if the job has grown back past its index meanwhile (3 -> 1 -> 3 within a step).
Only a parameter-server worker (kubetrain's own loop) means that by 76: from a user's script (a
Single or DDP replica) it is a failure like any other code."""
EXIT_TERMINATED = signaled(signal.SIGTERM)
"""143, 128 + SIGTERM: stopped on request after writing a checkpoint, not finished."""

PERMANENT_REASONS = {EXIT_CONFIG: "InvalidConfiguration", EXIT_LOAD: "LoadFailed"}
"""The permanent exit codes, each with the reason (one CamelCase word) a job fails with when a replica exits so."""
PERMANENT_CODES = {reason: code for code, reason in PERMANENT_REASONS.items()}
"""The reverse: the exit code of a job (`kubetrain run`) that failed for one of those reasons."""
