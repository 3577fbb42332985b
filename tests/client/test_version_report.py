"""`kubetrain version` without a cluster: the client's version, what it says when no cluster answers, and the
skew policy applied to what a cluster would tell (kubetrain.client.versions.compare). The cluster's part is
tests/cluster/test_version_command.py's."""

from __future__ import annotations

import json

import pytest
from support import kubetrain

from kubetrain.shared import __version__
from kubetrain.client.versions import Operator, Versions, compare, lines


def test_client_prints_the_clients_version_and_asks_no_cluster(tmp_path):
    done = kubetrain("version", "--client", env={"KUBECONFIG": str(tmp_path / "none")})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"client:   kubetrain {__version__}"
    as_json = kubetrain("version", "--client", "-o", "json")
    assert json.loads(as_json.stdout) == {"client": __version__}


def test_without_a_cluster_it_prints_the_client_and_says_why_it_cannot_ask(tmp_path):
    done = kubetrain("version", env={"KUBECONFIG": str(tmp_path / "none"), "KUBERNETES_SERVICE_HOST": ""})
    assert done.returncode == 1
    assert done.stdout.strip() == f"client:   kubetrain {__version__}"
    assert "no cluster to talk to" in done.stderr, done.stderr


def operator(version: str, *pods: str) -> Operator:
    return Operator("kubetrain-system", "kubetrain", f"kubetrain/operator:{version}", version,
                    {f"kubetrain-{i}": v for i, v in enumerate(pods)})


@pytest.mark.parametrize(("name", "found", "expected"), [
    ("all one version", Versions(client="0.2.0", operators=[operator("0.2.0", "0.2.0")], crd="0.2.0",
                                 crd_served=["v1alpha1"]), []),
    ("the CRD step forgotten", Versions(client="0.2.0", operators=[operator("0.2.0")], crd="0.1.9",
                                        crd_served=["v1alpha1"]), ["the CRD is 0.1.9, older than the operator"]),
    ("0.1.0's CRD, which carries no version", Versions(client="0.2.0", operators=[operator("0.2.0")],
                                                       crd_served=["v1alpha1"]), ["carries no version"]),
    ("a rollout half done: the newest pod counts", Versions(client="0.2.0", operators=[operator("0.1.0", "0.1.0", "0.2.0")],
                                                           crd="0.1.0", crd_served=["v1alpha1"]), ["older than the operator (0.2.0)"]),
    ("a client two minors ahead", Versions(client="0.3.0", operators=[operator("0.1.0")], crd="0.1.0",
                                           crd_served=["v1alpha1"]), ["more than one minor version apart"]),
    ("a job's trainer n-2", Versions(client="0.3.0", operators=[operator("0.3.0")], crd="0.3.0", crd_served=["v1alpha1"],
                                     job="ml/digits", trainer="0.1.0"), ["trainer is kubetrain 0.1.0"]),
    ("a job's trainer n-1", Versions(client="0.2.0", operators=[operator("0.2.0")], crd="0.2.0", crd_served=["v1alpha1"],
                                     job="ml/digits", trainer="0.1.0"), []),
])
def test_the_skew_policy_says_what_to_fix(name, found, expected):
    warnings = compare(found)
    assert len(warnings) == len(expected), (name, warnings)
    for warning, words in zip(warnings, expected):
        assert words in warning, (name, warning)


def test_the_text_names_each_part_and_where_it_was_found():
    found = Versions(client="0.2.0", operators=[operator("0.2.0", "0.2.0")], crd="0.2.0", crd_served=["v1alpha1"],
                     job="ml/digits", trainer_image="kubetrain/trainer:0.1.0", trainer="0.1.0")
    assert lines(found) == [
        "client:   kubetrain 0.2.0",
        "operator: kubetrain 0.2.0 (kubetrain-system/kubetrain: kubetrain/operator:0.2.0; pods: kubetrain-0 0.2.0)",
        "crd:      kubetrain 0.2.0 (trainingjobs.kubetrain.dev, served v1alpha1)",
        "trainer:  kubetrain 0.1.0 (ml/digits: kubetrain/trainer:0.1.0)",
    ]
    nothing = Versions(client="0.2.0", operator_problem="no kubetrain operator Deployment in any namespace",
                       crd_problem="the cluster has no trainingjobs.kubetrain.dev CRD: install kubetrain")
    assert lines(nothing)[1:] == ["operator: unknown (no kubetrain operator Deployment in any namespace)",
                                  "crd:      unknown (the cluster has no trainingjobs.kubetrain.dev CRD: install kubetrain)"]
