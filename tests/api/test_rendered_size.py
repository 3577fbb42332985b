"""What one job may cost the operator: its template's size times the pods it is merged into
(spec.MAX_RENDERED_TEMPLATE_BYTES), refused before anything is rendered; and what is rendered at all.

A 107 KB manifest within every bound of the CRD (64 shards, 1,024 workers, 8 standbys, 64 sidecars of
40 variables each) made `kubetrain validate` use 647 MiB for 21 s, and the operator render every pod
twice each round: past its 512 Mi limit, it crash-looped for every tenant.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc

import pytest
import yaml

from kubetrain.cli import main
from kubetrain.api.load import from_spec_dict
from kubetrain.api.spec import MAX_RENDERED_TEMPLATE_BYTES
from kubetrain.api.status import JobStatus
from kubetrain.engine import children as children_module
from kubetrain.engine import podsecurity
from kubetrain.engine.children import Settings
from kubetrain.engine.engine import ReplicaObservation
from kubetrain.engine.reconcile import reconcile

WORKERS, SHARDS, STANDBYS = 1024, 64, 8
PODS = WORKERS + SHARDS + STANDBYS


def heavy_spec(variables: int = 40, sidecars: int = 64, suspend: bool = True) -> dict:
    containers = [{"name": f"side-{i}", "image": "busybox",
                   "env": [{"name": f"V{j}", "value": "x" * 8} for j in range(variables)]} for i in range(sidecars)]
    return {"mode": "ParameterServer",
            "parameterServer": {"replicas": SHARDS, "workers": WORKERS, "standbyWorkers": STANDBYS},
            "runPolicy": {"suspend": suspend}, "podTemplate": {"spec": {"containers": containers}}}


def sized_spec(template_bytes: int) -> dict:
    """The heavy job's counts with a template of exactly `template_bytes` bytes of JSON."""
    spec = heavy_spec(variables=1, sidecars=1)
    env = spec["podTemplate"]["spec"]["containers"][0]["env"][0]
    env["value"] = ""
    size = len(json.dumps(spec["podTemplate"], separators=(",", ":")))
    env["value"] = "x" * (template_bytes - size)
    return spec


def manifest(tmp_path, spec: dict):
    file = tmp_path / "job.yaml"
    file.write_text(yaml.safe_dump({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob",
                                    "metadata": {"name": "heavy"}, "spec": spec}))
    return file


def test_the_papers_job_is_refused_naming_the_template_and_the_counts(tmp_path, capsys):
    file = manifest(tmp_path, heavy_spec())
    assert main(["validate", str(file)]) == 2
    err = capsys.readouterr().err
    assert f"{file}: spec.podTemplate: is " in err and f"would be merged into {PODS} pods" in err, err
    assert f"{WORKERS} (parameterServer.workers)" in err and f"{SHARDS} (parameterServer.replicas)" in err
    assert f"({MAX_RENDERED_TEMPLATE_BYTES} bytes, 4 MiB)" in err and "Traceback" not in err


def test_the_bound_holds_at_its_edge_and_refuses_one_byte_past_it(tmp_path, capsys):
    edge = MAX_RENDERED_TEMPLATE_BYTES // PODS
    assert main(["validate", str(manifest(tmp_path, sized_spec(edge)))]) == 0, capsys.readouterr().err
    assert main(["validate", str(manifest(tmp_path, sized_spec(edge + 1)))]) == 2
    assert f"is {edge + 1} bytes (as JSON)" in capsys.readouterr().err


def test_validate_of_the_largest_job_within_the_bound_stays_small(tmp_path):
    """A child process, so that its peak memory is its own: `kubetrain validate` of a job at the bound
    judges one pod of each role, not 1,096 pods twice (647 MiB before)."""
    file = manifest(tmp_path, sized_spec(MAX_RENDERED_TEMPLATE_BYTES // PODS))
    # VmHWM, the peak of this process's own memory: getrusage's ru_maxrss keeps the forking parent's
    # (pytest's, hundreds of MiB late in a run) across exec.
    code = ("import re, sys; from kubetrain.cli import main; rc = main(['validate', sys.argv[1]]); "
            "print(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)); sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, str(file)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    peak_mib = int(done.stdout.split()[-1]) / 1024
    # The interpreter, torch-free imports and the spec: about 35 MiB here; 100 MiB is far below 647.
    assert peak_mib < 100, peak_mib


def job_at_the_bound(suspend: bool = False):
    spec = sized_spec(MAX_RENDERED_TEMPLATE_BYTES // PODS)
    spec["runPolicy"]["suspend"] = suspend
    return from_spec_dict("heavy", spec, "team-a")


def count_renders(monkeypatch) -> list[str]:
    rendered: list[str] = []
    real = children_module.pod

    def pod(job, uid, replica, settings):
        rendered.append(replica.name)
        return real(job, uid, replica, settings)

    monkeypatch.setattr(children_module, "pod", pod)
    return rendered


def test_pod_security_judges_one_pod_of_each_role(monkeypatch):
    rendered = count_renders(monkeypatch)
    assert podsecurity.problems(job_at_the_bound(), Settings()) == []
    # Three roles, each rendered with the template and without it.
    assert sorted(rendered) == sorted(["ps-0", "worker-0", "standby-0"] * 2), rendered


@pytest.mark.parametrize("missing", [0, 1, PODS], ids=["none missing", "one missing", "all missing"])
def test_a_round_renders_only_the_pods_it_creates(monkeypatch, missing):
    job = job_at_the_bound()
    names = [f"ps-{i}" for i in range(SHARDS)] + [f"worker-{i}" for i in range(WORKERS)] \
        + [f"standby-{i}" for i in range(STANDBYS)]
    pods = {n: ReplicaObservation(replica=n, phase="Running") for n in names[missing:]}
    rendered = count_renders(monkeypatch)
    tracemalloc.start()
    try:
        old = JobStatus() if missing == PODS else JobStatus(state="Running")  # a new job, or a running one
        act = reconcile(job, "uid", "token", pods, old, 1000.0,
                        existing=None if missing == PODS else {("ConfigMap", "heavy-config")})
        peak_mib = tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()
    created = sorted(o["metadata"]["name"] for o in act.create if o["kind"] == "Pod")
    assert len(rendered) == len(created) == missing, (len(rendered), created[:5])
    # All 1,096 pods at the bound, each rendered once: 4 MiB of JSON, tens of MiB as Python objects.
    print(f"round with {missing} missing: {len(rendered)} rendered, traced peak {peak_mib:.1f} MiB")
    assert peak_mib < (150 if missing == PODS else 10), peak_mib
