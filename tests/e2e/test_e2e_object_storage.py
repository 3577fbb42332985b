"""Object storage in real pods: data read from s3:// and checkpoints written to s3:// by jobs on the real node,
the store a real S3 server (hack/objstore) that the pods reach at the host end of the node's veth, its keys in
the Secret the chart lets jobs name (hack/values-e2e.yaml).

An FSDP2 script job of 2 nodes (examples/llm/fsdp-mlp.yaml) checkpoints its shards to the bucket with no
claim at all (no ReadWriteMany, no volume but each pod's own disk); one of its pods is SIGKILLed through
containerd after a committed save, and the group resumes from that save in the bucket and ends on the
digest of the same job run fault-free on one ReadWriteMany claim. Beside it a built-in Single job reads its
data from s3:// shards. No secret key appears in any log, status or event.
"""

from __future__ import annotations

import json
import re
import time

import pytest
import yaml
from e2elib import EXAMPLES, S3_SECRET, apply, figure, first_checkpoint, first_step, logs, on_real_node, succeeded
from objstorelib import put_digits, tree
from test_e2e_faults import sigkill

from kubetrain.trainer.objstore import ObjectURI
from kubetrain.shared import __version__

pytestmark = pytest.mark.e2e

LLM = EXAMPLES / "llm"
SHARED_CLASS = "local-path-shared"  # hack/realnode/node: ReadWriteMany
STEPS = 200  # fsdp_mlp.py's --steps; a save every 50
# 4096 samples a step per rank: about 10 s of training here, so the kill lands well after the first
# save and before the end; the same for the fault-free run, whose weights the faulted one must match.
ARGS = ["--steps", str(STEPS), "--save-every", "50", "--batch-size", "4096", "--wait-saves"]
RESUMED = re.compile(r"rank (\d+): resumed from step (\d+) at world size 2")


def fsdp_job(name: str, storage: dict) -> dict:
    doc = yaml.safe_load((LLM / "fsdp-mlp.yaml").read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["script"]["args"] = ARGS
    doc["spec"]["checkpoint"]["storage"] = storage
    return on_real_node(doc)


@pytest.fixture(scope="module")
def llm_image(custom_image):
    """`custom_image` builds and loads every example image (hack/images build --load --examples)."""
    return f"kubetrain/llm-example:{__version__}"


def test_an_fsdp_job_checkpointing_to_s3_needs_no_claim_and_resumes_a_killed_pod_with_the_fault_free_weights(
        e2e, e2e_s3, llm_image):
    bucket = e2e_s3.bucket("e2e")
    store = e2e_s3.store()
    data = put_digits(store, bucket)
    clean = fsdp_job("fsdp-clean", {"accessMode": "ReadWriteMany", "storageClassName": SHARED_CLASS})
    faulty = fsdp_job("fsdp-s3", {"uri": f"s3://{bucket}/fsdp-s3/", "secretRef": S3_SECRET})
    single = on_real_node({
        "apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "s3-single"},
        "spec": {"mode": "Single", "dataset": {"uri": data, "secretRef": S3_SECRET},
                 "training": {"epochs": 10, "batchSize": 32},
                 "checkpoint": {"intervalSteps": 100, "storage": {"uri": f"s3://{bucket}/s3-single/",
                                                                   "secretRef": S3_SECRET}}}})
    for doc in (clean, faulty, single):
        apply(e2e, doc)

    # The fault: ddp-1's container (its torchrun agent and rank, PID 1) SIGKILLed through containerd, once
    # ddp-0 has reported a committed checkpoint (in the bucket).
    saved = first_checkpoint(e2e, "fsdp-s3-ddp-0")
    step_saved = int(saved.metrics["kubetrain_last_checkpoint_step"])
    sigkill(e2e, "fsdp-s3-ddp-1")
    killed = time.monotonic()
    after = first_step(e2e, "fsdp-s3-ddp-1")

    def resumed() -> dict[int, list[int]]:
        """Each rank's "resumed from step N" lines, from both pods' logs (the killed container's and its
        successor's). Read while the restarted group trains: once the job has ended its pods go
        (cleanPodPolicy), and a read after that once found rank 0's lines and not rank 1's."""
        found: dict[int, list[int]] = {}
        for replica in ("ddp-0", "ddp-1"):
            for rank, step in RESUMED.findall(logs(e2e, f"fsdp-s3-{replica}")):
                found.setdefault(int(rank), []).append(int(step))
        return found

    printed = e2e.wait("both ranks to print where they resumed", lambda: (lambda f: f if len(f) == 2 else None)(
        resumed()), timeout=300, every=2.0)
    secret = e2e_s3.secret
    for pod in ("fsdp-s3-ddp-0", "fsdp-s3-ddp-1"):
        assert secret not in logs(e2e, pod), pod
    status = {name: succeeded(e2e, name, timeout=900) for name in ("fsdp-clean", "fsdp-s3", "s3-single")}

    # No claim: the pods stage their shards on their own disk and the bucket holds the checkpoints.
    claims = json.loads(e2e.kubectl("get", "pvc", "-l", "kubetrain.dev/job-name=fsdp-s3", "-o", "json"))["items"]
    assert claims == []
    sts = e2e.get("statefulset", "fsdp-s3-ddp")
    assert "volumeClaimTemplates" not in sts["spec"]
    assert {"name": "data", "emptyDir": {}} in sts["spec"]["template"]["spec"]["volumes"]
    assert sorted(printed) == [0, 1] and min(min(s) for s in printed.values()) >= step_saved, (printed, step_saved)
    assert status["fsdp-s3"]["progress"]["step"] == STEPS and status["fsdp-s3"]["lastCheckpoint"]["step"] == STEPS
    digests = {n: status[n]["progress"]["metrics"]["digest48"] for n in ("fsdp-clean", "fsdp-s3")}
    assert digests["fsdp-s3"] == digests["fsdp-clean"], digests
    objects = tree(store, ObjectURI(bucket, "fsdp-s3/ddp-0/"))
    commit = json.loads(store.get_bytes(ObjectURI(bucket, "fsdp-s3/ddp-0/commits/sharded-00000200.json")))
    assert commit["world_size"] == 2
    assert {k.split("/", 1)[1] for k in commit["objects"]} == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert len([k for k in objects if k.startswith("commits/")]) == 2  # keepLast 2
    assert status["s3-single"]["progress"]["evalAccuracy"] >= 0.9, status["s3-single"]
    assert any(k.startswith("single-0/commits/") for k in tree(store, ObjectURI(bucket, "s3-single/")))

    # The secret key: in no log (the FSDP pods' above), no status, no event, no object the operator wrote.
    assert secret not in logs(e2e, "s3-single-single-0")
    for what in (("get", "trainingjobs", "-o", "json"), ("get", "events", "-o", "json"),
                 ("get", "pods,statefulsets,configmaps", "-o", "json")):
        assert secret not in e2e.kubectl(*what), what
    operator_log = e2e.kube.run("logs", e2e.operator_pod(), "--tail=2000", timeout=60, check=False).stdout
    assert secret not in operator_log
    figure(f"fsdp-s3: SIGKILL of ddp-1's container through containerd after committed save {step_saved} -> first "
           f"step of the restarted group {after.at - killed:.1f} s later; resumed from {printed} in the bucket; "
           f"digest {int(digests['fsdp-s3']):012x} (fault-free on a ReadWriteMany claim {int(digests['fsdp-clean']):012x}); "
           f"s3-single from s3:// shards: accuracy {status['s3-single']['progress']['evalAccuracy']:.4f}")
