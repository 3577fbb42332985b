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
import re
from typing import Any

from kubetrain.api import TrainingJob
from kubetrain.api.crd import PRETRAINED_CLAIM_MESSAGE
from kubetrain.api.podtemplate import SECURITY_CHECKS, rendered_pod_problems
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


CLAIMS_CHECK = next(c for c in SECURITY_CHECKS if c.allowance == "claims")
CHECKPOINT_CLAIM = re.compile(r"(?P<job>.+)-ckpt-(?:single-0|ps-[0-9]+|ddp)|data-(?P<node>.+)-ddp-[0-9]+")
"""The names kubetrain gives a job's checkpoint claims: `<job>-ckpt-<replica>` (children.claim_name: Single's, each
shard's, a DDP job's shared one) and `data-<job>-ddp-<n>` (a DDP node's, made by its StatefulSet from the claim
template `data`)."""


def checkpoint_claim_job(claim: str) -> str | None:
    """The job whose checkpoint claim `claim` is named as (CHECKPOINT_CLAIM); None for any other name."""
    found = CHECKPOINT_CLAIM.fullmatch(claim)
    return None if found is None else found["job"] or found["node"]


def existing_claim_problems(job: TrainingJob, allowed: Any, holder: str | None) -> list[str]:
    """checkpoint.storage.existingClaim naming another job's checkpoint claim (the pods would mount its
    checkpoints, to read them or to write over them), refused unless `allowed` holds `claims`: the same
    allowance as a claim in the template. Another job's is one labelled as that job's (`holder`: the job its
    kubetrain.dev/job-name label names, as the operator's index or the client read it; None when unlabelled or
    unknown), or one named as kubetrain names that job's claims (CHECKPOINT_CLAIM), whether it exists yet or not:
    a job could name the victim's claim before the victim started, wait Pending for it, and mount it once kubetrain
    made it for the victim. A job's own name's claims (kept from an earlier job of its name) stay its to name.

    One rule, one message, wherever a pod would mount the claim: the operator (drivers/cluster/refusals.py, with
    its index), the export pod (client/exportpod.py, with the claim's label) and `kubetrain validate` (by name)."""
    claim = job.spec.checkpoint.storage.existing_claim
    if not claim or "claims" in allowed:
        return []
    if holder is not None and holder != job.name:
        return [f"spec.checkpoint.storage.existingClaim: {claim!r} is job {holder}'s checkpoint claim; "
                f"{CLAIMS_CHECK.message}"]
    named = checkpoint_claim_job(claim)
    if named is not None and named != job.name:
        return [f"spec.checkpoint.storage.existingClaim: {claim!r} is named as job {named}'s checkpoint claim "
                f"(kubetrain makes it under that name when that job starts); {CLAIMS_CHECK.message}"]
    return []
