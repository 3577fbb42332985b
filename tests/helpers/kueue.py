"""Kueue for the tests: its CRDs installed and its manager running outside the cluster against the
test cluster, as `hack/kueue run` starts it (no webhooks registered, no leader election,
TrainingJob as an external framework). The binary comes from `hack/kueue build` (a cold build
takes minutes: the fixture never builds, it fails saying what to run)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from helpers.kube import ROOT
from helpers.net import free_port
from helpers.process import run, stop_process
from helpers.wait import wait_for

HACK_KUEUE = ROOT / "hack" / "kueue"
START_SECONDS = 60
"""Kueue's manager starts its caches and controllers in a few seconds here; a minute covers a
loaded machine. Beyond it the fixture fails with Kueue's log tail."""


def built() -> Path:
    done = run(str(HACK_KUEUE), "build", "--check", check=False)
    if done.returncode != 0:
        pytest.fail(f"Kueue is not built: run hack/kueue build (a few minutes cold)\n{done.stderr.strip()}",
                    pytrace=False)
    return Path(done.stdout.strip())


def install_crds(cluster) -> None:
    """`kubectl apply` of Kueue's CRDs and nothing more, as docs/scheduling.md's recipe: `running` starts
    `hack/kueue run` right after, which must wait until they are Established itself."""
    crds = sorted((built() / "crds").glob("*.yaml"))
    args = ["kubectl", "apply", "--server-side"]
    for crd in crds:
        args += ["-f", str(crd)]
    run(*args, env=cluster.env, timeout=120)


@contextmanager
def running(cluster, work: Path) -> Iterator[Path]:
    """Kueue's manager as a process for the duration; yields its log file."""
    work.mkdir(parents=True, exist_ok=True)
    log = work / "kueue.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(HACK_KUEUE), "run", str(work), str(free_port())], env=cluster.env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for("Kueue's controllers to start", lambda: proc.poll() is not None
                 or "Starting workers" in log.read_text(), START_SECONDS, 0.5,
                 explain=lambda: "kueue log:\n" + "\n".join(log.read_text().splitlines()[-30:]))
        assert proc.poll() is None, "Kueue exited:\n" + "\n".join(log.read_text().splitlines()[-40:])
        yield log
    finally:
        stop_process(proc, timeout=20, group=True)
