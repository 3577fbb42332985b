"""`spec.script`: the user's own command instead of the built-in loop, validated like every field."""

from pathlib import Path

import pytest
import yaml

from kubetrain.api import dump_manifest, from_object, load_one
from kubetrain.cli import main

CUSTOM = sorted((Path(__file__).parents[2] / "examples" / "custom").glob("*.yaml"))


def doc(mode="Single", **spec):
    return {"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "s"},
            "spec": {"mode": mode, **spec}}


SCRIPT = {"command": ["python", "train.py"]}

BAD = [
    ("no command", doc(script={}), "spec.script.command", "is required"),
    ("empty command", doc(script={"command": []}), "spec.script.command", "at least 1 item, got 0"),
    ("empty program", doc(script={"command": [""]}), "spec.script.command[0]", "must not be empty"),
    ("empty arg", doc(script={**SCRIPT, "args": ["--x", ""]}), "spec.script.args[1]", "must not be empty"),
    ("command not a list", doc(script={"command": "python train.py"}), "spec.script.command", "must be a list"),
    ("command item not a string", doc(script={"command": ["python", 3]}), "spec.script.command[1]", "must be a string"),
    ("too many args", doc(script={**SCRIPT, "args": ["a"] * 257}), "spec.script.args", "at most 256 items, got 257"),
    ("script with model", doc(script=SCRIPT, model={"name": "cnn"}), "spec.model",
     "applies to a script job only as a pretrained model to fetch"),
    ("script with dataset and training", doc(script=SCRIPT, dataset={"name": "digits"}, training={"epochs": 2}),
     "spec", "dataset, training do not apply when script is set"),
    ("script with a pretrained model's entry point", doc(script=SCRIPT, model={
        "entrypoint": "m:f", "pretrained": "/models/base"}), "spec.model.pretrained", "applies to name causal-lm"),
    ("script in ParameterServer mode", doc("ParameterServer", script=SCRIPT), "spec.script",
     "script jobs run in mode Single or DDP"),
    ("unknown script field", doc(script={**SCRIPT, "cwd": "/x"}), "spec.script.cwd", "unknown field"),
]


@pytest.mark.parametrize("name,manifest,path,words", BAD, ids=[b[0] for b in BAD])
def test_a_bad_script_manifest_is_refused_with_its_field_path(name, manifest, path, words, tmp_path, capsys):
    file = tmp_path / "job.yaml"
    file.write_text(yaml.safe_dump(manifest))
    assert main(["validate", str(file)]) == 2
    err = capsys.readouterr().err
    assert any(line.startswith(f"{file}: {path}: ") and words in line for line in err.splitlines()), err
    assert "Traceback" not in err


def test_a_script_job_has_no_built_in_model_data_or_training():
    job = from_object(doc("DDP", script={**SCRIPT, "args": ["--steps", "5"], "workingDir": "code"}))
    assert job.spec.model is None and job.spec.dataset is None and job.spec.training is None
    assert job.spec.script.command == ["python", "train.py"] and job.spec.script.args == ["--steps", "5"]
    dumped = yaml.safe_load(dump_manifest(job))
    assert "model" not in dumped["spec"] and "training" not in dumped["spec"]
    assert dumped["spec"]["script"]["workingDir"] == "code"
    # What kubetrain writes (job.yaml, the pods' ConfigMap) reads back as the same job.
    assert from_object(dumped).spec == job.spec


def test_a_built_in_job_still_gets_its_defaults():
    spec = from_object(doc()).spec
    assert spec.script is None and spec.model.name == "mlp" and spec.dataset.name == "digits"
    assert spec.training.epochs == 10 and spec.training.loss == "crossEntropy"


@pytest.mark.parametrize("example", CUSTOM, ids=[e.name for e in CUSTOM])
def test_the_custom_examples_are_valid(example, capsys):
    assert main(["validate", str(example)]) == 0
    assert load_one(example).spec.script is not None
