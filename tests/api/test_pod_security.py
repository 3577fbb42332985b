"""spec.podTemplate within Pod Security's bounds: what reaches past the pod is refused unless allowed.

Three places refuse, with one table (api/podtemplate.SECURITY_CHECKS) and the
same messages: `kubetrain validate` (`--allow`), the API server (the chart's
ValidatingAdmissionPolicy, `podSecurity.allow`) and the operator
(`pod_security_problems`, with its `--pod-security-allow`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from kubetrain.api import crd, from_object, podtemplate
from kubetrain.api.podtemplate import ALLOWANCES, SECURITY_CHECKS, pod_security_problems
from kubetrain.cli import main

from helpers.kube import wait_established

ROOT = Path(__file__).parents[2]
CHART = ROOT / "charts" / "kubetrain"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
PT = "spec.podTemplate.spec"


def manifest(pod_spec: dict, name: str = "t", metadata: dict | None = None) -> dict:
    template = {"spec": pod_spec, **({"metadata": metadata} if metadata else {})}
    return {"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
            "spec": {"mode": "Single", "podTemplate": template}}


def message(allowance: str, what: str) -> str:
    check = next(c for c in SECURITY_CHECKS if c.allowance == allowance and c.what.startswith(what))
    return check.message


@dataclass
class Case:
    name: str
    pod_spec: dict
    allowance: str
    path: str
    what: str  # the start of the check's `what`, to find its message
    metadata: dict | None = None  # the template's metadata

    @property
    def problem(self) -> str:
        return f"{self.path}: {message(self.allowance, self.what)}"

    def manifest(self, name: str = "t") -> dict:
        return manifest(self.pod_spec, name, self.metadata)


def sidecar(name: str = "side", **ctx) -> dict:
    return {"name": name, "image": "busybox", "securityContext": ctx}


SCRATCH_CLAIM = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}


CASES = [
    Case("privileged trainer", {"containers": [{"name": "trainer", "securityContext": {"privileged": True}}]},
         "privileged", f"{PT}.containers[trainer].securityContext.privileged", "privileged containers"),
    Case("privileged nameless container (the trainer)", {"containers": [{"securityContext": {"privileged": True}}]},
         "privileged", f"{PT}.containers[trainer].securityContext.privileged", "privileged containers"),
    Case("privileged sidecar", {"containers": [sidecar(privileged=True)]},
         "privileged", f"{PT}.containers[side].securityContext.privileged", "privileged containers"),
    Case("privileged init container", {"initContainers": [sidecar("fetch", privileged=True)]},
         "privileged", f"{PT}.initContainers[fetch].securityContext.privileged", "privileged containers"),
    Case("privilege escalation", {"containers": [sidecar(allowPrivilegeEscalation=True)]},
         "privileged", f"{PT}.containers[side].securityContext.allowPrivilegeEscalation", "privilege escalation"),
    Case("hostPID", {"hostPID": True}, "hostNamespaces", f"{PT}.hostPID", "the node's process"),
    Case("hostIPC", {"hostIPC": True}, "hostNamespaces", f"{PT}.hostIPC", "the node's IPC"),
    Case("hostNetwork", {"hostNetwork": True}, "hostNamespaces", f"{PT}.hostNetwork", "the node's network"),
    Case("hostPath volume", {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]},
         "hostPath", f"{PT}.volumes[root].hostPath", "hostPath"),
    Case("added capability", {"containers": [{"name": "trainer", "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}]},
         "capabilities", f"{PT}.containers[trainer].securityContext.capabilities.add", "added capabilities"),
    Case("added capability in an init container", {"initContainers": [sidecar("fetch", capabilities={"add": ["NET_ADMIN"]})]},
         "capabilities", f"{PT}.initContainers[fetch].securityContext.capabilities.add", "added capabilities"),
    Case("pod runAsUser 0", {"securityContext": {"runAsUser": 0}},
         "root", f"{PT}.securityContext.runAsUser", "running as root"),
    Case("pod runAsNonRoot false", {"securityContext": {"runAsNonRoot": False}},
         "root", f"{PT}.securityContext.runAsNonRoot", "runAsNonRoot: false"),
    Case("container runAsUser 0", {"containers": [sidecar(runAsUser=0)]},
         "root", f"{PT}.containers[side].securityContext.runAsUser", "running as root"),
    Case("container runAsNonRoot false", {"containers": [{"name": "trainer", "securityContext": {"runAsNonRoot": False}}]},
         "root", f"{PT}.containers[trainer].securityContext.runAsNonRoot", "runAsNonRoot: false"),
    Case("serviceAccountName", {"serviceAccountName": "admin"},
         "serviceAccount", f"{PT}.serviceAccountName", "another ServiceAccount"),
    Case("serviceAccount (deprecated spelling)", {"serviceAccount": "admin"},
         "serviceAccount", f"{PT}.serviceAccount", "another ServiceAccount"),
    Case("service account token", {"automountServiceAccountToken": True},
         "serviceAccount", f"{PT}.automountServiceAccountToken", "a ServiceAccount token"),
    # Issue 31: Pod Security baseline and restricted, the namespace's Secrets and claims, the scheduling fields.
    Case("Windows HostProcess container", {"containers": [sidecar(windowsOptions={"hostProcess": True})]},
         "privileged", f"{PT}.containers[side].securityContext.windowsOptions.hostProcess", "Windows HostProcess"),
    Case("Windows HostProcess pod", {"securityContext": {"windowsOptions": {"hostProcess": True}}},
         "privileged", f"{PT}.securityContext.windowsOptions.hostProcess", "Windows HostProcess"),
    Case("hostPort", {"containers": [{"name": "trainer", "ports": [{"name": "web", "containerPort": 8080,
                                                                    "hostPort": 8080}]}]},
         "hostPorts", f"{PT}.containers[trainer].ports[].hostPort", "ports of the node"),
    Case("procMount Unmasked", {"containers": [sidecar(procMount="Unmasked")]},
         "procMount", f"{PT}.containers[side].securityContext.procMount", "an unmasked /proc"),
    Case("unsafe sysctl", {"securityContext": {"sysctls": [{"name": "kernel.msgmax", "value": "65536"}]}},
         "sysctls", f"{PT}.securityContext.sysctls[].name", "sysctls outside"),
    Case("nfs volume", {"volumes": [{"name": "share", "nfs": {"server": "10.0.0.1", "path": "/"}}]},
         "volumeTypes", f"{PT}.volumes[share]", "volume types outside"),
    Case("gitRepo volume", {"volumes": [{"name": "repo", "gitRepo": {"repository": "https://example.com/r"}}]},
         "volumeTypes", f"{PT}.volumes[repo]", "volume types outside"),
    Case("another job's token Secret", {"volumes": [{"name": "tok", "secret": {"secretName": "victim-token-0a1b2c3d"}}]},
         "secrets", f"{PT}.volumes[tok].secret", "Secret volumes"),
    Case("a Secret in a projected volume", {"volumes": [{"name": "tls", "projected": {"sources": [
        {"configMap": {"name": "x"}}, {"secret": {"name": "victim-token-0a1b2c3d"}}]}}]},
         "secrets", f"{PT}.volumes[tls].projected.sources[].secret", "Secrets in projected"),
    Case("a variable from a Secret", {"containers": [{"name": "trainer", "env": [
        {"name": "STOLEN", "valueFrom": {"secretKeyRef": {"name": "victim-token-0a1b2c3d", "key": "token"}}}]}]},
         "secrets", f"{PT}.containers[trainer].env[].valueFrom.secretKeyRef", "variables from Secrets (valueFrom"),
    Case("envFrom a Secret", {"initContainers": [{"name": "fetch", "image": "busybox",
                                                  "envFrom": [{"secretRef": {"name": "victim"}}]}]},
         "secrets", f"{PT}.initContainers[fetch].envFrom[].secretRef", "variables from Secrets (envFrom"),
    # Issue 52: a CSI volume is within `restricted`, but its driver is handed the Secret it names.
    Case("a Secret handed to a CSI driver", {"volumes": [{"name": "bucket", "csi": {
        "driver": "s3.csi.example.com", "nodePublishSecretRef": {"name": "victim-token-0a1b2c3d"}}}]},
         "secrets", f"{PT}.volumes[bucket].csi.nodePublishSecretRef.name", "Secrets handed to a CSI driver"),
    Case("another job's claim", {"volumes": [{"name": "theirs", "persistentVolumeClaim": {
        "claimName": "victim-ckpt-single-0"}}]},
         "claims", f"{PT}.volumes[theirs].persistentVolumeClaim", "PersistentVolumeClaims"),
    Case("a projected ServiceAccount token", {"volumes": [{"name": "sa", "projected": {"sources": [
        {"serviceAccountToken": {"path": "token", "audience": "api"}}]}}]},
         "serviceAccount", f"{PT}.volumes[sa].projected.sources[].serviceAccountToken", "ServiceAccount tokens"),
    Case("nodeName", {"nodeName": "control-plane-0"}, "nodeName", f"{PT}.nodeName", "choosing the node"),
    Case("a toleration of every taint", {"tolerations": [{"key": "gpu", "operator": "Exists"}, {"operator": "Exists"}]},
         "tolerations", f"{PT}.tolerations[]", "a toleration of every taint"),
    Case("priorityClassName", {"priorityClassName": "system-node-critical"},
         "priorityClass", f"{PT}.priorityClassName", "a PriorityClass"),
    Case("runtimeClassName", {"runtimeClassName": "runc-unconfined"},
         "runtimeClass", f"{PT}.runtimeClassName", "another container runtime"),
    Case("AppArmor unconfined annotation", {}, "appArmor", "spec.podTemplate.metadata.annotations",
         "an AppArmor profile other", metadata={"annotations": {
             "container.apparmor.security.beta.kubernetes.io/trainer": "unconfined"}}),
    # Tenants, third pass: the kubelet sends a probe's or a hook's request from the node's network (the
    # cloud's metadata address, the node's own ports); Pod Security baseline refuses any host but "" (1.34+).
    *[Case(f"{probe} {handler}.host", {"containers": [{"name": "trainer", probe: {handler: {
        "host": "169.254.169.254", "port": 80, **({"path": "/latest/meta-data/"} if handler == "httpGet" else {})}}}]},
        "probeHosts", f"{PT}.containers[trainer].{probe}.{handler}.host", "a probe's host")
      for probe in ("livenessProbe", "readinessProbe", "startupProbe") for handler in ("httpGet", "tcpSocket")],
    *[Case(f"lifecycle.{hook} {handler}.host", {"containers": [sidecar(), {"name": "trainer", "lifecycle": {
        hook: {handler: {"host": "10.0.0.1", "port": 10250}}}}]},
        "probeHosts", f"{PT}.containers[trainer].lifecycle.{hook}.{handler}.host", "a lifecycle hook's host")
      for hook in ("postStart", "preStop") for handler in ("httpGet", "tcpSocket")],
    Case("probe host localhost in a sidecar init container", {"initContainers": [{
        "name": "proxy", "image": "busybox", "restartPolicy": "Always",
        "startupProbe": {"tcpSocket": {"host": "localhost", "port": 22}}}]},
         "probeHosts", f"{PT}.initContainers[proxy].startupProbe.tcpSocket.host", "a probe's host"),
    # ... and another job's checkpoints cloned, or its devices claimed, past the claim volume's check.
    Case("an ephemeral volume cloned from another job's claim", {"volumes": [{"name": "copy", "ephemeral": {
        "volumeClaimTemplate": {"spec": {**SCRATCH_CLAIM, "dataSource": {
            "kind": "PersistentVolumeClaim", "name": "victim-ckpt-single-0"}}}}}]},
         "claims", f"{PT}.volumes[copy].ephemeral.volumeClaimTemplate.spec.dataSource", "ephemeral volumes cloned"),
    Case("an ephemeral volume filled from a snapshot of another job's claim", {"volumes": [{"name": "copy", "ephemeral": {
        "volumeClaimTemplate": {"spec": {**SCRATCH_CLAIM, "dataSourceRef": {
            "apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": "victim-ckpt-snap"}}}}}]},
         "claims", f"{PT}.volumes[copy].ephemeral.volumeClaimTemplate.spec.dataSourceRef", "ephemeral volumes filled"),
    Case("an ephemeral volume bound to another job's volume", {"volumes": [{"name": "theirs", "ephemeral": {
        "volumeClaimTemplate": {"spec": {**SCRATCH_CLAIM, "volumeName": "pvc-0a1b2c3d"}}}}]},
         "claims", f"{PT}.volumes[theirs].ephemeral.volumeClaimTemplate.spec.volumeName", "ephemeral volumes bound"),
    Case("another job's ResourceClaim", {"resourceClaims": [{"name": "gpus", "resourceClaimName": "victim-gpus"}]},
         "claims", f"{PT}.resourceClaims[].resourceClaimName", "ResourceClaims"),
    *[case for scope, path, wrap in (
        ("pod", f"{PT}.securityContext", lambda ctx: {"securityContext": ctx}),
        ("container", f"{PT}.containers[side].securityContext", lambda ctx: {"containers": [sidecar(**ctx)]}))
      for case in (
        Case(f"{scope} seccomp Unconfined", wrap({"seccompProfile": {"type": "Unconfined"}}), "seccomp",
             f"{path}.seccompProfile.type", "the Unconfined seccomp"),
        Case(f"{scope} AppArmor Unconfined", wrap({"appArmorProfile": {"type": "Unconfined"}}), "appArmor",
             f"{path}.appArmorProfile.type", "the Unconfined AppArmor"),
        Case(f"{scope} SELinux type spc_t", wrap({"seLinuxOptions": {"type": "spc_t"}}), "seLinux",
             f"{path}.seLinuxOptions.type", "an SELinux type"),
        Case(f"{scope} SELinux user", wrap({"seLinuxOptions": {"user": "system_u"}}), "seLinux",
             f"{path}.seLinuxOptions.user", "an SELinux user"),
        Case(f"{scope} SELinux role", wrap({"seLinuxOptions": {"role": "system_r"}}), "seLinux",
             f"{path}.seLinuxOptions.role", "an SELinux role"),
    )],
]
IDS = [c.name for c in CASES]

# What stays allowed: the same fields at values that keep the pod within `restricted`.
WITHIN_BOUNDS = {
    "containers": [
        {"name": "trainer", "securityContext": {"privileged": False, "allowPrivilegeEscalation": False,
                                                "runAsUser": 1000, "runAsNonRoot": True,
                                                "capabilities": {"drop": ["ALL"], "add": []}}},
        sidecar(runAsUser=2000, capabilities={"drop": ["ALL"]}),
    ],
    "initContainers": [sidecar("fetch", allowPrivilegeEscalation=False)],
    "hostPID": False, "hostIPC": False, "hostNetwork": False,
    "serviceAccountName": "default", "automountServiceAccountToken": False,
    "securityContext": {"runAsUser": 1000, "runAsNonRoot": True, "runAsGroup": 0,
                        "seccompProfile": {"type": "Localhost", "localhostProfile": "profiles/train.json"},
                        "appArmorProfile": {"type": "RuntimeDefault"}, "seLinuxOptions": {"type": "container_t"},
                        "sysctls": [{"name": "net.ipv4.tcp_keepalive_time", "value": "60"}]},
    "volumes": [{"name": "dataset", "emptyDir": {}}, {"name": "cfg", "configMap": {"name": "x"}},
                {"name": "info", "projected": {"sources": [{"downwardAPI": {"items": [
                    {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]}}, {"configMap": {"name": "x"}}]}},
                {"name": "scratch", "ephemeral": {"volumeClaimTemplate": {"spec": {
                    **SCRATCH_CLAIM, "storageClassName": "fast", "volumeName": ""}}}},
                {"name": "inline", "csi": {"driver": "inline.csi.example.com", "readOnly": True,
                                           "volumeAttributes": {"size": "1Gi"}}}],
    "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}],
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                    {"key": "team", "operator": "Equal", "value": "ml"}],
    "nodeName": "", "priorityClassName": "", "runtimeClassName": "",
}
WITHIN_BOUNDS["containers"][0].update(
    ports=[{"name": "web", "containerPort": 8080}, {"name": "debug", "containerPort": 8081, "hostPort": 0}],
    env=[{"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "x", "key": "mode"}}}],
    envFrom=[{"configMapRef": {"name": "x"}}],
    # Probes and hooks aimed at the pod itself (no host, or an empty one: the pod's IP).
    livenessProbe={"httpGet": {"path": "/healthz", "port": 8080}},
    readinessProbe={"tcpSocket": {"port": 8080, "host": ""}},
    lifecycle={"preStop": {"httpGet": {"path": "/drain", "port": 8080, "host": ""}}})
WITHIN_BOUNDS["containers"][1]["securityContext"].update(procMount="Default", seccompProfile={"type": "RuntimeDefault"})


def write(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


# --- kubetrain validate -------------------------------------------------------------------

def test_every_check_has_a_case():
    covered = {(c.allowance, c.what) for c in SECURITY_CHECKS
               for case in CASES if case.allowance == c.allowance and c.what.startswith(case.what)
               and case.path.endswith(f".{c.path}" if c.path else "]")}
    assert covered == {(c.allowance, c.what) for c in SECURITY_CHECKS if not c.rendered_only}
    assert {c.allowance for c in SECURITY_CHECKS if not c.rendered_only} == set(ALLOWANCES)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_validate_refuses_what_reaches_past_the_pod_naming_the_field(case, tmp_path, capsys):
    path = write(tmp_path, case.manifest())
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: {case.problem}" in err.splitlines(), err
    assert f"podSecurity.allow: [{case.allowance}]" in err
    assert "--allow NAME,..." in err  # how to check for an installation that allows it
    assert "Traceback" not in err


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_validate_accepts_it_when_allowed(case, tmp_path, capsys):
    path = write(tmp_path, case.manifest())
    assert main(["validate", "--allow", case.allowance, str(path)]) == 0, capsys.readouterr().err
    others = ",".join(a for a in ALLOWANCES if a != case.allowance)
    assert main(["validate", "--allow", others, str(path)]) == 2  # only its own allowance lifts it


def test_validate_reports_every_refusal_at_once(tmp_path, capsys):
    pod_spec = {k: v for case in CASES[:1] + CASES[5:9] for k, v in case.pod_spec.items()}
    assert main(["validate", str(write(tmp_path, manifest(pod_spec)))]) == 2
    err = capsys.readouterr().err
    for case in CASES[:1] + CASES[5:9]:
        assert case.problem in err


def test_the_same_fields_within_bounds_pass(tmp_path, capsys):
    assert main(["validate", str(write(tmp_path, manifest(WITHIN_BOUNDS)))]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_example_stays_within_bounds(example, capsys):
    assert main(["validate", "--no-code-check", str(example)]) == 0, capsys.readouterr().err


def test_an_unknown_allowance_is_a_usage_error_listing_the_known_ones(tmp_path):
    path = write(tmp_path, manifest({}))
    proc = subprocess.run([sys.executable, "-m", "kubetrain.cli", "validate", "--allow", "privileged,sudo",
                           str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "unknown pod-security allowance 'sudo'" in proc.stderr
    assert ", ".join(ALLOWANCES) in proc.stderr
    assert "Traceback" not in proc.stderr


def test_validate_exits_2_without_traceback_as_a_command(tmp_path):
    path = write(tmp_path, manifest({"hostNetwork": True, "serviceAccountName": "admin"}))
    proc = subprocess.run([sys.executable, "-m", "kubetrain.cli", "validate", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert f"{PT}.hostNetwork: " in proc.stderr and f"{PT}.serviceAccountName: " in proc.stderr
    assert "Traceback" not in proc.stderr


# --- the operator's check (pod_security_problems) -----------------------------------------

def test_the_operators_check_takes_a_spec_and_its_allowances():
    job = from_object(manifest({"hostPID": True, "volumes": [{"name": "root", "hostPath": {"path": "/"}}]}))
    assert pod_security_problems(job.spec, frozenset()) == [
        f"{PT}.hostPID: {message('hostNamespaces', 'the node')}",
        f"{PT}.volumes[root].hostPath: {message('hostPath', 'hostPath')}",
    ]
    assert pod_security_problems(job.spec, {"hostPath"}) == [f"{PT}.hostPID: {message('hostNamespaces', 'the node')}"]
    assert pod_security_problems(job.spec, podtemplate.parse_allowances(["hostPath,hostNamespaces"])) == []
    assert pod_security_problems(from_object(manifest({})).spec) == []


def test_allowances_parse_from_comma_separated_flags():
    assert podtemplate.parse_allowances(["privileged, hostPath", "", "root"]) == {"privileged", "hostPath", "root"}
    with pytest.raises(ValueError, match="'Privileged'"):
        podtemplate.parse_allowances(["Privileged"])


def test_malformed_shapes_refuse_nothing_here():
    # Types are the schema's and Kubernetes' to refuse; this check never crashes on them.
    for pod_spec in ({"containers": "x"}, {"containers": [1, None]}, {"securityContext": "x"},
                     {"containers": [{"securityContext": {"privileged": "true", "runAsUser": False}}]}):
        assert pod_security_problems({"spec": pod_spec}) == []
    assert pod_security_problems({"spec": "x"}) == [] and pod_security_problems({}) == []


# --- the chart's policy: generated from the same table ------------------------------------

def test_the_charts_policy_rules_are_generated_from_the_table():
    committed = (ROOT / crd.POD_SECURITY_FILE).read_text()
    assert committed == crd.render_pod_security(), \
        f"run: python -m kubetrain.api.crd --pod-security > {crd.POD_SECURITY_FILE}"
    rules = yaml.safe_load(committed)["validations"]
    assert {r["allow"] for r in rules} == set(ALLOWANCES) | {None}  # None: the Volcano queue rule, no allowance's
    # Every message is a check's message, after the path the API server prints; the object-storage
    # credentials' rules (one per secretRef) come next, lifted by the same allowance as a template's Secrets;
    # a pvc:// pretrained model's claim last, lifted by the template's claims allowance.
    messages = {c.message for c in SECURITY_CHECKS} | {crd.SECRET_REF_MESSAGE, crd.PRETRAINED_CLAIM_MESSAGE,
                                                        crd.QUEUE_MESSAGE}
    assert all(r["message"].split(": ", 1)[1] in messages for r in rules)
    assert [r["message"].split(":")[0] for r in rules if r["message"].endswith(crd.SECRET_REF_MESSAGE)] == \
        ["spec.checkpoint.storage.secretRef", "spec.dataset.secretRef", "spec.model.secretRef"]
    assert rules[-1] == {**crd.PRETRAINED_CLAIM_VALIDATION}


def test_the_charts_values_schema_lists_the_allowances():
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["properties"]["podSecurity"]["properties"]["allow"]["items"]["enum"] == list(ALLOWANCES)
    assert yaml.safe_load((CHART / "values.yaml").read_text())["podSecurity"] == {"allow": []}  # off by default


def test_everything_allowed_means_no_policy_but_the_queue_rule():
    # A Volcano queue is a team's share of the cluster: only gangScheduling.volcano.queues lists them.
    [policy, _] = crd.pod_security_policy(allowed=set(ALLOWANCES), queues={"research"})
    assert [v["message"] for v in policy["spec"]["validations"]] == [
        f"spec.runPolicy.schedulingPolicy.queue: {crd.QUEUE_MESSAGE}"]
    assert policy["spec"]["validations"][0]["expression"].endswith('queue in ["research"]')
    policy, binding = crd.pod_security_policy(namespace="ml")
    assert binding["spec"]["matchResources"]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "ml"}
    assert len(policy["spec"]["validations"]) == len(crd.pod_security_rules()["validations"])


# --- on the real API server ----------------------------------------------------------------

CRD = ROOT / "deploy" / "crd" / "trainingjobs.yaml"


def helm_policy(cluster, release: str, namespace: str, allow: list[str]) -> list[dict]:
    """The chart's policy and binding as `helm template` renders them for a namespaced release."""
    args = ["helm", "template", release, str(CHART), "--namespace", namespace, "--set", "operator.namespaced=true"]
    if allow:
        args += ["--set", f"podSecurity.allow={{{','.join(allow)}}}"]
    return [d for d in yaml.safe_load_all(cluster.run(*args)) if d and d["kind"].startswith("ValidatingAdmissionPolicy")]


def without_labels(objs: list[dict]) -> list[dict]:
    return [{**o, "metadata": {"name": o["metadata"]["name"]}} for o in objs]


def apply(cluster, ns: str, doc: dict, dry_run: bool = True) -> subprocess.CompletedProcess:
    args = ["kubectl", "-n", ns, "apply", "--server-side", "-f", "-"] + (["--dry-run=server"] if dry_run else [])
    return subprocess.run(args, input=yaml.safe_dump(doc), env=cluster.env, capture_output=True, text=True, timeout=60)


def wait_enforced(cluster, ns: str, timeout: float = 60) -> None:
    """A new policy binding takes effect within a few seconds: wait until it refuses."""
    deadline = time.monotonic() + timeout
    while apply(cluster, ns, manifest({"hostPID": True}, "probe")).returncode == 0:
        assert time.monotonic() < deadline, f"the pod-security policy of {ns} is not enforced after {timeout} s"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def policies(cluster):
    """Namespaces `strict` (the chart's defaults) and `lenient` (podSecurity.allow: privileged, hostPath, root)."""
    cluster.kubectl("apply", "--server-side", "-f", str(CRD))
    wait_established(cluster, "trainingjobs.kubetrain.dev")
    tag = uuid.uuid4().hex[:6]
    spaces = {"strict": (f"ps-strict-{tag}", []), "lenient": (f"ps-lenient-{tag}", ["privileged", "hostPath", "root"])}
    objs = []
    for kind, (ns, allow) in spaces.items():
        cluster.kubectl("create", "namespace", ns)
        objs += helm_policy(cluster, f"{kind}-{tag}", ns, allow)
    cluster.run("kubectl", "apply", "-f", "-", input=yaml.safe_dump_all(objs))
    for ns, _ in spaces.values():
        wait_enforced(cluster, ns)
    yield {kind: ns for kind, (ns, _) in spaces.items()}
    for ns, _ in spaces.values():
        cluster.kubectl("delete", "namespace", ns, "--wait=false")
    for obj in objs:
        cluster.kubectl("delete", obj["kind"], obj["metadata"]["name"], "--ignore-not-found")


@pytest.mark.cluster
@pytest.mark.parametrize("allow", [[], ["privileged", "hostPath"], list(ALLOWANCES)], ids=["none", "two", "all"])
def test_the_chart_renders_the_policy_of_the_table_less_what_it_allows(cluster, allow):
    rendered = helm_policy(cluster, "kubetrain", "ml", allow)
    expected = crd.pod_security_policy(allowed=set(allow), name="kubetrain-pod-security", namespace="ml")
    assert without_labels(rendered) == expected


@pytest.mark.cluster
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_api_server_refuses_it_with_the_validators_message(cluster, policies, case):
    done = apply(cluster, policies["strict"], case.manifest())
    assert done.returncode != 0, f"{case.name}: accepted"
    assert case.problem in done.stderr, done.stderr
    lenient = apply(cluster, policies["lenient"], case.manifest())
    if case.allowance in ("privileged", "hostPath", "root"):
        assert lenient.returncode == 0, lenient.stderr
    else:
        assert case.problem in lenient.stderr, lenient.stderr


@pytest.mark.cluster
def test_the_api_server_refuses_object_storage_credentials_the_chart_does_not_list(cluster, policies):
    job = manifest({}, "creds")
    job["spec"]["checkpoint"] = {"storage": {"uri": "s3://bkt/run/", "secretRef": "team-secret"}}
    done = apply(cluster, policies["strict"], job)
    assert done.returncode != 0 and f"spec.checkpoint.storage.secretRef: {crd.SECRET_REF_MESSAGE}" in done.stderr, \
        done.stderr


@pytest.mark.cluster
def test_the_api_server_accepts_the_same_fields_within_bounds(cluster, policies):
    done = apply(cluster, policies["strict"], manifest(WITHIN_BOUNDS))
    assert done.returncode == 0, done.stderr


@pytest.mark.cluster
def test_only_a_new_spec_is_judged(cluster, policies):
    """A job admitted before the policy tightened keeps its metadata writable (the operator's
    finalizers and annotations); a change of its spec is judged."""
    ns = f"ps-late-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    objs = helm_policy(cluster, f"late-{ns[-6:]}", ns, [])
    try:
        assert apply(cluster, ns, manifest({"hostPID": True}, "early"), dry_run=False).returncode == 0
        cluster.run("kubectl", "apply", "-f", "-", input=yaml.safe_dump_all(objs))
        wait_enforced(cluster, ns)
        cluster.kubectl("-n", ns, "label", "trainingjob", "early", "team=a")
        cluster.kubectl("-n", ns, "annotate", "trainingjob", "early", "kopf.zalando.org/touch=1")
        done = subprocess.run(["kubectl", "-n", ns, "patch", "trainingjob", "early", "--type=merge", "-p",
                               json.dumps({"spec": {"podTemplate": {"spec": {"hostNetwork": True}}}})],
                              env=cluster.env, capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and f"{PT}.hostPID: " in done.stderr, done.stderr
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false")
        for obj in objs:
            cluster.kubectl("delete", obj["kind"], obj["metadata"]["name"], "--ignore-not-found")


# --- Pod Security `restricted` on the real API server: the pods kubetrain renders pass it --------

@pytest.fixture(scope="module")
def restricted_ns(cluster):
    ns = f"ps-restricted-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    cluster.kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=restricted",
                    "pod-security.kubernetes.io/warn=restricted")
    cluster.kubectl("-n", ns, "create", "serviceaccount", "kubetrain")  # the chart's operator runs as it
    # A pod is refused until the namespace's `default` ServiceAccount exists (made a moment after the namespace).
    deadline = time.monotonic() + 60
    while subprocess.run(["kubectl", "-n", ns, "get", "serviceaccount", "default"], env=cluster.env,
                         capture_output=True, timeout=30).returncode != 0:
        assert time.monotonic() < deadline, f"no default ServiceAccount in {ns}"
        time.sleep(0.2)
    yield ns
    cluster.kubectl("delete", "namespace", ns, "--wait=false")


def create_dry_run(cluster, ns: str, obj: dict) -> subprocess.CompletedProcess:
    obj = {**obj, "metadata": {k: v for k, v in obj["metadata"].items() if k not in ("ownerReferences", "namespace")}}
    return subprocess.run(["kubectl", "-n", ns, "create", "--dry-run=server", "-f", "-"], input=yaml.safe_dump(obj),
                          env=cluster.env, capture_output=True, text=True, timeout=60)


@pytest.mark.cluster
@pytest.mark.parametrize("spec", [
    {"mode": "Single"},
    {"mode": "ParameterServer", "parameterServer": {"replicas": 2, "workers": 2}},
    {"mode": "DDP", "ddp": {"nodes": 2}},
    {"mode": "Single", "podTemplate": {"spec": {"containers": [
        {"name": "upload", "image": "busybox",
         "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}]}}},
], ids=["single", "parameter-server", "ddp", "restricted-sidecar"])
def test_the_pods_kubetrain_renders_are_admitted_under_pod_security_restricted(cluster, restricted_ns, spec):
    from kubetrain.engine.children import children

    job = from_object({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob",
                       "metadata": {"name": "rj", "namespace": restricted_ns}, "spec": spec})
    workloads = [o for o in children(job, "uid", "token") if o["kind"] in ("Pod", "StatefulSet")]
    assert workloads
    for obj in workloads:
        done = create_dry_run(cluster, restricted_ns, obj)
        assert done.returncode == 0, done.stderr
        # A StatefulSet is admitted whatever its template; PodSecurity warns about the pods it would make.
        assert "PodSecurity" not in done.stderr, done.stderr


@pytest.mark.cluster
def test_the_charts_operator_is_admitted_under_pod_security_restricted(cluster, restricted_ns):
    docs = yaml.safe_load_all(cluster.run("helm", "template", "kubetrain", str(CHART), "--namespace", restricted_ns))
    (deployment,) = [d for d in docs if d and d["kind"] == "Deployment"]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "operator"}, "spec": deployment["spec"]["template"]["spec"]}
    for obj in (deployment, pod):
        done = create_dry_run(cluster, restricted_ns, obj)
        assert done.returncode == 0 and "PodSecurity" not in done.stderr, done.stderr


@pytest.mark.cluster
def test_the_restricted_namespace_does_refuse_what_the_policy_refuses(cluster, restricted_ns):
    # The control for the two tests above: this API server enforces `restricted`.
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "bad"},
           "spec": {"containers": [{"name": "c", "image": "busybox", "securityContext": {"privileged": True}}]}}
    done = create_dry_run(cluster, restricted_ns, pod)
    assert done.returncode != 0 and 'violates PodSecurity "restricted' in done.stderr, done.stderr


# --- the rendered pod is judged, and kubetrain's own security fields come after the template (issue 31) ---

def rendered(pod_spec: dict, mode: str = "Single", validate: bool = True) -> list[dict]:
    """The pods (or the StatefulSet's template) the job would create; `validate` False renders a
    template the validator would refuse, as a caller that skipped it would."""
    from kubetrain.engine.children import children

    doc = manifest(pod_spec if validate else {})
    doc["spec"]["mode"] = mode
    job = from_object(doc)
    job.spec.pod_template = {"spec": pod_spec}
    objs = [o for o in children(job, "uid", "token") if o["kind"] in ("Pod", "StatefulSet")]
    return [o["spec"]["template"] if o["kind"] == "StatefulSet" else o for o in objs]


def test_kubetrains_security_fields_are_applied_after_the_template():
    # An empty drop list once replaced kubetrain's drop of ALL; a sidecar once had none of it.
    pod_spec = {"containers": [{"name": "trainer", "securityContext": {"capabilities": {"drop": []}}},
                               {"name": "side", "image": "busybox"}],
                "initContainers": [{"name": "fetch", "image": "busybox",
                                    "securityContext": {"capabilities": {"drop": ["NET_RAW"]}}}]}
    for mode in ("Single", "DDP"):
        (pod,) = rendered(pod_spec, mode)
        for c in pod["spec"]["containers"] + pod["spec"]["initContainers"]:
            assert "ALL" in c["securityContext"]["capabilities"]["drop"], (mode, c["name"])
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, (mode, c["name"])
        assert pod["spec"]["initContainers"][0]["securityContext"]["capabilities"]["drop"] == ["NET_RAW", "ALL"]


def test_nulls_left_by_a_caller_that_skipped_validation_still_render_kubetrains_values():
    # The validator refuses these nulls (tests/api/test_validate.py); the renderer does not rely on it.
    pod_spec = {"securityContext": {"runAsNonRoot": None, "seccompProfile": None}, "automountServiceAccountToken": None,
                "containers": [{"name": "trainer", "securityContext": {"allowPrivilegeEscalation": None,
                                                                       "capabilities": None}}]}
    (pod,) = rendered(pod_spec, validate=False)
    spec = pod["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["automountServiceAccountToken"] is False
    trainer = spec["containers"][0]["securityContext"]
    assert trainer["allowPrivilegeEscalation"] is False and trainer["capabilities"] == {"drop": ["ALL"]}


def test_validate_refuses_a_null_that_would_remove_kubetrains_value(tmp_path, capsys):
    for field, pod_spec in [
        ("securityContext.runAsNonRoot", {"securityContext": {"runAsNonRoot": None}}),
        ("securityContext.runAsUser", {"securityContext": {"runAsUser": None}}),
        ("automountServiceAccountToken", {"automountServiceAccountToken": None}),
        ("containers[0].securityContext.allowPrivilegeEscalation",
         {"containers": [{"name": "trainer", "securityContext": {"allowPrivilegeEscalation": None}}]}),
    ]:
        path = write(tmp_path, manifest(pod_spec))
        assert main(["validate", str(path)]) == 2, field
        assert f"{path}: {PT}.{field}: must not be null" in capsys.readouterr().err


def test_the_check_judges_the_rendered_pod():
    """What the rendered pod lacks is refused, whatever the template said: the checks marked
    rendered_only see a pod whose merge lost kubetrain's values (a null, before nulls were refused)."""
    from kubetrain.engine import podsecurity
    from kubetrain.engine.children import Settings

    (own,) = rendered({})
    assert podtemplate.rendered_pod_problems(own, own) == []
    broken = json.loads(json.dumps(own))
    broken["spec"]["securityContext"]["runAsNonRoot"] = None
    broken["spec"]["automountServiceAccountToken"] = None
    broken["spec"]["containers"].append({"name": "side", "securityContext": {"capabilities": {"drop": []}}})
    assert podtemplate.rendered_pod_problems(broken, own) == [
        f"{PT}.automountServiceAccountToken: {message('serviceAccount', 'a pod without')}",
        f"{PT}.containers[side].securityContext.allowPrivilegeEscalation: {message('privileged', 'a container without')}",
        f"{PT}.containers[side].securityContext.capabilities.drop: {message('capabilities', 'a container that keeps')}",
        f"{PT}.securityContext.runAsNonRoot: {message('root', 'a pod without')}",
    ]
    # The template judge (the API server's view) sees nothing wrong in such a template.
    assert pod_security_problems({"spec": {"securityContext": {"runAsNonRoot": None}, "automountServiceAccountToken": None,
                                           "containers": [{"name": "side", "securityContext": {
                                               "capabilities": {"drop": []}}}]}}) == []
    # A job's own Secret (its token variable, its certificates' projected volume) is kubetrain's, not judged.
    ps = from_object({**manifest({}), "spec": {"mode": "ParameterServer"}})
    assert podsecurity.problems(ps, Settings()) == []
    ps.spec.pod_template = {"spec": {"volumes": [{"name": "theirs", "secret": {"secretName": "victim-token"}}]}}
    assert podsecurity.problems(ps, Settings()) == [
        f"{PT}.volumes[theirs].secret: {message('secrets', 'Secret volumes')}"]
    assert podsecurity.problems(ps, Settings(pod_security_allow=frozenset({"secrets"}))) == []


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_template_and_the_rendered_pods_are_refused_alike(case):
    """The API server's view (the template) and the operator's (the rendered pods) give the same refusal,
    and the case's allowance alone lifts both."""
    from kubetrain.engine import podsecurity
    from kubetrain.engine.children import Settings

    template = case.manifest()["spec"]["podTemplate"]
    assert case.problem in pod_security_problems(template)
    assert pod_security_problems(template, {case.allowance}) == []
    job = from_object(case.manifest())
    assert case.problem in podsecurity.problems(job, Settings())
    assert podsecurity.problems(job, Settings(pod_security_allow=frozenset({case.allowance}))) == []


def test_every_allowance_is_documented_where_an_operator_looks():
    """The chart's values, the operating guide's table and the security page name every allowance."""
    values = (CHART / "values.yaml").read_text()
    operating = (ROOT / "docs" / "operating.md").read_text()
    security = (ROOT / "docs" / "security.md").read_text()
    for name in ALLOWANCES:
        assert name in values, f"charts/kubetrain/values.yaml: {name}"
        assert f"| `{name}` |" in operating, f"docs/operating.md's table: {name}"
    assert "## What a job creator can reach inside the namespace" in security
    assert "## What remains" in security


def test_a_flood_of_refusals_prints_a_bounded_number_of_lines(tmp_path, capsys):
    from kubetrain.api.schema import MAX_SHOWN_PROBLEMS

    volumes = [{"name": f"v{i}", "hostPath": {"path": f"/{i}"}} for i in range(MAX_SHOWN_PROBLEMS + 30)]
    path = write(tmp_path, manifest({"volumes": volumes}))
    assert main(["validate", str(path)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == MAX_SHOWN_PROBLEMS + 2  # the problems shown, the count of the rest, the --allow hint
    assert lines[-2] == f"{path}: ... and 30 more problems"
