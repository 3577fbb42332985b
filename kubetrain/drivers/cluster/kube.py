"""All of the operator's Kubernetes I/O, in one module; ApiException becomes KubeError.

Responses are read as raw JSON (`_preload_content=False, _request_timeout=API_TIMEOUT`): the client's model
classes cost more CPU than the rest of a reconciliation together. The writes of every round (creates, the
status patch, pod deletes, Events) skip the generated methods altogether (`_send`).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import quote, urlsplit

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from kubetrain.shared.timestamps import iso

from kubetrain.api import GROUP, PLURAL, VERSION
from kubetrain.engine.children import LABEL_JOB
from kubetrain.engine.kueue import GROUP as KUEUE_GROUP, VERSION as KUEUE_VERSION
from . import metrics

log = logging.getLogger(__name__)

API_TIMEOUT = (5.0, 20.0)
"""Seconds to connect to and then to hear from the API server, for every call: a silent API
server must not hold a worker (and the job it reconciles) forever. 20 s covers a slow but
alive server (a create is answered in milliseconds; the budget is for an overloaded one)."""
LIST_TIMEOUT = (5.0, 120.0)
"""The start-up LIST of every job's pods may be tens of MB on a large cluster."""


class KubeError(Exception):
    """An API call failed; the message names the verb, the object and the API's reason."""

    def __init__(self, verb: str, what: str, err: ApiException):
        self.status = err.status
        reason = err.reason
        try:
            reason = json.loads(err.body or "{}").get("message") or reason
        except ValueError:
            pass
        super().__init__(f"{verb} {what}: {err.status} {reason}")


ROUTINE_YIELD_SECONDS = 1.0
"""The most one request of a routine round (a status to follow, a new job's children, the resync's pages)
waits while urgent work (a replacement to make) is queued or under way (`set_routine_gate`). The API
server and the operator's one interpreter serve the replacement's few requests first; a storm of urgent
work slows the routine rounds to a request a second per worker, never stops them."""

_local = threading.local()
_routine_gate: Callable[[float], object] | None = None


def set_routine_gate(wait: Callable[[float], object] | None) -> None:
    """`wait(seconds)`: returns once no urgent work is left, or after `seconds`; every request from a thread
    outside `urgent()` calls it first (None: none waits). Set once at the operator's start-up."""
    global _routine_gate
    _routine_gate = wait


@contextmanager
def urgent() -> Iterator[None]:
    """This thread's requests, inside, carry out urgent work: they never wait at the routine gate."""
    before = getattr(_local, "urgent", False)
    _local.urgent = True
    try:
        yield
    finally:
        _local.urgent = before


def carrying_urgency(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, to run in another thread (a pool's) as urgent as the thread that hands it over."""
    if not getattr(_local, "urgent", False):
        return fn

    def run(*args: Any, **kwargs: Any) -> Any:
        with urgent():
            return fn(*args, **kwargs)
    return run


def load_config() -> None:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


class CountingApiClient(client.ApiClient):
    """The client's ApiClient, every request counted by verb and resource (kubetrain_operator_api_requests_total),
    and every answer read as soon as it arrives; a routine round's request first waits for urgent work
    (ROUTINE_YIELD_SECONDS).

    The calls here ask for raw answers (`_preload_content=False`), and a create, patch or delete never reads
    its answer: urllib3 gives a connection back to its pool only once the answer's body is read, so each of
    those requests opened a new TLS connection (a handshake: 15 % of the operator's CPU while 1,000 jobs
    started). Reading the body here keeps one connection per thread; `resp.data` later returns what was read."""

    def call_api(self, method, url, *args, **kwargs):  # noqa: ANN001 - the client's own signature
        gate = _routine_gate
        if gate is not None and not getattr(_local, "urgent", False):
            gate(ROUTINE_YIELD_SECONDS)
        metrics.API_REQUESTS.labels(method, resource_of(url)).inc()
        response = super().call_api(method, url, *args, **kwargs)
        response.read()
        return response


def resource_of(url: str) -> str:
    """`pods`, `pods/status`, `trainingjobs/status`, ... of a request's URL: bounded, whatever the names.

    '.../api/v1/namespaces/ns/pods/name/status?x=1' -> 'pods/status';
    '.../apis/<group>/<version>/namespaces/ns/<plural>/name' -> '<plural>'; '.../api/v1/namespaces' -> 'namespaces'.
    """
    parts = [p for p in urlsplit(url).path.split("/") if p]
    parts = parts[2:] if parts[:1] == ["api"] else parts[3:]  # api/v1 or apis/<group>/<version>
    if parts[:1] == ["namespaces"] and len(parts) > 2:
        parts = parts[2:]  # the namespace's name, then what is asked of it
    if not parts:
        return "?"
    return parts[0] if len(parts) < 3 else f"{parts[0]}/{parts[2]}"


def _api() -> client.ApiClient:
    # One ApiClient per thread: kopf runs sync handlers on a thread pool.
    api = getattr(_local, "api", None)
    if api is None:
        api = _local.api = CountingApiClient()
    return api


def _json(resp: Any) -> Any:
    return json.loads(resp.data)


LIST_PAGE = 500
"""Objects per page of a LIST (`limit`, the API server's `continue`): a page of pods is about 2-3 MB;
the API server answers a page from its cache without holding every object of a large cluster in one
response, and the operator never holds more than one page of raw JSON."""


def list_labelled(resource: str, namespaces: list[str], pause: float = 0.0):
    """Every pod or claim that carries a job label, in the watched namespaces (all when empty), a page of
    LIST_PAGE at a time, `pause` seconds between pages (a safety-net resync spreads its requests)."""
    api = client.CoreV1Api(_api())
    calls = {
        "pods": (api.list_pod_for_all_namespaces, api.list_namespaced_pod),
        "persistentvolumeclaims": (api.list_persistent_volume_claim_for_all_namespaces,
                                   api.list_namespaced_persistent_volume_claim),
    }
    every, one = calls[resource]
    targets = [(every, ())] if not namespaces else [(one, (ns,)) for ns in namespaces]
    for call, args in targets:
        token = None
        while True:
            try:
                resp = call(*args, label_selector=LABEL_JOB, limit=LIST_PAGE, _continue=token,  # type: ignore[misc]  # the list calls take these keywords
                            _preload_content=False, _request_timeout=LIST_TIMEOUT)
            except ApiException as err:
                raise KubeError("list", f"{resource} of TrainingJobs", err) from None
            page = _json(resp)
            yield from page["items"]
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                break
            if pause:
                time.sleep(pause)


PLURALS = {
    "Pod": "pods", "Service": "services", "ConfigMap": "configmaps", "Secret": "secrets",
    "PersistentVolumeClaim": "persistentvolumeclaims", "StatefulSet": "statefulsets",
    "NetworkPolicy": "networkpolicies", "Event": "events", "Workload": "workloads",
}
"""The resource (plural) of each kind the operator writes through `_send`; the other projects' CRDs
(engine/gang.py) are CUSTOM_PLURALS."""


def _path(api_version: str, namespace: str, plural: str, *rest: str) -> str:
    """`/api/v1/namespaces/<ns>/pods[/<name>[/status]]`, `/apis/<group>/<version>/namespaces/...`."""
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return "/".join([prefix, "namespaces", quote(namespace, safe=""), plural, *(quote(p, safe="") for p in rest)])


def _send(method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
    """One write whose body is already the plain dict the API takes, sent as JSON as it is.

    The generated client's methods check every argument (pydantic's validate_call) and walk the body
    again (sanitize_for_serialization) before sending it: 0.38-0.41 ms of CPU per pod create on the
    2-core development machine, against 0.035 ms here, JSON included (hack/bench-client); about 2 CPU
    seconds of the operator's 46 while 1,000 jobs start (docs/benchmarks-history.md). The request is the one those methods send (the same
    headers, authentication and timeout, counted by CountingApiClient); a non-2xx answer raises
    ApiException as theirs do."""
    api = _api()
    headers = {**api.default_headers, "Accept": "application/json", "Content-Type": content_type}
    api.update_params_for_auth(headers, [], ["BearerToken"], path, method, body)
    resp = api.call_api(method, api.configuration.host + path, header_params=headers, body=body,
                        _request_timeout=API_TIMEOUT)
    if not 200 <= resp.status <= 299:
        raise ApiException.from_response(http_resp=resp, body=None, data=None)
    return resp


CREATE_TRIES = 3
"""Creates of one object in a row when each meets one of its name that is gone by the time it is looked at
(deleted meanwhile: a user freeing a name the job could not adopt). Past it the round fails and is retried
with backoff, rather than take an object that is not there for made."""


def create(obj: dict[str, Any], started: bool = False) -> bool:
    """Create an object; False when it exists already (another round created it: `_check_ours`, NotOurs
    otherwise). `started`: the job's status says it started before, so an earlier round made its
    children. One that exists at the create and is gone when looked at is created again."""
    kind, ns, name = obj["kind"], obj["metadata"].get("namespace", "default"), obj["metadata"]["name"]
    plural = PLURALS.get(kind) or CUSTOM_PLURALS.get(kind)
    if plural is None:
        raise ValueError(f"cannot create a {kind}")
    for _ in range(CREATE_TRIES):
        try:
            _send("POST", _path(obj["apiVersion"], ns, plural), obj)
            return True
        except ApiException as err:
            if err.status == 409:
                if _check_ours(obj, started):
                    return False
                gone = err
                continue  # deleted between the create and the look: create it now
            if err.status == 404 and kind in CUSTOM_PLURALS:
                # The namespace exists (the job is in it): what is missing is the resource, its CRD.
                raise NotServed(kind, obj["apiVersion"], CUSTOM_PLURALS[kind], f"{ns}/{name}") from None
            raise KubeError("create", f"{kind.lower()} {ns}/{name}", err) from None
    raise KubeError("create", f"{kind.lower()} {ns}/{name}", gone)


CUSTOM_PLURALS = {"PodGroup": "podgroups"}
"""Children of other projects' CRDs (engine/gang.py): created and read through CustomObjectsApi."""


def _group_version(obj: dict[str, Any]) -> tuple[str, str]:
    group, _, version = obj["apiVersion"].rpartition("/")
    return group, version


class NotServed(Exception):
    """The API server does not serve a child's resource: its CRD is not installed."""

    def __init__(self, kind: str, api_version: str, plural: str, where: str):
        group, _, version = api_version.rpartition("/")
        self.resource = f"{plural}.{group}"
        super().__init__(f"create {kind.lower()} {where}: the API server does not serve {plural}.{group} "
                         f"({version}); is the scheduler that defines it (its CRD) installed?")


class NotOurs(Exception):
    """A child's name is taken by an object this job does not own: reported, never adopted."""


_READERS = {
    "Pod": lambda api: client.CoreV1Api(api).read_namespaced_pod,
    "Service": lambda api: client.CoreV1Api(api).read_namespaced_service,
    "PersistentVolumeClaim": lambda api: client.CoreV1Api(api).read_namespaced_persistent_volume_claim,
    "NetworkPolicy": lambda api: client.NetworkingV1Api(api).read_namespaced_network_policy,
}
_TESTERS = {
    "ConfigMap": lambda api: client.CoreV1Api(api).patch_namespaced_config_map,
    "StatefulSet": lambda api: client.AppsV1Api(api).patch_namespaced_stateful_set,
}
"""Children the operator patches anyway (a resize renders them again): whether one is this job's is asked
with a JSON patch that only tests its owner's uid (it changes nothing), so that the operator needs no
`get` on them: two grants fewer under issue 15's ceiling (tests/cluster/test_chart.py)."""


def _check_ours(obj: dict[str, Any], started: bool = False) -> bool:
    """An object of this name exists: True when it is ours (an earlier round made it), False when it is gone
    by now (deleted meanwhile), or raise NotOurs.

    Ours means owned by this job's uid. The job's own checkpoint claim with whenDeleted: Retain
    has no owner: it is ours, labelled with the job's name, once the job has started (`started`:
    the round that first started it made the claim, or met this rule). Before that, an unowned
    claim of its name is someone else's: one kept from an earlier job of the same name, or one a
    tenant who may create claims made for the job to write its checkpoints to (or to resume from);
    kept checkpoints are given to a new job by making it the claim's owner (docs/operating.md).

    The token Secret is never read (the operator has no read access to Secrets). Its name carries
    the job's uid, so no earlier job's is met; but the uid is anyone's to read once the job
    exists, and a tenant who may create Secrets could make it (their token, CA and key) while the
    job waits to start. So it is ours only once the job has started: a round that first starts
    the job either made it or met this rule (rounds._create_all remembers what a failed wave made).
    A Kueue Workload is taken as ours (the operator may list and watch Workloads, not get one by name).
    """
    kind, meta = obj["kind"], obj["metadata"]
    ns, name = meta.get("namespace", "default"), meta["name"]
    if kind == "Workload":
        return True
    if kind == "Secret":
        if started:
            return True
        raise NotOurs(f"Secret {ns}/{name} exists, made before this job first started, so not by it; the job will "
                      "not use it (its pods would take their token and keys from it): delete it")
    if kind in _TESTERS:
        return _test_owner(kind, ns, name, meta["ownerReferences"][0]["uid"])
    try:
        if kind in CUSTOM_PLURALS:
            group, version = _group_version(obj)
            resp = client.CustomObjectsApi(_api()).get_namespaced_custom_object(
                group, version, ns, CUSTOM_PLURALS[kind], name, _preload_content=False, _request_timeout=API_TIMEOUT)
        else:
            resp = _READERS[kind](_api())(name, ns, _preload_content=False, _request_timeout=API_TIMEOUT)
    except ApiException as err:
        if err.status == 404:
            return False  # gone again (deleted meanwhile)
        raise KubeError("get", f"{kind.lower()} {ns}/{name}", err) from None
    found = _json(resp).get("metadata") or {}
    wanted = {ref.get("uid") for ref in meta.get("ownerReferences") or []}
    owners = {ref.get("uid") for ref in found.get("ownerReferences") or []}
    if owners & wanted:
        return True
    job = (meta.get("labels") or {}).get(LABEL_JOB)
    kept = kind == "PersistentVolumeClaim" and not owners and (found.get("labels") or {}).get(LABEL_JOB) == job
    if kept and started:
        return True
    whose = f"owned by {', '.join(sorted(str(o) for o in owners))}" if owners else "not owned by this job"
    hint = (" (a claim kept from an earlier job of this name: make this job its owner to resume from it, "
            "docs/operating.md#keeping-checkpoints-after-the-job)") if kept else ""
    raise NotOurs(f"{kind} {ns}/{name} exists and is {whose}; the job will not adopt it: delete or rename it{hint}")


def _test_owner(kind: str, ns: str, name: str, uid: str) -> bool:
    """True when the object's first owner is `uid` (the operator's children carry their job first), False
    when it is gone meanwhile, else NotOurs."""
    test = [{"op": "test", "path": "/metadata/ownerReferences/0/uid", "value": uid}]
    try:
        _TESTERS[kind](_api())(name, ns, test, _preload_content=False, _request_timeout=API_TIMEOUT)
    except ApiException as err:
        if err.status == 404:
            return False
        if err.status == 422:  # the test failed: no owner, or another first
            raise NotOurs(f"{kind} {ns}/{name} exists and is not owned by this job; the job will not adopt it: "
                          "delete or rename it") from None
        raise KubeError("patch", f"{kind.lower()} {ns}/{name}", err) from None
    return True


def statefulset_uid(namespace: str, name: str, owner: str) -> str | None:
    """The uid of the StatefulSet `name` if its first owner is the job of uid `owner`; None when there is
    none or another owns it. Asked, as _test_owner asks, with a JSON patch that only tests the owner (it
    changes nothing; the answer is the object): the operator has no `get` on StatefulSets. The pods a
    StatefulSet makes name it by uid, so the uid is what tells its pods from pods that name it falsely."""
    test = [{"op": "test", "path": "/metadata/ownerReferences/0/uid", "value": owner}]
    try:
        resp = _TESTERS["StatefulSet"](_api())(name, namespace, test, _preload_content=False,
                                               _request_timeout=API_TIMEOUT)
    except ApiException as err:
        if err.status in (404, 422):  # none, or not the job's (its create says ChildConflict)
            return None
        raise KubeError("patch", f"statefulset {namespace}/{name}", err) from None
    return (_json(resp).get("metadata") or {}).get("uid") or None


def list_workloads(namespaces: list[str]) -> list[dict[str, Any]]:
    """Every Kueue Workload that carries a job label (the index's first fill, as list_labelled)."""
    api = client.CustomObjectsApi(_api())
    items: list[dict[str, Any]] = []
    try:
        if not namespaces:
            resp = api.list_cluster_custom_object(KUEUE_GROUP, KUEUE_VERSION, "workloads", label_selector=LABEL_JOB,
                                                  _preload_content=False, _request_timeout=LIST_TIMEOUT)
            items += _json(resp)["items"]
        for ns in namespaces:
            resp = api.list_namespaced_custom_object(KUEUE_GROUP, KUEUE_VERSION, ns, "workloads",
                                                     label_selector=LABEL_JOB, _preload_content=False,
                                                     _request_timeout=LIST_TIMEOUT)
            items += _json(resp)["items"]
    except ApiException as err:
        raise KubeError("list", "Kueue workloads of TrainingJobs (is Kueue installed?)", err) from None
    return items


def delete_workload(namespace: str, name: str) -> None:
    """Delete a job's Workload (it was resized: engine/kueue.resized); one gone already is no error."""
    try:
        client.CustomObjectsApi(_api()).delete_namespaced_custom_object(
            KUEUE_GROUP, KUEUE_VERSION, namespace, "workloads", name, _preload_content=False,
            _request_timeout=API_TIMEOUT)
    except ApiException as err:
        if err.status != 404:
            raise KubeError("delete", f"workload {namespace}/{name}", err) from None


def get_kueue_object(plural: str, name: str) -> dict[str, Any] | None:
    """A cluster-scoped Kueue object (a ResourceFlavor, a WorkloadPriorityClass); None if missing."""
    try:
        resp = client.CustomObjectsApi(_api()).get_cluster_custom_object(
            KUEUE_GROUP, KUEUE_VERSION, plural, name, _preload_content=False, _request_timeout=API_TIMEOUT)
    except ApiException as err:
        if err.status == 404:
            return None
        raise KubeError("get", f"{plural} {name}", err) from None
    return _json(resp)


def patch_workload(namespace: str, name: str, patch: dict[str, Any]) -> None:
    """A merge patch of a Workload's spec (a live resize lowers its counts: engine/kueue.shrunk); one gone is no
    error (the next round reads the job's Workloads again)."""
    try:
        client.CustomObjectsApi(_api()).patch_namespaced_custom_object(
            KUEUE_GROUP, KUEUE_VERSION, namespace, "workloads", name, patch, _preload_content=False,
            _request_timeout=API_TIMEOUT)
    except ApiException as err:
        if err.status != 404:
            raise KubeError("patch", f"workload {namespace}/{name}", err) from None


def patch_workload_status(namespace: str, name: str, patch: dict[str, Any]) -> bool:
    """A merge patch of a Workload's status carrying the resourceVersion it was computed from:
    False when Kueue changed the Workload in between (409) or it is gone; the next round,
    queued by the watch event, computes the patch again."""
    try:
        client.CustomObjectsApi(_api()).patch_namespaced_custom_object_status(
            KUEUE_GROUP, KUEUE_VERSION, namespace, "workloads", name, patch, _preload_content=False,
            _request_timeout=API_TIMEOUT)
    except ApiException as err:
        if err.status in (404, 409):
            return False
        raise KubeError("patch", f"status of workload {namespace}/{name}", err) from None
    return True


def delete_pod(namespace: str, name: str, force: bool = False, uid: str = "") -> None:
    """Graceful delete: the trainer gets SIGTERM, checkpoints and exits within the grace period.
    `force`: gone from the API at once, whatever its kubelet does (a pod on a lost node, or one
    whose trainer has ended already: its replacement of the same name need not wait for the
    kubelet to tear the old sandbox down).
    `uid`: only that incarnation (a precondition): a round that acted on a stale view of the pod
    never deletes its replacement of the same name; one already gone or replaced is not an error."""
    options: dict[str, Any] = {"gracePeriodSeconds": 0} if force else {}
    if uid:
        options["preconditions"] = {"uid": uid}
    try:
        _send("DELETE", _path("v1", namespace, "pods", name), options or None)
    except ApiException as err:
        if err.status == 409 and uid:
            log.info("pod %s/%s: not deleted, it is another incarnation than %s now", namespace, name, uid)
        elif err.status != 404:
            raise KubeError("delete", f"pod {namespace}/{name}", err) from None


def replace(obj: dict[str, Any]) -> None:
    """Render an existing child again (a resize, engine/reconcile.RESIZED_KINDS): a ConfigMap's data, a
    StatefulSet's size and pod template, a PodGroup's minMember and minResources, each one JSON patch
    (lists replaced whole, nothing merged).

    The patch first tests that the object is this job's (its owner's uid), so a name taken by another's
    object in the meantime is reported (NotOurs), never overwritten; one that is missing is created.
    """
    kind, meta = obj["kind"], obj["metadata"]
    ns, name = meta.get("namespace", "default"), meta["name"]
    if kind == "ConfigMap":
        ops = [{"op": "replace", "path": "/data", "value": obj["data"]}]
        patch: Callable[..., Any] = client.CoreV1Api(_api()).patch_namespaced_config_map
    elif kind == "StatefulSet":
        ops = [{"op": "replace", "path": "/spec/template", "value": obj["spec"]["template"]},
               {"op": "replace", "path": "/spec/replicas", "value": obj["spec"]["replicas"]}]
        patch = client.AppsV1Api(_api()).patch_namespaced_stateful_set
    elif kind in CUSTOM_PLURALS:
        # Only what the size changes: the scheduler's own fields (a queue Volcano's webhook defaulted)
        # stay. `add` replaces a member that exists.
        ops = [{"op": "add", "path": f"/spec/{key}", "value": obj["spec"][key]}
               for key in ("minMember", "minResources") if key in obj["spec"]]
        group, version = _group_version(obj)

        def patch(name, ns, body, **kw):  # type: ignore[misc]  # the list calls take these keywords
            return client.CustomObjectsApi(_api()).patch_namespaced_custom_object(
                group, version, ns, CUSTOM_PLURALS[kind], name, body, _content_type="application/json-patch+json", **kw)
    else:
        raise ValueError(f"cannot replace a {kind}")
    owner = {"op": "test", "path": "/metadata/ownerReferences/0/uid", "value": meta["ownerReferences"][0]["uid"]}
    try:
        patch(name, ns, [owner, *ops], _preload_content=False, _request_timeout=API_TIMEOUT)
    except ApiException as err:
        if err.status == 404:
            create(obj)
            return
        if err.status == 422:  # the test failed: not ours (NotOurs), or ours listed second (an error)
            _check_ours(obj)
        raise KubeError("patch", f"{kind.lower()} {ns}/{name}", err) from None


def annotate_pod(namespace: str, name: str, annotations: dict[str, str]) -> None:
    """Set annotations on a pod (engine/reconcile.SIZE_ANNOTATION: the kubelet syncs a pod that changed,
    and refreshes its mounted job file); one that is gone meanwhile is no error."""
    try:
        client.CoreV1Api(_api()).patch_namespaced_pod(
            name, namespace, {"metadata": {"annotations": annotations}}, _preload_content=False,
            _request_timeout=API_TIMEOUT)
    except ApiException as err:
        if err.status != 404:
            raise KubeError("patch", f"pod {namespace}/{name}", err) from None


def scale_statefulset(namespace: str, name: str, replicas: int) -> None:
    # A patch of the StatefulSet itself, not of its scale subresource: the patch a resize needs
    # (replace above) covers this too, so the operator's RBAC needs no grant on statefulsets/scale.
    try:
        client.AppsV1Api(_api()).patch_namespaced_stateful_set(
            name, namespace, {"spec": {"replicas": replicas}}, _preload_content=False, _request_timeout=API_TIMEOUT
        )
    except ApiException as err:
        if err.status != 404:
            raise KubeError("scale", f"statefulset {namespace}/{name}", err) from None


def patch_status(namespace: str, name: str, status: dict[str, Any]) -> None:
    try:
        _send("PATCH", _path(f"{GROUP}/{VERSION}", namespace, PLURAL, name, "status"), {"status": status},
              "application/merge-patch+json")
    except ApiException as err:
        if err.status != 404:
            raise KubeError("patch", f"status of trainingjob {namespace}/{name}", err) from None


def delete_job(namespace: str, name: str) -> None:
    try:
        client.CustomObjectsApi(_api()).delete_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name, propagation_policy="Background", _preload_content=False, _request_timeout=API_TIMEOUT
        )
    except ApiException as err:
        if err.status != 404:
            raise KubeError("delete", f"trainingjob {namespace}/{name}", err) from None


def record_event(job: dict[str, Any], type_: str, reason: str, message: str) -> None:
    """A core/v1 Event about the job; failures are logged, never raised (events are best effort)."""
    meta = job["metadata"]
    now = iso()
    body = {
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "TrainingJob",
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta["uid"],
        },
        "type": type_,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": "kubetrain-operator"},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    try:
        _send("POST", _path("v1", meta["namespace"], PLURALS["Event"]), body)
    except ApiException as err:
        log.warning("cannot record event %s on %s/%s: %s", reason, meta["namespace"], meta["name"], KubeError("create", "event", err))


# A trainer's /metrics is tens of KiB (the catalogue, the process collectors,
# at most 32 reported names); a pod serving more is broken or hostile, and the
# operator must not hold it in memory (a 400 MiB answer once took the operator
# to 852 MiB against its 512 Mi limit).
MAX_SCRAPE_BYTES = 1 << 20
SCRAPE_READ_BYTES = 64 << 10
MAX_SCRAPE_HEAD_BYTES = 16 << 10
"""The status line and headers of a /metrics answer: prometheus-client sends about 150 bytes. More
is refused (None), as is a head that has not ended within the deadline."""
SCRAPE_SECONDS = 2.0
"""The deadline of one scrape, the whole exchange: a trainer answers in milliseconds; 2 s leaves room
for a loaded node, and bounds what a stalling chief costs one scrape worker (scrapes.SCRAPE_WORKERS)."""


class _Expired(Exception):
    """The scrape's deadline passed."""


def scrape(ip: str, port: int, timeout: float = SCRAPE_SECONDS, max_bytes: int = MAX_SCRAPE_BYTES) -> str | None:
    """The text of a pod's /metrics, or None when it does not answer (yet) or answers badly.

    The pod is a tenant's: `timeout` is one absolute deadline over the whole
    exchange, the connect, the status line, the headers and the body: every
    read waits only for what is left of it, so a peer dripping a byte at a
    time (a header byte every 0.5 s once held a 1 s scrape for 8 s, through
    http.client's per-read timeout) is cut off at the deadline wherever it
    drips. The head is read to at most MAX_SCRAPE_HEAD_BYTES, the body to at
    most `max_bytes`, and only a 200 counts (a redirect is not followed: it
    could point anywhere). HTTP/1.0 and `Connection: close`: the answer ends
    with the connection (or at its Content-Length), never in chunks.
    """
    deadline = time.monotonic() + timeout

    def left() -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _Expired
        return remaining

    try:
        with socket.create_connection((ip, port), timeout=left()) as sock:
            sock.settimeout(left())
            sock.sendall(f"GET /metrics HTTP/1.0\r\nHost: {ip}:{port}\r\nAccept: text/plain\r\n"
                         "Connection: close\r\n\r\n".encode())
            return _read_answer(sock, left, max_bytes, f"{ip}:{port}")
    except (_Expired, TimeoutError):  # TimeoutError: a read that waited for all that was left
        log.warning("scrape %s:%s: no whole answer within %.1fs", ip, port, timeout)
    except OSError as err:  # refused, reset
        log.debug("scrape %s:%s failed: %s", ip, port, err)
    except ValueError as err:  # a number in the answer that is none: a bad answer, not the operator's error
        log.warning("scrape %s:%s: a malformed answer: %s", ip, port, err)
    return None


def _read_answer(sock: socket.socket, left, max_bytes: int, where: str) -> str | None:
    buf = bytearray()
    start = length = None  # where the body starts; its announced length
    while True:
        sock.settimeout(left())
        chunk = sock.recv(SCRAPE_READ_BYTES)
        if not chunk:
            break
        buf += chunk
        if start is None:
            end = buf.find(b"\r\n\r\n", 0, MAX_SCRAPE_HEAD_BYTES + 4)
            if end < 0:
                if len(buf) > MAX_SCRAPE_HEAD_BYTES:
                    log.warning("scrape %s: a head of more than %d bytes; not read further", where, MAX_SCRAPE_HEAD_BYTES)
                    return None
                continue
            start = end + 4
            status, headers = _head(bytes(buf[:end]))
            if status != 200:
                log.debug("scrape %s: HTTP %s", where, status)
                return None
            if "chunked" in headers.get("transfer-encoding", ""):
                log.warning("scrape %s: a chunked answer to an HTTP/1.0 request; not read", where)
                return None
            announced = headers.get("content-length", "")
            length = int(announced) if _ascii_number(announced) and len(announced) <= 12 else None
            if announced and length is None or length is not None and length > max_bytes:
                log.warning("scrape %s: %s bytes announced, more than %d; not read", where, announced, max_bytes)
                return None
        if len(buf) - start > max_bytes:
            log.warning("scrape %s: more than %d bytes; not read further", where, max_bytes)
            return None
        if length is not None and len(buf) - start >= length:
            break
    if start is None:
        log.debug("scrape %s: the connection ended within the head", where)
        return None
    body = bytes(buf[start:start + length] if length is not None else buf[start:])
    if length is not None and len(body) < length:
        log.debug("scrape %s: %d of %d bytes before the connection ended", where, len(body), length)
        return None
    return body.decode(errors="replace")


def _ascii_number(text: str) -> bool:
    """Whether `text` is a number of ASCII digits. Not `str.isdigit`: the head is latin-1, where it holds
    for the superscripts \xb2, \xb3 and \xb9, which `int` refuses (a status line `HTTP/1.1 2\xb20` raised
    ValueError out of `scrape`, a traceback at every scrape of that chief)."""
    return text.isascii() and text.isdigit()


def _head(raw: bytes) -> tuple[int | None, dict[str, str]]:
    """(the status code, lower-cased header names -> values) of an HTTP answer's head."""
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    status = int(parts[1]) if len(parts) >= 2 and parts[0].startswith("HTTP/") and _ascii_number(parts[1]) \
        and len(parts[1]) == 3 else None
    headers = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if colon:
            headers[name.strip().lower()] = value.strip()
    return status, headers
