"""A round that fails on the API is retried with backoff and, after REPORT_AFTER_FAILURES in a
row, shown on the job. A narrow unit test of the handler: the Kubernetes calls are replaced."""

from __future__ import annotations

import pytest
from kubernetes.client.rest import ApiException

from kubetrain.drivers.cluster import kube
from kubetrain.drivers.cluster.reporting import REPORT_AFTER_FAILURES
from kubetrain.drivers.cluster.rounds import raw_ttl
from kubetrain.drivers.cluster.state import Controller, OperatorConfig
from kubetrain.drivers.cluster.workers import process
from kubetrain.engine.children import Settings

BODY = {"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "j", "namespace": "ns", "uid": "0123456789", "generation": 1},
        "spec": {"mode": "Single"}, "status": {}}


@pytest.fixture
def api(monkeypatch):
    calls: dict[str, list] = {"patch": [], "event": [], "create": []}

    def refuse(status: int, reason: str):
        def create(obj, started=False):
            calls["create"].append(obj["kind"])
            raise kube.KubeError("create", f"{obj['kind'].lower()} ns/{obj['metadata']['name']}",
                                 ApiException(status=status, reason=reason))
        monkeypatch.setattr(kube, "create", create)

    monkeypatch.setattr(kube, "patch_status", lambda ns, name, status: calls["patch"].append(status))
    monkeypatch.setattr(kube, "record_event", lambda body, t, reason, message: calls["event"].append((t, reason, message)))
    ctl = Controller(OperatorConfig(scrape=False), scrape_tick=None)
    ctl.index.jobs[("ns", "j")] = BODY
    yield ctl, refuse, calls
    ctl.close()


@pytest.mark.parametrize("status, reason", [(422, "ApiInvalid"), (429, "ApiThrottled"), (503, "ApiError")])
def test_api_errors_show_on_the_job_after_retries(api, status, reason):
    ctl, refuse, calls = api
    refuse(status, "Unprocessable" if status == 422 else "Too Many Requests" if status == 429 else "Unavailable")
    for n in range(1, REPORT_AFTER_FAILURES):
        process(ctl, ("ns", "j"))
        assert not [e for e in calls["event"] if e[1] == reason], f"reported after only {n} failures"
    process(ctl, ("ns", "j"))
    events = [e for e in calls["event"] if e[1] == reason]
    assert len(events) == 1 and events[0][0] == "Warning"
    assert f"{status}" in events[0][2] and f"failed {REPORT_AFTER_FAILURES} times in a row" in events[0][2]
    condition = next(c for c in calls["patch"][-1]["conditions"] if c["reason"] == reason)
    assert condition["type"] == "Created" and condition["status"] == "True"
    # Retried with a growing backoff, and reported once, not once per round.
    assert ctl.queue.failures(("ns", "j")) == REPORT_AFTER_FAILURES
    process(ctl, ("ns", "j"))
    assert len([e for e in calls["event"] if e[1] == reason]) == 1


def test_a_pod_template_beyond_the_operators_allowances_fails_the_job_without_pods(api, monkeypatch):
    """The chart's admission policy refuses it at the API; an operator in a cluster without the
    policy refuses it too, from its own --pod-security-allow."""
    ctl, _, calls = api
    created = []
    monkeypatch.setattr(kube, "create", lambda obj, started=False: created.append(obj["kind"]))
    privileged = {**BODY, "spec": {"mode": "Single", "podTemplate": {"spec": {"containers": [
        {"name": "trainer", "securityContext": {"privileged": True}}]}}}}
    ctl.index.jobs[("ns", "j")] = privileged
    process(ctl, ("ns", "j"))
    assert created == []
    status = calls["patch"][-1]
    assert status["state"] == "Failed" and status["completionTime"]
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "PodSecurity" and "privileged containers are not allowed" in failed["message"]
    assert [e[1] for e in calls["event"]] == ["PodSecurity"]
    # Allowed by this installation: the job gets its children.
    ctl.config.settings = Settings(pod_security_allow=frozenset({"privileged"}))
    ctl.forget_job(("ns", "j"))
    process(ctl, ("ns", "j"))
    assert "Pod" in created


def test_a_spec_the_crd_let_through_but_kubetrain_refuses_fails_with_invalid_spec(api):
    ctl, _, calls = api
    ctl.index.jobs[("ns", "j")] = {**BODY, "spec": {"mode": "Single", "training": {"epochs": "many"}}}
    process(ctl, ("ns", "j"))
    status = calls["patch"][-1]
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert status["state"] == "Failed" and failed["reason"] == "InvalidSpec"
    assert "spec.training.epochs" in failed["message"]
    # Decided by the engine, as every failure is: it ended (completionTime), with an Event, once.
    assert status["completionTime"] and "activeSince" not in status["memory"]
    assert [e[1] for e in calls["event"]] == ["InvalidSpec"]
    process(ctl, ("ns", "j"))
    assert [e[1] for e in calls["event"]] == ["InvalidSpec"]


def test_a_refused_spec_with_a_ttl_is_deleted_at_its_ttl(api, monkeypatch):
    """The spec does not parse, but its runPolicy.ttlSecondsAfterFinished does: the job is failed, its TTL's
    round asked for, and that round deletes it (not the safety net's, nor never)."""
    ctl, _, calls = api
    deleted = []
    monkeypatch.setattr(kube, "delete_job", lambda ns, name: deleted.append((ns, name)))
    spec = {"mode": "Single", "training": {"epochs": "many"}, "runPolicy": {"ttlSecondsAfterFinished": 3600}}
    ctl.index.jobs[("ns", "j")] = {**BODY, "spec": spec}
    process(ctl, ("ns", "j"))
    assert calls["patch"][-1]["state"] == "Failed" and deleted == []
    assert ctl.queue.get(timeout=0) is None and len(ctl.queue) == 1  # one delayed round: the TTL's
    # The TTL's round, an hour on: the status says the job ended long enough ago.
    ended = {**calls["patch"][-1], "completionTime": "2020-01-01T00:00:00Z"}
    ctl.forget_job(("ns", "j"))
    ctl.index.jobs[("ns", "j")] = {**BODY, "spec": spec, "status": ended}
    process(ctl, ("ns", "j"))
    assert deleted == [("ns", "j")]


@pytest.mark.parametrize("policy, ttl", [({"ttlSecondsAfterFinished": 60}, 60), ({"ttlSecondsAfterFinished": 0}, 0),
                                         ({"ttlSecondsAfterFinished": -1}, None), ({"ttlSecondsAfterFinished": "60"}, None),
                                         ({"ttlSecondsAfterFinished": True}, None), ("x", None), (None, None)])
def test_the_ttl_of_a_spec_that_does_not_parse_is_read_only_when_valid(policy, ttl):
    assert raw_ttl({"mode": "Single", "runPolicy": policy}) == ttl
    assert raw_ttl("not a spec") is None


def test_a_running_job_the_installation_refuses_now_fails_through_the_engine(api, monkeypatch):
    """Refused after it ran (its template changed to one beyond the allowances): the engine fails it as
    any failure, its clock paused and its running pod deleted (cleanPodPolicy Running)."""
    ctl, _, calls = api
    deleted = []
    monkeypatch.setattr(kube, "delete_pod", lambda ns, pod, force=False, uid="": deleted.append((pod, uid)))
    privileged = {**BODY, "spec": {"mode": "Single", "podTemplate": {"spec": {"containers": [
        {"name": "trainer", "securityContext": {"privileged": True}}]}}},
        "status": {"state": "Running", "startTime": "2026-01-01T00:00:00Z",
                   "memory": {"activeSince": 1_000.0, "activeSeconds": 5.0}}}
    ctl.index.jobs[("ns", "j")] = privileged
    pod = {"metadata": {"name": "j-single-0", "namespace": "ns", "uid": "p1",
                        "labels": {"kubetrain.dev/job-name": "j", "kubetrain.dev/replica": "single-0"},
                        "ownerReferences": [{"kind": "TrainingJob", "name": "j", "uid": BODY["metadata"]["uid"],
                                             "controller": True}]},
           "spec": {}, "status": {"phase": "Running"}}
    ctl.index.index_pod("ADDED", pod)
    process(ctl, ("ns", "j"))
    status = calls["patch"][-1]
    assert status["state"] == "Failed" and status["completionTime"]
    # Paused, and written so: a merge patch keeps a key it does not name null, and a restarted operator
    # would read the clock as running.
    assert status["memory"]["activeSince"] is None and status["memory"]["activeSeconds"] > 5.0
    # Its pod deleted as the incarnation the round saw (the uid a precondition).
    assert deleted == [("j-single-0", "p1")] and [e[1] for e in calls["event"]] == ["PodSecurity"]


def test_what_a_failed_wave_made_is_not_asked_for_again(api, monkeypatch):
    """A claim refused beside the job's token Secret: the Secret was made, and no later round may create
    it again, since before the job first started a Secret of its name that is there already is taken
    for someone else's (kube._check_ours): the job would have shown ChildConflict over its own Secret."""
    ctl, _, calls = api
    asked = []

    def create(obj, started=False):
        asked.append((obj["kind"], started))
        if obj["kind"] == "PersistentVolumeClaim":
            raise kube.KubeError("create", f"persistentvolumeclaim ns/{obj['metadata']['name']}",
                                 ApiException(status=422, reason="Unprocessable"))
        return True

    monkeypatch.setattr(kube, "create", create)
    process(ctl, ("ns", "j"))
    process(ctl, ("ns", "j"))
    assert asked.count(("Secret", False)) == 1 and asked.count(("PersistentVolumeClaim", False)) == 2, asked
