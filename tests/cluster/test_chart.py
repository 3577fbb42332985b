"""The Helm chart: lint, least privilege counted, install and uninstall on the real API server."""

from __future__ import annotations

import json
import subprocess
import uuid

import pytest
import yaml

from support import ROOT

from kubetrain.cli.commands import parse_gang_schedulers, parse_metrics_from

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


LEASE_GRANTS = {("coordination.k8s.io", "leases", v) for v in ("create", "get", "update")}
KUEUE_GRANTS = {("kueue.x-k8s.io", "workloads", v) for v in ("create", "list", "watch", "delete")} | {
    ("kueue.x-k8s.io", "workloads/status", "patch"), ("kueue.x-k8s.io", "resourceflavors", "get"),
    ("kueue.x-k8s.io", "workloadpriorityclasses", "get")}
GRANTS_LIMIT = 39
"""Issue 15's ceiling on the verb-resource grants of every role together, leader election included
(Kubeflow's training operator v1.8.1: 131)."""


@pytest.mark.parametrize("namespaced, kind", [(False, "ClusterRole"), (True, "Role")])
@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("kueue", [False, True])
def test_rbac_is_least_privilege(cluster, namespaced, kind, replicas, kueue):
    docs = rendered(cluster, f"operator.namespaced={str(namespaced).lower()}", f"operator.replicas={replicas}",
                    f"kueue.enabled={str(kueue).lower()}")
    roles = [d for d in docs if d["kind"] in ("Role", "ClusterRole")]
    # The operator's own (Role or ClusterRole), kopf's discovery (a ClusterRole), and with two
    # replicas the leader election's Role in the release's namespace.
    # With kueue.enabled a namespaced operator also gets a ClusterRole for Kueue's cluster-scoped objects.
    assert sorted(r["kind"] for r in roles) == sorted([kind, "ClusterRole"] + ["Role"] * (replicas > 1)
                                                      + ["ClusterRole"] * (kueue and namespaced))
    discovery = next(r for r in roles if r["metadata"]["name"].endswith("-discovery"))
    assert grants(discovery["rules"]) == {  # what kopf reads at start, read-only
        ("apiextensions.k8s.io", "customresourcedefinitions", "list"), ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
        ("", "namespaces", "list"), ("", "namespaces", "watch")}
    g = set().union(*(grants(r["rules"]) for r in roles))
    print(f"\n{kind}, {replicas} replica(s): {len(g)} verb-resource grants (Kubeflow training operator v1.8.1: 131)")
    assert len(g) <= GRANTS_LIMIT
    assert {x for x in g if x[1] == "leases"} == (LEASE_GRANTS if replicas > 1 else set())
    assert not {x for x in g if x[1] == "pods/exec"}
    assert {v for (_, r, v) in g if r == "secrets"} == {"create"}  # never get/list/watch/update
    assert {v for (_, r, v) in g if r == "networkpolicies"} == {"get", "create"}  # each job's, and the 409 owner check
    assert not {x for x in g if x[0] == "rbac.authorization.k8s.io"}
    assert not {x for x in g if "*" in x}
    # Kueue's objects only with kueue.enabled: its Workloads created and watched (and deleted, to be made
    # again, when the job is resized), their status patched (quota given back, Finished), flavors and
    # priority classes read.
    assert {x for x in g if x[0] == "kueue.x-k8s.io"} == (KUEUE_GRANTS if kueue else set())


def test_two_replicas_elect_a_leader_on_a_lease_they_alone_may_update(cluster):
    docs = rendered(cluster, "operator.replicas=2")
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"  # a new pod waits as a standby
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert {"--leader-elect", "--lease-name=kubetrain-leader", "--lease-namespace=kt"} <= set(container["args"])
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in container["env"]}
    assert env["POD_NAME"] == "metadata.name" and env["POD_NAMESPACE"] == "metadata.namespace"
    role = next(d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "kubetrain-leader-election")
    assert role["metadata"]["namespace"] == "kt"
    by_verb = {v: rule.get("resourceNames") for rule in role["rules"] for v in rule["verbs"]}
    # create cannot be limited to a name; reading and writing the Lease are limited to the one
    assert by_verb == {"create": None, "get": ["kubetrain-leader"], "update": ["kubetrain-leader"]}
    binding = next(d for d in docs
                   if d["kind"] == "RoleBinding" and d["metadata"]["name"] == "kubetrain-leader-election")
    assert binding["roleRef"]["name"] == "kubetrain-leader-election"
    assert binding["subjects"][0]["name"] == deployment["spec"]["template"]["spec"]["serviceAccountName"]


def test_the_lease_role_lets_the_operator_elect_a_leader_and_nothing_more(cluster):
    """The chart's ServiceAccount, Role and RoleBinding on the real API server, and the operator's own
    elector acting as that ServiceAccount: it creates, renews and releases its Lease, and is refused
    any other."""
    from kubernetes import config
    from kubernetes.client.rest import ApiException

    from kubetrain.drivers.cluster.leader import Decision, LeaderElector

    ns = f"kt-lease-{uuid.uuid4().hex[:5]}"
    cluster.kubectl("create", "namespace", ns)
    try:
        docs = [d for d in yaml.safe_load_all(helm(cluster, "template", "kubetrain", str(CHART), "--namespace", ns,
                                                    "--set", "operator.replicas=2")) if d]
        wanted = [d for d in docs
                  if d["kind"] == "ServiceAccount" or d["metadata"]["name"] == "kubetrain-leader-election"]
        assert sorted(d["kind"] for d in wanted) == ["Role", "RoleBinding", "ServiceAccount"]
        cluster.kube(ns).apply(*wanted)
        api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
        api.set_default_header("Impersonate-User", f"system:serviceaccount:{ns}:kubetrain")
        elector = LeaderElector("kubetrain-leader", ns, "kubetrain-0_test", api=api)
        assert elector.try_acquire_or_renew() is Decision.ACQUIRE  # a get (404), then a create
        elector.renew_once()  # an update
        assert elector.try_acquire_or_renew() is Decision.RENEW  # a get, then an update
        elector.release()
        assert cluster.kube(ns).json("get", "lease", "kubetrain-leader")["spec"]["holderIdentity"] in ("", None)
        with pytest.raises(ApiException) as refused:
            LeaderElector("another-lease", ns, "x_1", api=api).try_acquire_or_renew()
        assert refused.value.status == 403  # get is limited to the chart's Lease
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false")


def test_one_replica_runs_without_leader_election(cluster):
    docs = rendered(cluster)
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    assert not [a for a in deployment["spec"]["template"]["spec"]["containers"][0]["args"] if "lease" in a]
    forced = next(d for d in rendered(cluster, "operator.leaderElection.enabled=true") if d["kind"] == "Deployment")
    assert "--leader-elect" in forced["spec"]["template"]["spec"]["containers"][0]["args"]


def operator_args(docs: list[dict]) -> list[str]:
    return next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]


def test_network_policy_peers_reach_the_operator_as_flags_it_accepts(cluster):
    prometheus = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                  "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
    docs = rendered(cluster, "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.kubernetes\\.io/metadata\\.name=monitoring",
                    "networkPolicy.metricsFrom[0].podSelector.matchLabels.app\\.kubernetes\\.io/name=prometheus")
    [flag] = [a for a in operator_args(docs) if a.startswith("--metrics-from-json=")]
    # The operator's own pods first (it reads each job's progress there), then the values' peers.
    assert parse_metrics_from(flag.split("=", 1)[1]) == (
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kt"}},
         "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kubetrain", "app.kubernetes.io/instance": "kubetrain",
                                         "app.kubernetes.io/component": "operator"}}},
        prometheus)
    assert "--no-network-policy" not in operator_args(docs)


@pytest.mark.parametrize("namespaced", [False, True])
def test_without_network_policies_the_operator_is_told_so_and_may_not_create_them(cluster, namespaced):
    docs = rendered(cluster, "networkPolicy.enabled=false", f"operator.namespaced={str(namespaced).lower()}")
    args = operator_args(docs)
    assert "--no-network-policy" in args and not [a for a in args if a.startswith("--metrics-from-json")]
    g = set().union(*(grants(d["rules"]) for d in docs if d["kind"] in ("Role", "ClusterRole")))
    assert not {x for x in g if x[1] == "networkpolicies"}


PODGROUP_GRANTS = {(group, "podgroups", verb) for group in ("scheduling.volcano.sh", "scheduling.x-k8s.io")
                   for verb in ("get", "create", "patch")}


@pytest.mark.parametrize("namespaced", [False, True])
@pytest.mark.parametrize("replicas", [1, 2])
def test_gang_scheduling_adds_podgroup_grants_and_flags_only_for_the_enabled_schedulers(cluster, namespaced, replicas):
    base = (f"operator.namespaced={str(namespaced).lower()}", f"operator.replicas={replicas}")
    off = rendered(cluster, *base)
    assert not {x for d in off if d["kind"] in ("Role", "ClusterRole") for x in grants(d["rules"]) if x[1] == "podgroups"}
    assert not [a for a in operator_args(off) if a.startswith("--gang-scheduler")]
    on = rendered(cluster, *base, "gangScheduling.volcano.enabled=true", "gangScheduling.schedulerPlugins.enabled=true",
                  "gangScheduling.schedulerPlugins.schedulerName=default-scheduler")
    g = set().union(*(grants(d["rules"]) for d in on if d["kind"] in ("Role", "ClusterRole")))
    print(f"\ngang scheduling on, namespaced={namespaced}, {replicas} replica(s): {len(g)} verb-resource grants")
    assert {x for x in g if x[1] == "podgroups"} == PODGROUP_GRANTS  # create, get for the 409 owner check, patch at a resize
    assert len(g) <= GRANTS_LIMIT
    # The flags the operator parses, the first (Volcano) the default of a job that names none.
    args = [a for a in operator_args(on) if a.startswith("--gang-scheduler")]
    assert args == ["--gang-scheduler=volcano=volcano", "--gang-scheduler=scheduler-plugins=default-scheduler"]
    assert parse_gang_schedulers([a.split("=", 1)[1] for a in args]) == (
        ("volcano", "volcano"), ("scheduler-plugins", "default-scheduler"))
    one = rendered(cluster, *base, "gangScheduling.schedulerPlugins.enabled=true")
    g = set().union(*(grants(d["rules"]) for d in one if d["kind"] in ("Role", "ClusterRole")))
    assert {x for x in g if x[1] == "podgroups"} == {("scheduling.x-k8s.io", "podgroups", v)
                                                    for v in ("get", "create", "patch")}
    assert [a for a in operator_args(one) if a.startswith("--gang-scheduler")] == [
        "--gang-scheduler=scheduler-plugins=scheduler-plugins-scheduler"]


def test_values_schema_refuses_a_scheduler_name_that_is_no_name(cluster):
    for bad in ("gangScheduling.volcano.schedulerName=Not_A_Name", "gangScheduling.kueue.enabled=true"):
        done = subprocess.run(["helm", "template", "x", str(CHART), "--set", bad],
                              env=cluster.env, capture_output=True, text=True, timeout=60)
        assert done.returncode != 0, bad


def test_values_schema_refuses_a_metrics_peer_it_does_not_know(cluster):
    for bad in ("networkPolicy.metricsFrom[0].ports[0].port=80", "networkPolicy.metricsFrom[0].ipBlock.except={10.0.0.0/8}"):
        done = subprocess.run(["helm", "template", "x", str(CHART), "--set", bad],
                              env=cluster.env, capture_output=True, text=True, timeout=60)
        assert done.returncode != 0, bad


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


def test_no_tenant_endpoint_is_scraped_with_its_own_labels(cluster):
    """A trainer's /metrics is a tenant's code. With honorLabels its own `namespace` and `job` labels won
    over the target's: a script job in any namespace could serve
    kubetrain_training_step{namespace="team-b",job="victim"} with a step that moves, and keep the victim's
    KubetrainJobNoProgress alert from firing (or fire another tenant's). The PodMonitor and the plain
    scrape job take those labels from the pod (its namespace, its kubetrain.dev/* labels, which the
    operator sets and a template may not); the trainer's own become `exported_*`. Only the operator's
    endpoint keeps its labels: its `namespace` label is each job's, and it is no tenant's."""
    out = helm(cluster, "template", "kubetrain", str(CHART), "--namespace", "kt",
               "--api-versions", "monitoring.coreos.com/v1")
    monitors = {d["kind"]: d for d in yaml.safe_load_all(out) if d and d["kind"] in ("PodMonitor", "ServiceMonitor")}
    assert set(monitors) == {"PodMonitor", "ServiceMonitor"}
    trainers = monitors["PodMonitor"]["spec"]["podMetricsEndpoints"]
    assert trainers and not any(e.get("honorLabels") for e in trainers), trainers
    for endpoint in trainers:
        from_pod = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
        assert from_pod["namespace"] == ["__meta_kubernetes_namespace"]
        assert from_pod["job"] == ["__meta_kubernetes_pod_label_kubetrain_dev_job_name"]
    assert monitors["ServiceMonitor"]["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "operator"
    jobs = {j["job_name"]: j for j in yaml.safe_load((CHART / "files" / "scrape-configs.yaml").read_text())}
    assert not jobs["kubetrain-trainers"].get("honor_labels"), jobs["kubetrain-trainers"]
    relabelled = {r["target_label"]: r["source_labels"] for r in jobs["kubetrain-trainers"]["relabel_configs"]
                  if "target_label" in r and r.get("regex") is None}
    assert relabelled["namespace"] == ["__meta_kubernetes_namespace"]
    assert relabelled["job"] == ["__meta_kubernetes_pod_label_kubetrain_dev_job_name"]
    assert [name for name, j in jobs.items() if j.get("honor_labels")] in ([], ["kubetrain-operator"])


def test_a_trainer_scraped_by_the_charts_scrape_job_cannot_name_another_tenants_series(cluster, tmp_path):
    """The property itself, in a real Prometheus (the one `hack/cluster build` makes) running the chart's
    plain scrape jobs against the cluster: a trainer pod of job `forger` in one namespace serves
    kubetrain_training_step labelled as job `victim` of another namespace. What Prometheus stores is the
    forger's, by the pod's namespace and label; nothing lands under the victim's labels."""
    from prometheus_client import CollectorRegistry, Gauge, start_http_server

    from helpers.net import free_port
    from helpers.prometheus import start_prometheus
    from helpers.wait import wait_for

    ns = f"forge-{uuid.uuid4().hex[:5]}"
    port = free_port()
    registry = CollectorRegistry()
    Gauge("kubetrain_training_step", "s", ["namespace", "job", "role", "replica"], registry=registry).labels(
        namespace="team-victim", job="victim", role="worker", replica="worker-0").set(42)
    server, _ = start_http_server(port, addr="127.0.0.1", registry=registry)
    kube = cluster.kube(ns)
    cluster.kubectl("create", "namespace", ns)
    prom = None
    try:
        kube.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": "forger-worker-0", "namespace": ns,
            "labels": {"kubetrain.dev/job-name": "forger", "kubetrain.dev/role": "worker",
                       "kubetrain.dev/replica": "worker-0"}},
            "spec": {"containers": [{"name": "trainer", "image": "busybox",
                                     "ports": [{"name": "metrics", "containerPort": port}]}]}})
        wait_for("the pod placed by kwok", lambda: ((kube.get("pod", "forger-worker-0") or {}).get("status") or {})
                 .get("phase") == "Running", timeout=60)
        # kwok runs nothing: the pod's address is made the loopback, where this test serves its /metrics.
        kube.run("patch", "pod", "forger-worker-0", "--subresource=status", "--type=merge", "-p", json.dumps(
            {"status": {"podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}]}}))
        jobs = yaml.safe_load((CHART / "files" / "scrape-configs.yaml").read_text())
        for job in jobs:
            for sd in job["kubernetes_sd_configs"]:
                sd |= {"kubeconfig_file": str(cluster.kubeconfig), "namespaces": {"names": [ns]}}
        config = tmp_path / "prometheus.yml"
        config.write_text(yaml.safe_dump({"global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
                                          "scrape_configs": jobs}))
        prom = start_prometheus(cluster.bin_dir / "prometheus", config, tmp_path)
        seen = wait_for(f"the forger scraped: {prom.targets() if prom else ''}",
                        lambda: prom.query("kubetrain_training_step"), timeout=60)
        labels = seen[0]["metric"]
        assert (labels["namespace"], labels["job"], labels["role"], labels["replica"]) == (
            ns, "forger", "worker", "worker-0"), labels
        assert (labels["exported_namespace"], labels["exported_job"]) == ("team-victim", "victim")  # kept, not used
        assert prom.query('kubetrain_training_step{job="victim"}') == []
        assert prom.query('kubetrain_training_step{namespace="team-victim"}') == []
    finally:
        if prom is not None:
            prom.stop()
        server.shutdown()
        cluster.kubectl("delete", "namespace", ns, "--wait=false")


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


SECURITY_PAGE = ROOT / "docs" / "security.md"
EVERY_FEATURE = ("operator.replicas=2", "kueue.enabled=true", "gangScheduling.volcano.enabled=true",
                 "gangScheduling.schedulerPlugins.enabled=true", "networkPolicy.enabled=true")


@pytest.mark.parametrize("namespaced", [False, True])
def test_the_security_page_counts_the_grants_as_the_chart_renders_them(cluster, namespaced):
    """docs/security.md once said "at most 39" where every feature on made 45."""
    scope = f"operator.namespaced={str(namespaced).lower()}"

    def count(*sets: str) -> int:
        docs = rendered(cluster, scope, *sets)
        return len(set().union(*(grants(d["rules"]) for d in docs if d["kind"] in ("Role", "ClusterRole"))))

    text = " ".join(SECURITY_PAGE.read_text().split())
    claims = {
        "with the chart's defaults": count(),
        "with two replicas": count("operator.replicas=2"),
        "with Kueue": count("kueue.enabled=true"),
        "with both gang schedulers": count("gangScheduling.volcano.enabled=true",
                                           "gangScheduling.schedulerPlugins.enabled=true"),
        "with every feature on": count(*EVERY_FEATURE),
    }
    for words, n in claims.items():
        assert f"{n} {words}" in text, f"docs/security.md should say '{n} {words}'"
    assert "at most 39" not in text


def test_the_workers_value_reaches_the_operator_within_its_bounds(cluster):
    from kubetrain.drivers.cluster.state import MAX_WORKERS, WORKERS

    assert f"--workers={WORKERS}" in operator_args(rendered(cluster)), "the chart's default is the operator's"
    assert f"--workers={MAX_WORKERS}" in operator_args(rendered(cluster, f"operator.workers={MAX_WORKERS}"))
    for bad in (0, MAX_WORKERS + 1):
        done = subprocess.run(["helm", "template", "x", str(CHART), "--set", f"operator.workers={bad}"],
                              env=cluster.env, capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and "workers" in done.stderr, bad
