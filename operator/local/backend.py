"""The local backend: runs a TrainingJob's plan as processes on this machine and supervises them.

It executes the same plan (`core.plan`) and the same restart policy
(`core.policy`) as the operator, so a job that runs here behaves the same in a
cluster. Replicas are started in their own process groups (a DDP node is a
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from ..api import TrainingJob
from ..core import policy
from ..core.plan import Replica, plan_replicas
from .progress import JobProgress, JsonlTail, ProgressDisplay
from .rundir import RunDir, RunState
from .summary import build_summary, format_summary

POLL_SECONDS = 0.2
GRACE_SECONDS = 30.0
PS_DRAIN_SECONDS = 60.0  # shards exit by themselves once every worker finished


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (held open together so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class LocalEndpoints:
    """Endpoints on loopback: every port picked free at start, directories in the run dir."""

    run: RunDir
    ports: dict[str, int]
    metrics_enabled: bool
    code: Path | None = None

    def ps_address(self, index: int) -> str:
        return f"127.0.0.1:{self.ps_port(index)}"

    def ps_port(self, index: int) -> int:
        return self.ports[f"ps-{index}/grpc"]

    def rendezvous(self) -> str:
        return f"127.0.0.1:{self.ports['rendezvous']}"

    def metrics_port(self, replica: str) -> int:
        return self.ports[f"{replica}/metrics"] if self.metrics_enabled else 0

    def job_file(self) -> str:
        return str(self.run.job_file)

    def run_dir(self, replica: str) -> str:
        return str(self.run.path)

    def checkpoint_dir(self, replica: str) -> str:
        # Each DDP node has its own directory, as each pod has its own volume;
        # the group resumes from the newest checkpoint any node holds.
        return str(self.run.checkpoint_dir(replica))

    def local_addr(self) -> str | None:
        return "127.0.0.1"  # every byte stays on loopback

    def code_dir(self) -> str | None:
        return str(self.code) if self.code is not None else None

    def listen_address(self) -> str:
        return "127.0.0.1"  # a local run is reachable from this machine only


def local_endpoints(job: TrainingJob, run: RunDir, code_dir: Path | None = None) -> LocalEndpoints:
    from ..core.plan import replica_names

    names = [f"{r}-{i}" for r, i in replica_names(job)]
    keys = [f"{n}/metrics" for n in names] + [f"{n}/grpc" for n in names if n.startswith("ps-")] + ["rendezvous"]
    return LocalEndpoints(run, dict(zip(keys, free_ports(len(keys)))), job.spec.metrics.port != 0, code_dir)


@dataclass
class Proc:
    replica: Replica
    popen: subprocess.Popen | None = None
    log: TextIO | None = None
    log_tail: "LogTail | None" = None
    phase: str = "Pending"  # Pending | Running | Succeeded | Failed
    restart_at: float | None = None
    attempts: int = 0
    last_activity: float = field(default_factory=time.monotonic)


class LogTail:
    """New complete lines of a replica's log, for echoing with a prefix."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0
        self.partial = ""

    def read(self) -> list[str]:
        try:
            with open(self.path, errors="replace") as f:
                f.seek(self.offset)
                data = f.read()
                self.offset = f.tell()
        except FileNotFoundError:
            return []
        lines = (self.partial + data).split("\n")
        self.partial = lines.pop()
        return lines


class LocalBackend:
    def __init__(
        self,
        job: TrainingJob,
        run: RunDir,
        faults: dict[str, int] | None = None,
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
        self.progress = JobProgress()
        self.tails: dict[str, JsonlTail] = {}
        self.display = ProgressDisplay(out, job.name)
        self.state = RunState()
        self.last_checkpoint_at_restart = 0
        self.stop_requested = False
        # The shared secret parameter servers check; a Secret in a cluster.
        self.token = secrets.token_hex(16)

    # -- entry ----------------------------------------------------------------

    def run_job(self) -> int:
        """Run (or resume) the job to its end; returns the CLI's exit code."""
        self.state = self.run.prepare(self.job)
        summary = self.run.read_summary()
        if summary is not None and summary.get("state") == "Succeeded":
            self.display.message(f"{self.job.name}: already finished in {self.run.path}")
            self.display.message(format_summary(summary))
            return 0
        if summary is not None:  # a failed run: run it again from its checkpoints
            self.display.message(
                f"{self.job.name}: the last attempt failed ({summary.get('reason', '?')}); resuming from checkpoints"
            )
            self.run.summary_file.unlink()
            self.state.restarts = self.state.restarts_without_progress = 0
        resumed = self.state.invocations > 0
        self.state.invocations += 1
        self.state.state = "Running"
        self.state.restart_log = self.state.restart_log or []
        self.run.save_state(self.state)
        endpoints = local_endpoints(self.job, self.run, self.code_dir)
        for replica in plan_replicas(self.job, endpoints):
            self.procs[replica.name] = Proc(replica)
            self.tails[replica.name] = JsonlTail(self.run.metrics_file(replica.name))
        self.run.write_targets(self.job, [p.replica for p in self.procs.values()])
        self.run.write_plan([p.replica for p in self.procs.values()])
        self.last_checkpoint_at_restart = self._checkpoint_step()
        verb = "resuming" if resumed else "starting"
        self.display.message(
            f"{self.job.name}: {verb} {self.job.spec.mode} job, replicas {', '.join(self.procs)}; "
            f"run directory {self.run.path}"
        )
        started = time.monotonic()
        previous_wall = self.state.wall_seconds
        old_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            outcome, reason, message = self._supervise(started, previous_wall)
        except KeyboardInterrupt:
            outcome, reason, message = "Interrupted", "Interrupted", "interrupted by the user"
        finally:
            signal.signal(signal.SIGTERM, old_handler)
            self._stop_all()
            self._read_events()
            self.display.update(self.progress, force=True)
            self.display.close()
        self.state.wall_seconds = previous_wall + (time.monotonic() - started)
        if outcome == "Interrupted":
            self.state.state = "Running"
            self.run.save_state(self.state)
            self.display.message(
                f"{self.job.name}: stopped after a checkpoint; run the same command again to resume"
            )
            return 130
        self.state.state, self.state.reason, self.state.message = outcome, reason, message
        self.run.save_state(self.state)
        summary = build_summary(
            self.job, self.run.results(), outcome, self.state.wall_seconds, self._restarts(), reason, message
        )
        self.run.write_summary(summary)
        self.display.message(f"{self.job.name}: {outcome}" + (f" ({reason}: {message})" if outcome != "Succeeded" else ""))
        self.display.message(format_summary(summary))
        if outcome == "Succeeded":
            return 0
        # A replica's permanent exit code is the job's: 2 bad configuration, 3 data or model.
        return {"InvalidConfiguration": policy.EXIT_CONFIG, "LoadFailed": policy.EXIT_LOAD}.get(reason, 1)

    def _on_sigterm(self, signum, frame):  # noqa: ARG002
        raise KeyboardInterrupt

    # -- the loop -------------------------------------------------------------

    def _supervise(self, started: float, previous_wall: float) -> tuple[str, str, str]:
        spec = self.job.spec
        for p in self._ordered():
            self._start(p)
        workers_done_at: float | None = None
        while True:
            now = time.monotonic()
            self._read_events()
            self._echo_logs()
            self.display.update(self.progress)
            for p in self.procs.values():
                if p.phase == "Pending" and p.restart_at is not None and now >= p.restart_at:
                    self._start(p)
                if p.phase != "Running" or p.popen is None:
                    continue
                code = p.popen.poll()
                if code is None:
                    continue
                self._close_log(p)
                if code == 0:
                    p.phase = "Succeeded"
                    continue
                failed = self._on_failure(p, policy.Failure(p.replica.name, exit_code=code))
                if failed:
                    return failed
            phases = {n: p.phase for n, p in self.procs.items()}
            if policy.job_outcome(phases) == "Succeeded":
                return "Succeeded", "Completed", "every replica finished"
            if spec.mode == "ParameterServer" and policy.workers_done(phases):
                workers_done_at = workers_done_at or now
                if now - workers_done_at > PS_DRAIN_SECONDS:
                    stuck = [n for n, p in self.procs.items() if p.phase == "Running"]
                    self.display.message(f"{self.job.name}: stopping {', '.join(stuck)}: workers finished long ago")
                    self._stop_all()
                    return "Succeeded", "Completed", "workers finished; shards stopped by the supervisor"
            deadline = spec.run_policy.active_deadline_seconds
            if deadline is not None and previous_wall + (now - started) > deadline:
                return "Failed", "DeadlineExceeded", f"the job ran longer than activeDeadlineSeconds ({deadline} s)"
            hung = self._hung(now)
            if hung:
                self._kill(hung)
                failed = self._on_failure(hung, policy.Failure(hung.replica.name, reason="Hung"))
                if failed:
                    return failed
            time.sleep(POLL_SECONDS)

    def _ordered(self) -> list[Proc]:
        # Parameter servers first: workers connect to them (and retry until they can).
        return sorted(self.procs.values(), key=lambda p: (p.replica.role != "ps", p.replica.name))

    def _hung(self, now: float) -> Proc | None:
        limit = self.job.spec.run_policy.progress_deadline_seconds
        if now - self.progress.last_step_time <= limit:
            return None
        running = [p for p in self.procs.values() if p.phase == "Running"]
        if not running:
            return None
        # The replica silent for longest is the likeliest culprit.
        return min(running, key=lambda p: p.last_activity)

    def _on_failure(self, p: Proc, failure: policy.Failure) -> tuple[str, str, str] | None:
        """Apply the restart policy to a failed replica; the job's end when it gives up."""
        if self.stop_requested:
            return None
        checkpoint = self._checkpoint_step()
        progressed = checkpoint > self.last_checkpoint_at_restart
        counters = policy.Counters(self.state.restarts, self.state.restarts_without_progress)
        decision, counters = policy.decide(self.job.spec, failure, counters, progressed)
        self.display.message(f"[{p.replica.name}] {decision.message}")
        if decision.action == "fail":
            p.phase = "Failed"
            message = decision.message
            last = self._last_output(p)
            if last:
                # Like a pod's termination message: what the replica said last.
                self.display.message(f"[{p.replica.name}] last output: {last}")
                message += f" Last output: {last}"
            return "Failed", decision.reason, message
        self.state.restarts = counters.restarts
        self.state.restarts_without_progress = counters.restarts_without_progress
        assert self.state.restart_log is not None
        self.state.restart_log.append(
            {
                "replica": p.replica.name,
                "reason": decision.reason,
                "exit_code": failure.code,
                "time": time.time(),
                "step": self.progress.step,
                "checkpoint_step": checkpoint,
            }
        )
        self.run.save_state(self.state)
        self.last_checkpoint_at_restart = checkpoint
        group = [p]
        if self.job.spec.mode == "DDP":
            # One torchrun group: when a node's agent gives up, the others
            # cannot go on either; restart the whole group from the checkpoint.
            group = list(self.procs.values())
            for other in group:
                if other is not p and other.phase == "Running":
                    self._terminate(other)
        for member in group:
            member.phase = "Pending"
            member.restart_at = time.monotonic() + decision.delay_seconds
        self.progress.last_step_time = time.monotonic() + decision.delay_seconds
        return None

    # -- processes ------------------------------------------------------------

    def _start(self, p: Proc) -> None:
        replica = p.replica
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.update(replica.env)
        env["KUBETRAIN_JOB_TOKEN"] = self.token
        if replica.role == "ddp":
            env["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's own connections stay on loopback too
            # A rank lands on whichever node the rendezvous puts it: every node
            # learns which rank must fail, on the group's first start only.
            target = next((r for r in self.faults if r.startswith("ddp-")), None)
            if target is not None and p.attempts == 0:
                env["KUBETRAIN_FAULT"] = f"kill@step={self.faults[target]}"
                env["KUBETRAIN_FAULT_REPLICA"] = target
                if all(q.attempts > 0 or q is p for q in self.procs.values()):
                    del self.faults[target]
        else:
            fault = self.faults.pop(replica.name, None)
            if fault is not None:  # first attempt only: a restarted replica runs clean
                env["KUBETRAIN_FAULT"] = f"kill@step={fault}"
        command = [self.python if replica.command[0] == "python" else replica.command[0], *replica.command[1:]]
        log_path = self.run.log_file(replica.name)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        p.log_tail = LogTail(log_path)
        p.log = open(log_path, "a")
        p.attempts += 1
        if replica.name == "ddp-0":
            self.state.group_starts += 1
        p.log.write(f"--- kubetrain: attempt {p.attempts} of {replica.name} at {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n")
        p.log.flush()
        p.log_tail.offset = log_path.stat().st_size
        p.popen = subprocess.Popen(
            command, env=env, stdout=p.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        p.phase = "Running"
        p.restart_at = None
        p.last_activity = time.monotonic()

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

    def _kill(self, p: Proc) -> None:
        self._signal(p, signal.SIGKILL)
        if p.popen is not None:
            p.popen.wait()
        self._close_log(p)

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
        self.stop_requested = True
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
        now = time.monotonic()
        for name, tail in self.tails.items():
            events = tail.read()
            if events:
                self.procs[name].last_activity = now
            for event in events:
                self.progress.fold(name, event)

    def _echo_logs(self, only: Proc | None = None) -> None:
        if not self.echo_logs:
            return
        for p in [only] if only else self.procs.values():
            if p.log_tail is None:
                continue
            for line in p.log_tail.read():
                if line.strip():
                    self.display.message(f"[{p.replica.name}] {line}")

    def _restarts(self) -> int:
        """The supervisor's restarts, plus the group restarts torchrun made by itself:
        every start of the group writes a `start` event on rank 0."""
        if self.job.spec.mode != "DDP":
            return self.state.restarts
        starts = sum(1 for e in self.run.events("ddp-0") if e.get("event") == "start")
        return self.state.restarts + max(0, starts - self.state.group_starts)

    def _last_output(self, p: Proc) -> str:
        try:
            with open(self.run.log_file(p.replica.name), "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return ""
        lines = [line for line in lines if line.strip() and not line.startswith("--- kubetrain:")]
        return lines[-1].strip() if lines else ""

    def _checkpoint_step(self) -> int:
        """Newest checkpoint step of any replica, read from the `latest` pointers."""
        best = 0
        root = self.run.path / "checkpoints"
        for latest in root.glob("*/latest"):
            try:
                text = latest.read_text().strip()
                step = int(Path(text).stem.split("-")[-1])
            except (OSError, ValueError):
                continue
            best = max(best, step)
        return max(best, self.progress.checkpoint_step or 0)
