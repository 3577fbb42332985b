"""Who this replica is and where it works: the ReplicaContext, read from the environment.

Every replica, in a pod or as a local process, is started as
`python -m kubetrain.trainer ROLE` and learns everything else from the
KUBETRAIN_* variables of docs/internals.md.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kubetrain.shared.checkpoints import replica_dir
from kubetrain.shared.launch import (
    CHECKPOINT_DIR_VAR, CHECKPOINT_URI_VAR, FAULT_VAR, JOB_FILE_VAR, JOB_NAME_VAR, JOB_TOKEN_VAR, LISTEN_ADDRESS_VAR, METRICS_PORT_VAR,
    NAMESPACE_VAR, PS_ADDRS_VAR, PS_DATA_ADDRS_VAR, PS_DATA_PORT_VAR, PS_PORT_VAR, REPLICA_VAR, RUN_DIR_VAR,
    TERMINATION_LOG_VAR,
)
from kubetrain.api import InvalidSpec, Spec, TrainingJob, load_one

from .errors import ConfigError

FAULT_PATTERN = re.compile(r"kill@(step|save|allreduce)=([0-9]+)")
"""Where KUBETRAIN_FAULT kills: right after step N (`kill@step=N`), in the middle of writing step N's
checkpoint (`kill@save=N`), or in the middle of step N's gradient average across replica groups
(`kill@allreduce=N`, fault-tolerant DDP: kubetrain/trainer/ddp/ft.py)."""
REPLICA_PATTERN = re.compile(r"([a-z]+)-([0-9]+)")


@dataclass
class ReplicaContext:
    """One replica's view of its job; built once by `from_env` and passed down."""

    job: TrainingJob
    replica: str = "single-0"
    """`<role>-<index>`: single-0, ps-1, worker-0, ddp-0."""
    role: str = ""
    """Derived from `replica` when empty."""
    index: int = -1
    """Derived from `replica` when negative."""
    run_dir: Path = Path(".")
    """Receives metrics/<replica>.jsonl and results/<replica>.json."""
    checkpoint_dir: Path = Path("checkpoints")
    """This replica's own checkpoint directory (with checkpoint_uri: its staging area and local cache)."""
    checkpoint_uri: str = ""
    """This replica's checkpoint prefix in object storage (`s3://.../<replica>/`); empty: the directory only."""
    metrics_port: int = 0
    """Port of /metrics; 0 turns it off."""
    ps_addrs: list[str] = field(default_factory=list)
    """host:port of each parameter-server shard, in shard order (ps-0 hosts the coordinator)."""
    ps_port: int = 0
    """Port a parameter server listens on."""
    ps_data_addrs: list[str] = field(default_factory=list)
    """host:port of each shard's data plane (ps/dataplane.py), in shard order; empty: Pull and Push over gRPC."""
    ps_data_port: int = 0
    """Port a parameter server's data plane listens on; 0: none."""
    listen_address: str = "127.0.0.1"
    """Address /metrics and a parameter server listen on: loopback unless the plan says otherwise (a pod)."""
    token: str = ""
    """Shared secret the parameter servers check in call metadata."""
    fault_step: int | None = None
    """Local fault injection: SIGKILL this process right after this step."""
    fault_save: int | None = None
    """Local fault injection: SIGKILL this process in the middle of writing the checkpoint of this step (its
    files written, before the checkpoint is committed)."""
    fault_allreduce: int | None = None
    """Local fault injection: SIGKILL this process in the middle of this step's gradient average across
    replica groups (fault-tolerant DDP)."""
    namespace: str = ""
    """Metric label; the job's namespace when empty."""
    job_name: str = ""
    """Metric label; the job's name when empty."""
    termination_log: Path | None = None
    """Where the final results also go for the operator (a pod's /dev/termination-log); None: nowhere."""
    job_file: Path | None = None
    """The manifest the job was read from (KUBETRAIN_JOB_FILE); ps-0 reads an elastic job's size there."""
    stop_requested: bool = False
    """Set by the SIGTERM handler; training loops check it after every step."""

    def __post_init__(self) -> None:
        if not self.role or self.index < 0:
            match = REPLICA_PATTERN.fullmatch(self.replica)
            if match is None:
                raise ConfigError(
                    f"KUBETRAIN_REPLICA: expected '<role>-<index>' such as 'worker-1', got {self.replica!r}"
                )
            self.role = self.role or match.group(1)
            self.index = self.index if self.index >= 0 else int(match.group(2))
        self.run_dir = Path(self.run_dir)
        self.checkpoint_dir = Path(self.checkpoint_dir)
        self.namespace = self.namespace or self.job.metadata.namespace
        self.job_name = self.job_name or self.job.name

    @property
    def spec(self) -> Spec:
        return self.job.spec

    @classmethod
    def from_env(cls, role: str | None = None, environ: Mapping[str, str] | None = None) -> "ReplicaContext":
        """Read the KUBETRAIN_* variables; `role` names the default replica (`<role>-0`)."""
        env = os.environ if environ is None else environ
        job_file = env.get(JOB_FILE_VAR)
        if not job_file:
            raise ConfigError("KUBETRAIN_JOB_FILE: not set; it must name the job's manifest (job.yaml)")
        try:
            job = load_one(job_file)
        except InvalidSpec as err:
            raise ConfigError(str(err)) from None
        replica = env.get(REPLICA_VAR) or f"{role or 'single'}-0"
        run_dir = Path(env.get(RUN_DIR_VAR) or Path("runs") / job.name)
        return cls(
            job=job,
            job_file=Path(job_file),
            replica=replica,
            run_dir=run_dir,
            checkpoint_dir=Path(env.get(CHECKPOINT_DIR_VAR) or replica_dir(run_dir, replica)),
            checkpoint_uri=env.get(CHECKPOINT_URI_VAR, ""),
            metrics_port=_int(env, METRICS_PORT_VAR, job.spec.metrics.port),
            ps_addrs=[a for a in env.get(PS_ADDRS_VAR, "").split(",") if a],
            ps_port=_int(env, PS_PORT_VAR, 0),
            ps_data_addrs=[a for a in env.get(PS_DATA_ADDRS_VAR, "").split(",") if a],
            ps_data_port=_int(env, PS_DATA_PORT_VAR, 0),
            listen_address=env.get(LISTEN_ADDRESS_VAR) or "127.0.0.1",
            token=env.get(JOB_TOKEN_VAR, ""),
            fault_step=_fault(env.get(FAULT_VAR, ""), "step"),
            fault_save=_fault(env.get(FAULT_VAR, ""), "save"),
            fault_allreduce=_fault(env.get(FAULT_VAR, ""), "allreduce"),
            namespace=env.get(NAMESPACE_VAR, ""),
            job_name=env.get(JOB_NAME_VAR, ""),
            termination_log=Path(env[TERMINATION_LOG_VAR]) if env.get(TERMINATION_LOG_VAR) else None,
        )

    def maybe_fault(self, step: int) -> None:
        """SIGKILL this process right after `step` when KUBETRAIN_FAULT asks for it.

        SIGKILL, not an exception: nothing gets to clean up or checkpoint, as
        when a node dies, so the run directory shows what a real crash leaves.
        """
        if self.fault_step is not None and step == self.fault_step:
            os.kill(os.getpid(), signal.SIGKILL)

    def maybe_fault_in_allreduce(self, step: int) -> None:
        """SIGKILL this process now, in the middle of step `step`'s gradient average, when KUBETRAIN_FAULT
        is `kill@allreduce=<step>` (`step` is the one this average completes, 1-based as maybe_fault's)."""
        if self.fault_allreduce is not None and step == self.fault_allreduce:
            os.kill(os.getpid(), signal.SIGKILL)

    def maybe_fault_in_save(self, step: int) -> None:
        """SIGKILL this process while it writes the checkpoint of `step`, when KUBETRAIN_FAULT says kill@save."""
        if self.fault_save is not None and step == self.fault_save:
            os.kill(os.getpid(), signal.SIGKILL)

    def install_signal_handlers(self) -> None:
        """Turn SIGTERM into `stop_requested`; the loop then checkpoints and exits 143."""
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: object) -> None:
        self.stop_requested = True


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "")
    if raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}: expected an integer, got {raw!r}") from None


def _fault(raw: str, when: str) -> int | None:
    """The step of KUBETRAIN_FAULT (`kill@step=N` or `kill@save=N`) when it is of kind `when`."""
    if not raw:
        return None
    match = FAULT_PATTERN.fullmatch(raw)
    if match is None:
        raise ConfigError(f"KUBETRAIN_FAULT: expected 'kill@step=N' or 'kill@save=N', got {raw!r} (or "
                          "'kill@allreduce=N' in a fault-tolerant DDP job)")
    return int(match.group(2)) if match.group(1) == when else None
