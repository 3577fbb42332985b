"""Pod security judged on what a job would create: its rendered pods, not its template.

The template is merged into kubetrain's pods and kubetrain's own security fields are applied
after it (children.merge_pod_template), so what a pod may do is a property of that final
object: judging the template let `runAsNonRoot: null` through, which the merge then copied over
kubetrain's `true`. `kubetrain validate` and the operator (at reconcile time, with its
`--pod-security-allow`) both call `problems`; the API server's policy judges the template with
the same table (api/podtemplate.SECURITY_CHECKS), since it cannot render.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kubetrain.api import TrainingJob
from kubetrain.api.crd import PRETRAINED_CLAIM_MESSAGE
from kubetrain.api.podtemplate import rendered_pod_problems
from .children import Settings, representatives, workloads

UID = "pod-security"  # the rendered pods' owner, never sent anywhere


def _pod_of(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"] if obj["kind"] == "StatefulSet" else obj


def problems(job: TrainingJob, settings: Settings) -> list[str]:
    """"<path>: <message>" for every pod-security refusal of the pods the job would create, under the
    installation's allowances (`settings.pod_security_allow`); empty when they stay within bounds.

    Each pod is judged beside the same pod rendered without the template, whose own list items
    (the config volume projecting the job's own Secret, the token variable) are kubetrain's.
    """
    bare = TrainingJob(metadata=job.metadata, spec=dataclasses.replace(job.spec, pod_template={}))
    found: set[str] = set(secret_ref_problems(job, settings)) | set(pretrained_claim_problems(job, settings))
    chosen = representatives(job)
    for mine, own in zip(workloads(job, UID, settings, chosen), workloads(bare, UID, settings, chosen)):
        found.update(rendered_pod_problems(_pod_of(mine), _pod_of(own), settings.pod_security_allow))
    return sorted(found)


def pretrained_claim_problems(job: TrainingJob, settings: Settings) -> list[str]:
    """A pvc:// pretrained model: kubetrain mounts that claim (read-only) into the job's pods itself, so the
    template's `claims` check never sees it; it needs the same allowance."""
    model = job.spec.model
    if "claims" in settings.pod_security_allow or model is None or not (model.pretrained or "").startswith("pvc://"):
        return []
    return [f"spec.model.pretrained: {PRETRAINED_CLAIM_MESSAGE}"]


def secret_ref_problems(job: TrainingJob, settings: Settings) -> list[str]:
    """A secretRef (the job's object-storage credentials) naming a Secret the installation does not let jobs
    name. kubetrain puts that Secret's keys into the job's pods itself, so the template's `secrets` check
    never sees it: without this rule a job could read any Secret of its namespace (another job's token and
    TLS key among them) through a script that prints its environment."""
    if "secrets" in settings.pod_security_allow:
        return []
    return [f"spec.{path}: Secret {name!r} is not one this kubetrain installation lets jobs name as "
            f"object-storage credentials (the chart's objectStorage.secrets lists them"
            f"{': ' + ', '.join(sorted(settings.object_store_secrets)) if settings.object_store_secrets else ', now none'}"
            "; podSecurity.allow: [secrets] allows any)"
            for path, name in job.spec.secret_refs().items() if name not in settings.object_store_secrets]
