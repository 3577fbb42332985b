"""The hang rule tells a job that stands still from one whose progress could not be read.

The operator reads progress in a bounded pool (drivers/cluster/scrapes.py): a read that timed out, or one
that waits its turn behind other jobs' (its last result stale), reaches the engine as PROGRESS_UNKNOWN.
Four jobs whose pods never answered once held that pool, every other job's last reading went stale,
and the engine restarted them as Hung: unknown progress must never count as no progress.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kubetrain.shared.timestamps import iso
from kubetrain.api import from_object
from kubetrain.api.status import to_dict
from kubetrain.engine.engine import PROGRESS_UNKNOWN, ProgressReading
from kubetrain.engine.reconcile import PodObservation as Pod
from kubetrain.engine.reconcile import reconcile

T0 = 1_800_000_000.0
DEADLINE = 60
PODS = {n: Pod(n, "Running") for n in ("ps-0", "worker-0", "worker-1")}


def job():
    return from_object({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob",
                        "metadata": {"name": "j", "generation": 1},
                        "spec": {"mode": "ParameterServer", "runPolicy": {"progressDeadlineSeconds": DEADLINE}}})


def stepping_at_40():
    """The job's status after a round read step 40 at T0 + 10: its hang clock runs from there."""
    act = reconcile(job(), "u", "t", PODS, {"state": "Running", "startTime": iso(T0)}, T0 + 10,
                    ProgressReading(step=40))
    assert to_dict(act.status)["restarts"] == 0
    return act.status


@dataclass
class Case:
    name: str
    progress: object  # what the driver gives the round past the deadline
    hung: bool


CASES = [
    Case("unknown: the read timed out or waits its turn", PROGRESS_UNKNOWN, hung=False),
    Case("read, and the same step: it stood still", ProgressReading(step=40), hung=True),
    Case("read, and a new step", ProgressReading(step=41), hung=False),
    Case("nothing to read (the chief answers without a step, or none runs)", None, hung=True),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_only_a_reading_or_a_known_silence_past_the_deadline_is_a_hang(case):
    act = reconcile(job(), "u", "t", PODS, stepping_at_40(), T0 + 10 + DEADLINE + 1, case.progress)
    assert ("Hung" in [e[1] for e in act.events]) is case.hung
    assert to_dict(act.status)["restarts"] == int(case.hung)


def test_a_job_whose_progress_is_unknown_for_long_past_its_deadline_is_not_hung_until_a_reading_says_so():
    status = stepping_at_40()
    for late in (DEADLINE, DEADLINE + 1, 10 * DEADLINE, 100 * DEADLINE):  # the deadline, and well past it
        act = reconcile(job(), "u", "t", PODS, status, T0 + 10 + late, PROGRESS_UNKNOWN)
        assert not act.events and to_dict(act.status)["restarts"] == 0, late
        status = act.status
    assert to_dict(status)["progress"]["step"] == 40  # what was last read stays shown
    # The read comes back: a new step, and the job trains on, its clock from there.
    act = reconcile(job(), "u", "t", PODS, status, T0 + 10 + 100 * DEADLINE + 5, ProgressReading(step=41))
    assert not act.events and to_dict(act.status)["progress"]["step"] == 41
    # Or the same step: it did stand still, for longer than its deadline, and that is a hang.
    act = reconcile(job(), "u", "t", PODS, status, T0 + 10 + 100 * DEADLINE + 5, ProgressReading(step=40))
    assert [e[1] for e in act.events] == ["Hung"]


def test_before_its_deadline_an_unknown_round_still_asks_for_the_round_at_the_deadline():
    act = reconcile(job(), "u", "t", PODS, stepping_at_40(), T0 + 10 + DEADLINE - 20, PROGRESS_UNKNOWN)
    assert not act.events
    assert act.requeue_after == pytest.approx(20)
