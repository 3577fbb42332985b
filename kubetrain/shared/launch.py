"""The launch contract: the environment a replica starts with, a DDP node's torchrun argv, rank names.

Both sides read it: the plan (which never imports torch) sets the variables and builds the argv,
the trainer reads the variables, names its ranks and arms faults. A variable's name is written here
once; the operator, the local backend and the trainer use the constant.

The operator (which never imports torch) and the local backend both start a
DDP node with `torchrun_command`, so a pod and a local process run the same
argv. Every node joins one c10d rendezvous hosted by node 0's agent; torchrun
restarts the whole group when a rank fails (`--max-restarts`), and the ranks
resume from kubetrain's checkpoints. The argv runs torchrun through
`kubetrain.trainer.ddp.agent` (same arguments), which keeps restarts working
and exits with the failed rank's own exit code (see agent.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

STARTUP_TAG = "kubetrain-startup"
"""The prefix of a start-up milestone line on a replica's stderr (kubetrain/trainer/events.startup):
`kubetrain-startup {"milestone": ..., "time": <unix s>, ...}`. Instrumentation for benchmarks and the e2e
recovery break-down, which read them from the replica's log (a file locally, the pod's log): `kubetrain run`
keeps them in the log and out of the console (runner._echo_logs)."""

# What every replica finds in its environment (kubetrain/engine/plan.py sets them, kubetrain/trainer/context.py reads them).
JOB_FILE_VAR = "KUBETRAIN_JOB_FILE"
"""The job's manifest (job.yaml): in a pod the config volume's copy, locally the run directory's."""
JOB_NAME_VAR = "KUBETRAIN_JOB_NAME"
NAMESPACE_VAR = "KUBETRAIN_NAMESPACE"
REPLICA_VAR = "KUBETRAIN_REPLICA"
"""The replica's name, `<role>-<index>` (ps-0, worker-1, ddp-0, single-0)."""
RUN_DIR_VAR = "KUBETRAIN_RUN_DIR"
"""Where the replica writes its events (metrics/<replica>.jsonl) and its results (results/<replica>.json)."""
CHECKPOINT_DIR_VAR = "KUBETRAIN_CHECKPOINT_DIR"
"""The replica's checkpoint directory (kubetrain.shared.checkpoints describes its layout)."""
CHECKPOINT_URI_VAR = "KUBETRAIN_CHECKPOINT_URI"
"""With spec.checkpoint.storage.uri: the replica's prefix in object storage (`<uri>/<replica>/`, a DDP group's
`<uri>/ddp-0/`); KUBETRAIN_CHECKPOINT_DIR is then its local staging directory and the cache of its newest
checkpoint."""
DATA_CACHE_VAR = "KUBETRAIN_DATA_CACHE_DIR"
"""With spec.dataset.uri: the local disk cache of its objects (a local run's `<run>/cache/data`, a pod's
`/tmp/kubetrain/data-cache` on its own disk); unset: ~/.cache/kubetrain/data."""
MODEL_DIR_VAR = "KUBETRAIN_MODEL_DIR"
"""With spec.model.pretrained: the local directory of the pretrained model, fetched and checked before training
(a local run's `<run>/cache/model` or the local path itself; a pod's read-only `/kubetrain/model`)."""
MODEL_MAX_BYTES_VAR = "KUBETRAIN_MODEL_MAX_BYTES"
"""With an s3:// or hf:// spec.model.pretrained: spec.model.diskSize in bytes (a decimal integer), the most the
model's copy may take on local disk (a pod's `model` volume is bounded to it, its sizeLimit). The initializer
refuses a larger model before it downloads anything, naming both sizes; unset for a model read where it lies
(a path, pvc://)."""
MODEL_MOUNT = "/kubetrain/model"
"""Where a pod holds its copy of an s3:// (or hf://) pretrained model, fetched by its init container."""
PRETRAINED_CLAIM_MOUNT = "/kubetrain/pretrained"
"""Where a pod mounts, read-only, the claim of a pvc://CLAIM/PATH pretrained model."""


def pretrained_in_place(uri: str) -> bool:
    """Whether spec.model.pretrained is read where it lies (a path, a claim) rather than fetched (s3://, hf://)."""
    return not uri.startswith(("s3://", "hf://"))


CODE_DIR_VAR = "KUBETRAIN_CODE_DIR"
"""The user's code (spec.code), put first on sys.path of the replica and of a script's command."""
METRICS_PORT_VAR = "KUBETRAIN_METRICS_PORT"
LISTEN_ADDRESS_VAR = "KUBETRAIN_LISTEN_ADDRESS"
JOB_TOKEN_VAR = "KUBETRAIN_JOB_TOKEN"
"""The job's token: parameter servers refuse every call without it."""
TERMINATION_LOG_VAR = "KUBETRAIN_TERMINATION_LOG"
"""In a pod, the file whose text the kubelet hands the operator in the container's terminated state."""
PS_ADDRS_VAR = "KUBETRAIN_PS_ADDRS"
PS_DATA_ADDRS_VAR = "KUBETRAIN_PS_DATA_ADDRS"
PS_PORT_VAR = "KUBETRAIN_PS_PORT"
PS_DATA_PORT_VAR = "KUBETRAIN_PS_DATA_PORT"
NODE_RANK_VAR = "KUBETRAIN_NODE_RANK"
"""A DDP pod's node index (its StatefulSet-style pod index)."""
FAULT_VAR = "KUBETRAIN_FAULT"
"""Local fault injection (`kubetrain run --fault`): kill@step=N, kill@save=N or kill@allreduce=N."""

RDZV_PORT = 29400
"""The rendezvous port node 0's agent listens on (torchrun's own default)."""


# Local fault injection names a rank: every node's torchrun gets the same
# environment, so KUBETRAIN_FAULT alone would fire on every rank that sees it.
FAULT_REPLICA_VAR = "KUBETRAIN_FAULT_REPLICA"

# The test and benchmark knobs below are read by kubetrain/trainer/testhooks.py alone.
# A benchmark knob, no spec field: `worker-1:3` slows that replica 3x
# (kubetrain/trainer/testhooks.py reads it; `kubetrain bench modes` sets it).
SLOWDOWN_VAR = "KUBETRAIN_BENCH_SLOWDOWN"

# A test knob, no spec field: `STEP:GROUPS` (`600:3`) keeps a fault-tolerant replica group from committing
# step STEP until GROUPS groups take part in its quorum (kubetrain/trainer/testhooks.py reads it; tests that kill a
# group set it, so that the survivors train on until the replacement has joined whatever the machine's load).
FT_HOLD_VAR = "KUBETRAIN_TEST_FT_HOLD"
FT_JOIN_DELAY_VAR = "KUBETRAIN_TEST_FT_JOIN_DELAY"
"""A test knob: `GROUP:SECONDS,...` (`ddp-1:3,ddp-2:20`) makes those replica groups wait that long before they
make their torchft Manager: groups that come up seconds apart, as pods do on a loaded cluster."""
FT_COUNT_VAR = "KUBETRAIN_TEST_FT_COUNT"
"""A test knob of fault-tolerant DDP's built-in loop: when set, every rank adds the samples it trained to the
step's average (a count per sample of the training split), and each group writes, as each epoch ends, how
many samples the committed steps trained never, once, and more than once (an `epoch_samples` event):
what the job actually averaged, counted across every group, whatever the faults."""


# Fault-tolerant DDP (spec.ddp.faultTolerance, docs/custom-code.md#fault-tolerant-scripts): what every
# rank of a replica group finds in its environment, beside torchrun's own.
FT_LIGHTHOUSE_VAR = "KUBETRAIN_FT_LIGHTHOUSE"
"""http://host:port of the job's Lighthouse: torchft's Manager's `lighthouse_addr` (torchft reads TORCHFT_LIGHTHOUSE
when it is not given; kubetrain does not set that name, whose pod template entry it would have to refuse)."""
FT_GROUP_VAR = "KUBETRAIN_FT_REPLICA_GROUP"
"""This node's replica group: its index, 0 to KUBETRAIN_FT_REPLICA_GROUPS - 1."""
FT_GROUPS_VAR = "KUBETRAIN_FT_REPLICA_GROUPS"
"""The most replica groups the job can have (ddp.maxNodes, else ddp.nodes, and its spare groups): the global
ranks (`ddp-<rank>`, metrics and events) are numbered within them. The data is dealt by each step's quorum."""
FT_STORE_VAR = "KUBETRAIN_FT_STORE"
"""host:port of the group's TCPStore, hosted by the node's torchrun agent, as the other groups reach it."""
FT_LIGHTHOUSE_PORT_VAR = "KUBETRAIN_FT_LIGHTHOUSE_PORT"
"""The port the Lighthouse replica listens on."""
LIGHTHOUSE = "lighthouse-0"
"""The replica of a fault-tolerant job that runs its Lighthouse."""


def rank_replica(rank: int) -> str:
    """The replica name of a global rank: its metric label, event log and results file."""
    return f"ddp-{rank}"


def group_rank(env: Mapping[str, str]) -> int | None:
    """A fault-tolerant DDP rank's global rank (its replica group x ranks per group + its rank in the group,
    which is torchrun's RANK: a group is a torchrun group of its own); None outside a fault-tolerant job."""
    group = env.get(FT_GROUP_VAR)
    if not group:
        return None
    try:
        return int(group) * int(env.get("WORLD_SIZE", "1")) + int(env.get("RANK", "0"))
    except ValueError:
        raise ValueError(f"{FT_GROUP_VAR}, WORLD_SIZE, RANK: expected integers, got {group!r}, "
                         f"{env.get('WORLD_SIZE')!r}, {env.get('RANK')!r}") from None


def fault_armed(env: Mapping[str, str], replica: str) -> bool:
    """KUBETRAIN_FAULT fires on the group's first attempt only, and only on the rank it names (if any)."""
    return env.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and env.get(FAULT_REPLICA_VAR, replica) == replica


def torchrun_command(
    spec: Any,
    node_rank: int,
    rdzv_endpoint: str,
    job_id: str,
    *,
    python: str = "python",
    local_addr: str | None = None,
    role: str = "ddp",
) -> list[str]:
    """argv of the torchrun agent of node `node_rank` (0-based) of a DDP job.

    `spec` is a completed `kubetrain.api.Spec` of mode DDP (read by attribute: this
    package imports nothing of the operator).
    `rdzv_endpoint` is `host:port` of node 0 (in a cluster the first pod's
    headless-service name); node 0's agent hosts the rendezvous store there
    (`is_host=true`) and the other agents connect to it, so no agent has to
    guess from its hostname whether the endpoint is its own. `job_id` names
    the rendezvous: agents of another job on the same endpoint never join it.

    `local_addr` is the address this node's agent advertises to the others
    (and, on the agent that gets group rank 0, the MASTER_ADDR of the ranks);
    without it torchrun uses the host's FQDN. Locally pass "127.0.0.1" to keep
    every byte on loopback.

    Global ranks are assigned by the rendezvous, not by `node_rank` (c10d sorts
    the agents by address), so `--node-rank` is not passed: it would be
    ignored, and suggest an order that does not hold. The ranks of one node
    are `GROUP_RANK * procsPerNode + LOCAL_RANK`.

    `role` is what each rank runs: `ddp` (the built-in loop) or `script` (the
    user's command, through `kubetrain.trainer.script`).
    """
    ddp = spec.ddp
    if spec.mode != "DDP" or ddp is None:
        raise ValueError(f"spec.mode: torchrun_command needs mode DDP, got {spec.mode!r}")
    if not 0 <= node_rank < ddp.groups:
        spares = ddp.groups - ddp.nodes
        raise ValueError(f"node_rank {node_rank} is outside spec.ddp.nodes ({ddp.nodes})"
                         + (f" and its {spares} spare groups" if spares else ""))
    host, sep, port = rdzv_endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"rdzv_endpoint: expected 'host:port', got {rdzv_endpoint!r}")
    # Fault-tolerant: every node is a torchrun group of its own (a replica group), hosting its own
    # rendezvous and store; torchft joins the groups. A rank that fails ends the node, which the
    # job's restart policy replaces alone (counted, ReplicaGroupLost), so torchrun restarts nothing.
    fault_tolerant = ddp.fault_tolerance is not None
    argv = [
        python, "-m", "kubetrain.trainer.ddp.agent",  # torchrun's arguments, see agent.py
        "--nnodes", "1" if fault_tolerant else str(ddp.nodes),
        "--nproc-per-node", str(ddp.procs_per_node),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", rdzv_endpoint,
        "--rdzv-id", job_id,
        "--rdzv-conf", f"is_host={'true' if node_rank == 0 or fault_tolerant else 'false'}",
        "--max-restarts", "0" if fault_tolerant else str(ddp.max_restarts),
    ]
    if local_addr:
        argv += ["--local-addr", local_addr]
    return argv + ["-m", "kubetrain.trainer", role]
