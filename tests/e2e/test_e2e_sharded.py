"""Sharded checkpoints in real pods: FSDP2 scripts on one ReadWriteMany claim that both nodes mount.

examples/llm/fsdp-mlp.yaml (2 nodes x 1 rank, every rank writing its own
shards) runs from the llm-example image (examples/llm/Dockerfile, FROM the
trainer image) on the real node, its claim from the real node's
ReadWriteMany class (local-path-shared: local-path's shared-filesystem mode).
Rank 1's python is SIGKILLed right after a save; the group resumes from that
save and ends on the weights of a fault-free run (the script's batches depend
on the step and the rank alone: its digest of the gathered weights must be
equal). The transformer example (examples/llm/job.yaml) trains below the
corpus's unigram entropy in the same pods.
"""

from __future__ import annotations

import json
import re
import time

import pytest
import yaml
from e2elib import (
    EXAMPLES, REAL_NODE, apply, figure, first_checkpoint, first_step, logs, on_real_node, read_files,
    sigkill_process, succeeded,
)

pytestmark = pytest.mark.e2e

LLM = EXAMPLES / "llm"
SHARED_CLASS = "local-path-shared"  # hack/realnode/node: ReadWriteMany
STEPS = 200  # fsdp_mlp.py's --steps; a save every 50
# 4096 samples a step per rank: about 10 s of training here, so the kill lands well after the first
# save and before the end; the same for the fault-free run, whose weights the faulted one must match.
ARGS = ["--steps", str(STEPS), "--save-every", "50", "--batch-size", "4096", "--wait-saves"]
RESUMED = re.compile(r"rank (\d+): resumed from step (\d+) at world size 2")


def sharded_job(name: str, manifest: str = "fsdp-mlp.yaml", args: list[str] | None = None) -> dict:
    doc = yaml.safe_load((LLM / manifest).read_text())
    doc["metadata"]["name"] = name
    if args is not None:
        doc["spec"]["script"]["args"] = args
    doc["spec"]["checkpoint"]["storage"]["storageClassName"] = SHARED_CLASS
    return on_real_node(doc)


def results(e2e, job: str) -> dict:
    """ddp-0's results (run/results/ddp-0.json) on the job's one claim."""
    text = read_files(e2e, f"{job}-ckpt-ddp", ["run/results/ddp-0.json"])["run/results/ddp-0.json"]
    return json.loads(text)


@pytest.fixture(scope="module")
def llm_image(custom_image):
    """`custom_image` builds and loads every example image (hack/images build --load --examples)."""
    return "kubetrain/llm-example:0.1.0"


def test_an_fsdp_script_on_one_shared_claim_resumes_a_killed_rank_from_its_save_with_the_fault_free_weights(
        e2e, llm_image):
    clean, faulty = sharded_job("fsdp-clean", args=ARGS), sharded_job("fsdp-fault", args=ARGS)
    apply(e2e, clean)
    apply(e2e, faulty)

    # The fault: rank 1's python, once ddp-0 has reported a committed checkpoint.
    saved = first_checkpoint(e2e, "fsdp-fault-ddp-0")
    step_saved = int(saved.metrics["kubetrain_last_checkpoint_step"])
    sigkill_process(e2e, "fsdp-fault-ddp-1", "fsdp_mlp.py")
    killed = time.monotonic()
    printed = {}
    after = first_step(e2e, "fsdp-fault-ddp-1")  # torchrun restarts the group in place: the same pod answers
    for replica in ("ddp-0", "ddp-1"):
        for rank, step in RESUMED.findall(logs(e2e, f"fsdp-fault-{replica}")):
            printed.setdefault(int(rank), []).append(int(step))

    status = {name: succeeded(e2e, name) for name in ("fsdp-clean", "fsdp-fault")}
    # One ReadWriteMany claim for the job, both pods on it, on the real node.
    claim = e2e.get("pvc", "fsdp-fault-ckpt-ddp")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"] and claim["spec"]["storageClassName"] == SHARED_CLASS
    sts = e2e.get("statefulset", "fsdp-fault-ddp")
    assert "volumeClaimTemplates" not in sts["spec"]
    assert {"name": "data", "persistentVolumeClaim": {"claimName": "fsdp-fault-ckpt-ddp"}} in \
        sts["spec"]["template"]["spec"]["volumes"]

    assert sorted(printed) == [0, 1] and min(min(s) for s in printed.values()) >= step_saved, (printed, step_saved)
    assert status["fsdp-fault"]["progress"]["step"] == STEPS and status["fsdp-fault"]["lastCheckpoint"]["step"] == STEPS
    a, b = results(e2e, "fsdp-clean"), results(e2e, "fsdp-fault")
    assert b["metrics"]["digest48"] == a["metrics"]["digest48"] and b["eval_loss"] == a["eval_loss"], (a, b)
    # The checkpoints on the claim: each a directory of both ranks' files and one COMMIT.
    files = read_files(e2e, "fsdp-fault-ckpt-ddp", ["checkpoints/latest", "checkpoints/sharded-00000200/COMMIT"])
    commit = json.loads(files["checkpoints/sharded-00000200/COMMIT"])
    assert files["checkpoints/latest"].strip() == "sharded-00000200"
    assert set(commit["files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp"} and commit["world_size"] == 2
    figure(f"fsdp-fault: SIGKILL of rank 1's fsdp_mlp.py after committed save {step_saved} -> first step of the "
           f"restarted group {after.at - killed:.1f} s later; resumed from {printed}; digest "
           f"{int(b['metrics']['digest48']):012x} (fault-free {int(a['metrics']['digest48']):012x})")


def test_the_transformer_example_trains_below_the_unigram_entropy_in_real_pods(e2e, llm_image):
    steps = 100
    doc = sharded_job("llm", "job.yaml", ["--steps", str(steps), "--save-every", "50"])
    started = apply(e2e, doc)
    status = succeeded(e2e, "llm", timeout=900)
    pods = json.loads(e2e.kubectl("get", "pods", "-l", "kubetrain.dev/job-name=llm", "-o", "json"))["items"]
    assert {p["spec"].get("nodeName") for p in pods} <= {REAL_NODE}
    found = results(e2e, "llm")
    entropy = found["metrics"]["unigram_entropy"]
    assert found["eval_loss"] < entropy - 0.3, found  # tests/local/test_llm_example.py: the same bar at 120 steps
    assert status["lastCheckpoint"]["step"] == steps, status
    figure(f"llm (Llama, FSDP2, 2 pods): {steps} steps in {time.monotonic() - started:.0f} s from kubectl apply; "
           f"eval loss {found['eval_loss']:.3f} nats/byte against a unigram entropy of {entropy:.3f}")
