"""Why the installation refuses a job (`engine.Refusal`): pods beyond its pod-security allowances, a
claim of another job's, a gang no scheduler serves. The engine decides what a refusal does to the job."""

from __future__ import annotations

from ..api import TrainingJob
from ..api.podtemplate import SECURITY_CHECKS
from ..core import podsecurity
from ..core.engine import Refusal
from ..core.gang import gang_problem
from .state import Controller, JobState

CLAIMS_CHECK = next(c for c in SECURITY_CHECKS if c.allowance == "claims")


def refusal(ctl: Controller, job: TrainingJob, state: JobState) -> Refusal | None:
    """Why the installation refuses the job, if it does: pods beyond its pod-security allowances (the
    chart's admission policy refuses these at the API; a cluster without it still gets no such pod), or
    a gang no scheduler of the cluster serves (its pods, without their PodGroup, would be scheduled one
    by one: the gang the job asked for would not hold, so none is made)."""
    refused = pod_security(ctl, job, state) + claim_problems(ctl, job)
    if refused:
        return Refusal("PodSecurity", "; ".join(refused))
    unserved = gang_problem(job, ctl.config.settings.gang_schedulers)
    if unserved:
        return Refusal("GangSchedulingDisabled", unserved)
    return None


def pod_security(ctl: Controller, job: TrainingJob, state: JobState) -> list[str]:
    """The pod-security refusals of the pods the job would create (core/podsecurity.py), judged once
    per generation of its spec: rendering every pod of a large job each round would cost more than
    the rest of the round."""
    key = (job.metadata.uid, job.metadata.generation)
    if state.pod_security is None or state.pod_security[0] != key:
        state.pod_security = (key, podsecurity.problems(job, ctl.config.settings))
    return state.pod_security[1]


def claim_problems(ctl: Controller, job: TrainingJob) -> list[str]:
    """checkpoint.storage.existingClaim naming another job's checkpoint claim (the pods would mount its
    checkpoints, to read them or to write over them) is refused unless the installation allows claims:
    the same allowance as a claim in the template (api/podtemplate.py), judged here because only the
    operator sees which job a claim belongs to."""
    claim = job.spec.checkpoint.storage.existing_claim
    if not claim or "claims" in ctl.config.settings.pod_security_allow:
        return []
    holder = ctl.index.claim_holder(job.metadata.namespace, claim)
    if holder is None or holder == job.name:
        return []
    return [f"spec.checkpoint.storage.existingClaim: {claim!r} is job {holder}'s checkpoint claim; "
            f"{CLAIMS_CHECK.message}"]
