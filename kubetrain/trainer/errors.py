"""The errors of a trainer process, each mapped onto its exit code (kubetrain.shared.exitcodes)."""

from __future__ import annotations

from kubetrain.shared.exitcodes import (EXIT_CONFIG, EXIT_LOAD, EXIT_OK, EXIT_RELEASED, EXIT_TERMINATED,
                                         EXIT_TRANSIENT)

__all__ = ["EXIT_CONFIG", "EXIT_LOAD", "EXIT_OK", "EXIT_RELEASED", "EXIT_TERMINATED", "EXIT_TRANSIENT", "TrainerError",
           "ConfigError", "LoadError", "TransientError", "first_line"]


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


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (a one-line report of what a long one says)."""
    lines = str(err).strip().splitlines()
    return lines[0] if lines else ""
