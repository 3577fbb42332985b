"""A refused API call (403) is reported where a user looks: the operator's log and the job's status.

A narrow unit test of the handler: the one Kubernetes call it makes (the status
patch) is replaced by a recorder. The real refusal, from a Role without a verb,
is tests/e2e/test_e2e_lifecycle.py's.
"""

from __future__ import annotations

import json
import logging

from kubernetes.client.rest import ApiException

from kubetrain.api.status import to_dict
from kubetrain.drivers.cluster import kube
from kubetrain.drivers.cluster.reporting import report_forbidden
from kubetrain.drivers.cluster.state import Controller, JobState


def controller() -> Controller:
    ctl = Controller(scrape_tick=None)
    ctl.close()  # no worker runs here: the report alone is under test
    return ctl


def forbidden() -> kube.KubeError:
    err = ApiException(status=403, reason="Forbidden")
    err.body = json.dumps({"message": 'pods is forbidden: User "system:serviceaccount:ml:kubetrain" cannot create '
                                      'resource "pods" in API group "" in the namespace "ml"'})
    return kube.KubeError("create", "pod ml/j-single-0", err)


def test_forbidden_goes_to_the_log_and_the_condition_of_the_current_state(monkeypatch, caplog):
    patches = []
    monkeypatch.setattr(kube, "patch_status", lambda ns, name, status: patches.append((ns, name, status)))
    monkeypatch.setattr(kube, "record_event", lambda body, type_, reason, message: None)
    body = {"metadata": {"namespace": "ml", "name": "j", "uid": "u", "generation": 2},
            "status": {"state": "Created"}}
    state = JobState()

    with caplog.at_level(logging.ERROR, logger="kubetrain.operator"):
        report_forbidden(controller(), body, state, forbidden())

    (ns, name, status), = patches
    (condition,) = status["conditions"]
    assert (ns, name, condition["type"], condition["status"], condition["reason"]) == ("ml", "j", "Created", "True",
                                                                                       "Forbidden")
    assert condition["message"].startswith('create pod ml/j-single-0: 403 pods is forbidden: User '
                                           '"system:serviceaccount:ml:kubetrain" cannot create resource "pods"')
    assert "lacks this permission" in condition["message"] and "rbac.yaml" in condition["message"]
    assert f"ml/j: {condition['message']}" in caplog.text
    assert to_dict(state.status) == status  # the next round starts from what was written


def test_a_status_patch_refused_too_is_logged_not_raised(monkeypatch, caplog):
    def refuse(ns, name, status):
        raise forbidden()

    monkeypatch.setattr(kube, "patch_status", refuse)
    with caplog.at_level(logging.ERROR, logger="kubetrain.operator"):
        report_forbidden(controller(), {"metadata": {"namespace": "ml", "name": "j"}}, JobState(), forbidden())
    assert "cannot report that in the status either" in caplog.text
