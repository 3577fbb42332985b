"""The client's backend on this machine: `kubetrain run` in the background, one run directory per job.

A job named N lives in `RUNS_DIR/N/`, the run directory `kubetrain run
--run-dir RUNS_DIR/N` writes (docs/internals.md): its status is state.json
(the engine's, progress included), its events events.jsonl, its logs
logs/<replica>.log. A run started by hand with `kubetrain run --run-dir` is a
job of this backend too. Reading files costs no API call: `watch` and
`logs(follow=True)` look at the files every LOCAL_POLL_SECONDS.
"""

from __future__ import annotations

import builtins  # the classes below have a method named list
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kubetrain.shared.launch import CODE_DIR_VAR
from kubetrain.shared.timestamps import iso

from kubetrain.api import InvalidSpec, TrainingJob, dump_manifest, load_one
from kubetrain.api.status import to_dict
from kubetrain.engine.plan import replica_names
from kubetrain.drivers.local.runner import GRACE_SECONDS, LogTail
from kubetrain.drivers.local.rundir import RunDir, RunDirError, process_alive, scale_run
from .api import Backend, ClientError, Event, InvalidManifest, Job, JobExists, JobNotFound, prefixed, unknown_replica

LOCAL_POLL_SECONDS = 0.25
"""How often `watch` and `logs(follow=True)` look at a run's files: a file's size and state.json, both
cheap; a change shows within this (the supervisor itself writes progress at most once a second)."""
START_SECONDS = 60.0
"""`create` and `resume` wait this long for the `kubetrain run` they start to take the run directory (its
run.pid): importing the control plane and preparing the directory take about a second; one that exits
first (a run directory that holds another job) is reported with its message."""
STOP_SECONDS = GRACE_SECONDS + 30.0
"""`suspend` and `delete` wait this long for the supervisor to stop: its replicas get GRACE_SECONDS to
checkpoint after SIGTERM, then SIGKILL; the rest is the supervisor's own exit."""
LAUNCH = "launch.json"  # how the client started the run (manifest, code directory), for `resume`


class RunDirBackend(Backend):
    def __init__(self, runs_dir: str | Path = "runs"):
        self.runs_dir = Path(runs_dir).resolve()
        self.where = f"runs directory {self.runs_dir}"
        self._children: dict[str, subprocess.Popen] = {}  # runs started by this client, reaped by poll()

    # -- reading -----------------------------------------------------------------------

    def run_dir(self, name: str) -> RunDir:
        run = RunDir(self.runs_dir / name)
        if not run.job_file.is_file():
            raise JobNotFound(f"{name}: no such job in {self.where} (no {run.job_file})")
        return run

    def spec(self, name: str) -> TrainingJob:
        run = self.run_dir(name)
        try:
            return load_one(run.job_file)
        except InvalidSpec as err:
            raise InvalidManifest(err) from None

    def get(self, name: str) -> Job:
        self._reap()
        run = self.run_dir(name)
        job = self.spec(name)
        return self._job(run, job)

    def _job(self, run: RunDir, job: TrainingJob) -> Job:
        state = run.load_state() if run.state_file.exists() else None
        status = to_dict(state.status) if state is not None and state.status is not None else {}
        summary = run.read_summary()
        if summary is not None and summary.get("state") in ("Succeeded", "Failed"):
            status["state"] = summary["state"]
        elif run.supervisor() is None and status.get("state") not in ("Succeeded", "Failed", None):
            # Nobody supervises it (stopped by `suspend`, Ctrl-C, or killed): it runs again on `resume`.
            status["state"] = "Suspended"
        return Job.of(job.name, job.metadata.namespace, job.spec.mode, status)

    def list(self) -> list[Job]:
        self._reap()
        jobs = []
        for path in sorted(self.runs_dir.glob("*/job.yaml")):
            try:
                jobs.append(self._job(RunDir(path.parent), load_one(path)))
            except (InvalidSpec, OSError, ValueError):
                continue  # not a run of a TrainingJob (or half written): not a job
        return jobs

    def watch(self, name: str, timeout: float | None) -> Iterator[Job]:
        deadline = None if timeout is None else time.monotonic() + timeout
        last = None
        while True:
            job = self.get(name)
            seen = (to_dict(job), job.state)
            if seen != last:
                last = seen
                yield job
            if deadline is not None and time.monotonic() >= deadline:
                return
            time.sleep(LOCAL_POLL_SECONDS)

    def events(self, name: str) -> builtins.list[Event]:
        run = self.run_dir(name)
        out = []
        for line in run.events_file.read_text().splitlines() if run.events_file.exists() else []:
            try:
                e = json.loads(line)
                when = iso(float(e["time"]))
                out.append(Event(when, e["type"], e["reason"], e["message"]))
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by a kill
        return out

    def logs(self, name: str, replica: str | None, follow: bool) -> Iterator[str]:
        run = self.run_dir(name)
        job = self.spec(name)
        names = self._replicas(job)
        if replica is not None and replica not in names:
            raise unknown_replica(name, replica, names)
        chosen = [replica] if replica else names
        tails = {r: LogTail(run.log_file(r), from_start=True) for r in chosen}
        while True:
            running = run.supervisor() is not None
            for r, tail in tails.items():
                for line in tail.read(final=not follow or not running):
                    yield prefixed(r, line, replica is None)
            if not follow or not running:
                return
            time.sleep(LOCAL_POLL_SECONDS)

    @staticmethod
    def _replicas(job: TrainingJob) -> builtins.list[str]:
        return [f"{role}-{i}" for role, i in replica_names(job)]

    # -- acting ------------------------------------------------------------------------

    def create(self, job: TrainingJob, doc: dict[str, Any], code_dir: Path | None) -> str:
        run = RunDir(self.runs_dir / job.name)
        if run.job_file.exists():
            raise JobExists(f"{job.name}: a job of that name exists in {self.where} ({run.path}); delete it first "
                            "or give the job another metadata.name")
        run.path.mkdir(parents=True, exist_ok=True)
        manifest = run.path / "manifest.yaml"
        manifest.write_text(dump_manifest(job))
        launch = {"manifest": str(manifest), "code_dir": str(Path(code_dir or Path.cwd()).resolve())}
        (run.path / LAUNCH).write_text(json.dumps(launch) + "\n")
        self._start(job.name, run, launch)
        return job.name

    def _start(self, name: str, run: RunDir, launch: dict[str, str]) -> None:
        cmd = [sys.executable, "-m", "kubetrain.cli", "run", launch["manifest"], "--run-dir", str(run.path),
               "--code-dir", launch["code_dir"], "--quiet"]
        # PYTHONSAFEPATH: `-m` would put the working directory first on sys.path, where a folder named
        # operator/ (this repository's root) shadows the standard library's.
        env = {**os.environ, "PYTHONSAFEPATH": "1"}
        with open(run.path / "supervisor.log", "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True, cwd=launch["code_dir"])
        self._children[name] = proc
        deadline = time.monotonic() + START_SECONDS
        while run.supervisor() != proc.pid:
            code = proc.poll()
            if code is not None:
                if code == 0 and run.read_summary() is not None:
                    return  # finished already (a run that had ended, run again)
                last = (run.path / "supervisor.log").read_text(errors="replace").strip().splitlines()[-3:]
                raise ClientError(f"{name}: `kubetrain run` exited {code} at start: {' '.join(last)}")
            if time.monotonic() > deadline:
                raise ClientError(f"{name}: `kubetrain run` did not start within {START_SECONDS:.0f} s "
                                  f"(START_SECONDS); see {run.path / 'supervisor.log'}")
            time.sleep(0.05)

    def _reap(self) -> None:
        for name, proc in list(self._children.items()):
            if proc.poll() is not None:
                del self._children[name]

    def _stop(self, run: RunDir) -> None:
        pid = run.supervisor()
        if pid is None:
            return
        try:
            os.kill(pid, signal.SIGTERM)  # the supervisor stops its replicas after a checkpoint
        except ProcessLookupError:
            return
        deadline = time.monotonic() + STOP_SECONDS
        while process_alive(pid):
            self._reap()
            if time.monotonic() > deadline:
                raise ClientError(f"{run.path.name}: its `kubetrain run` (pid {pid}) did not stop within "
                                  f"{STOP_SECONDS:.0f} s (STOP_SECONDS)")
            time.sleep(0.1)

    def scale(self, name: str, replicas: int) -> None:
        run = self.run_dir(name)
        try:
            scale_run(run.path, replicas)
        except InvalidSpec as err:
            raise InvalidManifest(err) from None
        except RunDirError as err:
            raise ClientError(str(err)) from None

    def suspend(self, name: str) -> None:
        self._stop(self.run_dir(name))

    def resume(self, name: str) -> None:
        run = self.run_dir(name)
        if run.supervisor() is not None:
            return  # running
        summary = run.read_summary()
        if summary is not None and summary.get("state") == "Succeeded":
            return  # nothing left to run
        launch_file = run.path / LAUNCH
        if launch_file.exists():
            launch = json.loads(launch_file.read_text())
        else:  # started by hand: the run directory's own manifest, the code where the plan found it
            launch = {"manifest": str(run.job_file), "code_dir": self._code_dir_of(run)}
        self._start(name, run, launch)

    @staticmethod
    def _code_dir_of(run: RunDir) -> str:
        try:
            plan = json.loads(run.plan_file.read_text())
            return next(r["env"][CODE_DIR_VAR] for r in plan if r["env"].get(CODE_DIR_VAR))
        except (OSError, ValueError, KeyError, StopIteration):
            return str(Path.cwd())

    def delete(self, name: str) -> None:
        run = self.run_dir(name)
        self._stop(run)
        shutil.rmtree(run.path)

    def export(self, name: str, path: Path | str, fmt: str = "torch", merge_lora: bool = False) -> Path | str:
        run = self.run_dir(name)
        done = subprocess.run([sys.executable, "-m", "kubetrain.cli", "checkpoints", "export", str(run.path),
                               "--out", str(path), "--format", fmt, *(["--merge-lora"] if merge_lora else [])],
                              capture_output=True, text=True, env={**os.environ, "PYTHONSAFEPATH": "1"})
        if done.returncode != 0:
            raise ClientError(f"{name}: export failed: {done.stderr.strip() or done.stdout.strip()}")
        return path
