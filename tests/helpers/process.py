"""Running the commands the tests call, and stopping the processes they start so that none outlives its fixture."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Mapping


def run(*args: str, env: Mapping[str, str] | None = None, input: str | None = None, timeout: float = 120,
        check: bool = True) -> subprocess.CompletedProcess:
    """Runs a command (kubectl, helm, hack/cluster, ...) to its end with `env` (None: this process's),
    its output captured as text; with `check`, a non-zero exit fails naming the command and its stderr."""
    done = subprocess.run(args, input=input, env=None if env is None else dict(env), capture_output=True,
                          text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
    return done


def stop_process(proc: subprocess.Popen, timeout: float = 30, group: bool = False) -> None:
    """SIGTERM, then SIGKILL when it has not ended within `timeout` s; `group` signals its whole
    process group (a process started with start_new_session=True, whose children must go too)."""

    def send(sig: int) -> None:
        try:
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        except ProcessLookupError:
            pass  # already gone (a group whose leader ended and was reaped)

    send(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        proc.wait()


def require_program(name: str, install: str) -> str:
    """The path of program `name`; without it the test fails under CI (CI set: `.ci/run`, where every part
    must be there and a skip would hide a missing one) and is skipped elsewhere (a developer's machine)."""
    import shutil

    import pytest

    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed: {install}"
        if os.environ.get("CI"):
            pytest.fail(f"{message} (CI is set: a missing part fails the run)", pytrace=False)
        pytest.skip(message)
    return path
