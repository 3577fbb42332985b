"""Sharded checkpoints in real pods: the transformer example (examples/llm/job.yaml, a Llama decoder with
FSDP2, 2 nodes x 1 rank, every rank writing its own shards) on one ReadWriteMany claim that both nodes mount,
from the llm-example image (examples/llm/Dockerfile, FROM the trainer image) on the real node, its claim from
the real node's ReadWriteMany class (local-path-shared: local-path's shared-filesystem mode); it trains below
the corpus's unigram entropy. An FSDP script killed in its pod and resumed from its sharded save, with its
checkpoints in object storage and no claim at all, is tests/e2e/test_e2e_object_storage.py's.
"""

from __future__ import annotations

import json
import time

import pytest
import yaml
from e2elib import EXAMPLES, REAL_NODE, apply, figure, on_real_node, read_files, succeeded
from kubetrain.shared import __version__

pytestmark = pytest.mark.e2e

LLM = EXAMPLES / "llm"
SHARED_CLASS = "local-path-shared"  # hack/realnode/node: ReadWriteMany


def sharded_job(name: str, manifest: str, args: list[str] | None = None) -> dict:
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
    return f"kubetrain/llm-example:{__version__}"


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
