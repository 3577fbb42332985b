"""`kubetrain validate`: every invalid manifest named by its field path, exit 2, no traceback."""

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from kubetrain.cli import main

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))


def base(mode: str = "Single") -> dict:
    return {"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "t"}, "spec": {"mode": mode}}


def with_spec(mode: str = "Single", **spec) -> dict:
    doc = base(mode)
    doc["spec"].update(spec)
    return doc


LM = {"name": "causal-lm", "pretrained": "/models/base"}
TEXT = {"path": "/data/text.jsonl", "format": "text"}


@dataclass
class Case:
    name: str
    doc: object  # a dict, or raw text
    path: str  # the field path the message must name
    words: str = ""  # text the message must contain


CASES = [
    Case("yaml syntax", "spec: [\n", "(file)", "YAML syntax error at line"),
    Case("not an object", "- 1\n- 2\n", "(document)", "must be a TrainingJob"),
    Case("wrong apiVersion", {**base(), "apiVersion": "kubeflow.org/v1"}, "apiVersion", "kubetrain.dev/v1alpha1"),
    Case("wrong kind", {**base(), "kind": "PyTorchJob"}, "kind", "TrainingJob"),
    Case("missing name", {**base(), "metadata": {}}, "metadata.name", "required"),
    Case("name not DNS-1035", {**base(), "metadata": {"name": "My_Job"}}, "metadata.name", "DNS-1035"),
    Case("name starts with digit", {**base(), "metadata": {"name": "1job"}}, "metadata.name", "DNS-1035"),
    Case("name too long", {**base(), "metadata": {"name": "a" * 50}}, "metadata.name", "at most 45"),
    Case("missing spec", {k: v for k, v in base().items() if k != "spec"}, "spec", "required"),
    Case("missing mode", {**base(), "spec": {}}, "spec.mode", "required"),
    Case("unknown mode", with_spec(mode="Horovod"), "spec.mode", "one of Single, ParameterServer, DDP"),
    Case("mode case", with_spec(mode="ddp"), "spec.mode", "did you mean 'DDP'"),
    Case("unknown top field", {**base(), "specs": {}}, "specs", "unknown field"),
    Case("unknown spec field", with_spec(trainig={}), "spec.trainig", "did you mean 'training'"),
    Case("unknown nested field", with_spec(training={"batchSzie": 4}), "spec.training.batchSzie", "did you mean 'batchSize'"),
    Case("batch size zero", with_spec(training={"batchSize": 0}), "spec.training.batchSize", "at least 1, got 0"),
    Case("batch size string", with_spec(training={"batchSize": "64"}), "spec.training.batchSize", "integer"),
    Case("batch size bool", with_spec(training={"batchSize": True}), "spec.training.batchSize", "integer"),
    Case("epochs and maxSteps", with_spec(training={"epochs": 2, "maxSteps": 10}), "spec.training", "only one of epochs, maxSteps"),
    Case("learning rate zero", with_spec(training={"optimizer": {"learningRate": 0}}), "spec.training.optimizer.learningRate", "greater than 0"),
    Case("momentum one", with_spec(training={"optimizer": {"momentum": 1.0}}), "spec.training.optimizer.momentum", "less than 1"),
    Case("unknown optimizer", with_spec(training={"optimizer": {"name": "lamb"}}), "spec.training.optimizer.name", "sgd, adam"),
    Case("unknown device", with_spec(training={"device": "tpu"}), "spec.training.device", "auto, cpu, cuda"),
    Case("model name and entrypoint", with_spec(model={"name": "mlp", "entrypoint": "a.b:c"}), "spec.model", "only one of name, entrypoint"),
    Case("model neither", with_spec(model={"args": {}}), "spec.model", "one of name, entrypoint must be set"),
    Case("unknown model", with_spec(model={"name": "resnet"}), "spec.model.name", "mlp, cnn"),
    Case("bad entrypoint", with_spec(model={"entrypoint": "not an entrypoint"}), "spec.model.entrypoint", "package.module:function"),
    Case("dataset two sources", with_spec(dataset={"name": "digits", "path": "x.npz"}), "spec.dataset", "only one of name, path, uri, entrypoint"),
    Case("dataset uri not s3", with_spec(dataset={"uri": "gs://bucket/x.npz"}), "spec.dataset.uri", "s3://BUCKET/KEY"),
    Case("dataset uri bad bucket", with_spec(dataset={"uri": "s3://B_/x"}), "spec.dataset.uri", "s3://BUCKET/KEY"),
    Case("dataset secretRef without uri", with_spec(dataset={"name": "digits", "secretRef": "s3"}), "spec.dataset.secretRef",
         "applies to a uri"),
    Case("dataset cacheSize", with_spec(dataset={"uri": "s3://bkt/d/", "cacheSize": "lots"}), "spec.dataset.cacheSize",
         "quantity"),
    Case("parquet columns without shards", with_spec(dataset={"name": "digits", "labelColumn": "y"}),
         "spec.dataset.labelColumn", "applies to Parquet shards"),
    Case("checkpoint uri and claim", with_spec(checkpoint={"storage": {"uri": "s3://bkt/c/", "existingClaim": "c"}}),
         "spec.checkpoint.storage.uri", "not both"),
    Case("checkpoint secretRef without uri", with_spec(checkpoint={"storage": {"secretRef": "s3"}}),
         "spec.checkpoint.storage.secretRef", "applies to a uri"),
    Case("two secretRefs", with_spec(dataset={"uri": "s3://bkt/d/", "secretRef": "a"},
                                     checkpoint={"storage": {"uri": "s3://bkt/c/", "secretRef": "b"}}),
         "spec.dataset.secretRef", "must name the same Secret as checkpoint.storage.secretRef"),
    Case("eval fraction", with_spec(dataset={"name": "digits", "evalFraction": 1.5}), "spec.dataset.evalFraction", "at most 0.9"),
    Case("ps block in Single", with_spec(parameterServer={"workers": 2}), "spec", "parameterServer may be set only when mode is ParameterServer"),
    Case("ddp block in PS", with_spec(mode="ParameterServer", ddp={}), "spec", "ddp may be set only when mode is DDP"),
    Case("workers zero", with_spec(mode="ParameterServer", parameterServer={"workers": 0}), "spec.parameterServer.workers", "at least 1, got 0"),
    Case("aggregation", with_spec(mode="ParameterServer", parameterServer={"aggregation": "Semi"}), "spec.parameterServer.aggregation", "Sync, Async"),
    Case("compression", with_spec(mode="ParameterServer", parameterServer={"compression": {"algorithm": "topk"}}), "spec.parameterServer.compression.algorithm", "did you mean 'TopK'"),
    Case("topk ratio", with_spec(mode="ParameterServer", parameterServer={"compression": {"ratio": 0}}), "spec.parameterServer.compression.ratio", "greater than 0"),
    Case("sync timeout", with_spec(mode="ParameterServer", parameterServer={"syncTimeoutSeconds": -1}), "spec.parameterServer.syncTimeoutSeconds", "greater than 0"),
    Case("ddp backend", with_spec(mode="DDP", ddp={"backend": "mpi"}), "spec.ddp.backend", "gloo, nccl"),
    Case("nccl on cpu", with_spec(mode="DDP", ddp={"backend": "nccl"}, training={"device": "cpu"}), "spec.ddp.backend", "nccl needs GPUs"),
    Case("ddp shared claim", with_spec(mode="DDP", checkpoint={"storage": {"existingClaim": "ckpt"}}), "spec.checkpoint.storage.accessMode", "ReadWriteMany"),
    Case("fsdp needs one volume every node reads", with_spec(mode="DDP", ddp={"strategy": "FSDP"}),
         "spec.checkpoint.storage.accessMode", "strategy FSDP writes sharded checkpoints"),
    Case("fsdp of an elastic job up to 2 nodes", with_spec(mode="DDP", ddp={"strategy": "FSDP", "nodes": 1, "maxNodes": 2}),
         "spec.checkpoint.storage.accessMode", "up to 2 nodes needs ReadWriteMany"),
    Case("fsdp has no ddp comm hook", with_spec(mode="DDP", ddp={"strategy": "FSDP", "nodes": 1, "commHook": "FP16"}),
         "spec.ddp.commHook", "use None with strategy FSDP"),
    Case("fsdp shards the built-in loop only", with_spec(mode="DDP", ddp={"strategy": "FSDP", "nodes": 1},
                                                         script={"command": ["python", "t.py"]}),
         "spec.ddp.strategy", "a script job shards its own"),
    Case("unknown strategy", with_spec(mode="DDP", ddp={"strategy": "ZeRO"}), "spec.ddp.strategy", "DDP, FSDP"),
    Case("spare groups with a node range", with_spec(mode="DDP", ddp={"minNodes": 1, "faultTolerance": {"spareGroups": 1}}),
         "spec.ddp.faultTolerance.spareGroups", "at a fixed ddp.nodes: leave ddp.minNodes and ddp.maxNodes unset"),
    Case("spare groups past the most", with_spec(mode="DDP", ddp={"faultTolerance": {"spareGroups": 17}}),
         "spec.ddp.faultTolerance.spareGroups", "at most 16, got 17"),
    Case("spare groups negative", with_spec(mode="DDP", ddp={"faultTolerance": {"spareGroups": -1}}),
         "spec.ddp.faultTolerance.spareGroups", "at least 0"),
    Case("restart policy", with_spec(restartPolicy={"policy": "Always"}), "spec.restartPolicy.policy", "OnFailure, ExitCode, Never"),
    Case("backoff negative", with_spec(restartPolicy={"backoffLimit": -1}), "spec.restartPolicy.backoffLimit", "at least 0"),
    Case("suspend string", with_spec(runPolicy={"suspend": "yes"}), "spec.runPolicy.suspend", "true or false"),
    Case("clean pod policy", with_spec(runPolicy={"cleanPodPolicy": "Some"}), "spec.runPolicy.cleanPodPolicy", "All, Running, None"),
    Case("metrics port", with_spec(metrics={"port": 70000}), "spec.metrics.port", "at most 65535"),
    Case("checkpoint interval", with_spec(checkpoint={"intervalSteps": 0}), "spec.checkpoint.intervalSteps", "at least 1"),
    Case("storage size", with_spec(checkpoint={"storage": {"size": "lots"}}), "spec.checkpoint.storage.size", "quantity"),
    Case("resources key", with_spec(resources={"worker": {"limit": {}}}), "spec.resources.worker.limit", "limits, requests"),
    Case("null mode", with_spec(mode=None), "spec.mode", "must not be null"),
]


def with_pod(spec: dict, mode: str = "Single") -> dict:
    return with_spec(mode, podTemplate={"spec": spec})


def with_trainer(name: str | None = "trainer", **container) -> dict:
    """A podTemplate whose first container is the trainer (or, without a name, merges into it)."""
    return with_pod({"containers": [{**({"name": name} if name else {}), **container}]})


PT = "spec.podTemplate.spec"
# spec.podTemplate may not take kubetrain's own names (api/podtemplate.py); the CRD's CEL says the same.
CASES += [
    Case("podTemplate volume data", with_pod({"volumes": [{"name": "data", "emptyDir": {}}]}), f"{PT}.volumes[0].name",
         "'data' is kubetrain's own volume (the checkpoint volume); choose another name"),
    Case("podTemplate volume config", with_pod({"volumes": [{"name": "ok", "emptyDir": {}}, {"name": "config", "emptyDir": {}}]}),
         f"{PT}.volumes[1].name", "'config' is kubetrain's own volume"),
    Case("podTemplate volume tmp in DDP", with_pod({"volumes": [{"name": "tmp", "emptyDir": {"medium": "Memory"}}]}, "DDP"),
         f"{PT}.volumes[0].name", "'tmp' is kubetrain's own volume"),
    Case("trainer mount name", with_trainer(volumeMounts=[{"name": "data", "mountPath": "/ckpt"}]),
         f"{PT}.containers[0].volumeMounts[0].name", "'data' is kubetrain's own volume (the checkpoint volume), which it mounts at /kubetrain/data"),
    Case("trainer mount path", with_trainer(volumeMounts=[{"name": "scratch", "mountPath": "/kubetrain/data"}]),
         f"{PT}.containers[0].volumeMounts[0].mountPath", "'/kubetrain/data' is where kubetrain mounts its own volume 'data'"),
    Case("trainer mount path with slash", with_trainer(volumeMounts=[{"name": "scratch", "mountPath": "/tmp/"}]),
         f"{PT}.containers[0].volumeMounts[0].mountPath", "'/tmp' is where kubetrain mounts its own volume 'tmp'"),
    Case("trainer mount config path", with_trainer(volumeMounts=[{"name": "cfg", "mountPath": "/etc/kubetrain"}]),
         f"{PT}.containers[0].volumeMounts[0].mountPath", "choose another mountPath"),
    Case("trainer env prefix", with_trainer(env=[{"name": "OK", "value": "1"}, {"name": "KUBETRAIN_RUN_DIR", "value": "/x"}]),
         f"{PT}.containers[0].env[1].name", "'KUBETRAIN_RUN_DIR' is set by kubetrain in the trainer container"),
    Case("trainer env HOME", with_trainer(env=[{"name": "HOME", "value": "/home/me"}]),
         f"{PT}.containers[0].env[0].name", "'HOME' is set by kubetrain"),
    Case("trainer env PYTHONSAFEPATH", with_trainer(env=[{"name": "PYTHONSAFEPATH", "value": ""}]),
         f"{PT}.containers[0].env[0].name", "'PYTHONSAFEPATH' is set by kubetrain"),
    Case("nameless container is the trainer", with_trainer(None, env=[{"name": "PYTHONUNBUFFERED", "value": "0"}]),
         f"{PT}.containers[0].env[0].name", "'PYTHONUNBUFFERED' is set by kubetrain"),
    Case("trainer second in the list", with_pod({"containers": [{"name": "side"}, {"name": "trainer", "env": [{"name": "KUBETRAIN_X"}]}]}),
         f"{PT}.containers[1].env[0].name", "'KUBETRAIN_X' is set by kubetrain"),
    Case("trainer port metrics", with_trainer(ports=[{"name": "metrics", "containerPort": 8000}]),
         f"{PT}.containers[0].ports[0].name", "'metrics' is the name of kubetrain's own port"),
    Case("trainer port grpc", with_trainer(ports=[{"name": "grpc", "containerPort": 8000}]),
         f"{PT}.containers[0].ports[0].name", "'grpc' is the name of kubetrain's own port"),
    Case("trainer port rendezvous", with_trainer(ports=[{"name": "rendezvous", "containerPort": 8000}]),
         f"{PT}.containers[0].ports[0].name", "'rendezvous' is the name of kubetrain's own port"),
    Case("podTemplate volumes not a list", with_pod({"volumes": {"name": "x"}}), f"{PT}.volumes", "must be a list, got object"),
    Case("podTemplate spec not an object", with_spec(podTemplate={"spec": ["x"]}), PT, "must be an object, got list"),
    Case("podTemplate too many volumes", with_pod({"volumes": [{"name": f"v{i}", "emptyDir": {}} for i in range(257)]}),
         f"{PT}.volumes", "at most 256 items, got 257"),
    Case("standby workers with a size", with_spec("ParameterServer", replicas=3,
                                                  parameterServer={"workers": 2, "standbyWorkers": 1}),
         "spec.replicas", "keeps the size it was created with (parameterServer.workers): leave spec.replicas unset"),
    Case("too many standby workers", with_spec("ParameterServer", parameterServer={"standbyWorkers": 9}),
         "spec.parameterServer.standbyWorkers", "at most 8"),
    Case("podTemplate env name not a string", with_trainer(env=[{"name": 5}]), f"{PT}.containers[0].env[0].name", "must be a string"),
    # Issue 31: kubetrain's own labels and annotations (the operator, the Services and the NetworkPolicy
    # find a job's pods by them), and nulls, which removed kubetrain's own values in the merge.
    Case("podTemplate label kubetrain.dev/job-name", with_spec(podTemplate={"metadata": {"labels": {
        "kubetrain.dev/job-name": "victim", "kubetrain.dev/replica": "single-0"}}}),
         "spec.podTemplate.metadata.labels", "'kubetrain.dev/job-name' is kubetrain's own"),
    Case("podTemplate label managed-by", with_spec(podTemplate={"metadata": {"labels": {
        "app.kubernetes.io/managed-by": "me"}}}), "spec.podTemplate.metadata.labels",
         "'app.kubernetes.io/managed-by' is kubetrain's own"),
    Case("podTemplate annotation kubetrain.dev/size", with_spec(podTemplate={"metadata": {"annotations": {
        "kubetrain.dev/size": "1"}}}), "spec.podTemplate.metadata.annotations", "'kubetrain.dev/size' is kubetrain's own"),
    Case("podTemplate label of a kubetrain.dev subdomain", with_spec(podTemplate={"metadata": {"labels": {
        "x.kubetrain.dev/job-name": "victim"}}}), "spec.podTemplate.metadata.labels", "is kubetrain's own"),
    Case("podTemplate too many labels", with_spec(podTemplate={"metadata": {"labels": {
        f"l{i}": "x" for i in range(257)}}}), "spec.podTemplate.metadata.labels", "at most 256 keys, got 257"),
    Case("podTemplate labels a list", with_spec(podTemplate={"metadata": {"labels": ["a"]}}),
         "spec.podTemplate.metadata.labels", "must be a map of strings to strings, got list"),
    Case("podTemplate null runAsNonRoot", with_pod({"securityContext": {"runAsNonRoot": None}}),
         f"{PT}.securityContext.runAsNonRoot", "must not be null"),
    Case("podTemplate null runAsUser", with_trainer(securityContext={"runAsUser": None}),
         f"{PT}.containers[0].securityContext.runAsUser", "must not be null"),
    Case("podTemplate null allowPrivilegeEscalation", with_trainer(securityContext={"allowPrivilegeEscalation": None}),
         f"{PT}.containers[0].securityContext.allowPrivilegeEscalation", "must not be null"),
    Case("podTemplate null automountServiceAccountToken", with_pod({"automountServiceAccountToken": None}),
         f"{PT}.automountServiceAccountToken", "must not be null: leave the field out"),
    Case("podTemplate null capabilities", with_trainer(securityContext={"capabilities": None}),
         f"{PT}.containers[0].securityContext.capabilities", "must not be null"),
    # Tenants, third pass: null anywhere in spec, not only in podTemplate.spec (a free-form field passes its
    # null on: to the pods, to the model's or dataset's code).
    Case("null limits", with_spec(resources={"worker": {"limits": None}}), "spec.resources.worker.limits",
         "must not be null: leave the field out"),
    Case("null request", with_spec(resources={"ps": {"requests": {"cpu": None}}}), "spec.resources.ps.requests.cpu",
         "must not be null"),
    Case("null in claims", with_spec(resources={"worker": {"claims": [None]}}), "spec.resources.worker.claims[0]",
         "must not be null"),
    Case("null model argument", with_spec(model={"name": "mlp", "args": {"hidden": None}}), "spec.model.args.hidden",
         "must not be null: leave the field out"),
    Case("null deep in dataset arguments", with_spec(dataset={"name": "synthetic", "args": {"x": {"y": [1, None]}}}),
         "spec.dataset.args.x.y[1]", "must not be null"),
    Case("null template labels", with_spec(podTemplate={"metadata": {"labels": None}}),
         "spec.podTemplate.metadata.labels", "must not be null"),
    Case("null template annotation", with_spec(podTemplate={"metadata": {"annotations": {"a": None}}}),
         "spec.podTemplate.metadata.annotations.a", "must be a string, got null"),  # as the API server says it
    Case("null template metadata", with_spec(podTemplate={"metadata": None}), "spec.podTemplate.metadata",
         "must not be null"),
    Case("null minResources", with_spec(runPolicy={"schedulingPolicy": {"minResources": {"cpu": None}}}),
         "spec.runPolicy.schedulingPolicy.minResources.cpu", "must not be null"),
    # Issue 42: fine-tuning a pretrained causal LM.
    Case("causal-lm without pretrained", with_spec(model={"name": "causal-lm"}, dataset=TEXT),
         "spec.model.pretrained", "fine-tunes a pretrained model"),
    Case("pretrained on mlp", with_spec(model={"name": "mlp", "pretrained": "/m"}), "spec.model.pretrained",
         "applies to name causal-lm"),
    Case("causal-lm on tensors", with_spec(model=LM, dataset={"path": "/d.jsonl"}), "spec.dataset.format",
         "set format text, chat or prompt-completion"),
    Case("chat for mlp", with_spec(dataset={"path": "/d.jsonl", "format": "chat"}), "spec.dataset.format",
         "chat is tokenized for model causal-lm"),
    Case("chat without a source", with_spec(model=LM, dataset={"name": "digits", "format": "chat"}),
         "spec.dataset.format", "chat reads documents from a path or uri"),
    Case("messagesColumn on text", with_spec(model=LM, dataset={**TEXT, "messagesColumn": "turns"}),
         "spec.dataset.messagesColumn", "applies to format chat, got format text"),
    Case("chatTemplate on prompt-completion", with_spec(model=LM, dataset={
        "path": "/d.jsonl", "format": "prompt-completion", "chatTemplate": "{{ messages }}"}),
         "spec.dataset.chatTemplate", "applies to format chat, got format prompt-completion"),
    Case("promptColumn on chat", with_spec(model=LM, dataset={"path": "/d.jsonl", "format": "chat",
                                                              "promptColumn": "q"}),
         "spec.dataset.promptColumn", "applies to format prompt-completion, got format chat"),
    Case("trainOn on text", with_spec(model=LM, dataset={**TEXT, "trainOn": "all"}), "spec.dataset.trainOn",
         "applies to format chat or prompt-completion, got format text"),
    Case("trainOn unknown", with_spec(model=LM, dataset={"path": "/d.jsonl", "format": "chat", "trainOn": "user"}),
         "spec.dataset.trainOn", "assistant, all"),
    Case("one column for prompt and completion", with_spec(model=LM, dataset={
        "path": "/d.jsonl", "format": "prompt-completion", "completionColumn": "prompt"}),
         "spec.dataset.completionColumn", "must differ from promptColumn ('prompt')"),
    Case("text for mlp", with_spec(dataset=TEXT), "spec.dataset.format", "tokenized for model causal-lm"),
    Case("text without a source", with_spec(model=LM, dataset={"name": "digits", "format": "text"}),
         "spec.dataset.format", "reads documents from a path or uri"),
    Case("causal-lm with mse", with_spec(model=LM, dataset=TEXT, training={"loss": "mse"}), "spec.training.loss",
         "next-token cross entropy"),
    Case("causal-lm args", with_spec(model={**LM, "args": {"hidden": 4}}, dataset=TEXT), "spec.model.args",
         "takes its architecture from the pretrained config.json"),
    Case("lora without causal-lm", with_spec(training={"lora": {"rank": 4}}), "spec.training.lora",
         "set model.name causal-lm"),
    Case("lora rank zero", with_spec(model=LM, dataset=TEXT, training={"lora": {"rank": 0}}),
         "spec.training.lora.rank", "at least 1"),
    Case("causal-lm in a parameter server", with_spec("ParameterServer", model=LM, dataset=TEXT),
         "spec.model.name", "fine-tunes in mode Single or DDP"),
    Case("cosine on a parameter server", with_spec("ParameterServer", training={"optimizer": {"schedule": "cosine"}}),
         "spec.training.optimizer.schedule", "applies to modes Single and DDP"),
    Case("accumulation past the batch", with_spec(training={"batchSize": 4, "gradientAccumulationSteps": 8}),
         "spec.training.gradientAccumulationSteps", "at most batchSize (4), got 8"),
    Case("sequence too short", with_spec(model=LM, dataset={**TEXT, "sequenceLength": 4}),
         "spec.dataset.sequenceLength", "at least 8"),
    Case("pretrained bad scheme", with_spec(model={"name": "causal-lm", "pretrained": "gs://b/m"}, dataset=TEXT),
         "spec.model.pretrained", "pvc://CLAIM/PATH, s3://BUCKET/PREFIX/ or hf://ORG/NAME"),
    Case("pretrained secretRef for a path", with_spec(model={**LM, "secretRef": "creds"}, dataset=TEXT),
         "spec.model.secretRef", "applies to an s3:// pretrained"),
    Case("three secrets", with_spec(model={"name": "causal-lm", "pretrained": "s3://bucket/m/", "secretRef": "a"},
                                    dataset={**TEXT, "path": None, "uri": "s3://bucket/t/", "secretRef": "b"}),
         "spec.model.secretRef", "must name the same Secret as dataset.secretRef"),
    # Tenants, fourth pass (issue 58): a claim's model stays inside its claim, a copied model within its bound,
    # kubetrain's container names are kubetrain's in every list, another job's claim is not a job's existingClaim.
    Case("pretrained claim path out of the claim", with_spec(
        model={"name": "causal-lm", "pretrained": "pvc://models/llama/../../../../proc/self"}, dataset=TEXT),
         "spec.model.pretrained", "without '.', '..' or empty segments ('//'): the pods read KUBETRAIN_MODEL_DIR "
         "under the claim's mount, never beside it, got 'pvc://models/llama/../../../../proc/self'"),
    Case("pretrained claim path absolute", with_spec(
        model={"name": "causal-lm", "pretrained": "pvc://models//etc"}, dataset=TEXT),
         "spec.model.pretrained", "got 'pvc://models//etc'"),
    Case("pretrained claim name past 253", with_spec(
        model={"name": "causal-lm", "pretrained": f"pvc://{'m' * 300}/llama"}, dataset=TEXT),
         "spec.model.pretrained", "the claim's name (pvc://CLAIM) must be at most 253 characters, a DNS-1123 "
         "subdomain, got 300 characters"),
    Case("model disk past the most", with_spec(
        model={"name": "causal-lm", "pretrained": "s3://bucket/m/", "diskSize": "2Ti"}, dataset=TEXT),
         "spec.model.diskSize", "must be a quantity from 1Mi to 1Ti, got '2Ti'"),
    Case("model disk zero", with_spec(
        model={"name": "causal-lm", "pretrained": "s3://bucket/m/", "diskSize": "0"}, dataset=TEXT),
         "spec.model.diskSize", "must be a quantity from 1Mi to 1Ti, got '0'"),
    Case("model disk no quantity", with_spec(
        model={"name": "causal-lm", "pretrained": "s3://bucket/m/", "diskSize": "big"}, dataset=TEXT),
         "spec.model.diskSize", "expected a quantity such as 20Gi"),
    Case("template container named model-init", with_pod({"containers": [{"name": "model-init", "image": "x"}]}),
         f"{PT}.containers[0].name", "'model-init' is the name of kubetrain's own init container"),
    Case("template init container named trainer", with_pod({"initContainers": [{"name": "trainer", "image": "x"}]}),
         f"{PT}.initContainers[0].name", "'trainer' is the name of kubetrain's trainer container"),
    Case("existing claim named as another job's", with_spec(checkpoint={"storage": {"existingClaim": "victim-ckpt-single-0"}}),
         "spec.checkpoint.storage.existingClaim", "'victim-ckpt-single-0' is named as job victim's checkpoint claim "
         "(kubetrain makes it under that name when that job starts); PersistentVolumeClaims besides the job's own are "
         "not allowed (the cluster's kubetrain installation allows this with podSecurity.allow: [claims])"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_invalid_manifest_is_rejected_with_its_field_path(case, tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text(case.doc if isinstance(case.doc, str) else yaml.safe_dump(case.doc))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(f"{path}: {case.path}: ")]
    assert lines, f"no message names {case.path}:\n{err}"
    assert any(case.words in line for line in lines), err
    assert "Traceback" not in err


def test_all_problems_are_reported_at_once(tmp_path, capsys):
    doc = with_spec(training={"batchSize": 0, "epochs": -1, "optimizer": {"name": "x"}}, metrics={"port": -2})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main(["validate", str(path)]) == 2
    paths = {line.split(": ")[1] for line in capsys.readouterr().err.splitlines()}
    assert paths == {"spec.training.batchSize", "spec.training.epochs", "spec.training.optimizer.name", "spec.metrics.port"}


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_examples_are_valid(example, capsys):
    assert main(["validate", str(example)]) == 0
    assert capsys.readouterr().out.strip().endswith("ok")


def test_validate_command_exits_2_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(with_spec(training={"batchSize": 0})))
    proc = subprocess.run(
        [sys.executable, "-m", "kubetrain.cli", "validate", str(bad), str(tmp_path / "missing.yaml")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert f"{bad}: spec.training.batchSize: must be at least 1, got 0" in proc.stderr
    assert f"{tmp_path / 'missing.yaml'}: (file): no such file" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_defaults_are_filled():
    from kubetrain.api import from_object

    job = from_object(with_spec(mode="ParameterServer"))
    assert job.spec.parameter_server.workers == 2
    assert job.spec.parameter_server.compression.algorithm == "None"
    assert job.spec.training.epochs == 10
    assert job.spec.ddp is None
    assert from_object(with_spec(mode="DDP")).spec.ddp.nodes == 2


def test_a_pod_template_may_add_volumes_init_containers_and_sidecars(tmp_path, capsys):
    """Only the trainer's mounts, variables and ports can collide; a sidecar and an init container use any names."""
    doc = with_pod({
        "initContainers": [{"name": "fetch", "image": "busybox", "env": [{"name": "HOME", "value": "/x"}],
                            "volumeMounts": [{"name": "dataset", "mountPath": "/tmp"}]}],
        "volumes": [{"name": "dataset", "emptyDir": {}}],
        "containers": [
            {"name": "trainer", "env": [{"name": "DATASET_DIR", "value": "/dataset"}],
             "volumeMounts": [{"name": "dataset", "mountPath": "/dataset"}, {"name": "dataset", "mountPath": "/tmp/cache"}],
             "ports": [{"name": "profiler", "containerPort": 6006}, {"containerPort": 7000}]},
            {"name": "uploader", "env": [{"name": "KUBETRAIN_JOB_NAME", "value": "x"}],
             "volumeMounts": [{"name": "data", "mountPath": "/kubetrain/data", "readOnly": True}],
             "ports": [{"name": "metrics", "containerPort": 9100}]},
        ],
    })
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main(["validate", str(path)]) == 0, capsys.readouterr().err


def test_every_pod_template_collision_is_reported_at_once(tmp_path, capsys):
    doc = with_pod({"volumes": [{"name": "data"}, {"name": "tmp"}],
                    "containers": [{"name": "trainer", "env": [{"name": "HOME"}], "ports": [{"name": "grpc"}]}]})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main(["validate", str(path)]) == 2
    paths = {line.split(": ")[1] for line in capsys.readouterr().err.splitlines()}
    assert paths == {f"{PT}.volumes[0].name", f"{PT}.volumes[1].name", f"{PT}.containers[0].env[0].name",
                     f"{PT}.containers[0].ports[0].name"}


def test_a_null_where_the_reference_has_an_optional_field_means_unset():
    """The one null kubetrain reads: an optional field's (the CRD marks it nullable; the API server keeps it).
    Everywhere else a null is refused (CASES above), as the API server drops or refuses one in a field its
    schema declares (tests/cluster/test_api.py)."""
    from kubetrain.api import from_object

    job = from_object(with_spec("DDP", ddp={"nodes": 2, "minNodes": None},
                                runPolicy={"activeDeadlineSeconds": None, "schedulingPolicy": {"minAvailable": None,
                                                                                              "minResources": None}}))
    assert job.spec.run_policy.active_deadline_seconds is None
    assert job.spec.run_policy.scheduling_policy.min_available is None
    assert job.spec.run_policy.scheduling_policy.min_resources is None


def test_a_modes_required_sections_are_there_once_complete_and_their_absence_is_named():
    from kubetrain.api.load import from_spec_dict

    ddp = from_spec_dict("j", {"mode": "DDP", "ddp": {"nodes": 2}}).spec
    assert ddp.require_ddp().nodes == 2 and ddp.require_training().batch_size > 0
    with pytest.raises(ValueError, match=r"spec\.ddp\.faultTolerance is missing"):
        ddp.require_fault_tolerance()
    single = from_spec_dict("j", {"mode": "Single"}).spec
    with pytest.raises(ValueError, match=r"spec\.ddp is missing, and a DDP job has it"):
        single.require_ddp()
    with pytest.raises(ValueError, match=r"spec\.parameterServer is missing"):
        single.require_parameter_server()
    ps = from_spec_dict("j", {"mode": "ParameterServer"}).spec
    assert ps.require_parameter_server().replicas >= 1
