"""spec.runPolicy.schedulingTimeoutSeconds: a bad value named by its field path, exit 2, no traceback."""

from __future__ import annotations

import pytest
from test_validate import Case
from test_validate import test_invalid_manifest_is_rejected_with_its_field_path as refused_naming_its_path

from kubetrain.api import from_object

FIELD = "spec.runPolicy.schedulingTimeoutSeconds"


def doc(value) -> dict:
    return {"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "t"},
            "spec": {"mode": "Single", "runPolicy": {"schedulingTimeoutSeconds": value}}}


CASES = [
    Case("zero", doc(0), FIELD, "must be at least 1, got 0"),
    Case("negative", doc(-5), FIELD, "must be at least 1, got -5"),
    Case("a string", doc("10m"), FIELD, "must be an integer, got string '10m'"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_bad_scheduling_timeout_is_refused_with_its_field_path(case, tmp_path, capsys):
    refused_naming_its_path(case, tmp_path, capsys)


def test_the_scheduling_timeout_is_unset_by_default_and_read_as_written():
    assert from_object(doc(1)).spec.run_policy.scheduling_timeout_seconds == 1
    unset = dict(doc(1), spec={"mode": "Single"})
    assert from_object(unset).spec.run_policy.scheduling_timeout_seconds is None
