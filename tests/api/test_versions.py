"""One version for the package, the images, the chart and the CRD, set in one place; the previous release
recorded; what an image says of its version; the trainer skew policy (n-1)."""

from __future__ import annotations

import shutil
import subprocess
import tomllib

import pytest
import yaml
from support import ROOT

from kubetrain.shared import __version__
from kubetrain.api import crd, versions
from kubetrain.cli.parser import build_parser
from kubetrain.engine.children import Settings

RELEASE = ROOT / "hack" / "release"


def test_every_copy_of_the_version_is_the_packages():
    done = subprocess.run([str(RELEASE), "versions"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_pyproject_reads_the_version_from_the_package():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "kubetrain.shared.__version__"}


def test_the_chart_the_crd_and_the_operators_default_trainer_carry_it():
    chart = yaml.safe_load((ROOT / "charts/kubetrain/Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == __version__
    assert crd.crd()["metadata"]["annotations"][versions.VERSION_ANNOTATION] == __version__
    operator = build_parser().parse_args(["operator"])
    assert operator.trainer_image == Settings().image == f"kubetrain/trainer:{__version__}"
    assert "tag" not in yaml.safe_load((ROOT / "hack/values-e2e.yaml").read_text())["trainer"]["image"]


def copy_of_the_tree(tmp_path):
    """The files hack/release reads and rewrites, in a tree of their own."""
    for rel in ("hack/release", "hack/releases", "kubetrain/shared/__init__.py", "CHANGELOG.md", "README.md",
                "charts/kubetrain", "trainer/Dockerfile", "operator/Dockerfile", "docs", "examples", "deploy",
                "hack/values-e2e.yaml"):
        src, dst = ROOT / rel, tmp_path / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():  # what hack/release reads: text files (a generated model under examples/ is not)
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("base-model", "*.jsonl", "*.safetensors",
                                                                    "__pycache__"))
        else:
            shutil.copy2(src, dst)
    return tmp_path


def test_bump_sets_every_copy_and_opens_a_changelog_section(tmp_path):
    tree = copy_of_the_tree(tmp_path)
    done = subprocess.run([str(tree / "hack/release"), "bump", "9.8.7"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    check = subprocess.run([str(tree / "hack/release"), "versions"], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert '__version__ = "9.8.7"' in (tree / "kubetrain/shared/__init__.py").read_text()
    assert "ARG VERSION=9.8.7" in (tree / "trainer/Dockerfile").read_text()
    assert "image: kubetrain/custom-example:9.8.7" in (tree / "examples/custom/single.yaml").read_text()
    assert yaml.safe_load((tree / "charts/kubetrain/Chart.yaml").read_text())["appVersion"] == "9.8.7"
    changelog = (tree / "CHANGELOG.md").read_text()
    assert changelog.index("## 9.8.7 (unreleased)") < changelog.index(f"## {__version__}")


def test_a_stale_copy_is_named_with_its_line(tmp_path):
    tree = copy_of_the_tree(tmp_path)
    dockerfile = tree / "examples/llm/Dockerfile"
    dockerfile.write_text(dockerfile.read_text().replace(f"kubetrain/trainer:{__version__}", "kubetrain/trainer:0.0.9"))
    done = subprocess.run([str(tree / "hack/release"), "versions"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "examples/llm/Dockerfile:" in done.stdout and "kubetrain/trainer:0.0.9" in done.stdout, done.stdout


def test_the_previous_release_is_recorded_and_its_tag_agrees():
    version, commit = subprocess.run([str(RELEASE), "previous"], capture_output=True, text=True, check=True,
                                     timeout=60).stdout.split()
    assert versions.parse(version) < versions.parse(__version__)
    assert len(commit) == 40
    tagged = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "-q", "--verify", f"refs/tags/v{version}^{{commit}}"],
                            capture_output=True, text=True)
    if tagged.returncode == 0:  # a clone without tags falls back to the recorded commit
        assert tagged.stdout.strip() == commit


@pytest.mark.parametrize(("image", "name", "version"), [
    ("kubetrain/trainer:0.1.0", "trainer", "0.1.0"),
    ("docker.io/kubetrain/trainer:0.2.0", "trainer", "0.2.0"),
    ("registry.example:5000/ml/trainer:1.4.2-rc.1", "trainer", "1.4.2-rc.1"),
    ("registry.example:5000/ml/trainer", "trainer", ""),  # no tag: the colon is the port's
    ("kubetrain/trainer:latest", "trainer", ""),
    ("kubetrain/trainer@sha256:" + "a" * 64, "trainer", ""),
    ("kubetrain/custom-example:0.2.0", "trainer", ""),  # a user's image says nothing of its trainer
    ("kubetrain/operator:0.2.0", "operator", "0.2.0"),
    ("kubetrain/operator:0.2.0", "trainer", ""),
])
def test_an_image_names_a_version_only_as_kubetrains_own_image(image, name, version):
    assert versions.image_version(image, name) == version


@pytest.mark.parametrize(("trainer", "operator", "supported"), [
    ("0.2.0", "0.2.0", True),
    ("0.2.3", "0.2.0", True),  # patches do not count
    ("0.1.0", "0.2.0", True),  # n-1
    ("0.0.9", "0.2.0", False),  # n-2
    ("0.3.0", "0.2.0", False),  # newer: a rollback
    ("1.2.0", "0.2.0", False),
    ("0.9.0", "1.0.0", False),  # another major
    ("", "0.2.0", True),  # unknown: nothing to say
    ("0.2.0", "", True),
])
def test_the_operator_supports_its_own_minor_version_and_the_one_before(trainer, operator, supported):
    assert (versions.skew(trainer, operator) is None) == supported
