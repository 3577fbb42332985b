"""The test cluster's clients and servers report the pinned versions they were stamped with."""

import json

import pytest

pytestmark = pytest.mark.cluster


def test_kubectl_reports_v1_36_3_for_client_and_server(cluster):
    versions = json.loads(cluster.kubectl("version", "-o", "json"))

    assert versions["clientVersion"]["gitVersion"] == "v1.36.3"
    assert versions["serverVersion"]["gitVersion"] == "v1.36.3"


def test_helm_reports_v3_22_0(cluster):
    assert cluster.run("helm", "version", "--template", "{{.Version}}") == "v3.22.0"
