"""Fake kwok nodes come up Ready and get Running pods from real controllers and the scheduler."""

import json

import pytest

pytestmark = pytest.mark.cluster


def _ready(node: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"]["conditions"])


def test_fake_nodes_are_ready(cluster):
    nodes = cluster.kubectl_json("get", "nodes")["items"]

    assert len(nodes) == cluster.nodes
    assert all(_ready(node) for node in nodes), [n["status"]["conditions"] for n in nodes]
    assert {n["metadata"]["annotations"].get("kwok.x-k8s.io/node") for n in nodes} == {"fake"}


def test_deployment_gets_running_pods_on_fake_nodes(cluster):
    cluster.kubectl("create", "namespace", "deploy-test")
    cluster.kubectl("create", "deployment", "web", "-n", "deploy-test", "--replicas=2", "--image=kubetrain/fake:0")
    cluster.kubectl("rollout", "status", "deployment/web", "-n", "deploy-test", "--timeout=60s", timeout=90)

    pods = cluster.kubectl_json("get", "pods", "-n", "deploy-test")["items"]
    fake_nodes = {n["metadata"]["name"] for n in cluster.kubectl_json("get", "nodes")["items"]}
    assert [p["status"]["phase"] for p in pods] == ["Running", "Running"]
    assert {p["spec"]["nodeName"] for p in pods} <= fake_nodes
    cluster.kubectl("delete", "namespace", "deploy-test", "--wait=false")


def test_kwok_manages_only_nodes_annotated_fake(cluster):
    """A real kubelet's node (no annotation, no type=kwok label) must stay the kubelet's: kwok leaves it alone."""
    fake = {"annotations": {"kwok.x-k8s.io/node": "fake"}, "labels": {"type": "kwok"}}
    for name, meta in (("real-like", {}), ("fake-extra", fake)):
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, **meta}}
        cluster.run("kubectl", "create", "-f", "-", input=json.dumps(node))
    try:
        # Once kwok has made the annotated node Ready, it has seen both.
        cluster.kubectl("wait", "--for=condition=Ready", "node/fake-extra", "--timeout=60s", timeout=90)
        assert cluster.kubectl_json("get", "node", "real-like")["status"].get("conditions") is None
    finally:
        cluster.kubectl("delete", "node", "real-like", "fake-extra")
