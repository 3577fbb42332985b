"""What the installation refuses that only the operator can judge: a claim of another job's."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kubetrain.api import from_object
from kubetrain.drivers.cluster.refusals import claim_problems
from kubetrain.drivers.cluster.state import Controller, OperatorConfig
from kubetrain.engine.children import Settings, children
from kubetrain.engine.podsecurity import checkpoint_claim_job


def job(name: str, mode: str = "Single", claim: str = "", **spec):
    storage = {"existingClaim": claim, "accessMode": "ReadWriteMany"} if claim else {}
    doc = {"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": name, "namespace": "ns"},
           "spec": {"mode": mode, "checkpoint": {"storage": storage}, **spec}}
    return from_object(doc)


@dataclass
class Case:
    name: str
    claim: str
    refused: str = ""  # the start of the refusal; "" when the claim is allowed
    allow: frozenset[str] = frozenset()
    labelled: str = ""  # the job whose label an existing claim of that name carries (the index's view)


CASES = [
    # The victim's claim need not exist yet: kubetrain makes it, under that name, when the victim starts.
    Case("single's claim", "victim-ckpt-single-0", "spec.checkpoint.storage.existingClaim: 'victim-ckpt-single-0' "
         "is named as job victim's checkpoint claim"),
    Case("a shard's claim", "victim-ckpt-ps-3", "spec.checkpoint.storage.existingClaim: 'victim-ckpt-ps-3' is named"),
    Case("ddp's shared claim", "victim-ckpt-ddp", "spec.checkpoint.storage.existingClaim: 'victim-ckpt-ddp' is named"),
    Case("a ddp node's claim", "data-victim-ddp-0", "spec.checkpoint.storage.existingClaim: 'data-victim-ddp-0' is named"),
    Case("a job name with the infix", "a-ckpt-b-ckpt-single-0", "spec.checkpoint.storage.existingClaim: "
         "'a-ckpt-b-ckpt-single-0' is named as job a-ckpt-b's checkpoint claim"),
    Case("its own name's claim", "thief-ckpt-single-0"),  # kept from an earlier job of its name
    Case("a claim of the namespace", "shared"),
    Case("a name that is no replica's", "victim-ckpt-worker-0"),
    Case("allowed by the installation", "victim-ckpt-single-0", allow=frozenset({"claims"})),
    Case("labelled as another job's", "shared", "spec.checkpoint.storage.existingClaim: 'shared' is job victim's "
         "checkpoint claim; ", labelled="victim"),
    Case("labelled as its own", "shared", labelled="thief"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_an_existing_claim_named_or_labelled_as_another_jobs_is_refused(case):
    ctl = Controller(OperatorConfig(settings=Settings(pod_security_allow=case.allow)), scrape_tick=None)
    if case.labelled:
        ctl.index.set_claim(("ns", case.labelled), case.claim, "Bound")
    problems = claim_problems(ctl, job("thief", claim=case.claim))
    if not case.refused:
        assert problems == []
    else:
        assert len(problems) == 1 and problems[0].startswith(case.refused), problems
        assert "podSecurity.allow: [claims]" in problems[0]


@pytest.mark.parametrize("mode, spec", [
    ("Single", {}),
    ("ParameterServer", {"parameterServer": {"replicas": 3, "workers": 2}}),
    ("DDP", {"ddp": {"nodes": 3}}),
    ("DDP", {"ddp": {"nodes": 2}, "checkpoint": {"storage": {"accessMode": "ReadWriteMany"}}}),
])
def test_every_checkpoint_claim_kubetrain_names_is_read_back_as_its_jobs(mode, spec):
    """The refusal reads a claim's name as children.py writes it: each claim the job renders, and each
    claim its StatefulSet's template makes (`<template>-<statefulset>-<ordinal>`), names the job."""
    made = job("j-ckpt-x", mode, **spec)
    names = []
    for obj in children(made, "u", "t"):
        if obj["kind"] == "PersistentVolumeClaim":
            names.append(obj["metadata"]["name"])
        if obj["kind"] == "StatefulSet":
            names += [f"{t['metadata']['name']}-{obj['metadata']['name']}-{n}"
                      for t in obj["spec"].get("volumeClaimTemplates", []) for n in range(obj["spec"]["replicas"])]
    assert names
    assert {name: checkpoint_claim_job(name) for name in names} == {name: "j-ckpt-x" for name in names}
