"""Generated input into the manifest loader: a clean InvalidSpec or a job, never anything else.

Bounded: a fixed number of examples per property and a per-example deadline; hypothesis's
database is off so the run is the same on a fresh clone. The inputs are of three kinds: raw
bytes (encodings, control characters, YAML syntax fragments), YAML text built from generated
structures, and TrainingJob documents whose spec fields get generated values of any type.
"""

from __future__ import annotations

import math
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kubetrain_operator.api import InvalidSpec, TrainingJob, from_object, load_file, to_manifest
from kubetrain_operator.api.load import MAX_MANIFEST_BYTES

FUZZ = settings(max_examples=150, deadline=2000, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=12), inner, max_size=5)), max_leaves=30)
FIELDS = ["mode", "image", "model", "dataset", "training", "parameterServer", "ddp", "resources", "checkpoint",
          "restartPolicy", "runPolicy", "metrics", "script", "podTemplate"]
fragments = st.lists(st.sampled_from(
    ["apiVersion: kubetrain.dev/v1alpha1\n", "kind: TrainingJob\n", "metadata: {name: x}\n", "spec:\n",
     "  mode: Single\n", "&a [*a]\n", "!!python/object:os.system\n", "--- \n", "{", "]", "\t", "\x00", "\ufeff",
     "*b\n", "<<: *a\n", "- - - -\n", "key: 1e400\n", "seed: 99999999999999999999999\n"]), max_size=12)


def _outcome(path) -> str:
    started = time.monotonic()
    try:
        jobs = load_file(path)
    except InvalidSpec as err:
        assert err.problems, "InvalidSpec without a problem"
        for problem in err.problems:
            assert isinstance(problem.path, str) and problem.message
        return "refused"
    finally:
        assert time.monotonic() - started < 2.0, "the loader took too long"
    assert jobs and all(isinstance(j, TrainingJob) for j in jobs)
    return "accepted"


@FUZZ
@given(raw=st.binary(max_size=400))
def test_any_bytes(tmp_path_factory, raw):
    path = tmp_path_factory.mktemp("fuzz") / "job.yaml"
    path.write_bytes(raw)
    _outcome(path)


@FUZZ
@given(parts=fragments, tail=st.text(max_size=60))
def test_yaml_fragments(tmp_path_factory, parts, tail):
    path = tmp_path_factory.mktemp("fuzz") / "job.yaml"
    path.write_text("".join(parts) + tail)
    _outcome(path)


@FUZZ
@given(spec=st.dictionaries(st.sampled_from(FIELDS), values, max_size=6))
def test_generated_specs(spec):
    doc = {"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "fuzz"},
           "spec": {"mode": "Single", **spec}}
    try:
        job = from_object(doc)
    except InvalidSpec as err:
        assert err.problems and all(p.path.startswith(("spec", "metadata", "(")) for p in err.problems), err.problems
        return
    # Accepted: every number the job holds is finite (no NaN or infinity reaches a trainer or a
    # status) and an integer fits the API server's int64.
    def check(value, path="spec") -> None:
        if isinstance(value, float):
            assert math.isfinite(value), f"{path} = {value}"
        elif isinstance(value, int) and not isinstance(value, bool):
            assert -(2**63) <= value < 2**63, f"{path} = {value}"
        elif isinstance(value, dict):
            for k, v in value.items():
                check(v, f"{path}.{k}")
        elif isinstance(value, list):
            for n, v in enumerate(value):
                check(v, f"{path}[{n}]")
    check(to_manifest(job)["spec"])


def test_the_size_bound_holds_past_its_edge(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_bytes(b"#" * (MAX_MANIFEST_BYTES + 1))
    with pytest.raises(InvalidSpec, match="larger than"):
        load_file(path)
