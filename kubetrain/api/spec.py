"""The TrainingJob API (`kubetrain.dev/v1alpha1`): one typed description of every field.

Field names are the contract of DESIGN.md. The local backend, the operator,
the CRD schema (`crd.py`) and the reference docs all read these classes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from . import quantity
from .podtemplate import pod_template_problems
from .schema import AtMostOne, ExactlyOne, Excludes, OnlyWhen, field

GROUP = "kubetrain.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "TrainingJob"
PLURAL = "trainingjobs"

Mode = Literal["Single", "ParameterServer", "DDP"]
MODES: tuple[str, ...] = ("Single", "ParameterServer", "DDP")

ENTRYPOINT_PATTERN = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*"
ENTRYPOINT_HINT = "expected 'package.module:function'"
QUANTITY_PATTERN = r"[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?"
DNS1123_PATTERN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
# An object-storage URI: s3://BUCKET[/KEY], the bucket as S3 names it (3-63 lower-case letters, digits, dots and
# hyphens); the trainer's objstore.parse_uri checks the same and the key's parts.
OBJECT_URI_PATTERN = r"s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?"
OBJECT_URI_HINT = "expected s3://BUCKET/KEY"
OBJECT_URI_MAX = 1100  # s3:// + a 63-byte bucket + a 1,024-byte key
# spec.model.pretrained: a local path, a claim's path, an object-storage prefix or a Hub name.
PRETRAINED_PATTERN = r"(s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/.*)?|hf://[^/]+/[^/]+|[^:]+)"
PRETRAINED_HINT = "expected a path, pvc://CLAIM/PATH, s3://BUCKET/PREFIX/ or hf://ORG/NAME"
MAX_CLAIM_NAME = 253
"""A claim's name is a DNS-1123 subdomain: at most 253 characters (the API server refuses a longer one only when
the pod is made, after the job was accepted)."""
PVC_CLAIM_MESSAGE = f"the claim's name (pvc://CLAIM) must be at most {MAX_CLAIM_NAME} characters, a DNS-1123 subdomain"
PVC_PATH_MESSAGE = ("the path inside the claim (pvc://CLAIM/PATH) must name a directory of the claim without '.', "
                    "'..' or empty segments ('//'): the pods read KUBETRAIN_MODEL_DIR under the claim's mount, never "
                    "beside it")
# spec.model.diskSize: the local disk an s3:// or hf:// model's copy may take.
MODEL_DISK_DEFAULT = "20Gi"
"""A 7-8 B model in 16-bit weights (Llama 3.1 8B: 15 GiB of safetensors) and its tokenizer, with room; a larger
model names its own size."""
MODEL_DISK_MIN = "1Mi"
"""Room for config.json and a tokenizer at the least: below it no model fits, and an emptyDir's sizeLimit must be
more than zero."""
MODEL_DISK_MAX = "1Ti"
"""A node's local disk is the kubelet's root filesystem, shared by every pod on the node: 1Ti holds a 405 B model
in 16-bit weights (about 760 GiB) and is past what most nodes' disks hold; a larger model is copied to no node,
it is read from a claim (pvc://) where it lies."""
DISK_SIZE_MESSAGE = f"must be a quantity from {MODEL_DISK_MIN} to {MODEL_DISK_MAX}"


def pvc_problems(uri: str) -> list[str]:
    """What is wrong with a pvc://CLAIM/PATH pretrained model's claim name and path (PVC_CLAIM_MESSAGE,
    PVC_PATH_MESSAGE, each with the value); empty when both are sound. A trailing '/' is allowed."""
    claim, _, path = uri.removeprefix("pvc://").partition("/")
    problems = []
    if len(claim) > MAX_CLAIM_NAME:
        problems.append(f"{PVC_CLAIM_MESSAGE}, got {len(claim)} characters")
    segments = path.split("/")
    if any(s in (".", "..") for s in segments) or "" in segments[:-1]:
        problems.append(f"{PVC_PATH_MESSAGE}, got {_short(uri)}")
    return problems


def disk_size_problem(value: str) -> str | None:
    """DISK_SIZE_MESSAGE with the value when spec.model.diskSize is no quantity within its bounds; else None."""
    try:
        amount = quantity.parse(value)
    except quantity.QuantityError:
        return f"{DISK_SIZE_MESSAGE}, got {_short(value)}"
    if not quantity.parse(MODEL_DISK_MIN) <= amount <= quantity.parse(MODEL_DISK_MAX):
        return f"{DISK_SIZE_MESSAGE}, got {_short(value)}"
    return None


def _short(value: str) -> str:
    text = repr(value)
    return text if len(text) <= 120 else f"{text[:100]}... ({len(value)} characters)"


SECRET_REF_DOC = (
    "A Secret of the job's namespace holding the store's credentials under the keys every S3 tool reads: "
    "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, and optionally AWS_SESSION_TOKEN, AWS_REGION and "
    "AWS_ENDPOINT_URL (a store that is not AWS). They reach only this job's pods, as environment variables "
    "(never the operator, a log or the status). The cluster's kubetrain installation names the Secrets jobs may "
    "use (the chart's objectStorage.secrets). Cluster only: `kubetrain run` takes the AWS_* variables of its "
    "own environment."
)


def secret_ref_field(when: str) -> Any:
    """A secretRef field: the name of the Secret holding the store's AWS_* keys, `when` it applies."""
    return field(f"{SECRET_REF_DOC} {when}", "", pattern=DNS1123_PATTERN, pattern_hint="expected a DNS-1123 name",
                 max_length=253)


BUILTIN_LOSSES: tuple[str, ...] = ("crossEntropy", "mse", "l1", "smoothL1", "bceWithLogits")
LOSS_PATTERN = "(" + "|".join(BUILTIN_LOSSES) + ")|" + ENTRYPOINT_PATTERN
# Script jobs: a command line is short; these bound what a manifest may carry.
MAX_SCRIPT_ARGS = 256
# Names a script may report with kubetrain.report(step, name=value) as labelled
# series and in status.progress.metrics: a bound on the series (and the status
# size) an untrusted script can create. Further names stay in its event log only.
MAX_REPORTED_METRICS = 32
# Standby workers of a ParameterServer job: each is an idle pod (a worker's resources, torch loaded) that
# only takes over a failed worker; a few cover the failures that come at once, more only cost capacity.
MAX_STANDBY_WORKERS = 8
# What the operator may render for one job: the template's size (its JSON) times the pods it is merged
# into. A template is merged into every pod the operator makes (a ParameterServer job's shards, workers and
# standbys; a Single job's pod; a DDP job's StatefulSet template and its Lighthouse pod, one each however
# many nodes). A 107 KB template (64 sidecars of 40 variables) times a job of 1,096 pods was 117 MB of
# JSON and 647 MiB in the operator, past its 512 Mi limit: one tenant's job crash-looped the operator for
# every tenant. At 8 MiB, the worst template (small variables, each a dict) cost 57 MiB to render all
# 1,096 pods of a new job once; at 4 MiB, 37 MiB (traced by tracemalloc; tests/api/test_rendered_size.py
# measures a round). Rounds of several jobs render side by side only within one budget
# (drivers/cluster/budget.RENDER_BUDGET_BYTES). It allows a 3.8 KB template on a 1,096-pod job, 40 KB on 100
# pods (real templates: 1-4 KB).
MAX_RENDERED_TEMPLATE_BYTES = 4 * 1024 * 1024
# format text: the longest sample. Attention's memory grows with its square; a model's own limit
# (max_position_embeddings) is checked against sequenceLength when its config is read.
MAX_SEQUENCE_LENGTH = 131072
LM_FORMATS: tuple[str, ...] = ("text", "chat", "prompt-completion")
"""The dataset formats of model causal-lm: documents tokenized with the pretrained model's tokenizer."""
ANSWER_FORMATS: tuple[str, ...] = ("chat", "prompt-completion")
"""The formats whose records have answers (dataset.trainOn)."""
MAX_CHAT_TEMPLATE_LENGTH = 65536
"""dataset.chatTemplate: real templates are 1-15 KB (Llama 3.1's 4.6 KB, Qwen 2.5's 2.5 KB); four times the
largest is room, while the job stays far under the API server's 1.5 MB object limit."""
SCRIPT_MODEL_MESSAGE = ("applies to a script job only as a pretrained model to fetch ({name: causal-lm, pretrained: "
                        "URI}): the script builds its own model, from KUBETRAIN_MODEL_DIR")
SPARE_RANGE_MESSAGE = ("ddp.faultTolerance.spareGroups: spare groups stand in for lost ones at a fixed ddp.nodes: "
                       "leave ddp.minNodes and ddp.maxNodes unset, or set spareGroups 0 to resize the job")
STANDBY_SIZE_MESSAGE = ("replicas: a job with parameterServer.standbyWorkers keeps the size it was created with "
                        "(parameterServer.workers): leave spec.replicas unset; kubectl scale does not apply")


@dataclass
class Model:
    """The model to train: a built-in name or a user entry point."""

    __rules__ = (ExactlyOne(("name", "entrypoint")),)

    name: Literal["mlp", "cnn", "causal-lm"] | None = field(
        "Built-in model: mlp or cnn (classifiers and regressors of dataset's features), or causal-lm (a "
        "pretrained Hugging Face causal language model, fine-tuned on dataset format text, chat or "
        "prompt-completion; needs pretrained; "
        "docs/fine-tuning.md).", None)
    pretrained: str | None = field(
        "causal-lm: the Hugging Face model directory to start from (config.json, *.safetensors with or without "
        "model.safetensors.index.json, tokenizer files; an optional SHA256SUMS is checked): a local path "
        "(`kubetrain run`; relative to its working directory, as dataset.path), pvc://CLAIM/PATH (a claim of the job's "
        "namespace, cluster only), s3://BUCKET/PREFIX/ (credentials as dataset.uri's) or hf://ORG/NAME (the "
        "Hugging Face Hub; not tested). Fetched and checked once before training starts; every replica reads "
        "the same files.",
        None, max_length=OBJECT_URI_MAX, pattern=PRETRAINED_PATTERN, pattern_hint=PRETRAINED_HINT,
    )
    secret_ref: str = secret_ref_field("With an s3:// pretrained only.")
    disk_size: str = field(
        "s3:// and hf:// pretrained: the most local disk the model's copy may take (per pod, or per local run). "
        "In a pod its `model` volume is bounded to it (the emptyDir's sizeLimit) and the pod requests that much "
        "ephemeral-storage beside the trainer's own, so the scheduler places it where the disk is and the kubelet "
        f"evicts the pod, not its neighbours, past it. A model larger than this fails before the download, with "
        f"both sizes named (exit 3). From {MODEL_DISK_MIN} to {MODEL_DISK_MAX}: a model past that belongs on a "
        "claim (pvc://), read where it lies rather than copied to every pod's node.",
        MODEL_DISK_DEFAULT, pattern=QUANTITY_PATTERN, pattern_hint="expected a quantity such as 20Gi",
        max_length=quantity.MAX_LENGTH, since="0.2.0",
    )
    entrypoint: str | None = field(
        "User model factory 'package.module:function'; it is called with `args` as keyword "
        "arguments plus `input_shape` (one sample's shape) and, with training.loss crossEntropy, "
        "`num_classes`: it returns a torch.nn.Module mapping (N, *input_shape) to (N, num_classes). "
        "With any other loss it gets `output_shape` instead of `num_classes`, the shape of one "
        "sample's target ((1,) when y is 1-D), and the module maps (N, *input_shape) to "
        "(N, *output_shape). Imported from the manifest's directory by `kubetrain run`, from the "
        "image's working directory or installed packages in a cluster.",
        None,
        pattern=ENTRYPOINT_PATTERN,
        pattern_hint=ENTRYPOINT_HINT,
    )
    args: dict[str, Any] = field(
        "Keyword arguments for the model (mlp: hidden, layers; cnn: channels, hidden).",
        default_factory=dict,
    )

    def check(self) -> list[tuple[str, str]]:
        problems = []
        if self.name == "causal-lm" and not self.pretrained:
            problems.append(("pretrained", "causal-lm fine-tunes a pretrained model: name its Hugging Face "
                                           "directory (a path, pvc://, s3:// or hf://)"))
        if self.pretrained and self.name != "causal-lm":
            problems.append(("pretrained", f"applies to name causal-lm, got {self.name or self.entrypoint!r}"))
        if self.secret_ref and not (self.pretrained or "").startswith("s3://"):
            problems.append(("secretRef", "applies to an s3:// pretrained (the credentials of its store)"))
        if self.name == "causal-lm" and self.args:
            problems.append(("args", "causal-lm takes its architecture from the pretrained config.json: drop args"))
        if (self.pretrained or "").startswith("pvc://"):
            problems += [("pretrained", message) for message in pvc_problems(self.pretrained or "")]
        problem = disk_size_problem(self.disk_size)
        if problem is not None:
            problems.append(("diskSize", problem))
        return problems

    @property
    def disk_bytes(self) -> int:
        """diskSize in bytes (validated: within MODEL_DISK_MIN and MODEL_DISK_MAX), rounded up to a whole byte."""
        return math.ceil(quantity.parse(self.disk_size))


@dataclass
class Dataset:
    """The data to train on: a built-in name, an .npz file, or a user entry point."""

    __rules__ = (ExactlyOne(("name", "path", "uri", "entrypoint")),)

    name: Literal["digits", "synthetic"] | None = field(
        "Built-in dataset: digits (scikit-learn's bundled 8x8 digits) or synthetic "
        "(seeded classification data; args: samples, features, classes, seed).",
        None,
    )
    path: str | None = field(
        "An .npz file holding arrays `x` (features) and `y` (integer labels); or a directory of shards (.npz "
        "files, or Parquet files with feature and label columns), read as a `uri` prefix is.", None)
    uri: str | None = field(
        "Data in object storage: s3://BUCKET/KEY.npz (one object, read as `path` reads a file) or "
        "s3://BUCKET/PREFIX/ (shards: .npz or Parquet objects). Shards are streamed: each rank reads the shards "
        "of its own samples (every epoch deals whole shards to the ranks), a few ahead of the one it trains on, "
        "into a local cache of at most cacheSize; the data position is part of every checkpoint. Credentials: "
        "the AWS_* variables locally, secretRef in a cluster (docs/object-storage.md).",
        None, pattern=OBJECT_URI_PATTERN, pattern_hint=OBJECT_URI_HINT, max_length=OBJECT_URI_MAX,
    )
    secret_ref: str = secret_ref_field("With uri only.")
    cache_size: str = field(
        "Local disk the shards of a uri prefix or a path directory may take (per pod, or per local run): the "
        "shards used least recently go first. At least a few shards' size; the cache is read again, not "
        "downloaded again, in later epochs only when it holds every shard a rank reads.",
        "10Gi", pattern=QUANTITY_PATTERN, pattern_hint="expected a quantity such as 10Gi",
    )
    label_column: str = field("Parquet shards: the column of the labels (targets).", "label", max_length=256)
    feature_columns: list[str] = field(
        "Parquet shards: the feature columns, in order (numeric scalars, or one fixed-size list column); "
        "empty: every column but labelColumn.", default_factory=list, max_items=4096, max_length=256,
    )
    entrypoint: str | None = field(
        "User dataset 'package.module:function'; called with `args` as keyword arguments, "
        "it returns (x, y) arrays.",
        None,
        pattern=ENTRYPOINT_PATTERN,
        pattern_hint=ENTRYPOINT_HINT,
    )
    args: dict[str, Any] = field("Keyword arguments for the dataset.", default_factory=dict)
    eval_fraction: float = field(
        "Fraction of the samples held out for evaluation (of shards: that fraction of the shards, whole; of text: "
        "that fraction of the token samples, the last ones).",
        0.2, minimum=0.0, maximum=0.9
    )
    format: Literal["tensors", "text", "chat", "prompt-completion"] = field(
        "tensors: arrays of features and labels (x, y; Parquet columns). text: documents for model causal-lm, "
        "from path or uri: JSON Lines files (.jsonl, one record per line with a textColumn field), Parquet files "
        "(a textColumn column) or plain text files (.txt, .md: one record per file), tokenized with the "
        "pretrained model's tokenizer. chat: conversations for model causal-lm (JSON Lines or Parquet, a "
        "messagesColumn of {role, content} turns), rendered with the tokenizer's chat template. "
        "prompt-completion: pairs for model causal-lm (JSON Lines or Parquet, a promptColumn and a "
        "completionColumn). chat and prompt-completion train on the answers only (trainOn; "
        "docs/fine-tuning.md).", "tensors",
    )
    text_column: str = field("format text: the field (JSON Lines) or column (Parquet) holding each record's "
                             "text.", "text", max_length=256)
    sequence_length: int = field(
        "format text, chat and prompt-completion: tokens per training sample (chat and prompt-completion: a "
        "longer record is cut to it, keeping its start).", 512, minimum=8, maximum=MAX_SEQUENCE_LENGTH)
    packing: bool = field(
        "format text: true packs the records' tokens end to end (an end-of-sequence token between records) and "
        "cuts them into samples of sequenceLength, so no position is padding; false gives one sample per record, "
        "cut at sequenceLength and padded (padding is neither attended to nor trained on). chat and "
        "prompt-completion: true puts whole records side by side in a sample while they fit (none is split), "
        "each with its own positions, and no token attends across a record's boundary; false gives one padded "
        "sample per record.", True)
    messages_column: str = field(
        "format chat: the field (JSON Lines) or column (Parquet) holding each conversation: a list of turns, "
        "each {role, content} (system, user, assistant, as OpenAI's and Hugging Face's chat formats hold them).",
        "messages", max_length=256, since="0.2.0")
    prompt_column: str = field("format prompt-completion: the field or column holding each record's prompt.",
                               "prompt", max_length=256, since="0.2.0")
    completion_column: str = field(
        "format prompt-completion: the field or column holding each record's completion (the answer).",
        "completion", max_length=256, since="0.2.0")
    chat_template: str = field(
        "format chat: a Jinja chat template (as a tokenizer's chat_template) to render the conversations with; "
        "empty: the pretrained tokenizer's own, or the model directory's chat_template.jinja when the tokenizer "
        "has none.", "", max_length=MAX_CHAT_TEMPLATE_LENGTH, since="0.2.0")
    train_on: Literal["assistant", "all"] = field(
        "format chat and prompt-completion: which tokens carry the loss (training and the held-out loss). "
        "assistant: the assistant turns (chat, each with the template's end of its turn) or the completion "
        "and its end-of-sequence token (prompt-completion); system and user turns, prompts and the template's "
        "own text between turns do not. all: every token.", "assistant", since="0.2.0")

    def check(self) -> list[tuple[str, str]]:
        problems = []
        if self.secret_ref and self.uri is None:
            problems.append(("secretRef", "applies to a uri (the credentials of its store); set uri or drop it"))
        if self.uri is None and self.path is None and (self.feature_columns or self.label_column != "label"):
            problems.append(("labelColumn" if self.label_column != "label" else "featureColumns",
                             "applies to Parquet shards (a uri or path); set one or drop it"))
        if self.label_column in self.feature_columns:
            problems.append(("featureColumns", f"must not hold labelColumn ({self.label_column!r})"))
        if self.format in LM_FORMATS and self.path is None and self.uri is None:
            problems.append(("format", f"{self.format} reads documents from a path or uri: set one"))
        for name, value, formats in (("messagesColumn", self.messages_column != "messages", ("chat",)),
                                     ("chatTemplate", bool(self.chat_template), ("chat",)),
                                     ("promptColumn", self.prompt_column != "prompt", ("prompt-completion",)),
                                     ("completionColumn", self.completion_column != "completion",
                                      ("prompt-completion",)),
                                     ("trainOn", self.train_on != "assistant", ANSWER_FORMATS)):
            if value and self.format not in formats:
                problems.append((name, f"applies to format {' or '.join(formats)}, got format {self.format}"))
        if self.format == "prompt-completion" and self.prompt_column == self.completion_column:
            problems.append(("completionColumn", f"must differ from promptColumn ({self.prompt_column!r})"))
        return problems


@dataclass
class Optimizer:
    """The optimizer; in ParameterServer mode it runs on the parameter servers."""

    name: Literal["sgd", "adam", "adamw"] = field(
        "sgd, adam (weight decay added to the gradient) or adamw (decoupled weight decay, the usual choice for "
        "fine-tuning).", "sgd")
    learning_rate: float = field("Learning rate (the peak, with warmupSteps and schedule).", 0.05, minimum=0.0,
                                 exclusive_minimum=True)
    momentum: float = field("SGD momentum.", 0.9, minimum=0.0, maximum=1.0, exclusive_maximum=True)
    weight_decay: float = field("Weight decay (sgd and adam: L2; adamw: decoupled).", 0.0, minimum=0.0)
    warmup_steps: int = field("Steps over which the learning rate rises linearly from 0 to learningRate.", 0,
                              minimum=0)
    schedule: Literal["constant", "cosine"] = field(
        "The learning rate after the warm-up: constant, or cosine (decays to 0 at the run's last step). A "
        "function of the step alone, so a resumed run continues it exactly.", "constant")


@dataclass
class Lora:
    """Low-rank adapters (LoRA) on a causal-lm's linear layers, through peft."""

    rank: int = field("The adapters' rank r.", 8, minimum=1, maximum=4096)
    alpha: float = field("The scale numerator: an adapter's output is multiplied by alpha / rank.", 16.0,
                         minimum=0.0, exclusive_minimum=True)
    dropout: float = field("Dropout on an adapter's input.", 0.0, minimum=0.0, maximum=1.0,
                           exclusive_maximum=True)
    target_modules: list[str] = field(
        "Names (the last part) of the linear layers that get adapters, e.g. [q_proj, v_proj]; empty: peft's "
        "default for the model's architecture.", default_factory=list, max_items=256, max_length=256)


@dataclass
class Training:
    """How long and how to train."""

    __rules__ = (AtMostOne(("epochs", "max_steps")),)

    epochs: int | None = field(
        "Passes over the training data (10 when neither epochs nor maxSteps is set).",
        None,
        minimum=1,
        maximum=100000,
    )
    max_steps: int | None = field(
        "Optimizer steps to run, instead of epochs. In ParameterServer mode a step is one "
        "update of the parameters; each worker runs maxSteps / workers of them in Sync mode.",
        None,
        minimum=1,
    )
    batch_size: int = field("Samples per step, per worker or rank.", 64, minimum=1, maximum=65536)
    optimizer: Optimizer = field("The optimizer.", default_factory=Optimizer)
    seed: int = field("Seed of every random choice: initial weights, shuffling, data.", 0, minimum=0)
    device: Literal["auto", "cpu", "cuda"] = field(
        "auto uses a visible GPU when there is one; cuda fails when none is visible.", "auto"
    )
    loss: str = field(
        "The loss: crossEntropy (integer class labels; accuracy is reported too), mse, l1, smoothL1, "
        "bceWithLogits (float targets of the model's output shape), or a user entry point "
        "'package.module:function' returning a callable loss(output, target) -> scalar tensor.",
        "crossEntropy",
        pattern=LOSS_PATTERN,
        pattern_hint="expected " + ", ".join(BUILTIN_LOSSES) + " or 'package.module:function'",
    )
    gradient_accumulation_steps: int = field(
        "Micro-batches each step's batch is split into, forward and backward one at a time, their gradients "
        "summed before the one optimizer step: the same step with 1/N of the activation memory.", 1,
        minimum=1, maximum=1024)
    max_grad_norm: float | None = field(
        "Clip the gradients to this global L2 norm before each optimizer step; unset: no clipping.", None,
        minimum=0.0, exclusive_minimum=True)
    precision: Literal["fp32", "bf16"] = field(
        "fp32, or bf16: forward and backward under bfloat16 autocast (weights, gradients and optimizer state stay "
        "float32). On CPUs bf16 is emulated where the CPU lacks it, and slower.", "fp32")
    lora: Lora | None = field(
        "model causal-lm: train low-rank adapters (LoRA, through peft) instead of every weight; the pretrained "
        "weights stay frozen, and checkpoints hold only the adapter and its optimizer state.", None)

    def check(self) -> list[tuple[str, str]]:
        if self.gradient_accumulation_steps > self.batch_size:
            return [("gradientAccumulationSteps", f"splits each batch into micro-batches: at most batchSize "
                                                  f"({self.batch_size}), got {self.gradient_accumulation_steps}")]
        return []

    @property
    def effective_epochs(self) -> int | None:
        if self.epochs is None and self.max_steps is None:
            return 10
        return self.epochs


@dataclass
class Compression:
    """Gradient compression between workers and parameter servers."""

    algorithm: Literal["None", "FP16", "Int8", "TopK", "PowerSGD"] = field(
        "None, FP16, Int8 (scaled), TopK (with error feedback) or PowerSGD (with error feedback).",
        "None",
    )
    ratio: float = field(
        "TopK: fraction of the elements sent.", 0.01, minimum=0.0, maximum=1.0, exclusive_minimum=True
    )
    rank: int = field("PowerSGD: rank of the low-rank approximation.", 2, minimum=1, maximum=64)
    min_tensor_bytes: int = field(
        "Tensors smaller than this travel uncompressed.", 65536, minimum=0
    )
    warmup_steps: int = field(
        "Steps at the start of training that run without compression.", 0, minimum=0
    )


@dataclass
class ParameterServer:
    """The parameter-server topology (mode ParameterServer only)."""

    replicas: int = field(
        "Parameter-server shards; parameters are balanced across them by bytes.",
        1,
        minimum=1,
        maximum=64,
        immutable=True,
    )
    workers: int = field("Worker replicas.", 2, minimum=1, maximum=1024, immutable=True)
    standby_workers: int = field(
        "Standby workers: processes with torch imported, connected to ps-0, that take a failed worker's place "
        "the moment its process dies (a fraction of a second, where a new pod takes seconds); the failed "
        "pod is replaced as always and its replacement waits as the next standby. Never the chief's place "
        "(worker-0). Each costs a worker's resources while it waits (docs/parameter-server.md#standby-workers).",
        0, minimum=0, maximum=MAX_STANDBY_WORKERS, immutable=True,
    )
    aggregation: Literal["Sync", "Async"] = field(
        "Sync averages every live worker's gradient per step; Async applies gradients as they arrive.",
        "Sync",
    )
    max_staleness: int = field(
        "Async: a worker waits when it is this many steps ahead of the slowest.", 4, minimum=0
    )
    sync_timeout_seconds: float = field(
        "Sync: a worker silent this long is dropped from the step.",
        30.0,
        minimum=0.0,
        exclusive_minimum=True,
    )
    compression: Compression = field("Gradient compression.", default_factory=Compression)


# Fault-tolerant DDP (spec.ddp.faultTolerance): the Lighthouse's and each replica group's timings.
# A group's torchft Manager heartbeats the Lighthouse every 100 ms (torchft's default): a heartbeat
# timeout below FT_MIN_HEARTBEAT_SECONDS would drop groups that are alive. Above FT_MAX_TIMEOUT_SECONDS
# a lost group would stall the others longer than restarting them all from a checkpoint takes.
FT_MIN_HEARTBEAT_SECONDS = 0.2
FT_MAX_HEARTBEAT_SECONDS = 60.0
FT_MAX_TIMEOUT_SECONDS = 3600.0
FT_MAX_SPARE_GROUPS = 16
"""The most spare replica groups: each takes part in every step's average (its traffic, in the ring of every
group) while it trains nothing; more than a few stand by for losses that come together."""
FT_PORT = 29510
"""The port the Lighthouse listens on in a pod (torchft's own examples use 29510)."""


@dataclass
class FaultTolerance:
    """Per-step fault tolerance across DDP nodes (torchft): each node is a replica group that trains on
    when another dies; see docs/operating.md#fault-tolerant-ddp."""

    min_replicas: int = field(
        "Replica groups (DDP nodes) that must take part in a step for it to commit; with fewer alive the "
        "others wait (the Lighthouse's min_replicas). At most ddp.nodes (ddp.minNodes for an elastic job).",
        1, minimum=1, maximum=1024,
    )
    heartbeat_timeout_seconds: float = field(
        "A replica group whose heartbeats stop this long is out of the quorum, and the others go on "
        "without it at their next step (measured here: 1.06-1.10 s from a kill to the survivors' next "
        "committed step at 1 s). Groups heartbeat every 0.1 s: a timeout near that drops groups that "
        "are only slow for a moment (a long garbage collection, a loaded node).",
        1.0, minimum=FT_MIN_HEARTBEAT_SECONDS, maximum=FT_MAX_HEARTBEAT_SECONDS,
    )
    join_timeout_seconds: float = field(
        "How long the Lighthouse waits for a group that heartbeats but has not asked to join yet (one "
        "still setting up) before it forms a quorum without it; that group joins at a later step.",
        5.0, minimum=0.0, maximum=FT_MAX_TIMEOUT_SECONDS,
    )
    quorum_timeout_seconds: float = field(
        "How long a group waits for a quorum (fewer than minReplicas groups alive, the Lighthouse "
        "unreachable) before it gives up and exits 75 (retried: it is restarted as any replica is).",
        60.0, minimum=1.0, maximum=FT_MAX_TIMEOUT_SECONDS,
    )
    spare_groups: int = field(
        "Replica groups started beside ddp.nodes that train nothing while every group is there: each takes "
        "part in every step's average with nothing of its own, so it holds the same model and optimizer, "
        "and when a group is lost it trains from the next step on (about heartbeatTimeoutSeconds after the "
        "loss, no start, no heal). The groups with the lowest indices train; a lost group's replacement "
        "takes its place back once it has healed, and the spare stands by again. A spare is a pod like the "
        "others (resources, Kueue's quota). Not with an elastic node range (ddp.minNodes, ddp.maxNodes).",
        0, minimum=0, maximum=FT_MAX_SPARE_GROUPS,
    )
    timeout_seconds: float = field(
        "How long a group waits for a peer in a step's gradient average, its commit vote, and a healing "
        "transfer of the model from a peer, before the step is discarded. A peer that is killed fails "
        "them at once; this bounds a peer that hangs or is cut off.",
        60.0, minimum=1.0, maximum=FT_MAX_TIMEOUT_SECONDS,
    )


@dataclass
class DDP:
    """The torchrun data-parallel topology (mode DDP only)."""

    nodes: int = field("Nodes (pods) in the group.", 2, minimum=1, maximum=1024, immutable=True)
    procs_per_node: int = field("Ranks per node.", 1, minimum=1, maximum=64, immutable=True)
    backend: Literal["gloo", "nccl"] = field("gloo on CPUs, nccl on GPUs.", "gloo")
    strategy: Literal["DDP", "FSDP"] = field(
        "How the built-in loop spreads the model over the ranks: DDP (a whole replica on every rank, gradients "
        "averaged) or FSDP (FSDP2: every layer, then the model, sharded across the ranks, gradients "
        "reduce-scattered; checkpoints sharded, every rank writing its own shards, so a job of several nodes "
        "needs checkpoint.storage.accessMode ReadWriteMany, or checkpoint.storage.uri). With faultTolerance, "
        "FSDP shards the model over each replica group's procsPerNode ranks and the groups replicate it (HSDP); "
        "every group writes its own sharded checkpoints on its own volume. Script jobs shard their own model.",
        "DDP", immutable=True,
    )
    comm_hook: Literal["None", "FP16", "PowerSGD"] = field(
        "DDP communication hook: None, FP16 or PowerSGD (torch's built-in hooks); strategy DDP only.", "None"
    )
    power_sgd_rank: int = field(
        "PowerSGD hook: matrix approximation rank.", 2, minimum=1, maximum=64, name="powerSGDRank"
    )
    max_restarts: int = field(
        "torchrun --max-restarts: group restarts before giving up (not with faultTolerance: a lost replica "
        "group's node is replaced alone).", 3, minimum=0)
    min_nodes: int | None = field(
        "Elastic jobs: the fewest nodes spec.replicas (`kubectl scale`) may ask for; unset: nodes.",
        None, minimum=1, maximum=1024, immutable=True,
    )
    max_nodes: int | None = field(
        "Elastic jobs: the most nodes spec.replicas (`kubectl scale`) may ask for; unset: nodes.",
        None, minimum=1, maximum=1024, immutable=True,
    )

    fault_tolerance: FaultTolerance | None = field(
        "Per-step fault tolerance (torchft); present turns it on (`faultTolerance: {}` takes the defaults). "
        "Each node is then a replica group of procsPerNode ranks: a group that dies costs the others about "
        "heartbeatTimeoutSeconds instead of a restart of every rank from the last checkpoint; its "
        "replacement copies the model and optimizer from a live group, not from a checkpoint, and "
        "`kubectl scale` adds or removes groups without stopping the others. A Lighthouse pod (a local "
        "process under `kubetrain run`) forms the quorum. Checkpoints remain for the loss of every group.",
        None,
    )

    @property
    def groups(self) -> int:
        """The nodes (pods) the job runs: ddp.nodes, and the spare replica groups of a fault-tolerant job."""
        return self.nodes + (self.fault_tolerance.spare_groups if self.fault_tolerance is not None else 0)

    @property
    def node_range(self) -> tuple[int, int]:
        """The sizes spec.replicas may take: [minNodes, maxNodes], each nodes when unset."""
        low = self.min_nodes if self.min_nodes is not None else self.nodes
        high = self.max_nodes if self.max_nodes is not None else self.nodes
        return low, high


@dataclass
class Resources:
    """corev1 ResourceRequirements per role (cluster only)."""

    ps: dict[str, Any] = field("Resources of each parameter server.", default_factory=dict)
    worker: dict[str, Any] = field(
        "Resources of each worker (and standby worker), of the Single replica and of each DDP node.",
        default_factory=dict,
    )

    def check(self) -> list[tuple[str, str]]:
        problems = []
        for role in ("ps", "worker"):
            for key, value in getattr(self, role).items():
                if key in ("limits", "requests"):
                    # Read here, once: the gang sums (engine/gang.py) add them up in every round.
                    problems += quantity.map_problems(value, f"{role}.{key}")
                elif key != "claims":
                    problems.append((f"{role}.{key}", "unknown field; expected limits, requests or claims"))
        return problems


@dataclass
class Storage:
    """Where the checkpoints are kept: a volume (cluster only: the claim's settings), or object storage (uri)."""

    size: str = field(
        "Size of the PVC.", "1Gi", pattern=QUANTITY_PATTERN, pattern_hint="expected a quantity such as 1Gi"
    )
    storage_class_name: str = field("StorageClass of the PVC; empty uses the default class.", "")
    access_mode: Literal["ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod"] = field(
        "Access mode of the PVC.", "ReadWriteOnce"
    )
    existing_claim: str = field(
        "Use this PVC instead of creating one.",
        "",
        pattern=DNS1123_PATTERN,
        pattern_hint="expected a DNS-1123 name",
        max_length=253,
    )
    when_deleted: Literal["Delete", "Retain"] = field(
        "What happens to the checkpoint claims the operator created when the job is deleted: Delete "
        "them with the job, or Retain them (no owner reference) so the checkpoints can be copied off "
        "or exported afterwards (as a StatefulSet's persistentVolumeClaimRetentionPolicy.whenDeleted). "
        "Objects at a uri are never deleted with the job: the bucket is yours (a lifecycle rule expires them).",
        "Delete",
    )
    uri: str = field(
        "Checkpoints in object storage instead of a claim: s3://BUCKET/PREFIX/, this job's own prefix (each "
        "replica writes under PREFIX/<replica>/; a DDP group under ddp-0/). No claim is made: each pod stages its "
        "checkpoints on its own disk (an emptyDir), uploads them in the background and writes one commit object "
        "per checkpoint once every object is up and checked, so a sharded (FSDP) job of several nodes needs no "
        "ReadWriteMany claim. size, storageClassName, accessMode and existingClaim do not apply. Credentials: the "
        "AWS_* variables locally, secretRef in a cluster (docs/object-storage.md).",
        "", pattern=OBJECT_URI_PATTERN, pattern_hint=OBJECT_URI_HINT, max_length=OBJECT_URI_MAX,
    )
    secret_ref: str = secret_ref_field("With uri only.")

    def check(self) -> list[tuple[str, str]]:
        problems = []
        if self.uri and self.existing_claim:
            problems.append(("uri", "checkpoints go to a uri or to a claim (existingClaim), not both"))
        if self.secret_ref and not self.uri:
            problems.append(("secretRef", "applies to a uri (the credentials of its store); set uri or drop it"))
        return problems


@dataclass
class Checkpoint:
    """Checkpoints, owned by the system: written atomically, resumed on every start."""

    interval_steps: int = field("Steps between checkpoints.", 50, minimum=1)
    keep_last: int = field("Checkpoints kept; older ones are deleted.", 3, minimum=1, maximum=1000)
    storage: Storage = field("Where checkpoints are kept: a claim (cluster only), or object storage (uri).",
                             default_factory=Storage)


@dataclass
class RestartPolicy:
    """What happens when a replica fails."""

    policy: Literal["OnFailure", "ExitCode", "Never"] = field(
        "OnFailure retries every failure; ExitCode retries exit 75 and signals (128+N) only; "
        "Never fails the job at the first failure.",
        "OnFailure",
    )
    backoff_limit: int = field("Restarts allowed in total.", 6, minimum=0)
    max_restarts_without_progress: int = field(
        "Consecutive restarts that saw no new checkpoint before the job fails.", 3, minimum=0
    )


GANG_SCHEDULERS: tuple[str, ...] = ("volcano", "scheduler-plugins")
# Fields only one scheduler's PodGroup holds: (attribute, YAML name, that scheduler).
SCHEDULER_ONLY_FIELDS = (
    ("queue", "queue", "volcano"),
    ("priority_class", "priorityClass", "volcano"),
    ("schedule_timeout_seconds", "scheduleTimeoutSeconds", "scheduler-plugins"),
)


@dataclass
class SchedulingPolicy:
    """Gang scheduling: a PodGroup for Volcano or the scheduler-plugins coscheduling plugin
    (cluster only; names as Kubeflow's RunPolicy.SchedulingPolicy). See docs/scheduling.md."""

    gang_scheduler: Literal["volcano", "scheduler-plugins"] | None = field(
        "The scheduler that reads the job's PodGroup: volcano (scheduling.volcano.sh/v1beta1) or "
        "scheduler-plugins (the coscheduling plugin's scheduling.x-k8s.io/v1alpha1). Unset: the first "
        "one the operator is started with (`--gang-scheduler`, the chart's gangScheduling); a job naming "
        "one the operator does not serve fails with GangSchedulingDisabled.",
        None,
    )
    min_available: int | None = field(
        "Pods that must be placed together before any starts (the PodGroup's minMember); default: all "
        "of the job's pods (Single 1, ParameterServer replicas + workers, DDP nodes).",
        None,
        minimum=1,
    )
    queue: str = field(
        "Volcano: the queue the PodGroup waits in, one the cluster's kubetrain installation lets jobs name (the "
        "chart's gangScheduling.volcano.queues; none by default: a queue is a team's share of the cluster). Empty: "
        "Volcano's own default queue.",
        "",
        pattern=DNS1123_PATTERN,
        pattern_hint="expected a DNS-1123 name",
        max_length=253,
    )
    min_resources: dict[str, Any] | None = field(
        "Resources the gang needs before any pod starts (the PodGroup's minResources), e.g. {cpu: 4, "
        "memory: 8Gi}, quantities as spec.resources takes them; "
        "default: the sum of the requests of the first minAvailable pods (parameter servers first).",
        None,
    )
    priority_class: str = field(
        "Volcano: PriorityClass of the PodGroup (its priorityClassName), the order in which Volcano "
        "takes (and preempts) gangs; as the pods' own podTemplate.spec.priorityClassName, only where the "
        "cluster's kubetrain installation allows it (podSecurity.allow: [priorityClass]).",
        "",
        pattern=DNS1123_PATTERN,
        pattern_hint="expected a DNS-1123 name",
        max_length=253,
    )
    schedule_timeout_seconds: int | None = field(
        "scheduler-plugins: how long the coscheduling plugin waits for the whole gang before it "
        "gives up on this attempt and retries (the PodGroup's scheduleTimeoutSeconds).",
        None,
        minimum=1,
        maximum=2**31 - 1,
    )

    def check(self) -> list[tuple[str, str]]:
        problems = []
        problems += quantity.map_problems(self.min_resources, "minResources")
        if self.gang_scheduler is not None:
            problems += self.inapplicable(self.gang_scheduler)
        return problems

    def inapplicable(self, scheduler: str) -> list[tuple[str, str]]:
        """Fields set that `scheduler`'s PodGroup has no place for: refused rather than dropped.
        Checked here when the job names its scheduler, and by the operator when it picks one."""
        problems = []
        for attr, name, only in SCHEDULER_ONLY_FIELDS:
            if only != scheduler and getattr(self, attr) not in (None, ""):
                problems.append((name, f"applies to gangScheduler {only} only; {scheduler}'s PodGroup has no such field"))
        return problems

    def pods_problems(self, pods: int) -> list[tuple[str, str]]:
        """minAvailable against the job's pod count: a gang larger than the job is never placed."""
        if self.min_available is not None and self.min_available > pods:
            return [("minAvailable", f"must be at most the job's {pods} pod(s), got {self.min_available}")]
        return []


@dataclass
class RunPolicy:
    """Lifetime of the job."""

    suspend: bool = field("Stop the pods (after a checkpoint) and keep the job; false resumes.", False)
    active_deadline_seconds: int | None = field(
        "The job fails with DeadlineExceeded when it runs longer than this.", None, minimum=1
    )
    ttl_seconds_after_finished: int | None = field(
        "Delete the job this long after it finished.", None, minimum=0
    )
    progress_deadline_seconds: int = field(
        "No new step for this long means the job hangs; handled as a failure.", 600, minimum=1
    )
    scheduling_timeout_seconds: int | None = field(
        "The job fails with reason Unschedulable when one of its pods could not be scheduled for this long "
        "(the scheduler's PodScheduled=False, Unschedulable); unset: it waits for room as long as it takes.",
        None, minimum=1,
    )
    clean_pod_policy: Literal["All", "Running", "None"] = field(
        "Pods deleted when the job finishes: All, the still Running ones, or None.", "Running"
    )
    scheduling_policy: SchedulingPolicy | None = field(
        "Gang scheduling (cluster only): the operator creates a PodGroup for Volcano or scheduler-plugins "
        "before the pods, and the pods wait until all of them fit. Immutable: the PodGroup is made once.",
        None,
        immutable=True,
    )


@dataclass
class Metrics:
    """Prometheus metrics of every trainer process."""

    port: int = field("Port of the /metrics endpoint; 0 turns it off.", 9090, minimum=0, maximum=65535)


@dataclass
class Script:
    """The user's own training command, run instead of the built-in loop (modes Single and DDP)."""

    command: list[str] = field(
        "The command, as a list (no shell): for example [python, train.py]. `python` is the trainer's "
        "interpreter. In mode DDP it runs once per rank with torchrun's environment.",
        min_items=1,
        max_items=MAX_SCRIPT_ARGS,
        max_length=4096,
    )
    args: list[str] = field(
        "Arguments appended to the command.", default_factory=list, max_items=MAX_SCRIPT_ARGS, max_length=4096
    )
    working_dir: str = field(
        "Directory the command runs in, and that a relative path in the command resolves against. "
        "Locally it defaults to the directory holding the manifest (a relative workingDir is taken "
        "from there too); in a cluster to the image's working directory.",
        "",
        max_length=4096,
    )

    def check(self) -> list[tuple[str, str]]:
        problems = []
        for name, values in (("command", self.command), ("args", self.args)):
            for i, value in enumerate(values):
                if not value:
                    problems.append((f"{name}[{i}]", "must not be empty"))
                elif "\x00" in value:
                    problems.append((f"{name}[{i}]", "must not contain a NUL character"))
        return problems


@dataclass
class Spec:
    """The desired state of a TrainingJob."""

    __rules__ = (
        OnlyWhen("parameter_server", "mode", "ParameterServer"),
        OnlyWhen("ddp", "mode", "DDP"),
        Excludes("script", ("dataset", "training")),
    )

    mode: Mode = field("Single, ParameterServer or DDP.", immutable=True)
    replicas: int | None = field(
        "The job's size, what `kubectl scale trainingjob NAME --replicas N` sets (the scale subresource): "
        "the ParameterServer workers or the DDP nodes, in place of parameterServer.workers or ddp.nodes, which "
        "stay the size the job was created with. A ParameterServer job takes a change live: new workers join, "
        "those above the size leave after their step; a DDP job's nodes stop after a checkpoint and start "
        "again at the new size. The data of the epoch in progress is dealt again among the new set "
        "(docs/scheduling.md#elastic-jobs). DDP: between ddp.minNodes and ddp.maxNodes. Single: 1.",
        None, minimum=1, maximum=1024,
    )
    image: str = field("Trainer image (cluster only); empty uses the operator's default.", "")
    script: Script | None = field(
        "The user's own training command instead of the built-in loop (modes Single and DDP); "
        "dataset and training do not apply then, and model only as a pretrained model to fetch and check before "
        "the script starts ({name: causal-lm, pretrained: URI}; the script finds it at $KUBETRAIN_MODEL_DIR). "
        "See docs/custom-code.md.",
        None,
    )
    # None only in script jobs: `complete()` fills the built-in loop's defaults otherwise.
    model: Model | None = field("The model (built-in loops; mlp when unset); a script job's pretrained model.", None)
    dataset: Dataset | None = field("The data (built-in loops).", default_factory=lambda: Dataset(name="digits"))
    training: Training | None = field("Training settings (built-in loops).", default_factory=Training)
    parameter_server: ParameterServer | None = field(
        "Parameter-server settings (mode ParameterServer).", None
    )
    ddp: DDP | None = field("DDP settings (mode DDP).", None)
    resources: Resources = field(
        "Resources per role (cluster only): corev1 ResourceRequirements (requests, limits, claims). Each quantity "
        "as Kubernetes writes it (2, 500m, 4Gi, 1e3: a string, or an integer), from 0 to 9223372036854775807m "
        "(Kubernetes counts resources in 64-bit milli-units) with an exponent of at most two digits; so are "
        "podTemplate containers' and schedulingPolicy.minResources.", default_factory=Resources)
    checkpoint: Checkpoint = field("Checkpoints.", default_factory=Checkpoint)
    restart_policy: RestartPolicy = field("Restarts of failed replicas.", default_factory=RestartPolicy)
    run_policy: RunPolicy = field("Lifetime of the job.", default_factory=RunPolicy)
    metrics: Metrics = field("Metrics endpoint.", default_factory=Metrics)
    pod_template: dict[str, Any] = field(
        "Merged into every pod (cluster only): metadata labels and annotations, and spec fields "
        "such as nodeSelector, tolerations, affinity, initContainers. Lists merge with kubetrain's "
        "own by name (volumes; the trainer container's env and ports) and volumeMounts by mountPath, "
        "so a dataset volume goes beside kubetrain's; kubetrain's own names are refused: volumes "
        "config, data, tmp, model, pretrained; mounts at /etc/kubetrain, /kubetrain/data, /tmp, /kubetrain/model, "
        "/kubetrain/pretrained; the container name model-init (kubetrain's init container), in containers and "
        "initContainers alike, and trainer in initContainers; env KUBETRAIN_*, HOME, "
        "PYTHONUNBUFFERED, PYTHONSAFEPATH; ports metrics, grpc, ps-data, rendezvous, lighthouse; labels and annotations "
        "kubetrain.dev/* and app.kubernetes.io/managed-by, and the gang schedulers' PodGroup and queue keys "
        "(scheduling.k8s.io/group-name, scheduling.volcano.sh/group-name, scheduling.x-k8s.io/pod-group, "
        "pod-group.scheduling.sigs.k8s.io, scheduling.volcano.sh/queue-name, volcano.sh/queue-name); and null "
        "anywhere in spec (but as an optional field's unset). kubetrain's own "
        "security fields are applied after the template. What reaches past the pod is refused unless the "
        "cluster's kubetrain installation allows it (the chart's podSecurity.allow): Pod Security "
        "baseline and restricted (privileged containers and allowPrivilegeEscalation, hostPID, hostIPC, "
        "hostNetwork, hostPath volumes, hostPort, added capabilities, runAsUser 0 or runAsNonRoot false, "
        "Unconfined seccomp or AppArmor profiles, SELinux options, procMount, unsafe sysctls, volume "
        "types outside restricted's, a probe's or lifecycle hook's host), the namespace's Secrets and "
        "other claims (ephemeral volumes cloned or filled from one, or bound to a chosen volume; "
        "ResourceClaims by name), another ServiceAccount or its token, nodeName, a toleration of every "
        "taint, priorityClassName and runtimeClassName (docs/security.md). Its size times the pods it is "
        "merged into is at most 4 MiB of JSON.",
        default_factory=dict,
    )

    def check(self) -> list[tuple[str, str]]:
        problems = self._size_problems() + self._rendered_size_problems()
        if self.script is not None and self.mode == "ParameterServer":
            problems.append(("script", "script jobs run in mode Single or DDP, got ParameterServer "
                                       "(a parameter server needs the built-in loop's model, dataset and training)"))
        if self.mode == "DDP":
            ddp = self.ddp or DDP()
            if ddp.backend == "nccl" and self.training is not None and self.training.device == "cpu":
                problems.append(("ddp.backend", "nccl needs GPUs; use gloo with training.device cpu"))
            storage = self.checkpoint.storage
            # Rank 0 reads and writes the checkpoints and broadcasts them to the
            # group, so a volume per node (ReadWriteOnce) works; one claim
            # shared by pods that may land on several nodes does not.
            if ddp.nodes > 1 and storage.existing_claim and storage.access_mode != "ReadWriteMany" and not storage.uri:
                problems.append(
                    (
                        "checkpoint.storage.accessMode",
                        "a DDP job of several nodes sharing checkpoint.storage.existingClaim needs "
                        "ReadWriteMany; or leave existingClaim empty so each node gets its own volume",
                    )
                )
            problems += self._strategy_problems(ddp)
            problems += self._fault_tolerance_problems(ddp)
        problems += self._credentials_problems()
        problems += self._causal_lm_problems()
        problems += pod_template_problems(self.pod_template)
        if self.run_policy.scheduling_policy is not None:
            problems += [(f"runPolicy.schedulingPolicy.{p}", m)
                         for p, m in self.run_policy.scheduling_policy.pods_problems(self.pod_count)]
        return problems

    def secret_refs(self) -> dict[str, str]:
        """The Secrets the job names for object storage, by field path (those set)."""
        refs = {"checkpoint.storage.secretRef": self.checkpoint.storage.secret_ref}
        if self.dataset is not None:
            refs["dataset.secretRef"] = self.dataset.secret_ref
        if self.model is not None:
            refs["model.secretRef"] = self.model.secret_ref
        return {path: name for path, name in refs.items() if name}

    def _credentials_problems(self) -> list[tuple[str, str]]:
        """One set of AWS_* variables per pod: every secretRef of the job must name the same Secret."""
        refs = self.secret_refs()
        if len(set(refs.values())) > 1:
            (first, a), (second, b) = list(refs.items())[:2]
            return [(second, f"must name the same Secret as {first} ({a!r}), got {b!r}: a pod holds one set of "
                              "AWS_* credentials (put both stores' in one Secret, or use one store)")]
        return []

    def _causal_lm_problems(self) -> list[tuple[str, str]]:
        """model causal-lm, dataset format text and training.lora go together; what the parameter server's
        loop does not do. A script job may name a pretrained model (model: {name: causal-lm, pretrained}) and
        nothing else of the model."""
        if self.script is not None:
            model = self.model
            if model is not None and (not model.pretrained or model.entrypoint or model.args):
                return [("model", SCRIPT_MODEL_MESSAGE)]
            return []
        if self.dataset is None or self.training is None:
            return []
        model = self.model or Model(name="mlp")  # complete()'s default
        problems = []
        lm = model.name == "causal-lm"
        if lm and self.dataset.format not in LM_FORMATS:
            problems.append(("dataset.format", "model causal-lm trains on documents: set format text, chat or "
                                               "prompt-completion"))
        if self.dataset.format in LM_FORMATS and not lm:
            problems.append(("dataset.format", f"{self.dataset.format} is tokenized for model causal-lm, got model "
                                               f"{model.name or model.entrypoint!r}"))
        if lm and self.training.loss != "crossEntropy":
            problems.append(("training.loss", "causal-lm trains on next-token cross entropy: leave loss unset"))
        if self.training.lora is not None and not lm:
            problems.append(("training.lora", "adapts a pretrained model: set model.name causal-lm"))
        if self.mode == "ParameterServer":
            if lm:
                problems.append(("model.name", "causal-lm fine-tunes in mode Single or DDP (FSDP shards a model "
                                               "too large for one process); the parameter server trains the "
                                               "small built-in models"))
            optimizer = self.training.optimizer
            for name, unset in (("optimizer.warmupSteps", optimizer.warmup_steps == 0),
                                ("optimizer.schedule", optimizer.schedule == "constant"),
                                ("maxGradNorm", self.training.max_grad_norm is None)):
                if not unset:
                    problems.append((f"training.{name}", "applies to modes Single and DDP: a parameter server "
                                                         "applies each worker's gradients as they come"))
        return problems

    def _fault_tolerance_problems(self, ddp: DDP) -> list[tuple[str, str]]:
        """What cannot work with ddp.faultTolerance (the CRD holds the same rules in CEL, SPEC_CEL)."""
        ft = ddp.fault_tolerance
        if ft is None:
            return []
        problems = []
        low = ddp.node_range[0]
        if ft.min_replicas > low:
            what = "ddp.minNodes" if ddp.min_nodes is not None else "ddp.nodes"
            problems.append(("ddp.faultTolerance.minReplicas",
                             f"must be at most {what} ({low}): a quorum that needs more groups than the job "
                             f"may have never forms, got {ft.min_replicas}"))
        if ddp.comm_hook != "None":
            problems.append(("ddp.commHook", f"faultTolerance averages gradients through torchft's Manager, "
                                             f"not DDP's communication hooks: use None, got {ddp.comm_hook}"))
        if ft.spare_groups and (ddp.min_nodes is not None or ddp.max_nodes is not None):
            problems.append(("ddp.faultTolerance.spareGroups",
                             SPARE_RANGE_MESSAGE.split(": ", 1)[1] + f", got {ft.spare_groups}"))
        if self.checkpoint.storage.access_mode == "ReadWriteMany" and not self.checkpoint.storage.uri:
            problems.append(("checkpoint.storage.accessMode",
                             "with faultTolerance every replica group writes its own checkpoints on its own "
                             "volume: use ReadWriteOnce, got ReadWriteMany"))
        return problems

    def _strategy_problems(self, ddp: "DDP") -> list[tuple[str, str]]:
        """FSDP: sharded checkpoints need one volume every node reads; no DDP communication hook."""
        if ddp.strategy != "FSDP":
            return []
        problems = []
        if self.script is not None:
            problems.append(("ddp.strategy", "FSDP shards the built-in loop's model; a script job shards its own "
                                             "(fully_shard) and keeps strategy DDP"))
        if ddp.comm_hook != "None":
            problems.append(("ddp.commHook", f"{ddp.comm_hook} is a hook of DDP's gradient all-reduce; FSDP "
                                             "reduce-scatters its gradients: use None with strategy FSDP"))
        if (ddp.node_range[1] > 1 and self.checkpoint.storage.access_mode != "ReadWriteMany"
                and not self.checkpoint.storage.uri and ddp.fault_tolerance is None):
            problems.append(("checkpoint.storage.accessMode",
                             f"strategy FSDP writes sharded checkpoints, each rank its own shards, into one "
                             f"directory every rank reads: a job of up to {ddp.node_range[1]} nodes needs "
                             f"ReadWriteMany (one claim every node mounts), got {self.checkpoint.storage.access_mode}"))
        return problems

    @property
    def rendered_pods(self) -> dict[str, int]:
        """The objects the operator merges spec.podTemplate into, by the field that sets their number."""
        if self.mode == "ParameterServer":
            ps = self.parameter_server or ParameterServer()
            return {"parameterServer.replicas": ps.replicas, "parameterServer.workers": self.size,
                    "parameterServer.standbyWorkers": ps.standby_workers}
        if self.fault_tolerant:
            return {"ddp (one StatefulSet template)": 1, "ddp.faultTolerance (the Lighthouse pod)": 1}
        return {"ddp (one StatefulSet template)" if self.mode == "DDP" else "mode Single": 1}

    def _rendered_size_problems(self) -> list[tuple[str, str]]:
        """MAX_RENDERED_TEMPLATE_BYTES, judged before anything is rendered: the template's JSON is measured
        once (a 3 MB template costs milliseconds), the pods are counted, nothing is merged."""
        if not self.pod_template:
            return []
        size = len(json.dumps(self.pod_template, separators=(",", ":"), default=str))
        counts = self.rendered_pods
        pods = sum(counts.values())
        if size * pods <= MAX_RENDERED_TEMPLATE_BYTES:
            return []
        by_field = ", ".join(f"{n} ({path})" for path, n in counts.items() if n)
        return [("podTemplate", f"is {size} bytes (as JSON) and would be merged into {pods} pods: {by_field}; "
                                f"{size * pods} bytes in all, more than the operator renders for one job "
                                f"({MAX_RENDERED_TEMPLATE_BYTES} bytes, {MAX_RENDERED_TEMPLATE_BYTES // 2**20} MiB): "
                                "make the template smaller or the job smaller")]

    def _size_problems(self) -> list[tuple[str, str]]:
        """spec.replicas and the DDP node range (the CRD holds the same rules in CEL, SIZE_CEL)."""
        problems = []
        ps = self.parameter_server
        if self.replicas is not None and ps is not None and ps.standby_workers:
            problems.append(("replicas", STANDBY_SIZE_MESSAGE.removeprefix("replicas: ")))
        if self.mode == "Single" and self.replicas not in (None, 1):
            problems.append(("replicas", f"a Single job has one replica, got {self.replicas}"))
        if self.mode == "DDP":
            ddp = self.ddp or DDP()
            low, high = ddp.node_range
            if ddp.min_nodes is not None and ddp.max_nodes is not None and low > high:
                problems.append(("ddp.minNodes", f"must be at most ddp.maxNodes ({high}), got {low}"))
            elif not low <= ddp.nodes <= high:
                problems.append(("ddp.nodes", f"must be between ddp.minNodes ({low}) and ddp.maxNodes ({high}), "
                                              f"got {ddp.nodes}"))
            elif self.replicas is not None and not low <= self.replicas <= high:
                problems.append(("replicas", f"a DDP job runs between ddp.minNodes ({low}) and ddp.maxNodes ({high}) "
                                             f"nodes, got {self.replicas}"))
        return problems

    def complete(self) -> "Spec":
        """Fill the defaults that depend on other fields (the mode's block, epochs); spec.replicas, when
        set, becomes the workers or nodes every reader of the spec (the plan, the trainers) sees."""
        if self.mode == "ParameterServer" and self.parameter_server is None:
            self.parameter_server = ParameterServer()
        if self.mode == "DDP" and self.ddp is None:
            self.ddp = DDP()
        if self.replicas is not None and self.parameter_server is not None:
            self.parameter_server.workers = self.replicas
        if self.replicas is not None and self.ddp is not None:
            self.ddp.nodes = self.replicas
        if self.script is not None:
            # The user's script owns its model, data and loop: none of the built-in defaults apply. A pretrained
            # model stays: it is fetched and checked before the script starts (KUBETRAIN_MODEL_DIR).
            self.dataset = self.training = None
            return self
        self.model = self.model or Model(name="mlp")
        self.dataset = self.dataset or Dataset(name="digits")
        self.training = self.training or Training()
        if self.training.epochs is None and self.training.max_steps is None:
            self.training.epochs = 10
        return self

    # The sections complete() guarantees for a mode, typed as present: the code of a mode (a built-in loop,
    # the DDP runtime) reads them through these rather than narrowing an optional field at every use.
    def require_training(self) -> Training:
        """spec.training of a built-in loop's job (complete() fills it unless spec.script is set)."""
        return _required(self.training, "spec.training", "a built-in loop's job")

    def require_ddp(self) -> DDP:
        """spec.ddp of a DDP job (complete() fills it)."""
        return _required(self.ddp, "spec.ddp", "a DDP job")

    def require_parameter_server(self) -> ParameterServer:
        """spec.parameterServer of a ParameterServer job (complete() fills it)."""
        return _required(self.parameter_server, "spec.parameterServer", "a ParameterServer job")

    def require_fault_tolerance(self) -> FaultTolerance:
        """spec.ddp.faultTolerance of a fault-tolerant DDP job."""
        return _required(self.require_ddp().fault_tolerance, "spec.ddp.faultTolerance", "a fault-tolerant job")

    @property
    def fault_tolerant(self) -> bool:
        """A DDP job whose nodes are torchft replica groups (spec.ddp.faultTolerance)."""
        return self.mode == "DDP" and self.ddp is not None and self.ddp.fault_tolerance is not None

    @property
    def pod_count(self) -> int:
        """Pods of the job in a cluster: Single 1, ParameterServer shards + workers, DDP nodes."""
        if self.mode == "ParameterServer":
            return (self.parameter_server or ParameterServer()).replicas + self.size
        return self.size

    @property
    def size(self) -> int:
        """What `kubectl scale` counts: ParameterServer workers, DDP nodes, 1 for Single (after complete())."""
        if self.mode == "ParameterServer":
            return (self.parameter_server or ParameterServer()).workers
        if self.mode == "DDP":
            return (self.ddp or DDP()).nodes
        return 1

    @property
    def world_size(self) -> int:
        """Processes that read training data."""
        if self.mode == "ParameterServer":
            assert self.parameter_server is not None
            return self.parameter_server.workers
        if self.mode == "DDP":
            assert self.ddp is not None
            return self.ddp.nodes * self.ddp.procs_per_node
        return 1


@dataclass
class Metadata:
    name: str
    namespace: str = "default"
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None
    uid: str = ""
    generation: int = 0


_Section = TypeVar("_Section")


def _required(section: _Section | None, name: str, whose: str) -> _Section:
    if section is None:
        raise ValueError(f"{name} is missing, and {whose} has it once its spec is complete (Spec.complete)")
    return section


@dataclass
class TrainingJob:
    metadata: Metadata
    spec: Spec

    @property
    def name(self) -> str:
        return self.metadata.name
