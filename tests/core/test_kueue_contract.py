"""Kueue admission, pure: the Workload a queued job gets, what a Workload's status means for the
job's round, and the status writes Kueue expects of an external framework's controller."""

from kubetrain.shared.timestamps import iso
from kubetrain.api import from_object
from kubetrain.engine import kueue
from kubetrain.engine.children import NODE_LOST_TAINTS, Settings
from kubetrain.engine.reconcile import PodObservation as Pod
from kubetrain.engine.reconcile import reconcile
from kubetrain.api.status import to_dict

T0 = 1_800_000_000.0
NOW = "2027-01-15T08:00:00Z"


def job(mode="ParameterServer", labels=None, **spec):
    spec.setdefault("resources", {"worker": {"requests": {"cpu": "1"}}, "ps": {"requests": {"cpu": "500m"}}})
    return from_object({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob",
                        "metadata": {"name": "j", "generation": 1,
                                     "labels": {kueue.QUEUE_LABEL: "team", **(labels or {})}},
                        "spec": {"mode": mode, **spec}})


def workload_status(*conditions, admission=None, rv="7"):
    wl = {"metadata": {"name": "w", "namespace": "default", "resourceVersion": rv, "generation": 1},
          "spec": {"queueName": "team"},
          "status": {"conditions": [{"type": t, "status": s, "reason": r, "message": m,
                                     "lastTransitionTime": "2027-01-15T07:00:00Z"} for t, s, r, m in conditions]}}
    if admission is not None:
        wl["status"]["admission"] = admission
    return wl


ADMISSION = {"clusterQueue": "cq", "podSetAssignments": [
    {"name": "ps", "flavors": {"cpu": "on-demand"}, "count": 1},
    {"name": "worker", "flavors": {"cpu": "spot"}, "count": 2}]}
ADMITTED = workload_status(("QuotaReserved", "True", "QuotaReserved", "Quota reserved in ClusterQueue cq"),
                           ("Admitted", "True", "Admitted", "The workload is admitted"), admission=ADMISSION)


def test_the_workload_has_a_pod_set_per_role_with_counts_and_the_pods_requests():
    j = job(parameterServer={"replicas": 1, "workers": 2})
    wl = kueue.workload(j, "0123456789abcdef", Settings())
    assert wl["apiVersion"] == "kueue.x-k8s.io/v1beta2" and wl["kind"] == "Workload"
    assert wl["metadata"]["name"] == "trainingjob-j-01234567"
    assert wl["metadata"]["ownerReferences"][0]["uid"] == "0123456789abcdef"
    assert wl["metadata"]["ownerReferences"][0]["controller"] is True
    assert wl["spec"]["queueName"] == "team"
    sets = {p["name"]: p for p in wl["spec"]["podSets"]}
    assert {n: p["count"] for n, p in sets.items()} == {"ps": 1, "worker": 2}
    worker = sets["worker"]["template"]["spec"]["containers"][0]
    assert worker["resources"] == {"requests": {"cpu": "1"}}
    assert sets["ps"]["template"]["spec"]["containers"][0]["resources"] == {"requests": {"cpu": "500m"}}
    assert "priorityClassRef" not in wl["spec"]


def test_single_and_ddp_jobs_are_one_pod_set_and_a_priority_class_is_referenced_with_its_value():
    single = kueue.workload(job("Single", labels={kueue.PRIORITY_LABEL: "high"}), "u", Settings(), priority=1000)
    assert [(p["name"], p["count"]) for p in single["spec"]["podSets"]] == [("single", 1)]
    assert single["spec"]["priorityClassRef"] == {"group": "kueue.x-k8s.io", "kind": "WorkloadPriorityClass",
                                                  "name": "high"}
    assert single["spec"]["priority"] == 1000
    ddp = kueue.workload(job("DDP", ddp={"nodes": 3, "procsPerNode": 2}), "u", Settings())
    assert [(p["name"], p["count"]) for p in ddp["spec"]["podSets"]] == [("ddp", 3)]


def test_no_workload_yet_or_no_quota_is_queued_with_kueues_reason():
    assert (kueue.admission(None).admitted, kueue.admission(None).reason) == (False, "WorkloadPending")
    pending = workload_status(("QuotaReserved", "False", "Pending",
                               "couldn't assign flavors to pod set single: insufficient unused quota for cpu in "
                               "flavor default, 2 more needed"))
    seen = kueue.admission(pending)
    assert not seen.admitted and seen.reason == "QueuedForAdmission" and not seen.evicted
    assert "LocalQueue team" in seen.message and "insufficient unused quota for cpu" in seen.message


def test_admitted_runs_and_evicted_stops_whatever_the_admission_says():
    assert kueue.admission(ADMITTED).admitted
    evicted = workload_status(*[(c["type"], c["status"], c["reason"], c["message"])
                                for c in ADMITTED["status"]["conditions"]],
                              ("Evicted", "True", "Preempted", "Preempted to accommodate a higher priority Workload"),
                              admission=ADMISSION)
    seen = kueue.admission(evicted)
    assert not seen.admitted and seen.evicted and seen.reason == "Preempted"
    assert "higher priority" in seen.message


def test_placements_merge_the_flavors_node_labels_and_tolerations_and_admission_checks():
    wl = dict(ADMITTED, status=dict(ADMITTED["status"], admissionChecks=[{"name": "prov", "state": "Ready", "podSetUpdates": [
        {"name": "worker", "nodeSelector": {"zone": "a"}, "annotations": {"a": "b"}}]}]))
    flavors = {"on-demand": {"nodeLabels": {"pool": "on-demand"}},
               "spot": {"nodeLabels": {"pool": "spot"},
                        "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}]}}
    assert kueue.flavor_names(wl) == ["on-demand", "spot"]
    places = kueue.placements(wl, flavors)
    assert places["ps"].node_selector == {"pool": "on-demand"} and places["ps"].tolerations == []
    assert places["worker"].node_selector == {"pool": "spot", "zone": "a"}
    assert places["worker"].tolerations == [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}]
    assert places["worker"].annotations == {"a": "b"}


def test_a_queued_job_creates_no_pod_and_is_suspended_with_kueues_message():
    j = job(parameterServer={"replicas": 1, "workers": 2})
    queued = kueue.admission(workload_status(("QuotaReserved", "False", "Pending", "insufficient quota")))
    act = reconcile(j, "u", "tok", {}, {}, T0, admission=queued)
    assert [o for o in act.create if o["kind"] == "Pod"] == []
    assert to_dict(act.status)["state"] == "Suspended"
    cond = next(c for c in to_dict(act.status)["conditions"] if c["type"] == "Suspended")
    assert cond["reason"] == "QueuedForAdmission"
    assert cond["message"] == "Waiting for Kueue to admit the job in LocalQueue team: insufficient quota"
    assert ("Normal", "QueuedForAdmission") in [e[:2] for e in act.events]
    # The next round, still queued: no second Event, the clock still stopped.
    again = reconcile(j, "u", "tok", {}, act.status, T0 + 30, admission=queued)
    assert again.events == [] and to_dict(again.status)["memory"].get("activeSince") is None


def test_admitted_pods_start_with_the_admissions_node_selectors_and_tolerations():
    j = job(parameterServer={"replicas": 1, "workers": 2})
    places = kueue.placements(ADMITTED, {"spot": {"nodeLabels": {"pool": "spot"}, "tolerations": [{"key": "spot", "operator": "Exists"}]},
                                         "on-demand": {"nodeLabels": {"pool": "on-demand"}}})
    act = reconcile(j, "u", "tok", {}, {}, T0, admission=kueue.admission(ADMITTED), placements=places)
    pods = {o["metadata"]["name"]: o["spec"] for o in act.create if o["kind"] == "Pod"}
    assert set(pods) == {"j-ps-0", "j-worker-0", "j-worker-1"}
    # Every pod also tolerates a lost node briefly (children.NODE_LOST_TAINTS); the flavor adds its own.
    node_lost = [t for t in pods["j-ps-0"].get("tolerations", []) if t["key"] in NODE_LOST_TAINTS]
    assert pods["j-ps-0"]["nodeSelector"] == {"pool": "on-demand"} and pods["j-ps-0"]["tolerations"] == node_lost
    assert len(node_lost) == len(NODE_LOST_TAINTS)
    assert pods["j-worker-1"]["nodeSelector"] == {"pool": "spot"}
    assert {"key": "spot", "operator": "Exists"} in pods["j-worker-1"]["tolerations"]
    assert [t for t in pods["j-worker-1"]["tolerations"] if t["key"] != "spot"] == node_lost


def test_eviction_stops_every_replica_gracefully_and_readmission_resumes_the_job():
    j = job(parameterServer={"replicas": 1, "workers": 2})
    running = {n: Pod(n, "Running") for n in ("ps-0", "worker-0", "worker-1")}
    status = {"state": "Running", "startTime": iso(T0), "memory": {"activeSince": T0}}
    evicted = kueue.admission(workload_status(("Evicted", "True", "Preempted", "Preempted by a higher priority Workload")))
    act = reconcile(j, "u", "tok", running, status, T0 + 60, admission=evicted)
    assert sorted(act.delete_pods) == ["j-ps-0", "j-worker-0", "j-worker-1"] and act.create == []
    assert to_dict(act.status)["state"] == "Suspended"
    assert ("Warning", "Preempted") in [e[:2] for e in act.events]
    assert to_dict(act.status)["memory"]["activeSeconds"] == 60 and to_dict(act.status)["memory"].get("activeSince") is None
    assert to_dict(act.status)["restarts"] == 0  # no restart counted against the backoff limit
    back = reconcile(j, "u", "tok", {}, act.status, T0 + 300, admission=kueue.admission(ADMITTED), existing=set())
    assert sorted(o["metadata"]["name"] for o in back.create if o["kind"] == "Pod") == ["j-ps-0", "j-worker-0", "j-worker-1"]
    assert ("Normal", "Resumed") in [e[:2] for e in back.events]


def test_a_ddp_job_held_by_the_queue_is_scaled_to_zero_and_gets_its_statefulset_once_admitted():
    j = job("DDP", ddp={"nodes": 2, "procsPerNode": 1})
    queued = reconcile(j, "u", "tok", {}, {}, T0, admission=kueue.admission(None))
    assert queued.scale_statefulset == 0 and queued.create == []
    ddp_admitted = workload_status(("Admitted", "True", "Admitted", ""), admission={
        "clusterQueue": "cq", "podSetAssignments": [{"name": "ddp", "flavors": {"cpu": "spot"}, "count": 2}]})
    act = reconcile(j, "u", "tok", {}, queued.status, T0 + 5, admission=kueue.admission(ddp_admitted),
                    placements=kueue.placements(ddp_admitted, {"spot": {"nodeLabels": {"pool": "spot"}}}))
    sts = next(o for o in act.create if o["kind"] == "StatefulSet")
    assert sts["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "spot"}


def test_the_quota_is_given_back_once_after_an_eviction_as_kueues_jobframework_does():
    evicted = workload_status(("QuotaReserved", "True", "QuotaReserved", "Quota reserved in ClusterQueue cq"),
                              ("Admitted", "True", "Admitted", "The workload is admitted"),
                              ("Evicted", "True", "Preempted", "Preempted to accommodate a higher priority Workload"),
                              admission=ADMISSION)
    patch = kueue.release_quota(evicted, NOW)
    assert patch["metadata"]["resourceVersion"] == "7"  # refused if Kueue changed it in between
    assert patch["status"]["admission"] is None
    conds = {c["type"]: c for c in patch["status"]["conditions"]}
    assert (conds["QuotaReserved"]["status"], conds["QuotaReserved"]["reason"]) == ("False", "Pending")
    assert (conds["Admitted"]["status"], conds["Admitted"]["reason"]) == ("False", "NoReservation")
    assert (conds["Requeued"]["status"], conds["Requeued"]["reason"]) == ("True", "Preempted")
    assert conds["Evicted"]["status"] == "True"  # Kueue's own: it clears it when it admits again
    released = dict(evicted, status=patch["status"])
    assert kueue.release_quota(released, NOW) is None
    assert kueue.release_quota(ADMITTED, NOW) is None  # never evicted: nothing to give back


def test_a_finished_job_finishes_its_workload_once():
    patch = kueue.finish(ADMITTED, "Succeeded", "Every replica finished.", NOW)
    fin = next(c for c in patch["status"]["conditions"] if c["type"] == "Finished")
    assert (fin["status"], fin["reason"], fin["message"]) == ("True", "Succeeded", "Every replica finished.")
    assert kueue.finish(dict(ADMITTED, status=patch["status"]), "Succeeded", "", NOW) is None
    failed = kueue.finish(ADMITTED, "Failed", "", NOW)
    assert next(c for c in failed["status"]["conditions"] if c["type"] == "Finished")["reason"] == "Failed"


def test_the_external_framework_name_is_what_kueues_configuration_expects():
    assert kueue.EXTERNAL_FRAMEWORK == "TrainingJob.v1alpha1.kubetrain.dev"


def test_a_resized_job_has_its_workload_made_again_and_waits_for_kueue_to_admit_the_new_size():
    """Kueue's pod sets are immutable once it reserved quota: the operator deletes the Workload (made again
    at the new counts), the replicas stop after a checkpoint as for an eviction, and the job starts at its
    new size, live resize or not, once Kueue admits the new Workload."""
    at_2 = job(parameterServer={"replicas": 1, "workers": 2})
    wl = kueue.workload(at_2, "u", Settings())
    at_3 = job(replicas=3, parameterServer={"replicas": 1, "workers": 2})
    assert not kueue.resized(wl, at_2) and kueue.resized(wl, at_3)
    assert [ps["count"] for ps in kueue.workload(at_3, "u", Settings())["spec"]["podSets"]] == [1, 3]
    running = {n: Pod(n, "Running") for n in ("ps-0", "worker-0", "worker-1")}
    status = {"state": "Running", "startTime": iso(T0), "memory": {"activeSince": T0, "size": 2}}
    held = reconcile(at_3, "u", "tok", running, status, T0 + 60, admission=kueue.resizing(at_3))
    assert sorted(held.delete_pods) == ["j-ps-0", "j-worker-0", "j-worker-1"] and held.create == []
    assert to_dict(held.status)["state"] == "Suspended" and to_dict(held.status)["restarts"] == 0
    suspended = next(c for c in to_dict(held.status)["conditions"] if c["type"] == "Suspended")
    assert suspended["reason"] == "Resizing"
    assert suspended["message"].startswith("Resized to 3 workers: the job's Kueue Workload is made again")
    assert to_dict(held.status)["replicas"] == 2  # still the size it ran at
    # The new Workload queued: Kueue's words, and what the job waits for at which size.
    too_big = kueue.admission(workload_status(("QuotaReserved", "False", "Pending", "couldn't assign flavors to pod "
                                               "set worker: insufficient quota for cpu in flavor f, ... > maximum "
                                               "capacity (4)")))
    queued = reconcile(at_3, "u", "tok", {}, held.status, T0 + 70, admission=too_big)
    waiting = next(c for c in to_dict(queued.status)["conditions"] if c["type"] == "Suspended")
    assert waiting["reason"] == "QueuedForAdmission" and queued.create == [] and to_dict(queued.status)["replicas"] == 2
    assert waiting["message"] == ("Resized from 2 to 3 workers, not admitted at the new size yet. Waiting for Kueue "
                                  "to admit the job in LocalQueue team: couldn't assign flavors to pod set worker: "
                                  "insufficient quota for cpu in flavor f, ... > maximum capacity (4)")
    assert [e[:2] for e in queued.events] == [("Normal", "QueuedForAdmission")]
    admitted = workload_status(("Admitted", "True", "Admitted", ""), admission={
        "clusterQueue": "cq", "podSetAssignments": [{"name": "ps", "flavors": {}, "count": 1},
                                                    {"name": "worker", "flavors": {}, "count": 3}]})
    back = reconcile(at_3, "u", "tok", {}, held.status, T0 + 90, admission=kueue.admission(admitted), existing=set())
    assert sorted(o["metadata"]["name"] for o in back.create if o["kind"] == "Pod") == [
        "j-ps-0", "j-worker-0", "j-worker-1", "j-worker-2"]
    assert [o["kind"] for o in back.replace] == ["ConfigMap"] and to_dict(back.status)["replicas"] == 3
    assert [e[1] for e in back.events] == ["Resumed", "Resized"]
    assert back.events[1][2].startswith("Resized from 2 to 3 workers while stopped: the job resumes at the new size")
    assert to_dict(back.status)["restarts"] == 0


# --- workload slices: a fault-tolerant job resized while admitted ------------------------------------------------

def ft_job(nodes=3, generation=1):
    found = job("DDP", ddp={"nodes": nodes, "minNodes": 2, "maxNodes": 3, "faultTolerance": {}},
                resources={"worker": {"requests": {"cpu": "1"}}})
    found.metadata.generation = generation
    return found


def named(wl, name, created, annotations=None):
    wl = {**wl, "metadata": {**wl["metadata"], "name": name, "creationTimestamp": created,
                             **({"annotations": annotations} if annotations else {})}}
    return wl


def test_a_fault_tolerant_job_shrinks_its_workload_in_place_and_grows_by_a_slice():
    three = kueue.workload(ft_job(3), "uid", Settings())
    assert kueue.counts(three) == {"ddp": 3, "lighthouse": 1}
    assert kueue.slices_apply(ft_job()) and not kueue.slices_apply(job())
    assert kueue.slice_plan(three, ft_job(3)) is None
    assert kueue.slice_plan(three, ft_job(2)) == "shrink"
    assert kueue.shrunk(three, ft_job(2))["spec"]["podSets"][0] == {**three["spec"]["podSets"][0], "count": 2}
    two = kueue.workload(ft_job(2), "uid", Settings())
    assert kueue.slice_plan(two, ft_job(3)) == "grow"
    grown = kueue.workload_slice(ft_job(3, generation=4), "uid", Settings(), {**two, "metadata": {
        **two["metadata"], "namespace": "team-ns"}})
    assert grown["metadata"]["name"] == f"{two['metadata']['name']}-g4"
    assert grown["metadata"]["annotations"] == {kueue.SLICE_FOR: f"team-ns/{two['metadata']['name']}",
                                                kueue.ELASTIC: "true"}
    assert [ps["name"] for ps in grown["spec"]["podSets"]] == [ps["name"] for ps in two["spec"]["podSets"]]
    assert kueue.counts(grown) == {"ddp": 3, "lighthouse": 1}
    # until Kueue admits the slice, the job runs at the size its Workload was admitted at
    held = kueue.admitted_size(ft_job(3), two)
    assert held.spec.ddp.nodes == 2 and ft_job(3).spec.ddp.nodes == 3
    assert kueue.admitted_size(ft_job(2), two).spec.ddp.nodes == 2


def test_the_jobs_workload_is_the_one_holding_quota_and_the_replaced_one_until_its_slice_holds_it():
    """Kueue finishes the replaced slice before it reserves the new one's quota: in between, the replaced one
    stays the job's (else the job would read the pending slice and stop its groups)."""
    pending = workload_status(("QuotaReserved", "False", "Pending", "waiting"))
    old = named(ADMITTED, "w", "2027-01-15T07:00:00Z")
    new = named(pending, "w-g2", "2027-01-15T07:05:00Z", {kueue.SLICE_FOR: "default/w"})
    assert kueue.current({"w": old, "w-g2": new}) is old
    assert kueue.pending_slice({"w": old, "w-g2": new}, old) is new
    replaced = named(workload_status(*[(c["type"], c["status"], c["reason"], c["message"])
                                       for c in ADMITTED["status"]["conditions"]],
                                     ("Finished", "True", "WorkloadSliceReplaced", "replaced")), "w", "2027-01-15T07:00:00Z")
    assert kueue.current({"w": replaced, "w-g2": new}) is replaced  # the window between the two
    reserved = named(ADMITTED, "w-g2", "2027-01-15T07:05:00Z", {kueue.SLICE_FOR: "default/w"})
    assert kueue.current({"w": replaced, "w-g2": reserved}) is reserved
    assert kueue.pending_slice({"w": replaced, "w-g2": reserved}, replaced) is reserved
