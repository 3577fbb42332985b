"""A job's conditions (`api.status.Condition`) as a pure function of the old list, the observed state and the time.

A merge patch replaces lists whole, so the whole list is computed here.
`lastTransitionTime` is kept when a condition's status does not change; every
condition carries the generation it was computed for.
"""

from __future__ import annotations

from dataclasses import dataclass

from kubetrain.api.status import Condition

CONDITION_TYPES = ("Created", "Running", "Restarting", "Suspended", "Succeeded", "Failed")
STATES = CONDITION_TYPES  # the state is the condition that is True, last one wins
TERMINAL = ("Succeeded", "Failed")
# Reasons that hold only while the problem lasts: once the job moves on, the
# condition they were reported on goes back to its plain reason.
PROBLEM_REASONS = frozenset({"ImagePullFailed", "VolumePending", "Unschedulable", "Forbidden", "ApiInvalid",
                             "ApiThrottled", "ApiError", "ChildConflict"})


@dataclass(frozen=True)
class Observed:
    state: str  # one of STATES
    reason: str  # CamelCase
    message: str  # a sentence a user can act on


def _true_types(state: str) -> set[str]:
    if state == "Created":
        return {"Created"}
    return {"Created", state}


def conditions(old: list[Condition] | None, observed: Observed, now: str, generation: int) -> list[Condition]:
    """The new conditions list.

    A condition appears once it has been True and stays (False) afterwards, so
    `kubectl describe` shows the job's history (Running, then Restarting, then
    Running again) without a wall of False conditions at creation.
    """
    if observed.state not in STATES:
        raise ValueError(f"unknown state {observed.state!r}; expected one of {', '.join(STATES)}")
    by_type = {c.type: c for c in old or []}
    true_types = _true_types(observed.state)
    out = []
    for ctype in CONDITION_TYPES:
        before = by_type.get(ctype)
        is_true = ctype in true_types
        if before is None and not is_true:
            continue
        status = "True" if is_true else "False"
        if ctype == observed.state:
            reason, message = observed.reason, observed.message
        elif before is not None and is_true and before.reason in PROBLEM_REASONS:
            reason, message = ctype, f"The job is {ctype.lower()}."
        elif before is not None and (before.status == status or not is_true):
            # Unchanged, or no longer true: the last reason stays readable
            # (Restarting=False, reason Killed: the last restart and why).
            reason, message = before.reason or ctype, before.message
        else:
            reason, message = ctype, f"The job is {ctype.lower()}."
        changed = before is None or before.status != status
        out.append(Condition(type=ctype, status=status, reason=reason, message=message,
                             last_transition_time=now if changed or before is None else before.last_transition_time,
                             observed_generation=generation))
    return out


def state_of(conds: list[Condition] | None) -> str | None:
    """The state recorded in a conditions list: the last True type in CONDITION_TYPES order."""
    state = None
    for c in conds or []:
        if c.status == "True" and c.type in CONDITION_TYPES:
            if state is None or CONDITION_TYPES.index(c.type) > CONDITION_TYPES.index(state):
                state = c.type
    return state
