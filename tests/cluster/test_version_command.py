"""`kubetrain version` against a real API server: the chart's operator found by its labels (its pods on kwok's
nodes), the CRD's version annotation, a job's recorded trainer; with the user's own kubeconfig."""

from __future__ import annotations

import json
import uuid

import pytest
from helpers.kube import install_crd
from support import ROOT, job_doc, kubetrain

from kubetrain.shared import __version__

pytestmark = pytest.mark.cluster
CHART = ROOT / "charts" / "kubetrain"


@pytest.fixture
def installed(cluster):
    """The chart, namespaced, in a namespace of its own: (namespace, release)."""
    install_crd(cluster)
    release = f"kt-v{uuid.uuid4().hex[:5]}"
    ns = f"{release}-ns"
    cluster.run("helm", "install", release, str(CHART), "--namespace", ns, "--create-namespace",
                "--set", "operator.namespaced=true", "--wait", "--timeout", "120s", timeout=180)
    try:
        yield ns, release
    finally:
        cluster.run("helm", "uninstall", release, "--namespace", ns, "--wait", timeout=180)
        cluster.kubectl("delete", "namespace", ns, "--wait=false")


def version(cluster, *args: str):
    return kubetrain("version", *args, env={"KUBECONFIG": str(cluster.kubeconfig)}, timeout=120)


def test_it_finds_the_operator_and_the_crd_of_an_installation(cluster, installed):
    ns, release = installed
    deployment = f"{release}-kubetrain"  # the chart's full name
    done = version(cluster, "--operator-namespace", ns)
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert out[0] == f"client:   kubetrain {__version__}"
    assert out[1].startswith(f"operator: kubetrain {__version__} ({ns}/{deployment}: kubetrain/operator:{__version__}; "
                             f"pods: {deployment}-"), out
    assert out[1].endswith(f" {__version__})"), out
    assert out[2] == f"crd:      kubetrain {__version__} (trainingjobs.kubetrain.dev, served v1alpha1)", out
    assert not [line for line in out if line.startswith("warning:")], out
    everywhere = json.loads(version(cluster, "-o", "json").stdout)  # every namespace: ours among them
    assert {"namespace": ns, "name": deployment} in [{k: o[k] for k in ("namespace", "name")}
                                                     for o in everywhere["operators"]]


def test_a_jobs_recorded_trainer_and_its_skew(cluster, installed):
    ns, _ = installed
    name = f"v-{uuid.uuid4().hex[:5]}"
    cluster.kube(ns).apply(job_doc(name, "Single", model={"name": "mlp"}, dataset={"name": "digits"}))
    # What an operator of 0.0.x recorded: outside this operator's window.
    cluster.kubectl("-n", ns, "patch", "trainingjob", name, "--subresource=status", "--type=merge", "-p",
                    json.dumps({"status": {"trainer": {"image": "kubetrain/trainer:0.0.9", "version": "0.0.9"}}}))
    done = version(cluster, "--operator-namespace", ns, "--job", name, "-n", ns)
    assert done.returncode == 0, done.stderr
    assert f"trainer:  kubetrain 0.0.9 ({ns}/{name}: kubetrain/trainer:0.0.9)" in done.stdout.splitlines()
    assert "warning: The job's trainer is kubetrain 0.0.9" in done.stdout, done.stdout
    missing = version(cluster, "--operator-namespace", ns, "--job", "no-such-job", "-n", ns)
    assert missing.returncode == 1 and "not found" in missing.stderr, missing.stderr
