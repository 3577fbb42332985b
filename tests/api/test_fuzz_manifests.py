"""Generated input into the manifest loader: a clean InvalidSpec or a job, never anything else.

Bounded: a fixed number of examples per property and a per-example deadline; hypothesis's
database is off so the run is the same on a fresh clone. The inputs are of three kinds: raw
bytes (encodings, control characters, YAML syntax fragments), YAML text built from generated
structures, and TrainingJob documents whose spec fields get generated values of any type.
"""

from __future__ import annotations

import json
import math
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kubetrain.api import InvalidSpec, TrainingJob, from_object, load_file, to_manifest
from kubetrain.api.load import MAX_MANIFEST_BYTES

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


# --- the operator's path: specs as the API server delivers them (issue 31) ----------------------------
#
# The operator never reads YAML: kopf hands it the object as JSON decoded into dicts, nulls, any
# nesting the API server stored (up to 10,000 levels), numbers within int64 and float64. What it
# does with one is `from_spec_dict`, then (accepted) the rendered pods' pod-security check and a
# round of the engine. Each must end in a job or an InvalidSpec, and a job whose pods pass the
# check must render pods within Pod Security `restricted`, whatever its template held.

json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
    st.sampled_from(["Unconfined", "RuntimeDefault", "Localhost", "Exists", "ALL", "spc_t", "default", "admin", ""]),
)
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)), max_leaves=20)
SECURITY_KEYS = ["securityContext", "privileged", "allowPrivilegeEscalation", "runAsNonRoot", "runAsUser",
                 "capabilities", "add", "drop", "seccompProfile", "appArmorProfile", "type", "seLinuxOptions",
                 "procMount", "sysctls", "name", "hostPID", "hostNetwork", "hostIPC", "hostPath", "hostPort",
                 "ports", "volumes", "secret", "projected", "sources", "serviceAccountToken", "env", "envFrom",
                 "valueFrom", "secretKeyRef", "secretRef", "persistentVolumeClaim", "nfs", "emptyDir",
                 "automountServiceAccountToken", "serviceAccountName", "nodeName", "tolerations", "operator",
                 "key", "priorityClassName", "runtimeClassName", "containers", "initContainers", "trainer",
                 "windowsOptions", "hostProcess"]
# Dicts keyed by the fields the checks read, so the generator reaches them often; few nulls (one
# anywhere in a template refuses the job, tested on its own in test_validate.py).
pod_scalars = st.one_of(st.booleans(), st.integers(min_value=-2, max_value=70000),
                        st.sampled_from(["Unconfined", "RuntimeDefault", "Localhost", "Exists", "ALL", "NET_ADMIN",
                                         "spc_t", "container_t", "default", "admin", "", "Default", "Unmasked",
                                         "kernel.msgmax", "net.ipv4.tcp_syncookies"]))
pod_values = st.recursive(pod_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3),
    st.dictionaries(st.sampled_from(SECURITY_KEYS), inner, max_size=4)), max_leaves=25)
# Templates shaped as pods are (so that many are accepted and rendered), each field the checks read
# drawn from values on both sides of its bound; and, one time in three, any shape at all.
flag = st.booleans()
profile = st.fixed_dictionaries({"type": st.sampled_from(["RuntimeDefault", "Localhost", "Unconfined"])})
capabilities = st.fixed_dictionaries({}, optional={
    "add": st.lists(st.sampled_from(["NET_BIND_SERVICE", "SYS_ADMIN"]), max_size=2),
    "drop": st.lists(st.sampled_from(["ALL", "NET_RAW"]), max_size=2)})
security_contexts = st.fixed_dictionaries({}, optional={
    "privileged": flag, "allowPrivilegeEscalation": flag, "runAsNonRoot": flag, "readOnlyRootFilesystem": flag,
    "runAsUser": st.sampled_from([0, 1000, 2000]), "capabilities": capabilities, "seccompProfile": profile,
    "appArmorProfile": profile, "procMount": st.sampled_from(["Default", "Unmasked"]),
    "seLinuxOptions": st.dictionaries(st.sampled_from(["type", "user", "role", "level"]),
                                      st.sampled_from(["", "container_t", "spc_t", "system_u"]), max_size=2),
    "sysctls": st.lists(st.fixed_dictionaries({"name": st.sampled_from(["kernel.msgmax", "net.ipv4.tcp_syncookies"]),
                                               "value": st.just("1")}), max_size=2),
    "windowsOptions": st.fixed_dictionaries({"hostProcess": flag})})
env = st.lists(st.fixed_dictionaries({"name": st.sampled_from(["A", "B", "TOKEN"])}, optional={
    "value": st.just("x"),
    "valueFrom": st.sampled_from([{"secretKeyRef": {"name": "victim-token", "key": "token"}},
                                  {"configMapKeyRef": {"name": "c", "key": "k"}}])}), max_size=2)
containers = st.lists(st.fixed_dictionaries({"name": st.sampled_from(["trainer", "side", "fetch"])}, optional={
    "image": st.just("busybox"), "securityContext": security_contexts, "env": env,
    "envFrom": st.lists(st.sampled_from([{"secretRef": {"name": "s"}}, {"configMapRef": {"name": "c"}}]), max_size=2),
    "ports": st.lists(st.fixed_dictionaries({"containerPort": st.sampled_from([80, 8080])},
                                            optional={"hostPort": st.sampled_from([0, 80])}), max_size=2)}),
    max_size=3, unique_by=lambda c: c["name"])
volumes = st.lists(st.tuples(st.sampled_from(["v1", "v2", "v3"]), st.sampled_from([
    {"emptyDir": {}}, {"hostPath": {"path": "/"}}, {"secret": {"secretName": "victim-token"}},
    {"nfs": {"server": "s", "path": "/"}}, {"persistentVolumeClaim": {"claimName": "victim-ckpt-single-0"}},
    {"configMap": {"name": "c"}}, {"gitRepo": {"repository": "r"}},
    {"projected": {"sources": [{"serviceAccountToken": {"path": "t"}}]}},
    {"projected": {"sources": [{"secret": {"name": "s"}}, {"configMap": {"name": "c"}}]}}])),
    max_size=3, unique_by=lambda v: v[0]).map(lambda vs: [{"name": n, **source} for n, source in vs])
shaped_pod_specs = st.fixed_dictionaries({}, optional={
    "securityContext": security_contexts, "containers": containers, "initContainers": containers, "volumes": volumes,
    "automountServiceAccountToken": flag, "hostPID": flag, "hostIPC": flag, "hostNetwork": flag,
    "tolerations": st.lists(st.fixed_dictionaries({"operator": st.sampled_from(["Exists", "Equal"])},
                                                  optional={"key": st.sampled_from(["", "gpu"])}), max_size=2),
    "nodeName": st.sampled_from(["", "node-0"]), "priorityClassName": st.sampled_from(["", "system-node-critical"]),
    "runtimeClassName": st.sampled_from(["", "kata"]), "serviceAccountName": st.sampled_from(["", "default", "admin"])})
any_pod_specs = st.fixed_dictionaries({}, optional={
    "securityContext": pod_values, "containers": st.lists(pod_values, max_size=2), "initContainers": pod_values,
    "volumes": pod_values, "automountServiceAccountToken": pod_scalars, "tolerations": pod_values,
    "nodeName": pod_scalars})
pod_specs = st.one_of(shaped_pod_specs, shaped_pod_specs, any_pod_specs)
templates = st.fixed_dictionaries({}, optional={
    "spec": pod_specs,
    "metadata": st.fixed_dictionaries({}, optional={
        "labels": st.dictionaries(st.sampled_from(["team", "kubetrain.dev/job-name", "app.kubernetes.io/managed-by"]),
                                  st.sampled_from(["a", "victim"]), max_size=2),
        "annotations": st.dictionaries(st.sampled_from(["note", "kubetrain.dev/size",
                                                        "container.apparmor.security.beta.kubernetes.io/trainer"]),
                                       st.sampled_from(["unconfined", "runtime/default", "x"]), max_size=2)})})


def deep(value, levels: int):
    for _ in range(levels):
        value = {"a": value}
    return value


def restricted(pod: dict) -> list[str]:
    """What puts a rendered pod outside Pod Security `restricted` (the parts kubetrain's own fields guarantee)."""
    spec = pod["spec"]
    ctx = spec.get("securityContext") or {}
    out = []
    if ctx.get("runAsNonRoot") is not True:
        out.append("runAsNonRoot")
    if (ctx.get("seccompProfile") or {}).get("type") not in ("RuntimeDefault", "Localhost"):
        out.append("seccomp")
    if spec.get("automountServiceAccountToken") is not False:
        out.append("token")
    for key in ("hostPID", "hostIPC", "hostNetwork"):
        if spec.get(key) not in (None, False):
            out.append(key)
    for c in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        cctx = c.get("securityContext") or {}
        if cctx.get("allowPrivilegeEscalation") is not False or cctx.get("privileged") not in (None, False):
            out.append(f"{c.get('name')}: escalation")
        if "ALL" not in ((cctx.get("capabilities") or {}).get("drop") or []) or \
                (cctx.get("capabilities") or {}).get("add") not in (None, []):
            out.append(f"{c.get('name')}: capabilities")
        if cctx.get("runAsUser") == 0 or cctx.get("runAsNonRoot") is False:
            out.append(f"{c.get('name')}: root")
    for v in spec.get("volumes") or []:
        if isinstance(v, dict) and "hostPath" in v:
            out.append("hostPath")
    return out


@FUZZ
@given(spec=st.one_of(st.just({}), st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=3)),
       template=templates, levels=st.sampled_from([0, 0, 0, 0, 0, 59, 60, 61, 100, 1200]))
def test_the_operators_path_ends_in_a_job_or_invalid_spec(spec, template, levels):
    import sys

    from kubetrain.api import from_spec_dict
    from kubetrain.engine import podsecurity
    from kubetrain.engine.children import Settings, children
    from kubetrain.api.status import JobStatus, to_dict
    from kubetrain.engine.reconcile import reconcile

    spec = {"mode": "Single", **spec, "podTemplate": template}
    if levels:
        spec.setdefault("podTemplate", {}).setdefault("spec", {})["affinity"] = deep("x", levels)
    limit, frame, depth = sys.getrecursionlimit(), sys._getframe(), 0
    while frame is not None:
        frame, depth = frame.f_back, depth + 1
    # Nothing on this path may recurse over the spec's depth: 150 frames more than here are plenty for
    # the schema's own few levels, and far fewer than a spec of a thousand levels would take.
    sys.setrecursionlimit(depth + 150)
    try:
        job = from_spec_dict("fuzz", spec, "ns")
    except InvalidSpec as err:
        assert err.problems and all(p.path.startswith(("spec", "metadata", "(")) for p in err.problems), err.problems
        return
    finally:
        sys.setrecursionlimit(limit)
    assert levels + 4 <= 64, "a spec nested past the limit was accepted"  # the document, spec, podTemplate, its spec
    settings = Settings()
    refused = podsecurity.problems(job, settings)
    act = reconcile(job, "uid", "token", {}, JobStatus(), 1000.0, None, settings)
    json.dumps(to_dict(act.status))
    if refused:
        return  # the operator fails such a job (reason PodSecurity) and makes no pod
    for obj in children(job, "uid", "token", settings):
        json.dumps(obj)
        if obj["kind"] in ("Pod", "StatefulSet"):
            pod = obj["spec"]["template"] if obj["kind"] == "StatefulSet" else obj
            assert restricted(pod) == [], (template, pod["spec"])
