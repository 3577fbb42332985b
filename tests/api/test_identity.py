"""A checkpoint's identity (kubetrain/api/identity.py): what decides the math, compared field by field; the hashes
earlier releases wrote, recomputed; a new field with a default never changes an old checkpoint's identity."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kubetrain.api import from_spec_dict
from kubetrain.api.identity import (NOT_MATH, RELEASE_0_1_0_FIELDS, JobIdentity, default_at, differences, flatten,
                                    identity, judge, legacy_hashes, same, spec_hash)
from kubetrain.api.schema import fields_of, yaml_name
from kubetrain.api.spec import Spec

SINGLE = {"mode": "Single", "model": {"name": "mlp", "args": {"hidden": 32}}, "dataset": {"name": "digits"},
          "training": {"epochs": 3, "batchSize": 32, "optimizer": {"name": "sgd", "learningRate": 0.05}}}
PS = {"mode": "ParameterServer", "model": {"name": "mlp", "args": {"hidden": 32}}, "dataset": {"name": "digits"},
      "training": {"epochs": 3, "batchSize": 32, "optimizer": {"name": "adam", "learningRate": 0.01}},
      "parameterServer": {"replicas": 2, "workers": 2, "aggregation": "Async",
                          "compression": {"algorithm": "TopK", "ratio": 0.1}}}
DDP = {"mode": "DDP", "model": {"name": "cnn"}, "dataset": {"name": "synthetic", "args": {"samples": 512, "features": 64}},
       "training": {"maxSteps": 40, "batchSize": 16, "seed": 3}, "ddp": {"nodes": 2, "procsPerNode": 1, "commHook": "FP16"}}
SCRIPT = {"mode": "DDP", "script": {"command": ["python", "train.py"]}, "ddp": {"nodes": 2}}
LORA = {"mode": "Single", "model": {"name": "causal-lm", "pretrained": "/models/tiny"},
        "dataset": {"path": "data.jsonl", "format": "text", "sequenceLength": 64},
        "training": {"maxSteps": 10, "batchSize": 4, "optimizer": {"name": "adamw", "learningRate": 0.001},
                     "lora": {"rank": 4}}}
CHAT = {**LORA, "dataset": {"path": "chats.jsonl", "format": "chat", "sequenceLength": 64, "messagesColumn": "turns",
                             "trainOn": "all"}}
PAIRS = {**LORA, "dataset": {"path": "pairs.jsonl", "format": "prompt-completion", "promptColumn": "q"}}

# The hashes each release wrote for these specs, computed by that release's own code (spec_hash of
# trainer/checkpoint.py at 69d6222, of kubetrain/trainer/checkpoint.py at v0.1.0) on 2026-12-06.
WRITTEN = [
    pytest.param(SINGLE, "fc1da86a7eb4a395", "2e51ea3af3baa3fe", id="Single"),
    pytest.param(PS, "bab813787051a7d0", "bbf6f881e224ee67", id="ParameterServer"),
    pytest.param(DDP, "3b41b30e30c81511", "e549d01dbc8d2461", id="DDP"),
    pytest.param(SCRIPT, "db53d714a757e45b", "db53d714a757e45b", id="script"),
    pytest.param(LORA, None, "e7f1e5114cba573a", id="LoRA (fields 69d6222 lacked)"),
]


def spec(doc: dict[str, Any]) -> Spec:
    return from_spec_dict("job", copy.deepcopy(doc)).spec


@pytest.mark.parametrize(("doc", "of_2026_12_04", "of_0_1_0"), WRITTEN)
def test_the_hashes_earlier_releases_wrote_are_recomputed(doc, of_2026_12_04, of_0_1_0):
    hashes = legacy_hashes(spec(doc))
    assert hashes.get("2026-12-04 (69d6222)") == of_2026_12_04
    assert hashes["0.1.0"] == of_0_1_0


@pytest.mark.parametrize(("doc", "of_2026_12_04", "of_0_1_0"), WRITTEN)
def test_the_hash_this_release_writes_is_0_1_0s_so_a_rollback_resumes(doc, of_2026_12_04, of_0_1_0):
    assert spec_hash(spec(doc)) == of_0_1_0


@pytest.mark.parametrize(("doc", "of_2026_12_04", "of_0_1_0"), WRITTEN)
def test_a_checkpoint_of_an_earlier_release_holding_only_a_hash_is_judged_ours(doc, of_2026_12_04, of_0_1_0):
    for written in filter(None, (of_2026_12_04, of_0_1_0)):
        assert judge(spec(doc), written, None).ok


def test_a_hash_only_checkpoint_of_other_math_is_refused():
    changed = copy.deepcopy(SINGLE)
    changed["training"]["optimizer"]["learningRate"] = 0.1
    verdict = judge(spec(changed), "2e51ea3af3baa3fe", None)
    assert not verdict.ok and "hash of an earlier release" in verdict.reason


def test_a_field_new_since_0_1_0_that_is_not_math_leaves_the_hash_as_0_1_0_computes_it():
    doc = copy.deepcopy(SINGLE)
    doc["model"]["diskSize"] = "40Gi"
    assert "model.diskSize" in NOT_MATH and "model.diskSize" not in RELEASE_0_1_0_FIELDS
    assert spec_hash(spec(doc)) == "2e51ea3af3baa3fe"


@pytest.mark.parametrize(
    ("change", "named"),
    [
        pytest.param({"training": {"optimizer": {"learningRate": 0.1}}}, "training.optimizer.learningRate: 0.05 in the "
                     "checkpoint, 0.1 in this job", id="learning rate"),
        pytest.param({"model": {"args": {"hidden": 64}}}, "model.args.hidden: 32 in the checkpoint, 64 in this job",
                     id="model width"),
        pytest.param({"training": {"precision": "bf16"}}, 'training.precision: "fp32" in the checkpoint, "bf16" in '
                     "this job", id="a field new in 0.1.0"),
        pytest.param({"dataset": {"name": "synthetic"}}, 'dataset.name: "digits" in the checkpoint, "synthetic"',
                     id="the data"),
    ],
)
def test_a_real_change_of_the_math_is_refused_naming_the_field_and_both_values(change, named):
    recorded = identity(spec(SINGLE))
    changed = copy.deepcopy(SINGLE)
    for section, fields in change.items():
        for key, value in fields.items():
            if isinstance(value, dict):
                changed[section].setdefault(key, {}).update(value)
            else:
                changed[section][key] = value
    verdict = JobIdentity.of(spec(changed)).judge("ignored", recorded)
    assert not verdict.ok and named in verdict.reason


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"training": {"epochs": 30}}, id="more epochs"),
        pytest.param({"training": {"device": "cpu"}}, id="another device"),
        pytest.param({"dataset": {"cacheSize": "1Gi"}}, id="a cache size"),
        pytest.param({"model": {"diskSize": "1Gi"}}, id="a disk size"),
    ],
)
def test_what_does_not_decide_the_math_resumes(change):
    changed = copy.deepcopy(SINGLE)
    for section, fields in change.items():
        changed[section].update(fields)
    assert JobIdentity.of(spec(changed)).judge("ignored", identity(spec(SINGLE))).ok


def test_an_optional_section_set_with_its_defaults_differs_from_it_unset():
    recorded = identity(spec({**LORA, "training": {**LORA["training"], "lora": None}}))
    found = differences(recorded, identity(spec(LORA)))
    assert [d.path for d in found] == ["training.lora"] and "unset in the checkpoint, set in this job" in str(found[0])


def test_the_size_of_a_job_is_not_its_identity():
    bigger = copy.deepcopy(PS)
    bigger["parameterServer"]["workers"] = 8
    assert identity(spec(bigger)) == identity(spec(PS))


def drop(doc: dict[str, Any], path: str) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    *parents, last = path.split(".")
    node = out
    for part in parents:
        node = node[part]
    node.pop(last, None)
    return out


@pytest.mark.parametrize("doc", [SINGLE, PS, DDP, LORA, CHAT, PAIRS],
                         ids=["Single", "ParameterServer", "DDP", "LoRA", "chat", "prompt-completion"])
def test_a_checkpoint_written_before_a_field_existed_is_judged_at_that_fields_default(doc):
    """What a new spec field with a default must never do: change an old checkpoint's identity. Each field of the
    identity in turn is taken out of a recorded one, as a release before the field would have written it: the
    job resumes it exactly when its own value is the field's default (a value off the default is math the old
    release never ran)."""
    job = JobIdentity.of(spec(doc))
    assert job.document is not None
    recorded = dict(job.document)
    for path, value in flatten(recorded).items():
        verdict = job.judge("ignored", drop(recorded, path))
        assert verdict.ok == same(value, default_at(path)), (path, value, default_at(path), verdict.reason)


def test_every_field_of_the_math_sections_has_a_default():
    """A field of model, dataset or training without a default could not be judged in a checkpoint of the release
    before it: every resume after the upgrade would refuse."""
    import dataclasses

    from kubetrain.api.spec import Compression, Dataset, Lora, Model, Optimizer, Training

    for cls in (Model, Dataset, Training, Optimizer, Lora, Compression):
        for f, _ in fields_of(cls):
            assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING, \
                f"{cls.__name__}.{yaml_name(f)}"


@pytest.mark.parametrize(
    ("doc", "change", "named"),
    [
        pytest.param(CHAT, {"trainOn": "assistant"}, 'dataset.trainOn: "all" in the checkpoint, "assistant" in this job',
                     id="which tokens are trained"),
        pytest.param(CHAT, {"chatTemplate": "{{ messages }}"}, 'dataset.chatTemplate: "" in the checkpoint',
                     id="the chat template"),
        pytest.param(PAIRS, {"completionColumn": "a"}, 'dataset.completionColumn: "completion" in the checkpoint, "a"',
                     id="the completion column"),
    ],
)
def test_the_answer_only_formats_fields_are_math(doc, change, named):
    changed = copy.deepcopy(doc)
    changed["dataset"].update(change)
    verdict = JobIdentity.of(spec(changed)).judge("ignored", identity(spec(doc)))
    assert not verdict.ok and named in verdict.reason
