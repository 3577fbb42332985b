"""Why the installation refuses a job (`engine.Refusal`): pods beyond its pod-security allowances, a
claim of another job's, a gang no scheduler serves. The engine decides what a refusal does to the job."""

from __future__ import annotations

import re

from kubetrain.api import TrainingJob
from kubetrain.api.podtemplate import SECURITY_CHECKS
from kubetrain.engine import podsecurity
from kubetrain.engine.engine import Refusal
from kubetrain.engine.gang import gang_problem, policy_problems
from .state import Controller, JobState

CLAIMS_CHECK = next(c for c in SECURITY_CHECKS if c.allowance == "claims")
CHECKPOINT_CLAIM = re.compile(r"(?P<job>.+)-ckpt-(?:single-0|ps-[0-9]+|ddp)|data-(?P<node>.+)-ddp-[0-9]+")
"""The names kubetrain gives a job's checkpoint claims: `<job>-ckpt-<replica>` (engine/children.claim_name:
Single's, each shard's, a DDP job's shared one) and `data-<job>-ddp-<n>` (a DDP node's, made by its
StatefulSet from the claim template `data`)."""


def refusal(ctl: Controller, job: TrainingJob, state: JobState) -> Refusal | None:
    """Why the installation refuses the job, if it does: pods beyond its pod-security allowances (the
    chart's admission policy refuses these at the API; a cluster without it still gets no such pod), a
    PodGroup priority or Volcano queue it does not let jobs name (engine/gang.policy_problems), or
    a gang no scheduler of the cluster serves (its pods, without their PodGroup, would be scheduled one
    by one: the gang the job asked for would not hold, so none is made)."""
    settings = ctl.config.settings
    refused = (pod_security(ctl, job, state) + claim_problems(ctl, job)
               + policy_problems(job, settings.pod_security_allow, settings.volcano_queues))
    if refused:
        return Refusal("PodSecurity", "; ".join(refused))
    unserved = gang_problem(job, ctl.config.settings.gang_schedulers)
    if unserved:
        return Refusal("GangSchedulingDisabled", unserved)
    return None


def pod_security(ctl: Controller, job: TrainingJob, state: JobState) -> list[str]:
    """The pod-security refusals of the pods the job would create (engine/podsecurity.py), judged once
    per generation of its spec: rendering every pod of a large job each round would cost more than
    the rest of the round."""
    if job.spec.run_policy.suspend:
        # Nothing is rendered for a suspended job (Kueue suspends a queued one): it creates no pod, and a
        # tenant's suspended jobs must cost the operator nothing. Unsuspending changes the spec (a new
        # generation), and the round that starts its pods judges them first.
        return []
    key = (job.metadata.uid, job.metadata.generation)
    if state.pod_security is None or state.pod_security[0] != key:
        state.pod_security = (key, podsecurity.problems(job, ctl.config.settings))
    return state.pod_security[1]


def claim_problems(ctl: Controller, job: TrainingJob) -> list[str]:
    """checkpoint.storage.existingClaim naming another job's checkpoint claim (the pods would mount its
    checkpoints, to read them or to write over them) is refused unless the installation allows claims:
    the same allowance as a claim in the template (api/podtemplate.py), judged here because only the
    operator sees which job a claim belongs to. Another job's is one labelled as that job's (the index's
    view), or one named as kubetrain names that job's claims (CHECKPOINT_CLAIM), whether it exists yet
    or not; a job's own name's claims (kept from an earlier job of its name) stay its to name."""
    claim = job.spec.checkpoint.storage.existing_claim
    if not claim or "claims" in ctl.config.settings.pod_security_allow:
        return []
    holder = ctl.index.claim_holder(job.metadata.namespace, claim)
    if holder is not None and holder != job.name:
        return [f"spec.checkpoint.storage.existingClaim: {claim!r} is job {holder}'s checkpoint claim; "
                f"{CLAIMS_CHECK.message}"]
    # By its name too, whether or not it exists: a job could name the victim's claim before the victim
    # started, wait Pending for it, and mount it once kubetrain made it for the victim.
    named = checkpoint_claim_job(claim)
    if named is not None and named != job.name:
        return [f"spec.checkpoint.storage.existingClaim: {claim!r} is named as job {named}'s checkpoint claim "
                f"(kubetrain makes it under that name when that job starts); {CLAIMS_CHECK.message}"]
    return []


def checkpoint_claim_job(claim: str) -> str | None:
    """The job whose checkpoint claim `claim` is named as (CHECKPOINT_CLAIM); None for any other name."""
    found = CHECKPOINT_CLAIM.fullmatch(claim)
    return None if found is None else found["job"] or found["node"]
