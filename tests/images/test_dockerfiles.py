"""The Dockerfiles as users build them: pinned base, version label, non-root, exec-form entry points.

Static checks of the files (no buildah): they hold for a `docker build` on a
user's machine as much as for `hack/images build` here.
"""

from __future__ import annotations

import json
import re

import pytest
from kubetrain.shared import __version__
from support import ROOT

VERSION = __version__  # the one version (kubetrain/shared/__init__.py), which pyproject.toml reads
DOCKERFILES = {"trainer": ROOT / "trainer/Dockerfile", "operator": ROOT / "operator/Dockerfile"}


def instructions(path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", path.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def last(path, name: str) -> str:
    return [args for instr, args in instructions(path) if instr == name][-1]


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_base_image_default_is_a_pinned_python_image(image):
    base = [args for instr, args in instructions(DOCKERFILES[image]) if instr == "ARG" and args.startswith("BASE_IMAGE=")]
    assert len(base) == 1, base
    assert re.fullmatch(r"BASE_IMAGE=python:3\.1[1-9]\.\d+-slim-bookworm", base[0]), base[0]


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_version_label_default_is_the_packages_version(image):
    assert f"ARG VERSION={VERSION}" in [f"ARG {args}" for instr, args in instructions(DOCKERFILES[image]) if instr == "ARG"]
    assert 'org.opencontainers.image.version="${VERSION}"' in last(DOCKERFILES[image], "LABEL")


@pytest.mark.parametrize(
    ("image", "entrypoint", "cmd"),
    [
        ("trainer", ["python", "-m", "kubetrain.trainer"], ["--help"]),
        ("operator", ["kubetrain"], ["operator"]),
    ],
)
def test_entry_point_is_exec_form_and_final_user_is_1000(image, entrypoint, cmd):
    path = DOCKERFILES[image]
    assert json.loads(last(path, "ENTRYPOINT")) == entrypoint
    assert json.loads(last(path, "CMD")) == cmd
    assert last(path, "USER") == "1000:1000"
    assert [instr for instr, _ in instructions(path)].count("FROM") >= 2, "multi-stage"


def test_operator_image_installs_no_trainer_extra():
    text = DOCKERFILES["operator"].read_text()
    assert '["optional-dependencies"]["operator"]' in text
    assert "trainer\"]" not in text and "torch" not in re.sub(r"#.*", "", text)


def test_dockerignore_lets_through_what_the_build_copies():
    allowed = {line[1:] for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    for path in DOCKERFILES.values():
        for instr, args in instructions(path):
            if instr == "COPY" and not args.startswith("--from"):
                sources = args.split()[:-1]
                assert set(sources) <= allowed, (path.name, sources, allowed)
