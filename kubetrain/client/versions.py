"""`kubetrain version`'s reading of a cluster: the operator's version, the CRD's, and a job's trainer's.

All of it through the user's own credentials (the kubeconfig, as kubectl): the operator Deployments the chart
installs (labels app.kubernetes.io/name=kubetrain, app.kubernetes.io/component=operator) and their pods' images,
the CRD's `kubetrain.dev/version` annotation (api/versions.py), a job's status.trainer. What the cluster does
not answer (no kubeconfig, 403, nothing installed) is said in words beside what it did answer; nothing is
raised but a missing job. The comparisons are the skew policy's (docs/operating.md#upgrades): the CRD must be
the operator's version or newer (Helm never upgrades a chart's crds/), the client within one minor version of
the operator, a job's trainer within the operator's window (n-1).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException
from urllib3.exceptions import HTTPError

from kubetrain.shared import __version__
from kubetrain.api import GROUP, PLURAL
from kubetrain.api.versions import VERSION_ANNOTATION, image_version, parse, skew
from .cluster_backend import API_TIMEOUT, ClusterBackend, connect

OPERATOR_SELECTOR = "app.kubernetes.io/name=kubetrain,app.kubernetes.io/component=operator"
"""The chart's labels of the operator's Deployment and pods (charts/kubetrain/templates/_helpers.tpl)."""
OPERATOR_CONTAINER = "operator"
CRD_NAME = f"{PLURAL}.{GROUP}"


@dataclass
class Operator:
    """One installation's operator: its Deployment and the versions its pods run (two during a rollout)."""

    namespace: str
    name: str
    image: str
    version: str
    pods: dict[str, str] = field(default_factory=dict)  # pod name -> the version its image names


@dataclass
class Versions:
    """What `kubetrain version` found; a `*_problem` says why a part is unknown."""

    client: str = __version__
    operators: list[Operator] = field(default_factory=list)
    operator_problem: str = ""
    crd: str = ""
    crd_served: list[str] = field(default_factory=list)
    crd_problem: str = ""
    job: str = ""  # namespace/name
    trainer_image: str = ""
    trainer: str = ""
    job_problem: str = ""
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def _reason(err: Exception) -> str:
    if isinstance(err, ApiException):
        try:
            message = json.loads(err.body or "{}").get("message") or err.reason
        except (ValueError, TypeError):
            message = err.reason
        return f"{err.status} {message}"
    return str(err)


def _json(call: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """An API call's answer as raw JSON (the client's model classes make every field optional, and cost CPU)."""
    resp = call(*args, _preload_content=False, _request_timeout=API_TIMEOUT, **kwargs)
    data: dict[str, Any] = json.loads(resp.data)
    return data


def _image(spec: dict[str, Any]) -> str:
    """The operator container's image in a pod spec (the first container's when none is named so)."""
    containers = spec.get("containers") or [{}]
    chosen = next((c for c in containers if c.get("name") == OPERATOR_CONTAINER), containers[0])
    return str(chosen.get("image") or "")


def operators(api: client.ApiClient, namespace: str, everywhere: bool) -> tuple[list[Operator], str]:
    """The operator Deployments with the chart's labels: in every namespace (`everywhere`, falling back to
    `namespace` when listing them all is forbidden) or in `namespace`; and why none were found."""
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    try:
        if everywhere:
            try:
                found = _json(apps.list_deployment_for_all_namespaces, label_selector=OPERATOR_SELECTOR)
            except ApiException as err:
                if err.status != 403:
                    raise
                everywhere = False
                found = _json(apps.list_namespaced_deployment, namespace, label_selector=OPERATOR_SELECTOR)
        else:
            found = _json(apps.list_namespaced_deployment, namespace, label_selector=OPERATOR_SELECTOR)
    except (ApiException, HTTPError) as err:
        return [], f"cannot list the operator's Deployments: {_reason(err)}"
    out = []
    for deployment in found.get("items") or []:
        meta, spec = deployment.get("metadata") or {}, deployment.get("spec") or {}
        image = _image(((spec.get("template") or {}).get("spec")) or {})
        version = (image_version(image, OPERATOR_CONTAINER)
                   or (meta.get("labels") or {}).get("app.kubernetes.io/version", ""))
        operator = Operator(meta.get("namespace", ""), meta.get("name", ""), image, version)
        labels = (spec.get("selector") or {}).get("matchLabels") or {}
        try:
            pods = _json(core.list_namespaced_pod, operator.namespace,
                         label_selector=",".join(f"{k}={v}" for k, v in sorted(labels.items())))
        except (ApiException, HTTPError):
            pods = {}  # the Deployment's own image says enough
        for pod in pods.get("items") or []:
            if (pod.get("metadata") or {}).get("deletionTimestamp"):
                continue
            running = _image(pod.get("spec") or {})
            operator.pods[pod["metadata"]["name"]] = image_version(running, OPERATOR_CONTAINER) or "unknown"
        out.append(operator)
    where = "in any namespace" if everywhere else f"in namespace {namespace}"
    return out, "" if out else f"no kubetrain operator Deployment {where} (labels {OPERATOR_SELECTOR})"


def crd(api: client.ApiClient) -> tuple[str, list[str], str]:
    """The CRD's version annotation, its served API versions, and why the version is unknown."""
    try:
        obj = _json(client.ApiextensionsV1Api(api).read_custom_resource_definition, CRD_NAME)
    except (ApiException, HTTPError) as err:
        if isinstance(err, ApiException) and err.status == 404:
            return "", [], f"the cluster has no {CRD_NAME} CRD: install kubetrain"
        return "", [], f"cannot read the CRD {CRD_NAME}: {_reason(err)}"
    served = [v["name"] for v in (obj.get("spec") or {}).get("versions") or [] if v.get("served")]
    version = ((obj.get("metadata") or {}).get("annotations") or {}).get(VERSION_ANNOTATION, "")
    if not version:
        return "", served, (f"no {VERSION_ANNOTATION} annotation: applied by kubetrain 0.1.0 (which set none) or "
                            "by hand")
    return version, served, ""


def job_trainer(backend: ClusterBackend, name: str) -> tuple[str, str]:
    """(image, version) of a job's recorded trainer; ClientError (JobNotFound) when there is no such job."""
    job = backend.get(name)
    recorded = job.trainer
    if recorded is None:
        return "", ""
    return recorded.image, recorded.version


def read(namespace: str | None = None, job: str | None = None, operator_namespace: str | None = None) -> Versions:
    """Every version the cluster tells, compared (the warnings). client.api.ClientError when there is no
    cluster to ask, or no such job."""
    found = Versions()
    api, default = connect(namespace)
    found.operators, found.operator_problem = operators(api, operator_namespace or default, operator_namespace is None)
    found.crd, found.crd_served, found.crd_problem = crd(api)
    if job:
        backend = ClusterBackend(default, api)
        found.job = f"{default}/{job}"
        found.trainer_image, found.trainer = job_trainer(backend, job)
        if not found.trainer_image and not found.trainer:
            found.job_problem = ("no trainer recorded yet: the job has not started, or no operator that records "
                                 "one (0.2.0 or later) has driven it")
    found.warnings = compare(found)
    return found


def _numbers(version: str) -> tuple[int, int, int]:
    parsed = parse(version)
    return (parsed.major, parsed.minor, parsed.patch) if parsed is not None else (0, 0, 0)


def compare(found: Versions) -> list[str]:
    """The skew policy applied to what was found: one sentence per thing to fix."""
    warnings = []
    operator_versions = sorted({v for o in found.operators for v in (o.version, *o.pods.values())
                                if parse(v) is not None}, key=_numbers)
    newest = operator_versions[-1] if operator_versions else ""
    if newest and found.crd_served:
        if not found.crd or _numbers(found.crd) < _numbers(newest):
            was = f"is {found.crd}" if found.crd else "carries no version (0.1.0's)"
            warnings.append(f"the CRD {was}, older than the operator ({newest}): apply this version's CRD "
                            "(kubectl apply --server-side --force-conflicts -f charts/kubetrain/crds/); until then the "
                            "API server prunes the fields it does not declare (docs/operating.md#upgrades)")
    client_version, operator_version = parse(found.client), parse(newest)
    if client_version is not None and operator_version is not None and (
            client_version.major != operator_version.major or abs(client_version.minor - operator_version.minor) > 1):
        warnings.append(f"the client ({found.client}) and the operator ({newest}) are more than one minor version "
                        "apart: use the client of the operator's version")
    if found.trainer and newest:
        why = skew(found.trainer, newest)
        if why is not None:
            warnings.append(why)
    return warnings


def lines(found: Versions) -> list[str]:
    """`kubetrain version`'s text."""
    out = [f"client:   kubetrain {found.client}"]
    for o in found.operators:
        pods = ", ".join(f"{pod} {version}" for pod, version in sorted(o.pods.items()))
        out.append(f"operator: kubetrain {o.version or 'unknown'} ({o.namespace}/{o.name}: {o.image}"
                   f"{'; pods: ' + pods if pods else ''})")
    if not found.operators:
        out.append(f"operator: unknown ({found.operator_problem})")
    served = f", served {', '.join(found.crd_served)}" if found.crd_served else ""
    if found.crd:
        out.append(f"crd:      kubetrain {found.crd} ({CRD_NAME}{served})")
    else:
        out.append(f"crd:      unknown ({found.crd_problem}{served})")
    if found.job:
        if found.trainer or found.trainer_image:
            out.append(f"trainer:  kubetrain {found.trainer or 'unknown'} ({found.job}: "
                       f"{found.trainer_image or 'local processes'})")
        else:
            out.append(f"trainer:  unknown ({found.job}: {found.job_problem})")
    out += [f"warning: {w}" for w in found.warnings]
    return out

