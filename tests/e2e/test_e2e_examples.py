"""The examples run for real: applied to the test cluster, trained in pods on the real node, to Succeeded."""

from __future__ import annotations

import json
import re

import pytest
from kubetrain.shared.timestamps import parse_iso
from e2elib import (
    CHIEF, EPOCHS, FAULT_FREE, HOLDER, REAL_NODE, apply, example, figure, first_step, read_claim, succeeded,
)

from helpers.jsonl import json_objects


pytestmark = pytest.mark.e2e

SHOW_CLAIM = "ls /data/checkpoints; echo ---; for f in /data/run/results/*.json; do cat $f; echo; done"
REPLICAS = {"single.yaml": {"single": 1}, "parameter-server.yaml": {"ps": 1, "worker": 2}, "ddp.yaml": {"ddp": 2}}


def logged_accuracy(e2e, results: list[dict], log_pod: str) -> float:
    """The chief's eval accuracy from its results file, else (PS: workers keep no volume) from its log."""
    for result in results:
        if "eval_accuracy" in result:
            return result["eval_accuracy"]
    found = re.findall(r"final eval accuracy ([0-9.]+)", e2e.kubectl("logs", log_pod))
    assert found, f"no result with eval_accuracy and no 'final eval accuracy' in {log_pod}'s log: {results}"
    return float(found[-1])


@pytest.mark.parametrize("manifest", ["single.yaml", "parameter-server.yaml", "ddp.yaml"],
                         ids=["single", "parameter-server", "ddp"])
def test_example_trains_to_success_on_the_real_node(e2e, manifest):
    doc = example(manifest, EPOCHS[manifest])
    job = doc["metadata"]["name"]
    holder, claim = HOLDER[manifest]

    start = apply(e2e, doc)
    first = first_step(e2e, f"{job}-{CHIEF[manifest]}")
    status = succeeded(e2e, job)

    pods = json.loads(e2e.kubectl("get", "pods", "-l", f"kubetrain.dev/job-name={job}", "-o", "json"))["items"]
    assert {p["spec"].get("nodeName") for p in pods} <= {REAL_NODE}, [p["spec"].get("nodeName") for p in pods]
    # The final figures come from the replicas' termination messages, not a scrape seconds before the end.
    progress = status["progress"]
    assert progress["step"] == progress["totalSteps"] > 0, status
    assert status["lastCheckpoint"]["step"] == progress["totalSteps"], status
    assert status.get("restarts", 0) == 0, status
    assert status["replicaStatuses"] == {role: {"active": 0, "succeeded": n, "failed": 0}
                                         for role, n in REPLICAS[manifest].items()}, status

    listing, _, results = read_claim(e2e, claim.format(job=job), SHOW_CLAIM).partition("---")
    checkpoints = sorted(listing.split())
    assert "latest" in checkpoints, checkpoints
    steps = [int(c[len("ckpt-"):-len(".pt")]) for c in checkpoints if c.startswith("ckpt-")]
    assert steps and max(steps) == progress["totalSteps"], checkpoints
    accuracy = logged_accuracy(e2e, json_objects(results), f"{job}-{CHIEF[manifest]}")
    assert progress["evalAccuracy"] == pytest.approx(accuracy, abs=1e-4), (progress, accuracy)  # the log has 4 places
    assert accuracy >= 0.9, accuracy
    FAULT_FREE[manifest] = accuracy
    figure(f"{job}: kubectl apply -> first training step {first.at - start:.1f} s; Succeeded after "
           f"{status_seconds(status):.0f} s; {progress['totalSteps']} steps; accuracy {accuracy:.4f}; "
           f"checkpoints on {claim.format(job=job)} ({holder}): {', '.join(checkpoints)}")


def status_seconds(status: dict) -> float:
    return (parse_iso(status["completionTime"]) or 0) - (parse_iso(status["startTime"]) or 0)
