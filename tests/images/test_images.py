"""The images `hack/images build` makes, run in containers: entry points, no torch in the operator, a Single job.

Each test starts a working container of the built image (`buildah from`) and
runs commands in it with `buildah run` and runc, as uid 1000 (the images'
USER), with no network. The images must be current: the session fixture runs
`hack/images check` and fails, naming the stale image, when they are not
built from the current sources (the README's test command builds them first).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml
from kubetrain.shared import __version__
from support import ROOT, job_doc

pytestmark = pytest.mark.images

VERSION = __version__  # the one version (kubetrain/shared/__init__.py), which pyproject.toml reads
UID = 1000
# The pins the trainer image must carry, as requirements/dev.lock names them.
TRAINER_PINS = ["torch", "numpy", "scikit-learn", "grpcio", "protobuf", "prometheus_client", "PyYAML"]


def ref(image: str) -> str:
    return f"localhost/kubetrain/{image}:{VERSION}"


def lock_pins() -> dict[str, str]:
    lines = (ROOT / "requirements/dev.lock").read_text().split()
    return dict(line.split("==", 1) for line in lines if "==" in line)


@pytest.fixture(scope="session")
def images():
    if shutil.which("buildah") is None or shutil.which("runc") is None:
        pytest.fail("buildah and runc are needed to run the images: run hack/images build (it installs them)")
    check = subprocess.run([str(ROOT / "hack/images"), "check"], capture_output=True, text=True, timeout=300)
    if check.returncode != 0:
        pytest.fail(f"hack/images check: {check.stderr.strip()}")
    return {name: ref(name) for name in ("trainer", "operator")}


def config(image_ref: str) -> dict:
    out = subprocess.run(["buildah", "inspect", "--type", "image", image_ref], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)["OCIv1"]["config"]


@contextmanager
def container(image_ref: str):
    name = subprocess.run(
        ["buildah", "from", "--pull=never", "--quiet", image_ref], check=True, capture_output=True, text=True
    ).stdout.strip()
    try:
        yield name
    finally:
        subprocess.run(["buildah", "rm", name], capture_output=True)


def run(ctr: str, *command: str, env: dict[str, str] | None = None, volumes: dict[Path, str] | None = None,
        timeout: float = 300) -> subprocess.CompletedProcess:
    """`command` in the container as its USER, without network; volumes map host dirs to container paths."""
    args = ["buildah", "run", "--runtime", shutil.which("runc"), "--network", "none"]
    for key, value in (env or {}).items():
        args += ["--env", f"{key}={value}"]
    for host, path in (volumes or {}).items():
        args += ["--volume", f"{host}:{path}"]
    return subprocess.run([*args, ctr, "--", *command], capture_output=True, text=True, timeout=timeout)


def upper_dir_files(ctr: str) -> list[str]:
    """Files the container wrote into its own writable layer (overlay's upper dir), not into volumes."""
    merged = subprocess.run(["buildah", "mount", ctr], check=True, capture_output=True, text=True).stdout.strip()
    try:
        upper = Path(merged).parent / "diff"
        assert upper.is_dir(), f"no overlay upper dir next to {merged}: buildah's storage driver is not overlay"
        return sorted(str(p.relative_to(upper)) for p in upper.rglob("*") if not p.is_dir())
    finally:
        subprocess.run(["buildah", "umount", ctr], capture_output=True)


def test_operator_entry_point_answers_version(images):
    entrypoint = config(images["operator"])["Entrypoint"]
    with container(images["operator"]) as ctr:
        result = run(ctr, *entrypoint, "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"kubetrain {VERSION}"


def test_operator_image_has_no_torch_and_imports_the_operator(images):
    with container(images["operator"]) as ctr:
        torch = run(ctr, "python", "-c", "import torch")
        operator = run(ctr, "python", "-c",
                       "import sys, kopf, kubernetes, kubetrain.drivers.cluster.run, kubetrain.cli.commands; "
                       "print('torch' in sys.modules)")
    assert torch.returncode != 0
    assert "No module named 'torch'" in torch.stderr
    assert operator.returncode == 0, operator.stderr
    assert operator.stdout.strip() == "False"


def test_images_leave_the_benchmarks_out_and_say_so(images):
    """kubetrain.bench is a development tool: no image carries it, and `kubetrain bench` says where it runs."""
    for image in ("operator", "trainer"):
        with container(images[image]) as ctr:
            found = run(ctr, "python", "-c", "import importlib.util as u; print(u.find_spec('kubetrain.bench'))")
            bench = run(ctr, "python", "-m", "kubetrain.cli", "bench", "transport")
        assert found.returncode == 0 and found.stdout.strip() == "None", (image, found.stdout, found.stderr)
        assert bench.returncode == 2, (image, bench.stdout, bench.stderr)
        assert "kubetrain bench runs from a checkout" in bench.stderr and "Traceback" not in bench.stderr, bench.stderr


@pytest.mark.parametrize("image", ["trainer", "operator"])
def test_image_runs_as_uid_1000_with_the_version_label(images, image):
    cfg = config(images[image])
    with container(images[image]) as ctr:
        ids = run(ctr, "python", "-c", "import os; print(os.getuid(), os.getgid())")
    assert cfg["User"] == f"{UID}:{UID}"
    assert cfg["Labels"]["org.opencontainers.image.version"] == VERSION
    assert ids.returncode == 0, ids.stderr
    assert ids.stdout.split() == [str(UID), str(UID)]


def test_trainer_python_is_the_venvs_with_the_locked_pins(images):
    probe = (
        "import json, shutil, sys, importlib.metadata as m; "
        "import torch, grpc, kubetrain.trainer.ps, kubetrain.trainer.ddp; "
        f"print(json.dumps({{'python': shutil.which('python'), 'prefix': sys.prefix, "
        f"'versions': {{n: m.version(n) for n in {TRAINER_PINS!r}}}}}))"
    )
    with container(images["trainer"]) as ctr:
        result = run(ctr, "python", "-c", probe)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["python"] == "/opt/venv/bin/python"
    assert found["prefix"] == "/opt/venv"
    pins = lock_pins()
    assert found["versions"] == {name: pins[name] for name in TRAINER_PINS}


def test_trainer_image_runs_a_single_job_to_completion(images, tmp_path):
    # A host dir mounted where a pod mounts its data volume, and /tmp as the
    # pod's emptyDir: both writable by uid 1000, the rest of the filesystem
    # must stay untouched (it is read-only in pods).
    job_dir, tmp_dir = tmp_path / "job", tmp_path / "tmp"
    for d in (job_dir, tmp_dir):
        d.mkdir()
        os.chown(d, UID, UID)
    doc = job_doc(
        "image-single",
        model={"name": "mlp", "args": {"hidden": 64}},
        dataset={"name": "digits", "evalFraction": 0.2},
        training={"epochs": 5, "batchSize": 64, "optimizer": {"name": "sgd", "learningRate": 0.05, "momentum": 0.9},
                  "seed": 0},
        checkpoint={"intervalSteps": 20, "keepLast": 2},
    )
    (job_dir / "job.yaml").write_text(yaml.safe_dump(doc))
    env = {
        "KUBETRAIN_JOB_FILE": "/data/job.yaml",
        "KUBETRAIN_JOB_NAME": "image-single",
        "KUBETRAIN_NAMESPACE": "default",
        "KUBETRAIN_REPLICA": "single-0",
        "KUBETRAIN_RUN_DIR": "/data/run",
        "KUBETRAIN_CHECKPOINT_DIR": "/data/run/checkpoints/single-0",
        "KUBETRAIN_METRICS_PORT": "0",
        "OMP_NUM_THREADS": "1",
    }
    entrypoint = config(images["trainer"])["Entrypoint"]
    with container(images["trainer"]) as ctr:
        result = run(ctr, *entrypoint, "single", env=env, volumes={job_dir: "/data", tmp_dir: "/tmp"})
        written = upper_dir_files(ctr)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((job_dir / "run/results/single-0.json").read_text())
    assert summary["steps"] > 0 and summary["epochs"] == 5
    assert summary["eval_accuracy"] > 0.8, summary
    assert sorted(p.name for p in (job_dir / "run/checkpoints/single-0").glob("ckpt-*.pt")), "no checkpoint written"
    owners = {p.stat().st_uid for p in (job_dir / "run").rglob("*")}
    assert owners == {UID}
    # buildah run bind-mounts its own /etc/hosts, /etc/resolv.conf and
    # /run/.containerenv; anything else would fail on a read-only root.
    assert [f for f in written if f not in {"etc/hosts", "etc/resolv.conf", "run/.containerenv"}] == []
