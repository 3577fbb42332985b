"""Fine-tuning a pretrained Hugging Face model in real pods (docs/fine-tuning.md): an FSDP job of 2 nodes on the
real node starts from a model in the bucket (tests/finetunelib.py's, sharded), its text in the bucket too and
its checkpoints as well (no claim). Each pod's model-init container fetches and checks the model before the
trainer starts; the job ends with a held-out loss below the pretrained model's, in its status. A job whose
model is not there fails in its init container, with the URI in the job's failure message, and no trainer
ever starts."""

from __future__ import annotations

import json

import pytest
from e2elib import NAMESPACE, S3_SECRET, apply, figure, logs, on_real_node, succeeded

import kubetrain

from kubetrain.trainer.objstore import ObjectURI

pytestmark = pytest.mark.e2e


def finetune(name: str, bucket: str, model_prefix: str) -> dict:
    return on_real_node({
        "apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name},
        "spec": {
            "mode": "DDP", "ddp": {"nodes": 2, "strategy": "FSDP"},
            "model": {"name": "causal-lm", "pretrained": f"s3://{bucket}/{model_prefix}/", "secretRef": S3_SECRET},
            "dataset": {"uri": f"s3://{bucket}/text/finetune.jsonl", "secretRef": S3_SECRET, "format": "text",
                        "sequenceLength": 64, "evalFraction": 0.1},
            "training": {"maxSteps": 30, "batchSize": 8, "maxGradNorm": 1.0, "seed": 3,
                         "optimizer": {"name": "adamw", "learningRate": 0.003, "warmupSteps": 5,
                                       "schedule": "cosine"}},
            "checkpoint": {"intervalSteps": 10, "storage": {"uri": f"s3://{bucket}/runs/{name}/",
                                                             "secretRef": S3_SECRET}},
            "runPolicy": {"cleanPodPolicy": "None"},  # the pods' logs stay to be read
        },
    })


def pretrained_loss(pretrained) -> float:
    """The held-out loss of the pretrained model on the job's held-out samples (the same text, tokenizer and
    evalFraction), by kubetrain's own model and evaluation."""
    import torch

    from kubetrain.api.spec import Dataset
    from kubetrain.trainer.causal_lm import CausalLM, load_text
    from kubetrain.trainer.models import evaluate

    dataset = Dataset(path=str(pretrained.corpus), format="text", sequence_length=64, eval_fraction=0.1)
    data = load_text(dataset, pretrained.sharded, json.loads((pretrained.sharded / "config.json").read_text()))
    model = CausalLM(pretrained.sharded, None, seed=3)
    model.materialize(torch.device("cpu"))
    return evaluate(model, data.eval_x, data.eval_y, objective=data.objective)[0]


def test_an_fsdp_fine_tune_fetches_its_model_in_an_init_container_and_lowers_the_held_out_loss(
        e2e, e2e_s3, pretrained, tmp_path):
    bucket = e2e_s3.bucket("ft")
    store = e2e_s3.store()
    for file in pretrained.sharded.iterdir():
        store.upload(file, ObjectURI(bucket, f"base/{file.name}"))
    store.upload(pretrained.corpus, ObjectURI(bucket, "text/finetune.jsonl"))
    apply(e2e, finetune("ft-fsdp", bucket, "base"))
    apply(e2e, finetune("ft-missing", bucket, "no-such-model"))

    try:
        status = succeeded(e2e, "ft-fsdp", timeout=900)
    except AssertionError:  # what the trainers said, for the failure's report
        for pod in ("ft-fsdp-ddp-0", "ft-fsdp-ddp-1"):
            init = e2e.kube.run("logs", pod, "-c", "model-init", timeout=60, check=False).stdout
            print(f"--- {pod} (model-init):\n{init[-4000:]}\n--- {pod}:\n{logs(e2e, pod)[-4000:]}")
        raise
    progress = status["progress"]
    assert progress["step"] == 30 and status["lastCheckpoint"]["step"] == 30
    # The pretrained model's held-out loss, measured here as the loop measures it at its step 0 (its log line
    # may be gone: the StatefulSet restarts a container that ended, and keeps one previous log).
    baseline = pretrained_loss(pretrained)
    assert progress["evalLoss"] < baseline - 0.02, (progress, baseline)
    assert progress.get("evalPerplexity") == pytest.approx(2.718281828 ** progress["evalLoss"], rel=1e-3), status
    pod = e2e.get("pod", "ft-fsdp-ddp-1")
    [init] = pod["status"]["initContainerStatuses"]
    assert init["name"] == "model-init" and init["state"]["terminated"]["exitCode"] == 0
    assert not json.loads(e2e.kubectl("get", "pvc", "-l", "kubetrain.dev/job-name=ft-fsdp", "-o", "json"))["items"]

    # The model out, as a Hugging Face directory, through the client's export pod (the job's credentials read
    # its checkpoints and its pretrained config and tokenizer in the bucket).
    from kubernetes import config
    from transformers import AutoModelForCausalLM

    client = kubetrain.Client(namespace=NAMESPACE,
                              api_client=config.new_client_from_config(config_file=str(e2e.cluster.kubeconfig)))
    exported = client.export("ft-fsdp", tmp_path / "hf", "huggingface")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in exported.iterdir()}
    assert AutoModelForCausalLM.from_pretrained(exported).config.model_type == "llama"

    def failed() -> dict | None:
        seen = e2e.get("trainingjob", "ft-missing").get("status") or {}
        return seen if seen.get("state") == "Failed" else None

    gone = e2e.wait("ft-missing to fail", failed, timeout=300, every=1)
    condition = next(c for c in gone["conditions"] if c["type"] == "Failed")
    uri = f"s3://{bucket}/no-such-model/"
    assert condition["reason"] == "LoadFailed" and f"{uri}: no objects under this prefix" in condition["message"], \
        condition
    for name in ("ft-missing-ddp-0", "ft-missing-ddp-1"):
        seen = e2e.kube.run("get", "pod", name, "-o", "json", timeout=60, check=False)
        if seen.returncode == 0:  # the trainer container of a pod that is left never ran
            statuses = json.loads(seen.stdout)["status"].get("containerStatuses") or []
            assert all("running" not in (c.get("state") or {}) and not c.get("restartCount") for c in statuses)
    secret = e2e_s3.secret
    for what in (("get", "trainingjobs", "-o", "json"), ("get", "pods", "-o", "json")):
        assert secret not in e2e.kubectl(*what), what
    figure(f"ft-fsdp (2 nodes, FSDP, model, text and checkpoints in the bucket): held-out loss {baseline:.4f} -> "
           f"{progress['evalLoss']:.4f}; ft-missing failed in model-init: {condition['message'][:120]}")
