"""The operator's API client against a real API server: one connection per thread, requests counted by
verb and resource, never by name."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers.wait import wait_for
from kubernetes import config

from kubetrain.drivers.cluster import kube, metrics

pytestmark = pytest.mark.cluster

REQUESTS = 12


def counted() -> dict[tuple[str, str], float]:
    [family] = list(metrics.API_REQUESTS.collect())
    return {(s.labels["verb"], s.labels["resource"]): s.value for s in family.samples if s.name.endswith("_total")}


@pytest.mark.parametrize("url, resource", [
    ("https://h:1/api/v1/namespaces/ns/pods", "pods"),
    ("https://h:1/api/v1/namespaces/ns/pods/ps-0/status?fieldManager=x", "pods/status"),
    ("https://h:1/apis/kubetrain.dev/v1alpha1/namespaces/ns/trainingjobs/j/status", "trainingjobs/status"),
    ("https://h:1/apis/kueue.x-k8s.io/v1beta2/workloadpriorityclasses/high", "workloadpriorityclasses"),
    ("https://h:1/api/v1/pods?labelSelector=a&limit=500", "pods"),
    ("https://h:1/api/v1/namespaces", "namespaces"),
    ("https://h:1/api/v1/namespaces/ns", "namespaces"),
])
def test_a_request_counts_under_its_resource_never_its_names(url, resource):
    assert kube.resource_of(url) == resource


def pod_namespace(cluster, prefix: str) -> str:
    """A new namespace that takes pods: its default ServiceAccount exists (the controller-manager makes it
    a moment after the namespace; a pod created before is refused with 403)."""
    namespace = f"{prefix}-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", namespace)
    wait_for(f"the default ServiceAccount of {namespace}", lambda: cluster.kubectl(
        "get", "serviceaccounts", "-n", namespace, "-o", "name").strip() == "serviceaccount/default", timeout=60)
    return namespace


def test_writes_reuse_one_connection_and_are_counted_by_verb_and_resource(cluster):
    """A create never reads its answer: unless the client reads it, urllib3 keeps the connection out of its
    pool and the next request opens another (a TLS handshake each)."""
    config.load_kube_config(config_file=cluster.env["KUBECONFIG"])
    namespace = f"kc-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", namespace)
    before = counted()
    seen: dict = {}

    def work() -> None:  # a thread of its own: its own ApiClient, as each reconcile worker has
        try:
            created = [kube.create({"apiVersion": "v1", "kind": "ConfigMap",
                                    "metadata": {"name": f"cm-{i}", "namespace": namespace}, "data": {}})
                       for i in range(REQUESTS)]
            seen["created"] = created
            pools = kube._api().rest_client.pool_manager.pools
            seen["connections"] = sum(pools[key].num_connections for key in pools.keys())
        except Exception as err:  # noqa: BLE001 - reported by the assertion below
            seen["error"] = err

    try:
        thread = threading.Thread(target=work)
        thread.start()
        thread.join(timeout=120)
        assert "error" not in seen, seen.get("error")
        assert seen["created"] == [True] * REQUESTS
        assert seen["connections"] == 1, f"{REQUESTS} creates opened {seen['connections']} connections"
        after = counted()
        assert after.get(("POST", "configmaps"), 0) - before.get(("POST", "configmaps"), 0) == REQUESTS
        named = [labels for labels in after if namespace in "".join(labels) or "cm-" in "".join(labels)]
        assert not named, f"series named after objects: {named}"
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=false")


@pytest.fixture
def bare_pod(cluster):
    """(its namespace, a pod named p not yet created) in a namespace of its own, deleted after the test."""
    config.load_kube_config(config_file=cluster.env["KUBECONFIG"])
    namespace = pod_namespace(cluster, "kp")
    try:
        yield namespace, {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": namespace},
                          "spec": {"containers": [{"name": "c", "image": "busybox"}]}}
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=false")


def test_a_pod_is_deleted_only_as_the_incarnation_the_round_saw(cluster, bare_pod):
    """A round that acted on a stale view of a pod (its old incarnation's late event) must not delete the
    replacement of the same name: the delete carries the uid it saw as a precondition."""
    namespace, pod = bare_pod
    assert kube.create(pod)
    uid = cluster.kubectl("get", "pod", "p", "-n", namespace, "-o", "jsonpath={.metadata.uid}")
    kube.delete_pod(namespace, "p", force=True, uid="0" * 8 + uid[8:])  # another incarnation's: refused, quietly
    assert cluster.kubectl("get", "pod", "p", "-n", namespace, "-o", "jsonpath={.metadata.uid}") == uid
    kube.delete_pod(namespace, "p", force=True, uid=uid)  # its own: gone at once (no grace)
    assert cluster.kubectl("get", "pods", "-n", namespace, "-o", "name") == ""
    kube.delete_pod(namespace, "p", force=True, uid=uid)  # already gone: not an error


def test_writes_sent_as_plain_json_are_what_the_api_server_takes_and_refusals_name_the_object(cluster, bare_pod):
    """The round's writes skip the generated client's methods (`kube._send`): the same requests, their
    answers and refusals as the methods gave them."""
    namespace, pod = bare_pod
    assert kube.create(pod)
    with pytest.raises(kube.NotOurs, match=f"Pod {namespace}/p exists and is not owned by this job"):
        kube.create(pod)  # the name is taken (409) by a pod no job owns: never adopted
    with pytest.raises(kube.KubeError, match=rf"^create pod {namespace}/q: 422 .*containers"):
        kube.create({**pod, "metadata": {"name": "q", "namespace": namespace}, "spec": {"containers": []}})
    with pytest.raises(ValueError, match="cannot create a Deployment"):
        kube.create({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"}})
    job = {"metadata": {"name": "j", "namespace": namespace, "uid": "u-1"}}
    kube.record_event(job, "Normal", "Tested", "an event " + "x" * 2000)
    events = cluster.kubectl("get", "events", "-n", namespace, "--field-selector", "reason=Tested", "-o",
                             "jsonpath={.items[*].message}")
    assert events.startswith("an event x") and len(events) == 1024  # the message is cut to 1,024
    kube.patch_status(namespace, "missing", {"state": "Running"})  # a job gone meanwhile: no error
    kube.delete_pod(namespace, "p")  # graceful, no precondition: terminating, or gone already
    left = cluster.kubectl("get", "pods", "-n", namespace, "-o", "jsonpath={.items[*].metadata.deletionTimestamp}")
    assert left or cluster.kubectl("get", "pods", "-n", namespace, "-o", "name") == ""



def test_a_child_deleted_between_the_create_and_the_owner_test_is_created_again(cluster, bare_pod, monkeypatch):
    """A name the job could not adopt, freed by its user just as the round tried it: the create meets the old
    object (409), the owner test finds it gone (404), and the create is made again, rather than the job
    counting a ConfigMap that is not there as made (its pods would then wait for it forever)."""
    namespace, _ = bare_pod
    cluster.kubectl("create", "configmap", "c", "-n", namespace, "--from-literal=job.yaml=someone else's")
    # The owner must exist: the garbage collector deletes what names a missing one (it would race the test).
    cluster.kubectl("create", "configmap", "owner", "-n", namespace)
    uid = cluster.kubectl("get", "configmap", "owner", "-n", namespace, "-o", "jsonpath={.metadata.uid}")
    owner = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": uid}
    ours = {"apiVersion": "v1", "kind": "ConfigMap", "data": {"job.yaml": "ours"},
            "metadata": {"name": "c", "namespace": namespace, "ownerReferences": [owner]}}
    real = kube._TESTERS["ConfigMap"]

    def deleted_first(api):  # the user deletes the old one just before the owner test runs
        cluster.kubectl("delete", "configmap", "c", "-n", namespace)
        return real(api)

    monkeypatch.setitem(kube._TESTERS, "ConfigMap", deleted_first)
    assert kube.create(ours) is True
    made = cluster.kubectl("get", "configmap", "c", "-n", namespace, "-o", "jsonpath={.data.job\\.yaml}")
    assert made == "ours"
    monkeypatch.setitem(kube._TESTERS, "ConfigMap", real)
    assert kube.create(ours) is False  # exists and is ours: an earlier round made it
    with pytest.raises(kube.NotOurs, match="not owned by this job"):
        kube.create({**ours, "metadata": {**ours["metadata"], "ownerReferences": [{**owner, "uid": "other"}]}})

def test_routine_requests_pass_the_gate_and_urgent_ones_and_their_pool_threads_do_not(cluster):
    """Every request of a thread outside kube.urgent() first waits at the routine gate (while urgent work is
    under way, workqueue.wait_urgent_clear); an urgent round's requests, in its own thread or handed to the
    creators' pool (kube.carrying_urgency), never do."""
    config.load_kube_config(config_file=cluster.env["KUBECONFIG"])
    namespace = f"kg-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", namespace)
    waits: list[tuple[str, float]] = []
    kube.set_routine_gate(lambda seconds: waits.append((threading.current_thread().name, seconds)))

    def config_map(name: str) -> dict:
        return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": namespace}, "data": {}}

    try:
        with ThreadPoolExecutor(1, thread_name_prefix="pool") as pool:
            assert kube.create(config_map("routine"))
            assert waits == [(threading.current_thread().name, kube.ROUTINE_YIELD_SECONDS)]
            assert pool.submit(kube.carrying_urgency(kube.create), config_map("routine-pool")).result()
            assert len(waits) == 2 and waits[1][0].startswith("pool")
            with kube.urgent():
                assert kube.create(config_map("urgent"))
                assert pool.submit(kube.carrying_urgency(kube.create), config_map("urgent-pool")).result()
            assert len(waits) == 2, waits
            assert pool.submit(kube.create, config_map("after")).result()  # the pool thread is routine again
            assert len(waits) == 3
    finally:
        kube.set_routine_gate(None)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false")
