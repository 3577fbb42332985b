"""A checkpoint's identity: the part of a job's spec that decides its math, recorded and compared field by field.

A checkpoint may be resumed only by the job it was written for: a checkpoint of a model 128 wide must not be
loaded into one 256 wide, nor an optimizer's state carried into another learning rate without the user
knowing. What decides that is the math (`identity`): the mode, the model, the data, the training settings
but how long and where, and the topology the state's shape depends on (parameter-server shards and their
aggregation, DDP ranks per node and communication hook); not the job's size (an elastic job resumes at
another size), not how long it runs (a run may be extended), not a cache's size or a Secret's name.

A checkpoint records its identity itself, and a resume compares it with the job's field by field
(`differences`): a field the checkpoint lacks counts as its default, so a release that adds a field with a
default never breaks a resume; a field that really changed is refused, naming each field and both values.

Checkpoints written before identities were recorded (kubetrain 0.1.0 and earlier) hold a hash only: the
sha256 of the math, every field of those sections with its default included. Adding a field changed that
hash for every job (issue 53: every resume after an upgrade refused). Such a checkpoint is recognised by
recomputing the hash each earlier release would have written for this job (`LEGACY_HASHES`): the job's math
projected onto the fields that release knew, when every field added since is at its default. The hash a
checkpoint carries (`spec_hash`) stays that of 0.1.0's fields, frozen, so that a rollback to 0.1.0 resumes a
checkpoint written by this release for any job 0.1.0 could express.

Pure: no I/O. The trainer's checkpoint stores, the tools and the local run directory call it.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import MISSING, dataclass
from typing import Any

from .schema import fields_of, to_dict, yaml_name
from .spec import Spec

NOT_MATH: frozenset[str] = frozenset({
    "training.epochs", "training.maxSteps",  # how long: a run may be extended
    "training.device",  # where: a run may move between a GPU and a CPU
    "model.secretRef", "dataset.secretRef",  # which credentials read the files, not which files
    "dataset.cacheSize",  # a local cache's bound
    "model.diskSize",  # the pretrained model's disk bound in a pod
})
"""Fields of the math sections that do not decide the math: a change of one resumes."""
PS_MATH = ("replicas", "aggregation", "maxStaleness", "compression")
"""Of spec.parameterServer: the shards the parameters are split over and how gradients reach them (not
workers, the job's size)."""
DDP_MATH = ("procsPerNode", "commHook", "powerSGDRank")
"""Of spec.ddp: the ranks of a node and the hook's state (not nodes, the job's size)."""

UNSET = "unset"
"""How a field that neither side sets, and that has no default, reads in a message."""
_SET = "(set)"
"""The value a present optional section (training.lora, ddp.faultTolerance) flattens to, beside its fields."""


def identity(spec: Spec) -> dict[str, Any]:
    """The math of `spec` as a document of the spec's own shape (camelCase keys, defaults filled in)."""
    return _sections(spec, NOT_MATH)


def _sections(spec: Spec, left_out: frozenset[str]) -> dict[str, Any]:
    """The mode, model, dataset and training (but the fields `left_out`), and the topology (PS_MATH, DDP_MATH)
    of `spec`; a script job's, its mode alone (its state is its own: kubetrain cannot tell which changes of
    the script break it)."""
    doc = to_dict(spec)
    if spec.script is not None:
        return {"mode": doc["mode"], "script": True}
    out: dict[str, Any] = {"mode": doc["mode"]}
    for section in ("model", "dataset", "training"):
        out[section] = {k: v for k, v in doc.get(section, {}).items() if f"{section}.{k}" not in left_out}
    for section, kept in (("parameterServer", PS_MATH), ("ddp", DDP_MATH)):
        if section in doc:
            out[section] = {k: doc[section][k] for k in kept if k in doc[section]}
    return out


# --- the hash of earlier releases ----------------------------------------------------------------------------

RELEASE_0_1_0_FIELDS: frozenset[str] = frozenset("""
    model.name model.pretrained model.secretRef model.entrypoint model.args
    dataset.name dataset.path dataset.uri dataset.secretRef dataset.cacheSize dataset.labelColumn
    dataset.featureColumns dataset.entrypoint dataset.args dataset.evalFraction dataset.format dataset.textColumn
    dataset.sequenceLength dataset.packing
    training.batchSize training.optimizer training.optimizer.name training.optimizer.learningRate
    training.optimizer.momentum training.optimizer.weightDecay training.optimizer.warmupSteps
    training.optimizer.schedule training.seed training.loss training.gradientAccumulationSteps
    training.maxGradNorm training.precision training.lora training.lora.rank training.lora.alpha
    training.lora.dropout training.lora.targetModules
    parameterServer.replicas parameterServer.aggregation parameterServer.maxStaleness parameterServer.compression
    parameterServer.compression.algorithm parameterServer.compression.ratio parameterServer.compression.rank
    parameterServer.compression.minTensorBytes parameterServer.compression.warmupSteps
    ddp.procsPerNode ddp.commHook ddp.powerSGDRank
""".split())
"""The fields kubetrain 0.1.0 hashed (read from its spec model): model, dataset and training but
training.epochs, maxSteps and device; PS_MATH of parameterServer, DDP_MATH of ddp."""
NEVER_HASHED = frozenset({"training.epochs", "training.maxSteps", "training.device"})
"""What every release left out of its hash: a run may be extended or moved."""

RELEASE_FIELDS: tuple[tuple[str, frozenset[str]], ...] = (
    ("0.1.0", RELEASE_0_1_0_FIELDS),
    ("2026-12-04 (69d6222)", RELEASE_0_1_0_FIELDS - {
        "model.pretrained", "model.secretRef",
        "dataset.format", "dataset.textColumn", "dataset.sequenceLength", "dataset.packing",
        "training.optimizer.warmupSteps", "training.optimizer.schedule",
        "training.gradientAccumulationSteps", "training.maxGradNorm", "training.precision", "training.lora",
        "training.lora.rank", "training.lora.alpha", "training.lora.dropout", "training.lora.targetModules",
    }),
)
"""Each earlier release that wrote hashes only, with the fields it hashed (every field of those sections it
knew, its default included). No field joins a hash again: fields new since 0.1.0 are compared through the
recorded identity. tests/api/test_identity.py holds the hashes both releases wrote for golden jobs."""


def _hash(doc: Any) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def _hashed_sections(spec: Spec) -> dict[str, Any]:
    """What 0.1.0 and the releases before it put into the hash, from today's spec (defaults filled in)."""
    return _sections(spec, NEVER_HASHED)


def restrict(doc: Mapping[str, Any], known: frozenset[str], cls: type | None = Spec,
             prefix: str = "") -> dict[str, Any] | None:
    """`doc` (of the spec's shape) with only the fields at `known` paths, as a release that knew only those
    would have written it; None when a field outside them is set off its default (that release could not
    express the job). The top level (mode) and a user's maps (model.args) are kept as they are."""
    fields = {yaml_name(f): info for f, info in fields_of(cls)} if cls is not None else {}
    out: dict[str, Any] = {}
    for key, value in doc.items():
        path = prefix + str(key)
        if prefix and path not in known:
            if path not in NOT_MATH and not same(value, default_at(path)):
                return None
            continue
        info = fields.get(str(key))
        if info is not None and info.kind == "object" and isinstance(value, Mapping):
            inner = restrict(value, known, info.cls, path + ".")
            if inner is None:
                return None
            out[str(key)] = inner
        else:
            out[str(key)] = value
    return out


def spec_hash(spec: Spec) -> str:
    """The hash a checkpoint carries beside its identity: the one kubetrain 0.1.0 computes for this job (a
    rollback to 0.1.0 resumes it), or, for a job that sets a field 0.1.0 lacks, a hash of its whole identity
    (0.1.0 then refuses it, rightly: it would ignore that field)."""
    hashed = restrict(_hashed_sections(spec), RELEASE_0_1_0_FIELDS)
    return _hash(hashed) if hashed is not None else _hash({"identity": identity(spec)})


def legacy_hashes(spec: Spec) -> dict[str, str]:
    """The hash each earlier release would have written for this job, by release; a release that could not
    express the job (a field it lacked is set off its default) is left out."""
    base = _hashed_sections(spec)
    out = {}
    for release, known in RELEASE_FIELDS:
        doc = restrict(base, known)
        if doc is not None:
            out[release] = _hash(doc)
    return out


# --- comparing, field by field --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Difference:
    """One field whose value differs between a checkpoint and a job."""

    path: str
    recorded: Any
    current: Any

    def __str__(self) -> str:
        return self.told()

    def told(self, recorded: str = "in the checkpoint", current: str = "in this job") -> str:
        return f"{self.path}: {_show(self.recorded)} {recorded}, {_show(self.current)} {current}"


def differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[Difference]:
    """The fields whose values differ between two documents of the spec's shape (identities, or whole specs),
    in path order; a field one side lacks counts as its default there."""
    a, b = flatten(recorded), flatten(current)
    out: list[Difference] = []
    for path in sorted(a.keys() | b.keys()):
        if any(path.startswith(d.path + ".") and _SET in (d.recorded, d.current) for d in out):
            continue  # inside a section one side sets and the other does not: the section is the difference
        x = a[path] if path in a else default_at(path)
        y = b[path] if path in b else default_at(path)
        if not same(x, y):
            out.append(Difference(path, x, y))
    return out


def explain(found: list[Difference], limit: int = 8, recorded: str = "in the checkpoint",
            current: str = "in this job") -> str:
    """The differences as one sentence part, at most `limit` of them named, each side's value `recorded` and
    `current` ("128 in the checkpoint, 256 in this job")."""
    shown = "; ".join(d.told(recorded, current) for d in found[:limit])
    return shown + (f"; and {len(found) - limit} more" if len(found) > limit else "")


@dataclass(frozen=True)
class Verdict:
    """Whether a checkpoint belongs to a job, and when not, why (a sentence naming the fields)."""

    ok: bool
    reason: str = ""


def judge(spec: Spec, written_hash: str, written_identity: Mapping[str, Any] | None,
          written_with: Spec | None = None) -> Verdict:
    """Whether a checkpoint that recorded `written_identity` (None: an earlier release's, a hash only) and
    `written_hash` may be resumed by a job of `spec`. `written_with`: the spec of the manifest the checkpoints
    were written with, when one lies beside them (a checkpoint URI's job.yaml), to name the fields that
    differ when the checkpoint holds a hash only."""
    if written_identity is not None:
        found = differences(written_identity, identity(spec))
        return Verdict(True) if not found else Verdict(False, explain(found))
    if written_hash == spec_hash(spec) or written_hash in legacy_hashes(spec).values():
        return Verdict(True)
    reason = (f"it records only the hash of an earlier release's spec ({written_hash}), which no earlier release "
              f"computes for this job's model, dataset, training or topology (0.1.0's would be {spec_hash(spec)})")
    found = differences(identity(written_with), identity(spec)) if written_with is not None else []
    if found:
        return Verdict(False, f"{reason}; the manifest it was written with differs: {explain(found)}")
    return Verdict(False, f"{reason}, so at least one of their fields differs")


# --- flattening, with the schema's defaults -------------------------------------------------------------------


def flatten(doc: Mapping[str, Any], cls: type | None = Spec, prefix: str = "") -> dict[str, Any]:
    """`doc` as dotted paths to leaves: a schema section's fields each a path, a present optional section
    also a path of its own (so that "unset" and "set with its defaults" differ), a user's map (model.args)
    its keys; lists are leaves."""
    known = {yaml_name(f): (f, info) for f, info in fields_of(cls)} if cls is not None else {}
    out: dict[str, Any] = {}
    for key, value in doc.items():
        path = prefix + str(key)
        f, info = known.get(str(key), (None, None))
        if info is not None and info.kind == "object" and isinstance(value, Mapping):
            if f is not None and f.default is None:
                out[path] = _SET
            out.update(flatten(value, info.cls, path + "."))
        elif isinstance(value, Mapping) and value:
            out.update(flatten(value, None, path + "."))
        else:
            out[path] = value
    return out


def default_at(path: str) -> Any:
    """The default of the spec field at dotted `path` as a document holds it; UNSET for a field with none, an
    unset optional one, a key of a user's map and a path the schema does not know (a field since removed)."""
    cls: type | None = Spec
    parts = path.split(".")
    for i, part in enumerate(parts):
        if cls is None:
            return UNSET
        found = [(f, info) for f, info in fields_of(cls) if yaml_name(f) == part]
        if not found:
            return UNSET
        f, info = found[0]
        if i == len(parts) - 1:
            if f.default is not MISSING:
                return UNSET if f.default is None else to_dict(f.default)
            if f.default_factory is not MISSING:
                value = to_dict(f.default_factory())
                return value if not isinstance(value, dict) else UNSET
            return UNSET
        cls = info.cls if info.kind == "object" else None
    return UNSET


def same(x: Any, y: Any) -> bool:
    """Equal as values: 1 and 1.0 are, True and 1 are not, an empty map and an unset one are."""
    if x == UNSET or y == UNSET:
        return _empty(x) and _empty(y)
    if isinstance(x, bool) or isinstance(y, bool):
        return type(x) is type(y) and x == y
    if isinstance(x, (int, float)) and isinstance(y, (int, float)):
        return x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(same(a, b) for a, b in zip(x, y))
    return bool(x == y)


def _empty(value: Any) -> bool:
    return value == UNSET or value is None or value == {}


def _show(value: Any) -> str:
    if value == UNSET or value is None:
        return "unset"
    if value == _SET:
        return "set"
    return json.dumps(value, sort_keys=True)


@dataclass(frozen=True)
class JobIdentity:
    """What a job writes into each of its checkpoints (its hash and identity), and how it judges a checkpoint's
    record at a restore. Built from a spec (`of`); a benchmark's store, which has no job, names itself by a
    hash alone and accepts only that hash."""

    spec_hash: str
    document: Mapping[str, Any] | None = None
    spec: Spec | None = None

    @classmethod
    def of(cls, spec: Spec) -> "JobIdentity":
        return cls(spec_hash(spec), identity(spec), spec)

    def judge(self, written_hash: str, written_identity: Mapping[str, Any] | None,
              written_with: Spec | None = None) -> Verdict:
        if self.spec is None:
            return Verdict(written_hash == self.spec_hash,
                           f"its hash is {written_hash}, this store's {self.spec_hash}")
        return judge(self.spec, written_hash, written_identity, written_with)
