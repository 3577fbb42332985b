"""The local backend's half of a live ParameterServer resize, with a stand-in trainer (the real one's half,
ps-0 re-dealing the epoch, is tests/local/test_elastic.py's): `kubetrain scale` while `kubetrain run` runs
starts the new worker with the rewritten job.yaml and stops nothing; a worker above the size that exits 0 by
itself (ps-0 released it) is no event of the job and no restart; the run still ends when the job does."""

from __future__ import annotations

import io
import json
import sys
import threading
from pathlib import Path

import yaml

from helpers.wait import wait_for
from kubetrain.api import from_object
from kubetrain.cli import main as kubetrain_main
from kubetrain.drivers.local.runner import LocalRunner
from kubetrain.drivers.local.rundir import RunDir
from support import job_doc

# What a trainer of this test does: note its start (replica, pid, the size its job file says), then
# exit 0 once released (a worker whose index is at or above the size in its job file) or once the test
# says the job is done. SIGTERM ends it as a kill (no handler): a stop shows as a start without an exit.
STAND_IN = '''
import os, sys, time, yaml
name, log, done = os.environ["KUBETRAIN_REPLICA"], os.environ["STAND_IN_LOG"], os.environ["STAND_IN_DONE"]
def size():
    with open(os.environ["KUBETRAIN_JOB_FILE"]) as f:
        spec = yaml.safe_load(f)["spec"]
    return spec.get("replicas") or spec["parameterServer"]["workers"]
def note(what):
    with open(log, "a") as f:
        f.write(f"{what} {name} {os.getpid()} {size()}\\n")
note("start")
while True:
    if name.startswith("worker-") and int(name.split("-")[1]) >= size():
        note("released")
        sys.exit(0)
    if os.path.exists(done):
        note("done")
        sys.exit(0)
    time.sleep(0.05)
'''


def lines(log: Path) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines()] if log.exists() else []


def started(log: Path) -> dict[str, list[str]]:
    """replica -> the pids it was started with, in order."""
    out: dict[str, list[str]] = {}
    for what, name, pid, _ in lines(log):
        if what == "start":
            out.setdefault(name, []).append(pid)
    return out


def test_a_parameter_server_job_resized_live_keeps_its_processes_and_lets_the_released_ones_go(tmp_path,
                                                                                             monkeypatch):
    trainer = tmp_path / "trainer.py"
    trainer.write_text(STAND_IN)
    python = tmp_path / "python"  # what the plan's `python -m kubetrain.trainer ROLE` runs
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {trainer}\n")
    python.chmod(0o755)
    log, done = tmp_path / "trainers.log", tmp_path / "done"
    monkeypatch.setenv("STAND_IN_LOG", str(log))
    monkeypatch.setenv("STAND_IN_DONE", str(done))
    job = from_object(job_doc("live", "ParameterServer", parameterServer={"workers": 2}))
    run = RunDir(tmp_path / "run")
    out = io.StringIO()
    backend = LocalRunner(job, run, out=out, echo_logs=False, python=str(python))
    seen: dict = {}

    def scale_and_finish():
        try:
            first = wait_for("the three replicas", lambda: len(started(log)) == 3 and started(log), 60)
            assert kubetrain_main(["scale", str(run.path), "--replicas", "3"]) == 0
            seen["up"] = wait_for("worker-2 started", lambda: "worker-2" in started(log) and started(log), 60)
            seen["first"] = first
            assert kubetrain_main(["scale", str(run.path), "--replicas", "1"]) == 0
            wait_for("worker-1 and worker-2 released and forgotten",
                     lambda: sum(1 for e in lines(log) if e[0] == "released") == 2
                     and not {"worker-1", "worker-2"} & set(backend.procs), 60)
            seen["state"] = json.loads((run.path / "state.json").read_text())["status"]
            seen["starts_at_1"] = started(log)
        finally:
            done.touch()

    helper = threading.Thread(target=scale_and_finish)
    helper.start()
    code = backend.run_job()  # the main thread: it handles SIGTERM
    helper.join(60)
    assert code == 0, out.getvalue()
    assert "up" in seen and "starts_at_1" in seen, (seen, out.getvalue())
    first = seen["first"]
    # Nothing restarted at either resize: one process each, the same from start to end.
    assert seen["starts_at_1"] == {**first, "worker-2": seen["up"]["worker-2"]}
    assert all(len(pids) == 1 for pids in seen["starts_at_1"].values())
    # worker-2 started with the job file at 3; worker-1 and worker-2 left by themselves at 1.
    assert ["start", "worker-2", seen["up"]["worker-2"][0], "3"] in lines(log)
    assert sorted(e[1] for e in lines(log) if e[0] == "released") == ["worker-1", "worker-2"]
    assert seen["state"]["replicas"] == 1 and seen["state"]["restarts"] == 0
    assert seen["state"]["state"] == "Running"
    summary = json.loads((run.path / "summary.json").read_text())
    assert summary["state"] == "Succeeded" and summary["restarts"] == 0
    assert yaml.safe_load(run.job_file.read_text())["spec"]["replicas"] == 1
    said = out.getvalue()
    assert "Resized from 2 to 3 workers, live: worker-2 joins" in said
    assert "Resized from 3 to 1 workers, live: worker-1 and worker-2 leave after their step" in said
    assert " restart 1 of " not in said and "exited" not in said  # no restart decided, no exit reported
