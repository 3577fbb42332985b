"""Restart policy: observed failures and counters in, restart or fail out."""

from dataclasses import dataclass

import pytest

from kubetrain.api import from_object
from kubetrain.engine.policy import Counters, Failure, backoff, decide, job_outcome, workers_done


def spec(**restart):
    doc = {"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "t"},
           "spec": {"mode": "Single", "restartPolicy": restart}}
    return from_object(doc).spec


@dataclass
class Case:
    name: str
    restart: dict
    failure: Failure
    counters: Counters
    progressed: bool
    action: str
    reason: str


CASES = [
    Case("transient restarts", {}, Failure("w", 75), Counters(), True, "restart", "TransientError"),
    Case("sigkill restarts", {}, Failure("w", -9), Counters(), True, "restart", "Killed"),
    Case("sigterm exit 143 restarts", {}, Failure("w", 143), Counters(), True, "restart", "Signaled"),
    Case("generic error restarts on OnFailure", {}, Failure("w", 1), Counters(), True, "restart", "Error"),
    Case("invalid config is permanent", {}, Failure("w", 2), Counters(), True, "fail", "InvalidConfiguration"),
    Case("load failure is permanent", {}, Failure("w", 3), Counters(), True, "fail", "LoadFailed"),
    Case("ExitCode retries 75", {"policy": "ExitCode"}, Failure("w", 75), Counters(), True, "restart", "TransientError"),
    Case("ExitCode retries signals", {"policy": "ExitCode"}, Failure("w", 137), Counters(), True, "restart", "Killed"),
    Case("ExitCode refuses 1", {"policy": "ExitCode"}, Failure("w", 1), Counters(), True, "fail", "Error"),
    Case("Never refuses", {"policy": "Never"}, Failure("w", 75), Counters(), True, "fail", "TransientError"),
    Case("eviction restarts", {}, Failure("w", None, "Evicted"), Counters(), True, "restart", "Evicted"),
    Case("hang restarts", {}, Failure("w", None, "Hung"), Counters(), True, "restart", "Hung"),
    Case("backoff limit", {"backoffLimit": 2}, Failure("w", 75), Counters(2, 0), True, "fail", "BackoffLimitExceeded"),
    Case("within backoff limit", {"backoffLimit": 3}, Failure("w", 75), Counters(2, 0), True, "restart", "TransientError"),
    Case("no progress budget spent", {"maxRestartsWithoutProgress": 2}, Failure("w", 75), Counters(2, 2), False, "fail", "NoProgress"),
    Case("progress resets the budget", {"maxRestartsWithoutProgress": 2}, Failure("w", 75), Counters(2, 2), True, "restart", "TransientError"),
    Case("zero budget fails the first restart without progress", {"maxRestartsWithoutProgress": 0}, Failure("w", 75), Counters(), False, "fail", "NoProgress"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_decide(case):
    decision, after = decide(spec(**case.restart), case.failure, case.counters, case.progressed)
    assert (decision.action, decision.reason) == (case.action, case.reason)
    assert decision.message.startswith("w ")
    if case.action == "restart":
        assert after.restarts == case.counters.restarts + 1
        expected = 0 if case.progressed else case.counters.restarts_without_progress + 1
        assert after.restarts_without_progress == expected
        assert decision.delay_seconds == backoff(after.restarts)
    else:
        assert after == case.counters


def test_backoff_doubles_and_is_capped():
    assert [backoff(n) for n in (1, 2, 3, 4, 5)] == [0.0, 1.0, 2.0, 4.0, 8.0]
    assert backoff(30) == 60.0


def test_failure_messages_name_the_signal():
    assert Failure("ps-0", -9).describe() == "ps-0 was killed by SIGKILL"
    assert Failure("ps-0", 137).describe() == "ps-0 was killed by SIGKILL"
    assert Failure("worker-1", 3).describe() == "worker-1 exited with code 3"


def test_job_succeeds_when_every_replica_finished():
    assert job_outcome({"ps-0": "Running", "worker-0": "Succeeded"}) == "Running"
    assert job_outcome({"ps-0": "Succeeded", "worker-0": "Succeeded"}) == "Succeeded"
    assert workers_done({"ps-0": "Running", "worker-0": "Succeeded", "worker-1": "Succeeded"})
    assert not workers_done({"ps-0": "Running", "worker-0": "Succeeded", "worker-1": "Running"})
