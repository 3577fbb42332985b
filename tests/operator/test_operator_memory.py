"""One tenant's jobs, within every bound of the CRD, must not exhaust the operator's memory.

A 107 KB ParameterServer job (64 shards, 1,024 workers, 8 standbys, 64 sidecars of 40 variables each,
suspended) made one operator round render every pod twice, 637 MiB, past the operator's 512 Mi limit:
it was OOM-killed and crash-looped for every tenant. Now such a job fails at once naming the fields
(api/spec.MAX_RENDERED_TEMPLATE_BYTES), a suspended job is not rendered at all, a round renders only
the pods it creates, and every round's renders share one budget (drivers/cluster/budget.py).
"""

from __future__ import annotations

import json
import re

import pytest

from test_lifecycle import condition, manifest, pods_of
from test_tenants import create_json, failed_status, own_operator_with_a_victim

from kubetrain.api.spec import MAX_RENDERED_TEMPLATE_BYTES

pytestmark = pytest.mark.cluster

MEMORY_BOUND_MIB = 120
"""How much the operator's peak memory (VmHWM) may grow while the jobs below are applied and
reconciled: the jobs at the bound render a few MiB each, one job's 40 pods are created; before the
fix one round of the heavy job alone took 637 MiB."""
HEAVY, AT_BOUND = 3, 3


def heavy_spec(variables: int = 40, sidecars: int = 64, workers: int = 1024, shards: int = 64,
               standbys: int = 8, suspend: bool = True) -> dict:
    containers = [{"name": f"side-{i}", "image": "busybox",
                   "env": [{"name": f"V{j}", "value": "x" * 8} for j in range(variables)]} for i in range(sidecars)]
    return {"parameterServer": {"replicas": shards, "workers": workers, "standbyWorkers": standbys},
            "runPolicy": {"suspend": suspend}, "podTemplate": {"spec": {"containers": containers}}}


def at_bound(pods: int, **counts) -> dict:
    """A template of one sidecar with one variable, padded to the largest size `pods` pods allow."""
    spec = heavy_spec(variables=1, sidecars=1, **counts)
    env = spec["podTemplate"]["spec"]["containers"][0]["env"][0]
    env["value"] = ""
    size = len(json.dumps(spec["podTemplate"], separators=(",", ":")))
    env["value"] = "x" * (MAX_RENDERED_TEMPLATE_BYTES // pods - size)
    return spec


def vm(pid: int, field: str) -> float:
    """VmRSS or VmHWM of the process, in MiB."""
    text = open(f"/proc/{pid}/status").read()
    return int(re.search(rf"{field}:\s+(\d+)", text).group(1)) / 1024


def test_jobs_within_every_bound_keep_the_operator_small_and_others_reconciled(cluster, operator, spawn_operator):
    with own_operator_with_a_victim(cluster, operator, spawn_operator, "mem") as (op, proc, storage):
        baseline = vm(proc.proc.pid, "VmHWM")

        for i in range(HEAVY):  # refused before anything is rendered
            create_json(op, manifest(name=f"heavy-{i}", checkpoint=storage, **heavy_spec()))
        for i in range(AT_BOUND):  # suspended: nothing rendered
            create_json(op, manifest(name=f"bound-{i}", checkpoint=storage, **at_bound(1096)))
        # And one that runs: 40 pods at the bound, each rendered once, when it is created.
        create_json(op, manifest(name="runs", checkpoint=storage,
                                 **at_bound(40, workers=36, shards=4, standbys=0, suspend=False)))

        for i in range(HEAVY):
            failed = condition(failed_status(op, f"heavy-{i}", timeout=120), "Failed")
            assert failed["reason"] == "InvalidSpec", failed
            assert "spec.podTemplate: is " in failed["message"] and "would be merged into 1096 pods" in failed["message"]
            assert "1024 (parameterServer.workers)" in failed["message"], failed["message"]
        for i in range(AT_BOUND):
            op.wait(f"bound-{i} Suspended", lambda i=i: op.job_status(f"bound-{i}").get("state") == "Suspended",
                    timeout=120)
            assert pods_of(op, f"bound-{i}") == {}
        op.wait("the running job's 40 pods", lambda: len(pods_of(op, "runs")) == 40, timeout=180)

        # Meanwhile another job's replica fails: its round comes, and restarts it.
        old = op.get("pod", "victim-single-0")["metadata"]["uid"]
        op.set_pod_status("victim-single-0", "Failed", exit_code=1)
        op.wait("the victim's restart", lambda: op.job_status("victim").get("restarts", 0) >= 1, timeout=90)
        op.wait("the victim's replacement pod",
                lambda: (p := op.get("pod", "victim-single-0")) and p["metadata"]["uid"] != old, timeout=90)

        grown = vm(proc.proc.pid, "VmHWM") - baseline
        print(f"operator peak memory: {baseline:.0f} MiB before, grew {grown:.1f} MiB "
              f"(bound {MEMORY_BOUND_MIB} MiB; RSS now {vm(proc.proc.pid, 'VmRSS'):.0f} MiB)")
        assert proc.proc.poll() is None, proc.log.read_text()[-3000:]
        assert grown < MEMORY_BOUND_MIB, grown
        assert "Traceback" not in proc.log.read_text()
