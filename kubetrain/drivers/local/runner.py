"""The local backend: runs a TrainingJob's plan as processes on this machine and supervises them.

It is the second driver of the job engine (`core.engine`): every round it
observes the replicas' processes and the chief's events, lets the engine decide,
and starts or stops processes, so a job that runs here behaves the same in a
cluster (the same plan, restart policy, timers, hang rule and deadline clock). Replicas are started in their own process groups (a DDP node is a
torchrun agent with ranks below it), their output goes to logs/<replica>.log,
and one progress display follows the job.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TextIO

from kubetrain.shared import __version__
from kubetrain.shared.checkpoints import LATEST, RUN_CHECKPOINTS, latest_step
from kubetrain.shared.exitcodes import PERMANENT_CODES, PERMANENT_REASONS, shell_code
from kubetrain.shared.timestamps import iso
from kubetrain.shared.tls_files import TLS_DIR_VAR
from kubetrain.shared.launch import (CODE_DIR_VAR, FAULT_REPLICA_VAR, FAULT_VAR, JOB_FILE_VAR, JOB_NAME_VAR,
                                      JOB_TOKEN_VAR, LIGHTHOUSE, METRICS_PORT_VAR, MODEL_DIR_VAR, NAMESPACE_VAR,
                                      REPLICA_VAR, RUN_DIR_VAR, STARTUP_TAG, pretrained_in_place)

INITIALIZER = "initializer-0"
"""The pretrained model's fetch before training: its log is logs/initializer-0.log."""

from kubetrain.api import InvalidSpec, TrainingJob, load_one, to_manifest
from kubetrain.api.status import JobStatus, TrainerImage, to_dict
from kubetrain.engine import engine
from kubetrain.engine.plan import Replica, plan_replicas, replica_names, shared_checkpoints
from kubetrain.engine.conditions import TERMINAL
from kubetrain.engine.certificates import job_certificates, ps_hosts_of, uses_tls
from .progress import JobProgress, JsonlTail, ProgressDisplay
from .rundir import RunDir, RunState, sizeless
from .summary import build_summary, format_summary

POLL_SECONDS = 0.2
GRACE_SECONDS = 30.0
PROGRESS_SAVE_SECONDS = 1.0
"""state.json is rewritten for a change of progress alone at most this often: the client's `get` and `wait`
read the progress there. Every round (POLL_SECONDS) would fsync five times a second; a reader sees
progress at most this old (a cluster's status is up to the scrape interval, 5 s, old)."""


MAX_PORT_TRIES = 256
"""Ports bound, per block, while looking for consecutive free ones (a DDP node's ranks each serve
/metrics on the node's port + its local rank): past this many the machine's ports are too crowded
to run the job, and the run stops saying so rather than looking forever."""


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (held open together so none repeats)."""
    return free_blocks([1] * n)


def free_blocks(widths: list[int], avoid: frozenset[int] = frozenset()) -> list[int]:
    """For each width, a free loopback port whose next width - 1 ports are free too and not in
    `avoid`; all of them distinct (every port found is held open until the last block is found)."""
    held: list[socket.socket] = []
    bases = []
    try:
        for width in widths:
            for _ in range(MAX_PORT_TRIES):
                base = _hold(0, held)
                if base is not None and base not in avoid and all(port not in avoid and _hold(port, held) is not None
                                             for port in range(base + 1, base + width)):
                    bases.append(base)
                    break
            else:
                raise OSError(f"no {width} consecutive free loopback ports after {MAX_PORT_TRIES} tries "
                              f"(MAX_PORT_TRIES): this machine's ports are nearly all in use")
        return bases
    finally:
        for s in held:
            s.close()


def _hold(port: int, held: list[socket.socket]) -> int | None:
    """Binds 127.0.0.1:port (0: any free one) and keeps the socket in `held`; the port, or None when taken."""
    if port > 65535:
        return None
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        s.close()
        return None
    held.append(s)
    return s.getsockname()[1]


def _can_bind(port: int) -> bool:
    """Whether a server could listen on 127.0.0.1:port now (as the trainer's does, reusing TIME_WAIT)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class LocalEndpoints:
    """Endpoints on loopback: every port picked free at start, directories in the run dir."""

    run: RunDir
    ports: dict[str, int]
    metrics_enabled: bool
    code: Path | None = None
    shared_checkpoints: bool = False
    """Every DDP node uses one checkpoint directory (accessMode ReadWriteMany), as pods share one claim."""

    def ps_address(self, index: int) -> str:
        return f"127.0.0.1:{self.ps_port(index)}"

    def ps_port(self, index: int) -> int:
        return self.ports[f"ps-{index}/grpc"]

    def ps_data_address(self, index: int) -> str:
        return f"127.0.0.1:{self.ps_data_port(index)}"

    def ps_data_port(self, index: int) -> int:
        return self.ports[f"ps-{index}/ps-data"]

    def rendezvous(self) -> str:
        return f"127.0.0.1:{self.ports['rendezvous']}"

    def group_rendezvous(self, index: int) -> str:
        return f"127.0.0.1:{self.ports[f'ddp-{index}/rendezvous']}"

    def advertise_address(self, index: int) -> str:
        return "127.0.0.1"  # every group on this machine's loopback

    def lighthouse_address(self) -> str:
        return f"127.0.0.1:{self.lighthouse_port()}"

    def lighthouse_port(self) -> int:
        return self.ports[f"{LIGHTHOUSE}/lighthouse"]

    def metrics_port(self, replica: str) -> int:
        return self.ports[f"{replica}/metrics"] if self.metrics_enabled else 0

    def job_file(self) -> str:
        return str(self.run.job_file)

    def run_dir(self, replica: str) -> str:
        return str(self.run.path)

    def checkpoint_dir(self, replica: str) -> str:
        # Each DDP node has its own directory, as each pod has its own volume;
        # the group resumes from the newest checkpoint any node holds. With
        # accessMode ReadWriteMany every node shares one (node 0's), as the
        # pods share one claim: what sharded checkpoints need.
        if self.shared_checkpoints:
            return str(self.run.checkpoint_dir("ddp-0"))
        return str(self.run.checkpoint_dir(replica))

    def data_cache_dir(self) -> str:
        return str(self.run.path / "cache" / "data")

    def model_dir(self, pretrained: str) -> str:
        if not pretrained_in_place(pretrained) or pretrained.startswith("pvc://"):
            return str(self.run.path / "cache" / "model")  # pvc://: the initializer refuses it locally
        return str(Path(pretrained).expanduser().resolve())  # relative: to the working directory, as dataset.path

    def local_addr(self) -> str | None:
        return "127.0.0.1"  # every byte stays on loopback

    def code_dir(self) -> str | None:
        return str(self.code) if self.code is not None else None

    def listen_address(self) -> str:
        return "127.0.0.1"  # a local run is reachable from this machine only


def local_endpoints(job: TrainingJob, run: RunDir, code_dir: Path | None = None,
                    kept: dict[str, int] | None = None) -> LocalEndpoints:
    """Free loopback ports for every replica of the job; `kept`: the ports of an earlier plan that stay
    (a live resize: the shards' and the running workers' own), only the missing ones picked."""
    names = [f"{r}-{i}" for r, i in replica_names(job)]
    shards = [n for n in names if n.startswith("ps-")]
    keys = [f"{n}/metrics" for n in names] + [f"{n}/{port}" for n in shards for port in ("grpc", "ps-data")] + ["rendezvous"]
    if job.spec.fault_tolerant:  # every replica group hosts its own rendezvous; the Lighthouse listens
        keys += [f"{n}/rendezvous" for n in names if n.startswith("ddp-")] + [f"{LIGHTHOUSE}/lighthouse"]
    ports = {k: (kept or {})[k] for k in keys if k in (kept or {})}
    missing = [k for k in keys if k not in ports]
    if missing:
        width = {k: port_width(job, k.partition("/")[0], k.partition("/")[2]) for k in keys}
        kept_ports = frozenset(p + i for k, p in ports.items() for i in range(width[k]))  # free until they start again
        ports.update(zip(missing, free_blocks([width[k] for k in missing], avoid=kept_ports)))
    return LocalEndpoints(run, ports, job.spec.metrics.port != 0, code_dir, shared_checkpoints(job))


def port_width(job: TrainingJob, replica: str, name: str) -> int:
    """How many ports, from the one named, a replica's server takes: a DDP node's ranks serve /metrics on
    its port + their local rank (kubetrain/trainer/ddp/runtime.py), so locally, where every node shares loopback,
    that block must be free; every other server takes its one port."""
    if name == "metrics" and replica.startswith("ddp-") and job.spec.ddp is not None:
        return job.spec.ddp.procs_per_node
    return 1


def _ports_text(first: int, width: int) -> str:
    return str(first) if width == 1 else f"{first}-{first + width - 1}"


def write_certificates(job: TrainingJob, run: RunDir) -> Path | None:
    """A parameter-server job's CA and replica certificate for this invocation (engine/certificates.py), in
    `<run>/tls/` (0700, files 0600), as the operator puts them in a job's Secret; None for other modes.
    New ones every invocation, like the token: every replica starts again with them."""
    if not uses_tls(job):
        return None
    assert job.spec.parameter_server is not None
    hosts = ps_hosts_of(job.name, job.spec.parameter_server.replicas)
    files = job_certificates(job.name, job.metadata.namespace, hosts, datetime.now(timezone.utc))
    return save_certificates(run.path / "tls", files)


def save_certificates(folder: Path, files: dict[str, str]) -> Path:
    """Write `job_certificates`' files into `folder`, readable by this user only (0700, 0600)."""
    folder.mkdir(mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)
    for name, text in files.items():
        fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    return folder


@dataclass
class Proc:
    replica: Replica
    popen: subprocess.Popen | None = None
    log: TextIO | None = None
    log_tail: "LogTail | None" = None
    phase: str = "Absent"  # Absent (never started, or stopped) | Running | Succeeded | Failed
    exit_code: int | None = None
    attempts: int = 0
    started: float = 0.0  # unix seconds of the current attempt's start

    def observation(self) -> engine.ReplicaObservation | None:
        """The process as the engine sees a replica; None while it does not exist."""
        if self.phase == "Absent":
            return None
        code = self.exit_code
        if code is not None:
            code = shell_code(code)  # killed by signal N: 128+N, as a container's exit code
        return engine.ReplicaObservation(self.replica.name, self.phase, exit_code=code, uid=f"attempt-{self.attempts}")


class LogTail:
    """New complete lines of a replica's log, for echoing with a prefix (and for the client's `logs`)."""

    def __init__(self, path: Path, from_start: bool = False):
        self.path = path
        self.offset = path.stat().st_size if path.exists() and not from_start else 0
        self.partial = ""

    def read(self, final: bool = False) -> list[str]:
        """The lines appended since the last read; a partial last line waits for its newline unless `final`."""
        try:
            with open(self.path, errors="replace") as f:
                f.seek(self.offset)
                data = f.read()
                self.offset = f.tell()
        except FileNotFoundError:
            return []
        lines = (self.partial + data).split("\n")
        self.partial = lines.pop()
        if final and self.partial:
            lines.append(self.partial)
            self.partial = ""
        return lines


LOCAL_TRAINER = TrainerImage(image="", version=__version__)
"""What a local run's replicas run: processes of the installed kubetrain, no image (the job's status.trainer)."""


class LocalRunner:
    def __init__(
        self,
        job: TrainingJob,
        run: RunDir,
        faults: dict[str, str] | None = None,
        out: TextIO = sys.stderr,
        echo_logs: bool = True,
        python: str = sys.executable,
        code_dir: Path | None = None,
    ):
        """`code_dir`: where the job's own code lives (a script, entry points): the manifest's directory."""
        self.job = job
        self.run = run
        self.faults = dict(faults or {})
        self.out = out
        self.echo_logs = echo_logs
        self.python = python
        self.code_dir = code_dir
        self.procs: dict[str, Proc] = {}
        self._job_file_seen: tuple[int, int] | None = None  # the run's job.yaml as last read (_follow_scale)
        self.progress = JobProgress()
        self.tails: dict[str, JsonlTail] = {}
        self.display = ProgressDisplay(out, job.name)
        self.state = RunState()  # what only this machine keeps: wall time, invocations, the restart log
        self.status = JobStatus()  # the job's status as the engine decided it, memory included
        # The shared secret parameter servers check; a Secret in a cluster.
        self.token = secrets.token_hex(16)
        self.tls_dir: Path | None = None  # the run's certificates (write_certificates), as a pod's Secret
        self.endpoints: LocalEndpoints | None = None  # the ports of the plan (_plan, _plan_live)
        self._saved_at = 0.0  # when state.json was last written (monotonic)

    # -- entry ----------------------------------------------------------------

    def run_job(self) -> int:
        """Run (or resume) the job to its end; returns the CLI's exit code."""
        self.state = self.run.prepare(self.job)
        summary = self.run.read_summary()
        if summary is not None and summary.get("state") == "Succeeded":
            self.display.message(f"{self.job.name}: already finished in {self.run.path}")
            self.display.message(format_summary(summary))
            return 0
        self.status = self.state.status if self.state.status is not None else JobStatus()
        if summary is not None:  # a failed run: run it again from its checkpoints
            self.display.message(
                f"{self.job.name}: the last attempt failed ({summary.get('reason', '?')}); resuming from checkpoints"
            )
            self.run.summary_file.unlink()
            self.status = JobStatus()
        if self.job.spec.run_policy.suspend:
            self.display.message(f"{self.job.name}: spec.runPolicy.suspend is true; set it to false to run the job")
            return 0
        resumed = self.state.invocations > 0
        self.run.write_pid()
        self.state.invocations += 1
        self.state.restart_log = self.state.restart_log or []
        self._save()
        self.tls_dir = write_certificates(self.job, self.run)
        self._plan()
        verb = "resuming" if resumed else "starting"
        self.display.message(
            f"{self.job.name}: {verb} {self.job.spec.mode} job, replicas {', '.join(self.procs)}; "
            f"run directory {self.run.path}"
        )
        started = time.monotonic()
        previous_wall = self.state.wall_seconds
        old_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            outcome, reason, message = self._initialize() or self._supervise()
        except KeyboardInterrupt:
            outcome, reason, message = "Interrupted", "Interrupted", "interrupted by the user"
        finally:
            signal.signal(signal.SIGTERM, old_handler)
            self._stop_all()
            self._read_events()
            self.display.update(self.progress, force=True, eta=self._eta())
            self.display.close()
            self.run.clear_pid()
        self.state.wall_seconds = previous_wall + (time.monotonic() - started)
        if outcome == "Interrupted":
            # Every replica was stopped from outside: a suspended job, which the next run resumes.
            self.status = engine.interrupted(self.status, time.time())
            self._save()
            self.display.message(
                f"{self.job.name}: stopped after a checkpoint; run the same command again to resume"
            )
            return 130
        self._save()
        summary = build_summary(
            self.job, self.run.results(), outcome, self.state.wall_seconds, self._restarts(), reason, message
        )
        self.run.write_summary(summary)
        self.display.message(f"{self.job.name}: {outcome}" + (f" ({reason}: {message})" if outcome != "Succeeded" else ""))
        self.display.message(format_summary(summary))
        if outcome == "Succeeded":
            return 0
        # A replica's permanent exit code is the job's: 2 bad configuration, 3 data or model.
        return PERMANENT_CODES.get(reason, 1)

    def _initialize(self) -> tuple[str, str, str] | None:
        """spec.model.pretrained fetched and checked before any replica starts (`python -m kubetrain.trainer
        initializer`, a cluster pod's init container): None when ready, else the job's failure."""
        spec = self.job.spec
        if spec.model is None or not spec.model.pretrained or not self.procs:
            return None
        first = next(iter(self.procs.values())).replica
        keep = (JOB_FILE_VAR, RUN_DIR_VAR, MODEL_DIR_VAR, CODE_DIR_VAR, NAMESPACE_VAR, JOB_NAME_VAR)
        env = {**os.environ, **{k: v for k, v in first.env.items() if k in keep or k.startswith("PYTHON")},
               REPLICA_VAR: INITIALIZER}
        log_path = self.run.log_file(INITIALIZER)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.display.message(f"{self.job.name}: fetching and checking the pretrained model {spec.model.pretrained}")
        with open(log_path, "a") as log:
            log.write(f"--- kubetrain: {INITIALIZER} at {iso()}\n")
            log.flush()
            done = subprocess.run([self.python, "-m", "kubetrain.trainer", "initializer"], env=env, stdout=log,
                                  stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
            log.write(done.stderr)
        if done.returncode == 0:
            return None
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        message = lines[-1].split(": error: ", 1)[-1] if lines else f"exit code {done.returncode}"
        return "Failed", PERMANENT_REASONS.get(done.returncode, "InitializerFailed"), message

    def _plan(self) -> None:
        """The replicas of the job at its size (again after a DDP resize: every replica is stopped then)."""
        self.endpoints = local_endpoints(self.job, self.run, self.code_dir)
        old = self.procs
        self.procs = {}
        for replica in plan_replicas(self.job, self.endpoints):
            if self.tls_dir is not None:  # in the plan, as a pod's environment has it
                replica.env[TLS_DIR_VAR] = str(self.tls_dir)
            self.procs[replica.name] = Proc(replica, attempts=old[replica.name].attempts if replica.name in old else 0)
            self.tails.setdefault(replica.name, JsonlTail(self.run.metrics_file(replica.name)))
        self._write_plan()
        self._job_file_seen = self._job_file_stamp()

    def _plan_live(self) -> None:
        """A ParameterServer job resized live (engine/engine.py `_resize_live`): the replicas that run keep their
        processes and ports; a new worker gets a plan of its own, to start with the run's job.yaml, which
        `kubetrain scale` rewrote at the new size (the shards' addresses are the ones they listen on). The
        workers above the size stay until they ended: ps-0 releases them, and the engine has them stopped
        (`_forget_departed`)."""
        kept = dict(self.endpoints.ports) if self.endpoints is not None else {}
        self.endpoints = local_endpoints(self.job, self.run, self.code_dir, kept)
        for replica in plan_replicas(self.job, self.endpoints):
            if replica.name in self.procs:
                continue
            if self.tls_dir is not None:
                replica.env[TLS_DIR_VAR] = str(self.tls_dir)
            self.procs[replica.name] = Proc(replica)
            self.tails.setdefault(replica.name, JsonlTail(self.run.metrics_file(replica.name)))
        self._write_plan()

    def _forget_departed(self, stopped: list[str]) -> None:
        """Workers above the job's size that the engine had stopped (they ended, or outstayed the release
        grace) are no replicas of the job any more: gone from its processes, its plan and its scrape targets."""
        wanted = {f"{role}-{index}" for role, index in replica_names(self.job)}
        gone = [name for name in stopped if name not in wanted and name in self.procs]
        for name in gone:
            del self.procs[name]
        if gone:
            self._write_plan()

    def _write_plan(self) -> None:
        self.run.write_targets(self.job, [p.replica for p in self.procs.values()])
        self.run.write_plan([p.replica for p in self.procs.values()])

    def _job_file_stamp(self) -> tuple[int, int] | None:
        try:
            st = self.run.job_file.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def _follow_scale(self) -> None:
        """`kubetrain scale` rewrote the run's job file with another spec.replicas: the job takes that
        size (the engine resizes a ParameterServer job live; a DDP job's nodes stop after a checkpoint and
        the new set starts). A file that does not load, or changed in more than its size, is reported once
        and ignored."""
        stamp = self._job_file_stamp()
        if stamp == self._job_file_seen:
            return
        self._job_file_seen = stamp
        try:
            job = load_one(self.run.job_file)
        except (InvalidSpec, OSError) as err:
            self.display.message(f"{self.job.name}: {self.run.job_file} changed but does not load; ignored: {err}")
            return
        if sizeless(to_manifest(job)["spec"]) != sizeless(to_manifest(self.job)["spec"]):
            self.display.message(f"{self.job.name}: {self.run.job_file} changed in more than spec.replicas; "
                                 "only the size of a running job can change (kubetrain scale); ignored")
            return
        if job.spec.size != self.job.spec.size:
            self.job = job

    def _eta(self) -> int | None:
        """The engine's ETA (status.progress.etaSeconds), for the progress line."""
        return self.status.progress.eta_seconds if self.status.progress is not None else None

    def _on_sigterm(self, signum, frame):  # noqa: ARG002
        raise KeyboardInterrupt

    def _save(self) -> None:
        self._saved_at = time.monotonic()
        self.state.status = self.status
        self.run.save_state(self.state)

    # -- the loop: observe, let the engine decide, act ------------------------

    def _supervise(self) -> tuple[str, str, str]:
        saved_at, saved_progress = self._saved_at, to_dict(self.status).get("progress")
        while True:
            self._read_events()
            self._echo_logs()
            self.display.update(self.progress, eta=self._eta())
            for p in self.procs.values():
                if p.phase == "Running" and p.popen is not None:
                    code = p.popen.poll()
                    if code is not None:
                        self._close_log(p)
                        p.phase, p.exit_code = ("Succeeded" if code == 0 else "Failed"), code
            self._follow_scale()
            before = to_dict(self.status)
            done = self.decide(time.time())
            self.status = done.status
            ended = self._act(done.actions)
            if ended is not None:
                self._save()
                return ended
            after = to_dict(self.status)
            if {k: v for k, v in after.items() if k != "progress"} != {k: v for k, v in before.items() if k != "progress"}:
                self._save()
            elif after.get("progress") != saved_progress and time.monotonic() - saved_at >= PROGRESS_SAVE_SECONDS:
                self._save()  # progress alone: for readers of state.json (the client), at most once a PROGRESS_SAVE_SECONDS
            if self._saved_at > saved_at:
                saved_at, saved_progress = self._saved_at, to_dict(self.status).get("progress")
            time.sleep(POLL_SECONDS)

    def decide(self, now: float, refusal: engine.Refusal | None = None) -> engine.Round:
        """One round of the engine over the processes as they are (pure but for reading the run directory).
        `refusal`: the job may not run at all (engine.Refusal), as the operator's refusals reach the engine."""
        observed = {n: o for n, p in self.procs.items() if (o := p.observation()) is not None}
        return engine.step(self.job, self.status, observed, now, self._progress_reading(), refusal=refusal,
                           trainer=LOCAL_TRAINER)

    def _act(self, actions: engine.Actions) -> tuple[str, str, str] | None:
        """Carry out a round's actions; the job's end (state, reason, message) when it ended."""
        for kind, reason, message in actions.events:
            self.run.append_event(time.time(), kind, reason, message)
            if reason not in ("Completed",):
                self.display.message(f"{self.job.name}: {message}")
        for r in actions.restarted:
            assert self.state.restart_log is not None
            self.state.restart_log.append({"replica": r.replica, "reason": r.reason, "exit_code": r.exit_code,
                                           "time": time.time(), "step": r.step if r.step is not None else self.progress.step,
                                           "checkpoint_step": r.checkpoint_step})
        for name in actions.stop:
            self._terminate(self.procs[name])
            self.procs[name].phase = "Absent"
        if self._resizes_live():
            self._forget_departed(actions.stop)
        state = self.status.state
        if state in TERMINAL:
            condition = next((c for c in self.status.conditions if c.type == state), None)
            reason = condition.reason if condition else state
            message = condition.message if condition else ""
            if state == "Failed" and actions.failed is not None:
                last = self._last_output(self.procs[actions.failed])
                if last:
                    # Like a pod's termination message: what the replica said last.
                    self.display.message(f"[{actions.failed}] last output: {last}")
                    message += f" Last output: {last}"
            return state, reason, message
        if actions.resized:
            if self._resizes_live():
                self._plan_live()
            else:
                self._plan()  # every replica was stopped: the group starts again at the new size
        # Parameter servers and the Lighthouse first: workers and replica groups connect to them (and retry
        # until they can).
        for name in sorted(actions.start, key=lambda n: (not n.startswith(("ps-", "lighthouse-")), n)):
            self._start(self.procs[name])
        return None

    def _resizes_live(self) -> bool:
        """A resize keeps the replicas that stay (ParameterServer, fault-tolerant DDP); a plain DDP job's
        torchrun group restarts whole at the new size."""
        return self.job.spec.mode == "ParameterServer" or self.job.spec.fault_tolerant

    def _progress_reading(self) -> engine.ProgressReading | None:
        """The chief's progress from the replicas' events (a cluster reads the same from its metrics)."""
        seen = self.progress
        if seen.step == 0 and seen.checkpoint_step is None:
            return None
        return engine.ProgressReading(
            step=seen.step,
            total_steps=seen.total_steps,
            loss=seen.loss,
            eval_accuracy=seen.eval_accuracy,
            eval_loss=seen.eval_loss,
            eval_perplexity=seen.eval_perplexity,
            samples_per_second=seen.throughput or None,
            checkpoint_step=self._checkpoint_step() or None,
            quorum=seen.quorum,
            **self._set_aside(),
        )

    def _set_aside(self) -> dict[str, Any]:
        """The checkpoints set aside by the replicas' current processes, as a cluster reads its chief's count."""
        found = [what for when, replica, what in self.progress.set_aside
                 if replica in self.procs and when >= self.procs[replica].started]
        return {"set_aside": len(found), "set_aside_detail": "; ".join(found)[:1000]} if found else {}

    # -- processes ------------------------------------------------------------

    def _start(self, p: Proc) -> None:
        replica = p.replica
        self._metrics_port_still_free(p)
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.update(replica.env)
        env[JOB_TOKEN_VAR] = self.token
        if replica.role == "ddp":
            env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's own connections stay on loopback too
            # A rank lands on whichever node the rendezvous puts it: every node
            # learns which rank must fail, on the group's first start only.
            target = next((r for r in self.faults if r.startswith("ddp-")), None)
            if target is not None and p.attempts == 0:
                env[FAULT_VAR] = self.faults[target]
                env[FAULT_REPLICA_VAR] = target
                if all(q.attempts > 0 or q is p for q in self.procs.values()):
                    del self.faults[target]
        else:
            fault = self.faults.pop(replica.name, None)
            if fault is not None:  # first attempt only: a restarted replica runs clean
                env[FAULT_VAR] = fault
        command = [self.python if replica.command[0] == "python" else replica.command[0], *replica.command[1:]]
        log_path = self.run.log_file(replica.name)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        p.log_tail = LogTail(log_path)
        p.log = open(log_path, "a")
        p.attempts += 1
        p.started = time.time()
        if replica.name == "ddp-0":
            self.state.group_starts += 1
        p.log.write(f"--- kubetrain: attempt {p.attempts} of {replica.name} at {iso()}\n")
        p.log.flush()
        p.log_tail.offset = log_path.stat().st_size
        p.popen = subprocess.Popen(
            command, env=env, stdout=p.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        p.phase = "Running"
        p.exit_code = None

    def _metrics_port_still_free(self, p: Proc) -> None:
        """Ports are picked free when the run starts, but another process (another `kubetrain run`
        started at the same moment) may take one before the replica binds it: the replica then
        exits 75 and is restarted, to fail the same way again. Before each start, a metrics port
        taken since (or, for a DDP node, one of its ranks' ports after it: port_width) is
        replaced by a free one (Prometheus's targets file follows)."""
        port = p.replica.ports.get("metrics")
        width = port_width(self.job, p.replica.name, "metrics")
        if not port or all(_can_bind(port + i) for i in range(width)):
            return
        planned = frozenset(first + i for q in self.procs.values() if q is not p
                            for name, first in q.replica.ports.items()
                            for i in range(port_width(self.job, q.replica.name, name)))
        new = free_blocks([width], avoid=planned)[0]
        p.replica.ports["metrics"] = new
        p.replica.env[METRICS_PORT_VAR] = str(new)
        self.run.write_targets(self.job, [q.replica for q in self.procs.values()])
        self.display.message(f"[{p.replica.name}] metrics port {_ports_text(port, width)} is taken by another "
                             f"process; using {_ports_text(new, width)}")

    def _close_log(self, p: Proc) -> None:
        self._echo_logs(p)
        if p.log is not None:
            p.log.close()
            p.log = None

    def _signal(self, p: Proc, sig: int) -> None:
        if p.popen is None:
            return
        try:
            os.killpg(p.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _terminate(self, p: Proc, grace: float = GRACE_SECONDS) -> None:
        """SIGTERM (the trainer checkpoints and exits), SIGKILL after the grace period."""
        self._signal(p, signal.SIGTERM)
        if p.popen is not None:
            try:
                p.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self._signal(p, signal.SIGKILL)
                p.popen.wait()
        self._signal(p, signal.SIGKILL)  # leftovers of the group (torchrun's ranks)
        self._close_log(p)

    def _stop_all(self) -> None:
        running = [p for p in self.procs.values() if p.popen is not None and p.popen.poll() is None]
        for p in running:
            self._signal(p, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_SECONDS
        for p in running:
            assert p.popen is not None
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._signal(p, signal.SIGKILL)
                p.popen.wait()
        for p in self.procs.values():
            if p.popen is not None:
                self._signal(p, signal.SIGKILL)
            self._close_log(p)

    # -- observation ----------------------------------------------------------

    def _read_events(self) -> None:
        for name, tail in self.tails.items():
            for event in tail.read():
                self.progress.fold(name, event)

    def _echo_logs(self, only: Proc | None = None) -> None:
        if not self.echo_logs:
            return
        for p in [only] if only else self.procs.values():
            if p.log_tail is None:
                continue
            for line in p.log_tail.read():
                # The start-up milestones are instrumentation: the log file keeps them for benchmarks.
                if line.strip() and not line.startswith(STARTUP_TAG):
                    self.display.message(f"[{p.replica.name}] {line}")

    def _restarts(self) -> int:
        """The supervisor's restarts, plus the group restarts torchrun made by itself:
        every start of the group writes a `start` event on rank 0."""
        if self.job.spec.mode != "DDP":
            return self.status.restarts
        starts = sum(1 for e in self.run.events("ddp-0") if e.get("event") == "start")
        return self.status.restarts + max(0, starts - self.state.group_starts)

    def _last_output(self, p: Proc) -> str:
        try:
            with open(self.run.log_file(p.replica.name), "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return ""
        lines = [line for line in lines
                 if line.strip() and not line.startswith(("--- kubetrain:", STARTUP_TAG))]
        return lines[-1].strip() if lines else ""

    def _checkpoint_step(self) -> int:
        """Newest checkpoint step of any replica, read from the `latest` pointers."""
        best = 0
        for pointer in (self.run.path / RUN_CHECKPOINTS).glob(f"*/{LATEST}"):
            try:
                step = latest_step(pointer.parent)
            except OSError:  # a link or FIFO in its place: the trainer's own events still say
                continue
            best = max(best, step or 0)
        return max(best, self.progress.checkpoint_step or 0)
