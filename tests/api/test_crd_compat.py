"""The CRD evolves without breaking stored jobs: the generated CRD against the previous release's.

The previous release's CRD is tests/assets/releases/<version>/trainingjobs.yaml (a copy, so that a clone
without tags runs this; its README says where it came from, and a test below holds it equal to the release's
commit when the clone has it). tests/helpers/crd_compat.py says what counts as breaking; the table of mutated
CRDs below tests that judge. docs/operating.md#upgrades says what v1alpha1 promises.
"""

from __future__ import annotations

import copy
import subprocess

import pytest
import yaml
from helpers.crd_compat import problems
from support import ROOT

from kubetrain.api import crd

RELEASES = ROOT / "tests" / "assets" / "releases"
PREVIOUS, COMMIT = subprocess.run([str(ROOT / "hack" / "release"), "previous"], capture_output=True, text=True,
                                  check=True).stdout.split()
OLD = yaml.safe_load((RELEASES / PREVIOUS / "trainingjobs.yaml").read_text())

ACCEPTED: dict[str, str] = {}
"""Reviewed changes that break nothing stored, by `path: message` as the judge prints it, each with why. Empty:
nothing has needed one. A change a stored job would feel belongs in a new API version with a conversion."""


def test_the_generated_crd_keeps_every_stored_job_of_the_previous_release():
    found = [str(p) for p in problems(OLD, crd.crd()) if str(p) not in ACCEPTED]
    assert not found, (f"the CRD breaks jobs that {PREVIOUS} stored (docs/operating.md#upgrades: a change like this "
                       "needs a new API version with a conversion webhook):\n" + "\n".join(found))


def test_the_previous_releases_crd_is_the_one_its_commit_holds():
    """The copy is what the release shipped: where the clone has the release's commit, byte for byte."""
    shipped = subprocess.run(["git", "-C", str(ROOT), "show", f"{COMMIT}:charts/kubetrain/crds/trainingjobs.yaml"],
                             capture_output=True, text=True)
    if shipped.returncode != 0:
        pytest.skip(f"the clone lacks {COMMIT[:12]} (release {PREVIOUS}): the copy is taken as it is")
    assert (RELEASES / PREVIOUS / "trainingjobs.yaml").read_text() == shipped.stdout


def version(doc: dict, name: str = "v1alpha1") -> dict:
    return next(v for v in doc["spec"]["versions"] if v["name"] == name)


def node(doc: dict, path: str) -> dict:
    """The schema node of `path` (spec.training.epochs) in the CRD's first version."""
    here = version(doc)["schema"]["openAPIV3Schema"]
    for part in path.split("."):
        here = here["properties"][part]
    return here


def mutate(path: str, **changes):
    def apply(doc: dict) -> None:
        target = node(doc, path)
        for key, value in changes.items():
            if value is None:
                target.pop(key)
            else:
                target[key] = value
    return apply


def remove(path: str):
    def apply(doc: dict) -> None:
        parent, _, name = path.rpartition(".")
        del node(doc, parent)["properties"][name]
    return apply


def add_field(path: str, schema: dict):
    def apply(doc: dict) -> None:
        parent, _, name = path.rpartition(".")
        node(doc, parent)["properties"][name] = schema
    return apply


def require(path: str, name: str):
    def apply(doc: dict) -> None:
        node(doc, path).setdefault("required", []).append(name)
    return apply


def names(**changes):
    def apply(doc: dict) -> None:
        doc["spec"]["names"].update(changes)
    return apply


def unserve(doc: dict) -> None:
    version(doc)["served"] = False


def second_version(conversion: str | None, narrowed: bool):
    """A v1beta1 beside v1alpha1 (its storage version now), its schema narrowed or not, with a conversion."""
    def apply(doc: dict) -> None:
        beta = copy.deepcopy(version(doc))
        beta["name"] = "v1beta1"
        if narrowed:
            beta["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["training"]["properties"].pop("seed")
        version(doc)["storage"] = False
        doc["spec"]["versions"].append(beta)
        if conversion:
            doc["spec"]["conversion"] = {"strategy": conversion, "webhook": {
                "conversionReviewVersions": ["v1"], "clientConfig": {"service": {
                    "namespace": "kubetrain-system", "name": "kubetrain-conversion", "path": "/convert"}}}}
    return apply


CASES = [
    # (name, mutation, the problem's path and a word of its message, or None: compatible)
    ("a field removed", remove("spec.training.seed"), ("spec.training.seed", "removed")),
    ("a status field removed", remove("status.memory.lastStep"), ("status.memory.lastStep", "removed")),
    ("a type changed", mutate("spec.training.epochs", type="string"), ("spec.training.epochs", "type changed")),
    ("a number narrowed to an integer", mutate("spec.dataset.evalFraction", type="integer"),
     ("spec.dataset.evalFraction", "type changed")),
    ("a new enum", mutate("spec.image", enum=["kubetrain/trainer"]), ("spec.image", "restricted")),
    ("an enum losing a value", mutate("spec.mode", enum=["ParameterServer", "DDP"]), ("spec.mode", "Single")),
    ("a lowered maximum", mutate("spec.replicas", maximum=512), ("spec.replicas", "maximum lowered")),
    ("a new maximum", mutate("spec.training.maxSteps", maximum=10), ("spec.training.maxSteps", "maximum lowered")),
    ("a raised minimum", mutate("spec.training.batchSize", minimum=8), ("spec.training.batchSize", "minimum raised")),
    ("a shorter maxLength", mutate("spec.model.pretrained", maxLength=100), ("spec.model.pretrained", "maxLength")),
    ("fewer items", mutate("spec.script.command", maxItems=8), ("spec.script.command", "maxItems")),
    ("an exclusive maximum", mutate("spec.metrics.port", exclusiveMaximum=True),
     ("spec.metrics.port", "exclusiveMaximum")),
    ("a new pattern", mutate("spec.dataset.path", pattern="^/data/"), ("spec.dataset.path", "pattern new")),
    ("a changed pattern", mutate("spec.dataset.uri", pattern="^s3://only/"), ("spec.dataset.uri", "pattern changed")),
    ("a newly required field", require("spec.training", "seed"), ("spec.training", "newly required: seed")),
    ("a new field required", lambda d: (add_field("spec.training.budget", {"type": "integer"})(d),
                                        require("spec.training", "budget")(d)), ("spec.training", "budget")),
    ("a changed default", mutate("spec.training.batchSize", default=32), ("spec.training.batchSize", "default changed")),
    ("a default removed", mutate("spec.ddp.nodes", default=None), ("spec.ddp.nodes", "removed")),
    ("a default added to an existing field", mutate("spec.training.maxGradNorm", default=1.0),
     ("spec.training.maxGradNorm", "default 1.0 added")),
    ("unknown fields no longer preserved", mutate("spec.model.args", **{"x-kubernetes-preserve-unknown-fields": None}),
     ("spec.model.args", "prunes")),
    ("a list made a map", mutate("status.memory.groupRestart", **{"x-kubernetes-list-type": "set"}),
     ("status.memory.groupRestart", "list-type")),
    ("the plural renamed", names(plural="trainjobs"), ("spec.names.plural", "changed")),
    ("a short name dropped", names(shortNames=[]), ("spec.names.shortNames", "tj")),
    ("the version no longer served", unserve, ("spec.versions[v1alpha1]", "not served")),
    ("the scale subresource removed", lambda d: version(d)["subresources"].pop("scale"),
     ("spec.versions[v1alpha1].subresources.scale", "removed")),
    ("a second version without a conversion", second_version(None, narrowed=False), ("spec.versions", "storage")),
    # Compatible changes: nothing to say.
    ("a new optional field", add_field("spec.training.budget", {"type": "integer", "minimum": 1}), None),
    ("a new field with a CRD default", add_field("spec.training.budget", {"type": "integer", "default": 3}),
     ("spec.training.budget", "a new field with a CRD default")),
    ("a new object field with a default inside", add_field("spec.training.budget", {
        "type": "object", "properties": {"steps": {"type": "integer", "default": 3}}}), None),
    ("a new status field", add_field("status.trainer", {"type": "object", "properties": {"image": {"type": "string"}}}),
     None),
    ("an enum gaining a value", mutate("spec.mode", enum=["Single", "ParameterServer", "DDP", "JAX"]), None),
    ("an integer widened to a number", mutate("spec.training.epochs", type="number"), None),
    ("a raised maximum", mutate("spec.replicas", maximum=4096), None),
    ("a lowered minimum", mutate("spec.dataset.sequenceLength", minimum=1), None),
    ("a pattern dropped", mutate("spec.dataset.uri", pattern=None), None),
    ("a description edited", mutate("spec.mode", description="What runs."), None),
    ("a new short name", names(shortNames=["tj", "tjob"]), None),
    ("a new CEL rule (ratcheted)", mutate("spec.training", **{"x-kubernetes-validations": [
        {"rule": "self.batchSize <= 4096", "message": "too big"}]}), None),
    ("a narrowed v1beta1 beside v1alpha1, with a conversion webhook", second_version("Webhook", narrowed=True), None),
]


@pytest.mark.parametrize(("name", "mutation", "expected"), CASES, ids=[c[0] for c in CASES])
def test_the_judge_names_what_breaks_stored_jobs_and_nothing_else(name, mutation, expected):
    new = copy.deepcopy(OLD)
    mutation(new)
    found = problems(OLD, new)
    if expected is None:
        assert found == [], (name, [str(p) for p in found])
        return
    path, word = expected
    assert any(p.path == path and word in p.message for p in found), (name, [str(p) for p in found])


def test_the_previous_release_is_compatible_with_itself():
    assert problems(OLD, copy.deepcopy(OLD)) == []
