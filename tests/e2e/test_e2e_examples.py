"""The examples run for real: applied to the test cluster, trained in pods on the real node, to Succeeded."""

from __future__ import annotations

import json
import re
import time

import pytest
import yaml
from e2elib import NAMESPACE, REAL_NODE, example, job_status, json_objects, read_claim, stepped

pytestmark = pytest.mark.e2e

# The examples train 10 epochs of digits in a few seconds, less than two of
# the operator's 5-second reads of the chief's /metrics: more epochs let it
# see progress and checkpoints while the job runs (Single, alone in one
# process, trains about 20k samples/s here).
EPOCHS = {"single.yaml": 300, "parameter-server.yaml": 30, "ddp.yaml": 40}
SHOW_CLAIM = "ls /data/checkpoints; echo ---; for f in /data/run/results/*.json; do cat $f; echo; done"


def final_accuracy(e2e, results: list[dict], log_pod: str) -> float:
    """The chief's eval accuracy from its results file, else (PS: workers keep no volume) from its log."""
    for result in results:
        if "eval_accuracy" in result:
            return result["eval_accuracy"]
    found = re.findall(r"final eval accuracy ([0-9.]+)", e2e.kubectl("logs", log_pod))
    assert found, f"no result with eval_accuracy and no 'final eval accuracy' in {log_pod}'s log: {results}"
    return float(found[-1])


@pytest.mark.parametrize("manifest, chief_claim, accuracy_pod", [
    ("single.yaml", "{job}-ckpt-single-0", "{job}-single-0"),
    ("parameter-server.yaml", "{job}-ckpt-ps-0", "{job}-worker-0"),
    ("ddp.yaml", "data-{job}-ddp-0", "{job}-ddp-0"),
], ids=["single", "parameter-server", "ddp"])
def test_example_trains_to_success_on_the_real_node(e2e, manifest, chief_claim, accuracy_pod):
    doc = example(manifest, EPOCHS[manifest])
    job = doc["metadata"]["name"]
    start = time.monotonic()
    e2e.cluster.run("kubectl", "-n", NAMESPACE, "apply", "-f", "-", input=yaml.safe_dump(doc))

    first = e2e.wait(f"{job} to report a training step", lambda: stepped(e2e, job), timeout=300, every=1)
    first_progress = time.monotonic() - start
    status = e2e.wait(f"{job} to succeed", lambda: (s := job_status(e2e, job)).get("state") == "Succeeded" and s,
                      timeout=600, every=2)
    elapsed = time.monotonic() - start

    pods = json.loads(e2e.kubectl("get", "pods", "-l", f"kubetrain.dev/job-name={job}", "-o", "json"))["items"]
    assert {p["spec"].get("nodeName") for p in pods} <= {REAL_NODE}, [p["spec"].get("nodeName") for p in pods]
    progress = status["progress"]
    assert 0 < first["step"] <= progress["step"] <= progress["totalSteps"], (first, progress)
    assert status["lastCheckpoint"]["step"] > 0, status
    assert status.get("restarts", 0) == 0, status

    listing, _, results = read_claim(e2e, chief_claim.format(job=job), SHOW_CLAIM).partition("---")
    checkpoints = sorted(listing.split())
    assert "latest" in checkpoints, checkpoints
    steps = [int(c[len("ckpt-"):-len(".pt")]) for c in checkpoints if c.startswith("ckpt-")]
    assert steps and max(steps) == progress["totalSteps"], checkpoints
    accuracy = final_accuracy(e2e, json_objects(results), accuracy_pod.format(job=job))
    assert accuracy >= 0.9, accuracy
    print(f"{job}: first progress after {first_progress:.0f}s, Succeeded after {elapsed:.0f}s; "
          f"progress {progress}; checkpoints {checkpoints}; accuracy {accuracy:.4f}")
