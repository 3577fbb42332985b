"""The Helm chart: lint, least privilege counted, install and uninstall on the real API server."""

from __future__ import annotations

import json
import subprocess
import uuid

import pytest
import yaml

from support import ROOT

pytestmark = pytest.mark.cluster
CHART = ROOT / "charts" / "kubetrain"


def helm(cluster, *args: str, timeout: float = 300) -> str:
    return cluster.run("helm", *args, timeout=timeout)


def rendered(cluster, *sets: str) -> list[dict]:
    args = ["template", "kubetrain", str(CHART), "--namespace", "kt"]
    for s in sets:
        args += ["--set", s]
    return [d for d in yaml.safe_load_all(helm(cluster, *args)) if d]


def test_helm_lint_strict_is_clean(cluster):
    out = helm(cluster, "lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in out


def test_values_schema_rejects_unknown_values(cluster):
    done = subprocess.run(["helm", "template", "x", str(CHART), "--set", "operator.imagee.tag=1"],
                          env=cluster.env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "imagee" in done.stderr


def grants(rules: list[dict]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


@pytest.mark.parametrize("namespaced, kind", [(False, "ClusterRole"), (True, "Role")])
def test_rbac_is_least_privilege(cluster, namespaced, kind):
    docs = rendered(cluster, f"operator.namespaced={str(namespaced).lower()}")
    roles = [d for d in docs if d["kind"] in ("Role", "ClusterRole")]
    assert sorted(r["kind"] for r in roles) == sorted([kind, "ClusterRole"]) if kind == "Role" else [kind, kind]
    discovery = next(r for r in roles if r["metadata"]["name"].endswith("-discovery"))
    assert grants(discovery["rules"]) == {  # what kopf reads at start, read-only
        ("apiextensions.k8s.io", "customresourcedefinitions", "list"), ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
        ("", "namespaces", "list"), ("", "namespaces", "watch")}
    g = set().union(*(grants(r["rules"]) for r in roles))
    print(f"\n{kind}: {len(g)} verb-resource grants (Kubeflow training operator v1.8.1: 131)")
    assert len(g) <= 24
    assert not {x for x in g if x[1] == "pods/exec"}
    assert {v for (_, r, v) in g if r == "secrets"} == {"create"}  # never get/list/watch/update
    assert not {x for x in g if x[0] == "rbac.authorization.k8s.io"}
    assert not {x for x in g if "*" in x}


def test_deploy_manifests_are_rendered_from_the_chart(cluster, tmp_path):
    out = tmp_path / "deploy"
    done = subprocess.run([str(ROOT / "hack" / "gen-deploy"), str(out)], env=cluster.env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for name in ("operator.yaml", "kustomization.yaml", "namespace.yaml", "crd/trainingjobs.yaml"):
        assert (out / name).read_text() == (ROOT / "deploy" / name).read_text(), f"deploy/{name} is stale: run hack/gen-deploy"


def test_dashboards_are_configmaps_with_the_grafana_label(cluster):
    maps = [d for d in rendered(cluster) if d["kind"] == "ConfigMap"]
    files = sorted(p.name for p in (CHART / "dashboards").glob("*.json"))
    assert sorted(k for m in maps for k in m["data"]) == files
    assert all(m["metadata"]["labels"]["grafana_dashboard"] == "1" for m in maps)


def test_install_and_uninstall_leave_nothing_behind(cluster):
    release = f"kt-{uuid.uuid4().hex[:5]}"
    ns = f"{release}-ns"
    helm(cluster, "install", release, str(CHART), "--namespace", ns, "--create-namespace",
         "--set", "operator.namespaced=true", "--wait", "--timeout", "120s")
    dep = json.loads(cluster.kubectl("-n", ns, "get", "deployment", "-o", "json"))["items"]
    assert [d["spec"]["strategy"]["type"] for d in dep] == ["Recreate"]
    assert dep[0]["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    notes = helm(cluster, "get", "notes", release, "--namespace", ns)
    assert "kubectl apply -f examples/quickstart.yaml" in notes
    helm(cluster, "uninstall", release, "--namespace", ns, "--wait")
    left = cluster.kubectl("get", "all,configmaps,serviceaccounts,roles,rolebindings", "-n", ns,
                           "-l", f"app.kubernetes.io/instance={release}", "-o", "name")
    assert left.strip() == ""
    cluster.kubectl("delete", "namespace", ns, "--wait=false")
