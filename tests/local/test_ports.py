"""A local replica's metrics port taken by another process before the replica binds it is replaced."""

from __future__ import annotations

import json
import socket

import pytest

from kubetrain.api import from_object
from kubetrain.drivers.local.runner import (
    MAX_PORT_TRIES,
    LocalRunner,
    Proc,
    _can_bind,
    free_blocks,
    local_endpoints,
)
from kubetrain.engine.plan import plan_replicas
from kubetrain.drivers.local.rundir import RunDir


def test_a_taken_metrics_port_is_replaced_before_the_start(tmp_path):
    job = from_object({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob",
                       "metadata": {"name": "ports"}, "spec": {"mode": "Single"}})
    run = RunDir(tmp_path / "run")
    run.prepare(job)
    backend = LocalRunner(job, run, echo_logs=False)
    (replica,) = plan_replicas(job, local_endpoints(job, run))
    backend.procs = {replica.name: Proc(replica)}
    taken = replica.ports["metrics"]
    with socket.socket() as squatter:  # another `kubetrain run` got there first
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        backend._metrics_port_still_free(backend.procs[replica.name])
    port = replica.ports["metrics"]
    assert port != taken and replica.env["KUBETRAIN_METRICS_PORT"] == str(port)
    targets = json.loads(run.targets_file.read_text())
    assert targets[0]["targets"] == [f"127.0.0.1:{port}"]
    # A free port is left as it is.
    backend._metrics_port_still_free(backend.procs[replica.name])
    assert replica.ports["metrics"] == port


def ddp_job(procs: int):
    return from_object({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "ports"},
                        "spec": {"mode": "DDP", "ddp": {"nodes": 2, "procsPerNode": procs, "backend": "gloo"}}})


def test_a_ddp_nodes_ranks_get_a_block_of_free_ports_and_a_taken_rank_port_moves_the_block(tmp_path):
    """A DDP node's ranks serve /metrics on its port + local rank (kubetrain/trainer/ddp/runtime.py): locally every
    node shares loopback, so the whole block is picked free, and a port of it taken before the start
    (CI saw rank 1's taken by another process for a whole run: four restarts, each exit 75) moves it."""
    job = ddp_job(3)
    run = RunDir(tmp_path / "run")
    run.prepare(job)
    endpoints = local_endpoints(job, run)
    blocks = [range(endpoints.metrics_port(n), endpoints.metrics_port(n) + 3) for n in ("ddp-0", "ddp-1")]
    every = [p for block in blocks for p in block] + [endpoints.ports["rendezvous"]]
    assert len(set(every)) == len(every), endpoints.ports  # no two replicas share a port
    for port in every:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # each one free

    backend = LocalRunner(job, run, echo_logs=False)
    replicas = plan_replicas(job, endpoints)
    backend.procs = {r.name: Proc(r) for r in replicas}
    node = backend.procs["ddp-0"]
    base = node.replica.ports["metrics"]
    with socket.socket() as squatter:  # rank 2's port, not the node's own
        squatter.bind(("127.0.0.1", base + 2))
        squatter.listen()
        backend._metrics_port_still_free(node)
    new = node.replica.ports["metrics"]
    assert new != base and node.replica.env["KUBETRAIN_METRICS_PORT"] == str(new)
    other = backend.procs["ddp-1"].replica.ports["metrics"]
    assert not set(range(new, new + 3)) & set(range(other, other + 3))
    for port in range(new, new + 3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_free_blocks_gives_up_naming_its_limit_past_max_port_tries():
    everything = frozenset(range(1, 65536))  # every port avoided: no try can succeed
    with pytest.raises(OSError, match=f"after {MAX_PORT_TRIES} tries"):
        free_blocks([1], avoid=everything)
    (base,) = free_blocks([4])
    assert all(_can_bind(p) for p in range(base, base + 4))
