"""helpers/apiread.py, the tests' reads without a kubectl process, print what `kubectl get -o json` prints."""

import json
import uuid

import pytest

from helpers import apiread
from helpers.kube import install_crd, wait_established

pytestmark = pytest.mark.cluster


def kubectl_json(kube, *args: str) -> dict:
    return json.loads(kube(*args, "-o", "json"))


def direct(kube, *args: str):
    """The read through apiread itself (Kubectl would run kubectl where apiread declines)."""
    kind, name, query = apiread.read_args(args)
    return apiread.reader(kube.env).get(kind, name, kube.namespace, query, timeout=30)


def comparable(doc: dict) -> str:
    """A List's items (its own metadata is kubectl's, empty) or the object, as sorted JSON."""
    return json.dumps(doc["items"] if doc.get("kind") == "List" else doc, sort_keys=True)


def test_reads_print_what_kubectl_prints_in_a_namespace_and_across_the_cluster(cluster):
    install_crd(cluster)  # a custom resource's definition among the reads
    namespace = f"read-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", namespace)
    kube = cluster.kube(namespace)
    try:
        for i in range(3):
            kube.apply({"apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": f"cm-{i}", "labels": {"pick": "yes" if i else "no"}},
                        "data": {"i": str(i)}})
        for args in (("get", "configmaps"), ("get", "cm", "-l", "pick=yes"), ("get", "configmap", "cm-1"),
                     ("get", "configmaps", "--field-selector", "metadata.name=cm-2"),
                     ("get", "namespaces", namespace), ("get", "crd", "trainingjobs.kubetrain.dev")):
            read = direct(kube, *args)
            assert comparable(read) == comparable(kubectl_json(kube, *args)), args
        assert [c["metadata"]["name"] for c in direct(kube, "get", "configmap", "-l", "pick=yes")["items"]] == \
            ["cm-1", "cm-2"]
        assert all(c["kind"] == "ConfigMap" and c["apiVersion"] == "v1" for c in direct(kube, "get", "cm")["items"])
        assert "managedFields" not in direct(kube, "get", "configmap", "cm-0")["metadata"]
        # Not found: None from apiread and Kubectl.get(), kubectl's failure from Kubectl.json().
        assert direct(kube, "get", "configmap", "nope") is apiread.NOT_FOUND
        assert kube.get("configmap", "nope") is None
        with pytest.raises(AssertionError, match="NotFound"):
            kube.json("get", "configmap", "nope")
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=false")


def test_a_kind_installed_after_the_first_read_is_found(cluster):
    kube = cluster.kube("default")
    kube.items("pods")  # discovery done before the next kind is known
    group = f"t{uuid.uuid4().hex[:6]}.kubetrain.dev"
    kube.apply({"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
                "metadata": {"name": f"widgets.{group}"},
                "spec": {"group": group, "scope": "Namespaced",
                         "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "shortNames": ["wg"]},
                         "versions": [{"name": "v1", "served": True, "storage": True,
                                       "schema": {"openAPIV3Schema": {"type": "object",
                                                                      "x-kubernetes-preserve-unknown-fields": True}}}]}})
    try:
        wait_established(cluster, f"widgets.{group}")
        kube.apply({"apiVersion": f"{group}/v1", "kind": "Widget", "metadata": {"name": "w"}})
        assert direct(kube, "get", f"widgets.{group}", "w")["kind"] == "Widget"
        assert [w["metadata"]["name"] for w in direct(kube, "get", f"wg.{group}")["items"]] == ["w"]
    finally:
        cluster.kubectl("delete", "crd", f"widgets.{group}", "--wait=false")


@pytest.mark.parametrize("args", [
    ("get", "pods", "-o", "wide"), ("get", "pods,services"), ("get", "pod/x"), ("describe", "pod", "x"),
    ("get", "pods", "-A"), ("get",), ("get", "pods", "a", "b"), ("get", "pods", "-l"),
])
def test_anything_but_a_plain_read_is_left_to_kubectl(args):
    with pytest.raises(apiread.Unsupported):
        apiread.read_args(args)


def test_a_plain_read_is_parsed_with_its_selectors():
    assert apiread.read_args(("get", "pods", "-l", "a=b", "--field-selector=status.phase=Running")) == (
        "pods", None, {"labelSelector": "a=b", "fieldSelector": "status.phase=Running"})
    assert apiread.read_args(("get", "trainingjob", "j")) == ("trainingjob", "j", {})
