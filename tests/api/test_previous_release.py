"""What this release writes, the previous release reads: the n-1 half of docs/operating.md#upgrades that the
CRD's comparison (test_crd_compat.py) cannot see.

A job keeps its trainer across an upgrade (status.trainer), so this release's operator writes job files that the
previous release's trainer reads (a replica restarted after the upgrade, a ConfigMap rendered again at a resize);
and after a rollback the previous release's operator reads the jobs this release stored. The previous release's
model refuses a field it does not know: both must hold only what it knows, for every job it could express. The
previous release's package is taken from its commit (hack/releases) and run in a process of its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from io import BytesIO

import pytest
import yaml
from support import EXAMPLES, ROOT

from kubetrain.api import dump_manifest, load_file

PREVIOUS, COMMIT = subprocess.run([str(ROOT / "hack" / "release"), "previous"], capture_output=True, text=True,
                                  check=True).stdout.split()
MANIFESTS = sorted(p for p in EXAMPLES.rglob("*.yaml")
                   if "kind: TrainingJob" in p.read_text() and "base-model" not in str(p))
READ = """
import json, sys
from pathlib import Path
import kubetrain
from kubetrain.api import InvalidSpec, load_file
assert Path(kubetrain.__file__).is_relative_to(sys.argv[1]), kubetrain.__file__
out = {}
for path in sys.argv[2:]:
    try:
        load_file(path)
        out[path] = "ok"
    except InvalidSpec as err:
        out[path] = "; ".join(err.shown())
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def previous_package(tmp_path_factory):
    """The previous release's `kubetrain` package, from its commit."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", COMMIT, "kubetrain"],
                             capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"the clone lacks {COMMIT[:12]} (release {PREVIOUS}): {archive.stderr.decode().strip()}")
    root = tmp_path_factory.mktemp(f"kubetrain-{PREVIOUS}")
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(root, filter="data")
    return root


def read_by_previous(package, paths) -> dict[str, str]:
    """Each file as the previous release's model reads it: "ok" or its problems."""
    done = subprocess.run([sys.executable, "-c", READ, str(package), *map(str, paths)], capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(package), "PYTHONSAFEPATH": "1",
                                                       "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_the_previous_releases_trainer_reads_the_job_files_this_release_writes(previous_package, tmp_path):
    """For every example the previous release can express: the job file (the spec with defaults filled in, what
    the operator mounts at /etc/kubetrain/job.yaml and `kubetrain run` keeps as job.yaml) reads there too."""
    as_written = read_by_previous(previous_package, MANIFESTS)
    expressible = [p for p in MANIFESTS if as_written[str(p)] == "ok"]
    assert expressible, as_written
    files = []
    for path in expressible:
        for i, job in enumerate(load_file(path)):
            out = tmp_path / f"{path.stem}-{i}.yaml"
            out.write_text(dump_manifest(job))
            files.append(out)
    refused = {p: why for p, why in read_by_previous(previous_package, files).items() if why != "ok"}
    assert not refused, f"{PREVIOUS}'s trainer refuses job files this release writes: {refused}"


def test_a_job_stored_by_this_release_reads_under_the_previous_operator(previous_package, tmp_path):
    """After a rollback the previous operator reads what the API server stores and returns: the manifest as
    the user wrote it, with the CRD's defaults applied (a new field has none: test_crd_compat.py)."""
    from kubetrain.api import crd

    schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    files = []
    for path in MANIFESTS:
        for i, doc in enumerate(d for d in yaml.safe_load_all(path.read_text()) if d):
            stored = dict(doc, spec=with_defaults(doc["spec"], schema))
            out = tmp_path / f"{path.stem}-{i}.yaml"
            out.write_text(yaml.safe_dump(stored))
            files.append((path, out))
    as_written = read_by_previous(previous_package, MANIFESTS)
    read = read_by_previous(previous_package, [out for _, out in files])
    refused = {str(path): read[str(out)] for path, out in files
               if as_written[str(path)] == "ok" and read[str(out)] != "ok"}
    assert not refused, f"{PREVIOUS}'s operator refuses jobs as this release's CRD stores them: {refused}"


def with_defaults(value, schema: dict):
    """`value` as the API server returns it: the structural schema's defaults applied where a field is absent,
    in every object present (as the API server does when it reads an object)."""
    if not isinstance(value, dict) or schema.get("type") != "object":
        return value
    out = dict(value)
    for name, prop in (schema.get("properties") or {}).items():
        if name not in out and "default" in prop:
            out[name] = json.loads(json.dumps(prop["default"]))
        if name in out:
            out[name] = with_defaults(out[name], prop)
    return out
