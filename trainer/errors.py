"""Exit codes of every trainer process and the errors that map onto them.

A supervisor (the local backend, the operator's restart policy, torchrun)
decides from the exit code alone whether a failure is worth a retry: 2 and 3
are permanent, 75 and 128+N are retried.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_CONFIG = 2
EXIT_LOAD = 3
EXIT_TRANSIENT = 75
# 128 + SIGTERM: stopped on request after writing a checkpoint, not finished.
EXIT_TERMINATED = 143


class TrainerError(Exception):
    """A failure the trainer reports with a one-line message and its own exit code."""

    exit_code = 1


class ConfigError(TrainerError):
    """The configuration cannot work (a bad field, a changed spec); retrying will not help."""

    exit_code = EXIT_CONFIG


class LoadError(TrainerError):
    """The data or the model could not be loaded (missing file, bad entry point)."""

    exit_code = EXIT_LOAD


class TransientError(TrainerError):
    """A failure that may pass (a peer not up yet, a port still taken); the supervisor retries."""

    exit_code = EXIT_TRANSIENT
