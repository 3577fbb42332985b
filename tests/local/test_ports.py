"""A local replica's metrics port taken by another process before the replica binds it is replaced."""

from __future__ import annotations

import json
import socket

from kubetrain_operator.api import from_object
from kubetrain_operator.local.backend import LocalBackend, Proc, local_endpoints
from kubetrain_operator.core.plan import plan_replicas
from kubetrain_operator.local.rundir import RunDir


def test_a_taken_metrics_port_is_replaced_before_the_start(tmp_path):
    job = from_object({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob",
                       "metadata": {"name": "ports"}, "spec": {"mode": "Single"}})
    run = RunDir(tmp_path / "run")
    run.prepare(job)
    backend = LocalBackend(job, run, echo_logs=False)
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
