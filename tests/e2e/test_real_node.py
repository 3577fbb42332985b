"""The real node does what a cluster's node does: runs pods, serves logs and exec, DNS, Services, volumes."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path

import pytest
from e2elib import E2E_CLUSTER, HELPER_IMAGE, NAMESPACE, NODE_CGROUP, REAL_NODE, REAL_NODE_SELECTOR, RESTRICTED_CONTAINER, \
    RESTRICTED_POD, processes

pytestmark = pytest.mark.e2e


def test_real_node_is_ready_at_an_address_in_its_own_namespace_range(e2e):
    node = e2e.cluster.kubectl_json("get", "node", REAL_NODE)

    ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
    address = {a["type"]: a["address"] for a in node["status"]["addresses"]}["InternalIP"]
    assert ready == "True"
    assert ipaddress.ip_address(address) in ipaddress.ip_network("10.250.0.0/16"), address
    assert node["metadata"]["labels"]["kubetrain/node"] == "real"
    assert "kwok.x-k8s.io/node" not in node["metadata"].get("annotations", {})
    assert node["status"]["nodeInfo"]["kubeletVersion"] == "v1.36.3"


def test_pod_gets_a_volume_logs_exec_and_names_of_services(e2e):
    name = "node-check"
    e2e.kube.apply(*[
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
         "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "10Mi"}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name},
         "spec": {"clusterIP": "None", "selector": {"app": name}, "ports": [{"port": 80}]}},
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": name}},
         "spec": {"nodeSelector": dict(REAL_NODE_SELECTOR), "securityContext": RESTRICTED_POD,
                  "containers": [{"name": "c", "image": HELPER_IMAGE, "imagePullPolicy": "IfNotPresent",
                                  "securityContext": RESTRICTED_CONTAINER,
                                  "command": ["/bin/sh", "-c", "echo hello from $(cat /proc/sys/kernel/hostname); "
                                              "echo kept > /data/f; exec sleep 3600"],
                                  "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
                  "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": name}}]}},
    ])
    try:
        e2e.kubectl("wait", "--for=condition=Ready", f"pod/{name}", "--timeout=120s", timeout=130)
        pod = e2e.get("pod", name)
        claim = e2e.get("pvc", name)

        assert pod["spec"]["nodeName"] == REAL_NODE
        assert ipaddress.ip_address(pod["status"]["podIP"]) in ipaddress.ip_network(e2e.pod_cidr)
        assert claim["status"]["phase"] == "Bound"
        assert claim["spec"]["storageClassName"] == "local-path"  # the default class
        assert e2e.kubectl("logs", name).strip() == f"hello from {name}"
        assert e2e.kubectl("exec", name, "--", "cat", "/data/f").strip() == "kept"
        looked_up = e2e.kubectl("exec", name, "--", "/bin/sh", "-c", f"nslookup {name}.{NAMESPACE}.svc.cluster.local")
        assert pod["status"]["podIP"] in looked_up, looked_up
        # The pod's processes run under the node's own cgroup root, which weighs like four busy processes of
        # the host (hack/realnode/node's node_cpu_shares), not like one.
        [(pid, _)] = processes(e2e, name, "c")
        [cpu] = [line.split(":", 2)[2] for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
                 if "cpu" in line.split(":")[1].split(",")]
        root = cpu.strip("/").split("/")[0]
        assert root == NODE_CGROUP, cpu
        assert Path(f"/sys/fs/cgroup/cpu/{root}/cpu.shares").read_text().strip() == "4096"
    finally:
        e2e.kubectl("delete", "pod,svc,pvc", name, "--wait=false")


def test_pods_reach_the_api_server_through_the_kubernetes_service(e2e):
    """The operator's pod: in-cluster config, 10.0.0.1:443 through kube-proxy, the certificate checked."""
    probe = ("import json, ssl, urllib.request; "
             "sa = '/var/run/secrets/kubernetes.io/serviceaccount/'; "
             "ctx = ssl.create_default_context(cafile=sa + 'ca.crt'); "
             "req = urllib.request.Request('https://kubernetes.default.svc/version', "
             "headers={'Authorization': 'Bearer ' + open(sa + 'token').read()}); "
             "print(json.load(urllib.request.urlopen(req, context=ctx, timeout=10))['gitVersion'])")

    out = e2e.kubectl("exec", "deploy/kubetrain", "--", "python", "-c", probe)

    assert out.strip() == "v1.36.3"


def test_second_up_of_the_running_cluster_says_so(e2e):
    done = e2e.cluster.hack_cluster("up", "--real-node")

    assert done.returncode == 1
    assert f"cluster {E2E_CLUSTER} is already up" in done.stderr
    assert json.loads(e2e.cluster.kubectl("get", "node", REAL_NODE, "-o", "json"))["metadata"]["name"] == REAL_NODE
