"""The plan: which replicas a TrainingJob runs, with what command and environment.

Pure: a validated job and an `Endpoints` (where things live: ports, hosts,
directories) in, plain data out. The local backend and the operator execute
the same plan; only their `Endpoints` differ (loopback ports and run-directory
paths locally, Service names and volume mounts in a cluster).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kubetrain.shared.launch import (
    CHECKPOINT_DIR_VAR, CHECKPOINT_URI_VAR, CODE_DIR_VAR, DATA_CACHE_VAR, FT_GROUPS_VAR, FT_GROUP_VAR, FT_LIGHTHOUSE_PORT_VAR, FT_LIGHTHOUSE_VAR,
    FT_STORE_VAR, JOB_FILE_VAR, JOB_NAME_VAR, LISTEN_ADDRESS_VAR, METRICS_PORT_VAR, MODEL_DIR_VAR, MODEL_MAX_BYTES_VAR,
    NAMESPACE_VAR, PS_ADDRS_VAR, PS_DATA_ADDRS_VAR, PS_DATA_PORT_VAR, PS_PORT_VAR, REPLICA_VAR, RUN_DIR_VAR,
    pretrained_in_place, torchrun_command,
)

from kubetrain.api import TrainingJob

PYTHON = "python"
TRAINER_MODULE = "kubetrain.trainer"
GRPC_PORT = 50051  # parameter servers in a cluster
DATA_PORT = 50052  # their data planes (Pull and Push of tensors: kubetrain/trainer/ps/dataplane.py)


class Endpoints(Protocol):
    """Where a replica finds the others and its files."""

    def ps_address(self, index: int) -> str:
        """host:port of parameter-server shard `index`."""

    def ps_port(self, index: int) -> int:
        """Port shard `index` listens on."""

    def ps_data_address(self, index: int) -> str:
        """host:port of shard `index`'s data plane."""

    def ps_data_port(self, index: int) -> int:
        """Port shard `index`'s data plane listens on."""

    def rendezvous(self) -> str:
        """host:port of the DDP c10d rendezvous (hosted by node 0)."""

    def group_rendezvous(self, index: int) -> str:
        """Fault-tolerant DDP: host:port of node `index`'s own rendezvous, whose store its ranks and the
        other groups' torchft share (hosted by the node's torchrun agent)."""

    def advertise_address(self, index: int) -> str:
        """Fault-tolerant DDP: the address other groups reach node `index` at."""

    def lighthouse_address(self) -> str:
        """Fault-tolerant DDP: host:port of the job's Lighthouse."""

    def lighthouse_port(self) -> int:
        """Fault-tolerant DDP: the port the Lighthouse listens on."""

    def metrics_port(self, replica: str) -> int:
        """Port of the replica's /metrics endpoint (0: off)."""

    def job_file(self) -> str: ...

    def run_dir(self, replica: str) -> str: ...

    def checkpoint_dir(self, replica: str) -> str: ...

    def data_cache_dir(self) -> str:
        """Where a replica caches the objects of spec.dataset.uri: the machine's or the pod's own disk."""

    def model_dir(self, pretrained: str) -> str:
        """Where a replica reads spec.model.pretrained (`pretrained`), fetched and checked by the initializer:
        locally the run's cache or the local path itself; in a pod its read-only copy or the claim's path."""

    def local_addr(self) -> str | None:
        """Address a DDP node's agent advertises (None: the host's name)."""

    def listen_address(self) -> str:
        """The address a replica's servers (/metrics, a parameter server) listen on: loopback
        locally, so that no other host reaches a local run; every interface in a pod."""

    def code_dir(self) -> str | None:
        """Where user code (a script, entry points) is found: locally the manifest's directory;
        None in a cluster, where it is the container's working directory."""


@dataclass(frozen=True)
class Replica:
    role: str  # single | ps | worker | ddp
    index: int
    command: tuple[str, ...]
    env: dict[str, str] = field(hash=False)
    ports: dict[str, int] = field(hash=False)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def stateful(self) -> bool:
        """Holds checkpoints: restarting it needs its volume."""
        return self.role in ("single", "ps", "ddp")


def replica_names(job: TrainingJob) -> list[tuple[str, int]]:
    spec = job.spec
    if spec.mode == "Single":
        return [("single", 0)]
    if spec.mode == "ParameterServer":
        ps = spec.parameter_server
        assert ps is not None
        return ([("ps", i) for i in range(ps.replicas)] + [("worker", i) for i in range(ps.workers)]
                + [("standby", i) for i in range(ps.standby_workers)])
    ddp = spec.ddp
    assert ddp is not None
    lighthouse = [("lighthouse", 0)] if ddp.fault_tolerance is not None else []
    return [("ddp", i) for i in range(ddp.groups)] + lighthouse


def plan_replicas(job: TrainingJob, endpoints: Endpoints) -> list[Replica]:
    spec = job.spec
    ps_addrs = data_addrs = ""
    if spec.mode == "ParameterServer":
        assert spec.parameter_server is not None
        ps_addrs = ",".join(endpoints.ps_address(i) for i in range(spec.parameter_server.replicas))
        data_addrs = ",".join(endpoints.ps_data_address(i) for i in range(spec.parameter_server.replicas))
    replicas = []
    for role, index in replica_names(job):
        name = f"{role}-{index}"
        ports: dict[str, int] = {}
        metrics_port = endpoints.metrics_port(name)
        if metrics_port:
            ports["metrics"] = metrics_port
        env = {
            JOB_NAME_VAR: job.name,
            NAMESPACE_VAR: job.metadata.namespace,
            REPLICA_VAR: name,
            JOB_FILE_VAR: endpoints.job_file(),
            RUN_DIR_VAR: endpoints.run_dir(name),
            CHECKPOINT_DIR_VAR: endpoints.checkpoint_dir(name),
            **({CHECKPOINT_URI_VAR: checkpoint_uri(job, name)} if spec.checkpoint.storage.uri else {}),
            **({DATA_CACHE_VAR: endpoints.data_cache_dir()} if spec.dataset is not None and spec.dataset.uri else {}),
            **({MODEL_DIR_VAR: endpoints.model_dir(spec.model.pretrained)}
               if spec.model is not None and spec.model.pretrained else {}),
            # A fetched model's bound (spec.model.diskSize): the initializer refuses a larger one before it downloads.
            **({MODEL_MAX_BYTES_VAR: str(spec.model.disk_bytes)} if spec.model is not None and spec.model.pretrained
               and not pretrained_in_place(spec.model.pretrained) else {}),
            METRICS_PORT_VAR: str(metrics_port),
            LISTEN_ADDRESS_VAR: endpoints.listen_address(),
            "PYTHONUNBUFFERED": "1",
            # `python -m` must not put the working directory first on sys.path:
            # run from a kubetrain checkout, its operator/ folder would shadow
            # the standard library's `operator`.
            "PYTHONSAFEPATH": "1",
        }
        code_dir = endpoints.code_dir()
        if code_dir is not None:
            env[CODE_DIR_VAR] = code_dir
        if spec.mode == "ParameterServer":
            env[PS_ADDRS_VAR] = ps_addrs
            env[PS_DATA_ADDRS_VAR] = data_addrs
        if role == "ps":
            ports["grpc"] = endpoints.ps_port(index)
            env[PS_PORT_VAR] = str(ports["grpc"])
            ports["ps-data"] = endpoints.ps_data_port(index)
            env[PS_DATA_PORT_VAR] = str(ports["ps-data"])
        if role == "ddp" and spec.fault_tolerant:
            rendezvous = endpoints.group_rendezvous(index)
            command = tuple(
                torchrun_command(spec, index, rendezvous, f"{job.metadata.namespace}-{job.name}-{name}",
                                 python=PYTHON, local_addr=endpoints.local_addr(), role=entry_role(job, role))
            )
            ports["rendezvous"] = int(rendezvous.rsplit(":", 1)[1])
            env.update(fault_tolerance_env(job, endpoints, index, ports["rendezvous"]))
        elif role == "ddp":
            assert spec.ddp is not None
            rdzv_id = f"{job.metadata.namespace}-{job.name}"
            command = tuple(
                torchrun_command(spec, index, endpoints.rendezvous(), rdzv_id, python=PYTHON,
                                 local_addr=endpoints.local_addr(), role=entry_role(job, role))
            )
            if index == 0:
                ports["rendezvous"] = int(endpoints.rendezvous().rsplit(":", 1)[1])
        elif role == "lighthouse":
            ports["lighthouse"] = endpoints.lighthouse_port()
            env[FT_LIGHTHOUSE_PORT_VAR] = str(ports["lighthouse"])
            command = (PYTHON, "-m", TRAINER_MODULE, role)
        else:
            command = (PYTHON, "-m", TRAINER_MODULE, entry_role(job, role))
        replicas.append(Replica(role=role, index=index, command=command, env=env, ports=ports))
    return replicas


def fault_tolerance_env(job: TrainingJob, endpoints: Endpoints, index: int, store_port: int) -> dict[str, str]:
    """What a fault-tolerant DDP node's ranks find beside torchrun's environment (kubetrain/shared/launch.py names them)."""
    assert job.spec.ddp is not None
    lighthouse = f"http://{endpoints.lighthouse_address()}"
    return {
        FT_LIGHTHOUSE_VAR: lighthouse,
        FT_GROUP_VAR: str(index),
        FT_GROUPS_VAR: str(job.spec.ddp.node_range[1] + job.spec.ddp.groups - job.spec.ddp.nodes),
        FT_STORE_VAR: f"{endpoints.advertise_address(index)}:{store_port}",
    }


def shared_checkpoints(job: TrainingJob) -> bool:
    """Whether a DDP job's nodes share one checkpoint directory: one ReadWriteMany claim that every pod
    mounts (locally, one directory), not a volume per node. Sharded checkpoints (every rank writes its own
    shards, every rank reads them all) need it; a plain one works either way (rank 0 writes, the group
    takes the newest any node holds). Checkpoints in object storage share the store instead: each node
    stages its own on its own disk."""
    return (job.spec.mode == "DDP" and job.spec.checkpoint.storage.access_mode == "ReadWriteMany"
            and not job.spec.checkpoint.storage.uri)


def checkpoint_uri(job: TrainingJob, replica: str) -> str:
    """A replica's checkpoint prefix in object storage (spec.checkpoint.storage.uri): `<uri>/<replica>/`, as a
    run directory's checkpoints/<replica>/. A DDP group's nodes share `<uri>/ddp-0/`, as with one shared
    claim (a sharded state needs one place every rank reads); a fault-tolerant job's replica groups each
    keep their own, as each keeps its own volume."""
    root = job.spec.checkpoint.storage.uri.rstrip("/")
    owner = "ddp-0" if job.spec.mode == "DDP" and not job.spec.fault_tolerant and replica.startswith("ddp-") \
        else replica
    return f"{root}/{owner}/"


def entry_role(job: TrainingJob, role: str) -> str:
    """What `python -m kubetrain.trainer` runs for a replica: its role, or `script` for the user's command
    (never for a Lighthouse: it is kubetrain's own)."""
    return "script" if job.spec.script is not None and role != "lighthouse" else role


def chief(job: TrainingJob) -> str:
    """The replica whose metrics and results speak for the job."""
    return {"Single": "single-0", "ParameterServer": "worker-0", "DDP": "ddp-0"}[job.spec.mode]

