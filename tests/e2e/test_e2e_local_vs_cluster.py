"""The same manifest, `kubetrain run` on this machine and `kubectl apply` in the cluster: the same plan, the same steps.

The local run records what it launched in RUN_DIR/plan.json; the cluster's
plan is in its pods' specs. Only where things live may differ (ports,
addresses, directories, the namespace); every replica, command and other
variable must be the same, and so must each replica's final step count
(its results file locally, its termination message in the cluster).
"""

from __future__ import annotations

import json

import pytest
import yaml
from e2elib import NAMESPACE, apply, example, figure, succeeded
from support import kubetrain

pytestmark = pytest.mark.e2e

# Where a replica finds the others and its files: the Endpoints' part of the plan.
WHERE = {"KUBETRAIN_JOB_FILE", "KUBETRAIN_RUN_DIR", "KUBETRAIN_CHECKPOINT_DIR", "KUBETRAIN_METRICS_PORT",
         "KUBETRAIN_PS_ADDRS", "KUBETRAIN_PS_PORT", "KUBETRAIN_PS_DATA_ADDRS", "KUBETRAIN_PS_DATA_PORT",
         "KUBETRAIN_LISTEN_ADDRESS", "KUBETRAIN_TLS_DIR"}
# What only a pod has: the token from its Secret, a writable HOME, the termination message's path.
POD_ONLY = {"KUBETRAIN_JOB_TOKEN", "HOME", "KUBETRAIN_TERMINATION_LOG"}
# What only a local process has: the manifest's directory, where user code is found
# (a pod finds it in its image's working directory).
LOCAL_ONLY = {"KUBETRAIN_CODE_DIR"}
STEPS = ("steps", "global_step")


def test_parameter_server_example_plans_and_steps_the_same_locally_and_in_the_cluster(e2e, tmp_path):
    doc = example("parameter-server.yaml", 10)  # the example's own epochs
    name = doc["metadata"]["name"] = "same-ps"
    doc["metadata"]["namespace"] = NAMESPACE
    manifest = tmp_path / "job.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / "run"

    local = kubetrain("run", str(manifest), "--run-dir", str(run_dir), "--quiet")
    assert local.returncode == 0, local.stderr[-3000:]
    apply(e2e, doc)
    status = succeeded(e2e, name)

    local_plan = {r["replica"]: r for r in json.loads((run_dir / "plan.json").read_text())}
    pods = json.loads(e2e.kubectl("get", "pods", "-l", f"kubetrain.dev/job-name={name}", "-o", "json"))["items"]
    cluster_plan = {p["metadata"]["labels"]["kubetrain.dev/replica"]: p for p in pods}
    assert sorted(cluster_plan) == sorted(local_plan) == ["ps-0", "worker-0", "worker-1"]
    for replica, planned in local_plan.items():
        container = cluster_plan[replica]["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert container["command"] == planned["command"], replica
        assert set(env) == (set(planned["env"]) - LOCAL_ONLY) | POD_ONLY, (replica, set(env) ^ set(planned["env"]))
        same = {k: v for k, v in planned["env"].items() if k not in WHERE | LOCAL_ONLY}
        assert {k: env[k] for k in same} == same, replica
        assert len(env.get("KUBETRAIN_PS_ADDRS", "").split(",")) == len(planned["env"]["KUBETRAIN_PS_ADDRS"].split(","))

    local_results = {f.stem: json.loads(f.read_text()) for f in (run_dir / "results").glob("*.json")}
    cluster_results = {replica: json.loads(pod["status"]["containerStatuses"][0]["state"]["terminated"]["message"])
                       for replica, pod in cluster_plan.items()}
    local_steps = {r: {k: v[k] for k in STEPS if k in v} for r, v in local_results.items()}
    cluster_steps = {r: {k: v[k] for k in STEPS if k in v} for r, v in cluster_results.items()}
    assert cluster_steps == local_steps, (cluster_steps, local_steps)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert status["progress"]["step"] == local_steps["worker-0"]["global_step"], (status, summary)
    figure(f"{name}: local and cluster plans match (3 replicas, commands, {len(same)} shared variables); "
           f"final steps per replica {cluster_steps}")
