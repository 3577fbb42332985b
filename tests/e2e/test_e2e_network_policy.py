"""Per-job network isolation, enforced for real: the real node runs kube-router's firewall controller.

While a job trains, a pod outside it (busybox, in the job's namespace) is
refused at every port of the job's pods: the parameter server's gRPC and
data-plane ports (by pod IP and by its Service's name), the rendezvous port of a DDP job, and
the metrics port. A pod that the chart's `networkPolicy.metricsFrom` admits
(hack/values-e2e.yaml: pods labelled as a Prometheus in the job's namespace)
reaches the metrics port and nothing else. The same outside pod reaches
another pod (the operator's metrics), so a refusal is the policy's, not a
broken network. The job still succeeds, and survives a worker SIGKILLed
after the probes: its replacement (a new pod, a new IP) is admitted by the
job's own rule.
"""

from __future__ import annotations

import time

import pytest
from e2elib import (
    HELPER_IMAGE, METRICS_PORT, REAL_NODE_SELECTOR, RESTRICTED_CONTAINER, RESTRICTED_POD, apply, example, figure,
    first_step, succeeded, warning_reasons,
)
from test_e2e_faults import sigkill

from kubetrain.shared.launch import RDZV_PORT
from kubetrain.engine.plan import DATA_PORT, GRPC_PORT

pytestmark = pytest.mark.e2e

OUTSIDER = "np-outsider"
SCRAPER = "np-scraper"
# What hack/values-e2e.yaml's networkPolicy.metricsFrom admits besides the host: a Prometheus's label.
SCRAPER_LABELS = {"app.kubernetes.io/name": "prometheus"}
OPERATOR_METRICS_PORT = 8080  # the chart's operator.metricsPort
CONNECT_SECONDS = 2


def probe_pod(name: str, labels: dict[str, str]) -> dict:
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
        "spec": {"nodeSelector": dict(REAL_NODE_SELECTOR), "securityContext": RESTRICTED_POD,
                 "terminationGracePeriodSeconds": 0,
                 "containers": [{"name": "probe", "image": HELPER_IMAGE, "imagePullPolicy": "IfNotPresent",
                                 "securityContext": RESTRICTED_CONTAINER,
                                 "command": ["/bin/busybox", "sleep", "3600"]}]},
    }


@pytest.fixture(scope="module")
def probes(e2e):
    """Two busybox pods on the real node, beside the jobs: one no rule admits, one labelled as a Prometheus."""
    e2e.kube.apply(probe_pod(OUTSIDER, {"app": OUTSIDER}), probe_pod(SCRAPER, {"app": SCRAPER, **SCRAPER_LABELS}))
    try:
        e2e.kubectl("wait", "--for=condition=Ready", f"pod/{OUTSIDER}", f"pod/{SCRAPER}", "--timeout=120s", timeout=130)
        yield
    finally:
        e2e.kubectl("delete", "pod", OUTSIDER, SCRAPER, "--wait=false")


def reach(e2e, pod: str, targets: list[tuple[str, int]]) -> dict[str, str]:
    """'open', or 'closed: <nc's reason>', for each host:port, tried from inside `pod` (busybox nc
    connects and, its stdin empty, closes at once; -w bounds a connect that is never answered)."""
    lines = [f'if out=$(/bin/busybox nc -w {CONNECT_SECONDS} {host} {port} </dev/null 2>&1); '
             f'then echo "{host}:{port} open"; else echo "{host}:{port} closed: $out"; fi'
             for host, port in targets]
    out = e2e.kubectl("exec", pod, "--", "/bin/sh", "-c", "; ".join(lines), timeout=60 + 5 * len(targets))
    seen = {}
    for line in out.strip().splitlines():
        target, _, verdict = line.partition(" ")
        seen[target] = verdict
    assert len(seen) == len(targets), out
    return seen


def opened(seen: dict[str, str]) -> set[str]:
    return {target for target, verdict in seen.items() if verdict == "open"}


def pod_ip(e2e, pod: str) -> str:
    return e2e.get("pod", pod)["status"]["podIP"]


def operator_ip(e2e) -> str:
    """An operator pod's IP: a pod that has no policy, so the outsider reaching it shows the network works."""
    [first, *_] = e2e.kube.items("pods", "-l", "app.kubernetes.io/component=operator")
    return first["status"]["podIP"]


def assert_policy_of(e2e, job: str) -> None:
    policy = e2e.get("networkpolicy", f"{job}-isolation")
    assert [r["name"] for r in policy["metadata"]["ownerReferences"]] == [job], policy["metadata"]
    assert policy["spec"]["podSelector"] == {"matchLabels": {"kubetrain.dev/job-name": job}}, policy["spec"]


def test_parameter_server_job_refuses_outside_pods_and_survives_a_killed_worker(e2e, probes):
    name = "np-ps"
    doc = example("parameter-server.yaml", 200)  # long enough for the probes and a kill mid-run
    doc["metadata"]["name"] = name
    start = apply(e2e, doc)
    # Read from the host: the e2e values admit the host's addresses to the metrics port.
    first = first_step(e2e, f"{name}-worker-0")
    assert_policy_of(e2e, name)
    ps, w0, w1 = (pod_ip(e2e, f"{name}-{r}") for r in ("ps-0", "worker-0", "worker-1"))
    service = f"{name}-ps-0"  # its Service's virtual address: kube-proxy takes the connection to ps-0

    probed = time.monotonic()
    outsider = reach(e2e, OUTSIDER, [(ps, GRPC_PORT), (service, GRPC_PORT), (ps, DATA_PORT), (service, DATA_PORT),
                                     (ps, METRICS_PORT), (w0, METRICS_PORT), (w1, METRICS_PORT),
                                     (operator_ip(e2e), OPERATOR_METRICS_PORT)])
    scraper = reach(e2e, SCRAPER, [(ps, METRICS_PORT), (service, METRICS_PORT), (w0, METRICS_PORT), (ps, GRPC_PORT),
                                   (service, GRPC_PORT), (ps, DATA_PORT)])
    probe_seconds = time.monotonic() - probed

    assert opened(outsider) == {f"{operator_ip(e2e)}:{OPERATOR_METRICS_PORT}"}, outsider
    assert opened(scraper) == {f"{ps}:{METRICS_PORT}", f"{service}:{METRICS_PORT}", f"{w0}:{METRICS_PORT}"}, scraper

    # Still training through all of that; now a worker dies and its replacement (a new pod and IP) rejoins.
    status = e2e.get("trainingjob", name).get("status") or {}
    assert status.get("state") != "Succeeded", f"{name} ended before the probes were done; give it more epochs"
    old_uid = e2e.get("pod", f"{name}-worker-1")["metadata"]["uid"]
    sigkill(e2e, f"{name}-worker-1")
    killed = time.monotonic()
    after = first_step(e2e, f"{name}-worker-1", not_uid=old_uid)
    status = succeeded(e2e, name)

    assert status["restarts"] >= 1 and "Killed" in warning_reasons(e2e, name), status
    progress = status["progress"]
    assert progress["step"] == progress["totalSteps"] > 0 and progress["evalAccuracy"] >= 0.9, status
    refusals = sorted({v.rsplit(": ", 1)[-1].strip() for v in outsider.values() if v != "open"})  # nc's reason
    figure(f"{name}: first step {first.at - start:.1f} s after apply; from an outside pod "
           f"{len(outsider) - 1}/{len(outsider) - 1} of the job's ports refused ({'; '.join(refusals)}), "
           f"the operator's pod reached; the metricsFrom pod reached metrics only ({probe_seconds:.1f} s of probes); "
           f"worker-1 SIGKILLed -> replacement's first step {after.at - killed:.1f} s later; Succeeded, "
           f"accuracy {progress['evalAccuracy']:.4f}")


def test_ddp_rendezvous_refuses_outside_pods(e2e, probes):
    name = "np-ddp"
    doc = example("ddp.yaml", 200)
    doc["metadata"]["name"] = name
    apply(e2e, doc)
    first_step(e2e, f"{name}-ddp-0")
    assert_policy_of(e2e, name)
    rank0, rank1 = pod_ip(e2e, f"{name}-ddp-0"), pod_ip(e2e, f"{name}-ddp-1")
    rendezvous = f"{name}-ddp-0.{name}-ddp"  # what the ranks dial

    outsider = reach(e2e, OUTSIDER, [(rank0, RDZV_PORT), (rendezvous, RDZV_PORT), (rank0, METRICS_PORT),
                                     (rank1, METRICS_PORT)])
    scraper = reach(e2e, SCRAPER, [(rank0, METRICS_PORT), (rendezvous, METRICS_PORT), (rank0, RDZV_PORT)])

    assert opened(outsider) == set(), outsider
    assert opened(scraper) == {f"{rank0}:{METRICS_PORT}", f"{rendezvous}:{METRICS_PORT}"}, scraper
    status = succeeded(e2e, name)
    assert status.get("restarts", 0) == 0, status  # the ranks' own rendezvous and gloo traffic went through
    figure(f"{name}: rendezvous ({RDZV_PORT}) and metrics refused to an outside pod, metrics reached by the "
           f"metricsFrom pod; Succeeded at step {status['progress']['step']} with no restart")
