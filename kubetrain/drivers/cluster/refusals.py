"""Why the installation refuses a job (`engine.Refusal`): pods beyond its pod-security allowances, a
claim of another job's, a gang no scheduler serves. The engine decides what a refusal does to the job."""

from __future__ import annotations

from kubetrain.api import TrainingJob
from kubetrain.engine import podsecurity
from kubetrain.engine.engine import Refusal
from kubetrain.engine.gang import gang_problem, policy_problems
from .state import Controller, JobState


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
    """checkpoint.storage.existingClaim naming another job's checkpoint claim, unless the installation allows
    claims (engine/podsecurity.existing_claim_problems), judged here because only the operator sees which job a
    claim belongs to: the index's view of the claims labelled as a job's."""
    claim = job.spec.checkpoint.storage.existing_claim
    holder = ctl.index.claim_holder(job.metadata.namespace, claim) if claim else None
    return podsecurity.existing_claim_problems(job, ctl.config.settings.pod_security_allow, holder)
