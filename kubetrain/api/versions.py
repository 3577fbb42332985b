"""kubetrain's versions: what an image says of its version, and which trainer versions an operator supports.

One version names the package, its two images (`kubetrain/trainer:<version>`, `kubetrain/operator:<version>`),
the chart (its version and appVersion) and the CRD (its `kubetrain.dev/version` annotation): it is set in one
place, `kubetrain.shared.__version__`, and tests/api/test_versions.py holds every other copy equal to it.

The skew policy (docs/operating.md#upgrades), as Kubernetes' own between a kubelet and its API server: an
operator supports trainers of its own minor version and of the one before (n-1). A job runs one trainer for
its whole life (`status.trainer`, recorded by the engine), so an upgraded operator drives jobs that an older
one started; a job whose trainer is outside the window (older than n-1, or newer than the operator: after a
rollback) gets one Warning Event per operator version, and runs on. Pure.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kubetrain.shared import __version__

VERSION_ANNOTATION = "kubetrain.dev/version"
"""On the CRD (api/crd.py): the kubetrain version whose model generated it. `kubetrain version` compares it with
the operator's: Helm never upgrades a chart's `crds/`, and an operator newer than its CRD writes fields the API
server prunes."""
TRAINER_IMAGE_NAME = "trainer"
"""The last path component of kubetrain's trainer image (`kubetrain/trainer`, `registry.example/ml/trainer`):
its tag is the trainer's version."""
MINORS_SUPPORTED_BEHIND = 1
"""How many minor versions older than the operator a trainer may be: n-1, so that every job running when an
operator is upgraded by one minor version keeps a supported trainer until it ends."""
SKEW_REASON = "TrainerVersionSkew"

_VERSION = re.compile(r"v?(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)([-+][0-9A-Za-z.+-]*)?")


@dataclass(frozen=True, order=True)
class Version:
    """A semantic version's numbers; a pre-release or build suffix is kept apart from the ordering."""

    major: int
    minor: int
    patch: int
    suffix: str = ""

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}{self.suffix}"

    @property
    def minor_line(self) -> str:
        """`0.2`: what the skew policy counts in."""
        return f"{self.major}.{self.minor}"


def parse(text: str) -> Version | None:
    """`0.2.0`, `v0.2.0`, `0.2.0-rc.1` as a Version; None for anything else (a digest, `latest`, "")."""
    match = _VERSION.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None:
        return None
    return Version(int(match[1]), int(match[2]), int(match[3]), match[4] or "")


def image_version(image: str, name: str = TRAINER_IMAGE_NAME) -> str:
    """The kubetrain version an image reference names: its tag when the image is kubetrain's `name` image
    (`kubetrain/trainer:0.1.0`, `registry:5000/ml/trainer:0.2.0`; `operator` for the operator's), else ""
    (unknown: a user's own image, a digest, a tag that is no version). A user's image built FROM the trainer
    says nothing of which one."""
    reference = image.split("@", 1)[0]
    repository, colon, tag = reference.rpartition(":")
    if not colon or "/" in tag:  # no tag (`kubetrain/trainer`), or the colon was a registry's port
        return ""
    if repository.rsplit("/", 1)[-1] != name:
        return ""
    version = parse(tag)
    return str(version) if version is not None else ""


def skew(trainer: str, operator: str = __version__) -> str | None:
    """Why an operator of version `operator` does not support a trainer of version `trainer` (a sentence for
    the Warning Event), or None when it does, or when either version is unknown."""
    t, o = parse(trainer), parse(operator)
    if t is None or o is None:
        return None
    oldest = max(0, o.minor - MINORS_SUPPORTED_BEHIND)
    if t.major == o.major and oldest <= t.minor <= o.minor:
        return None
    window = (f"{o.major}.{oldest} to {o.minor_line}" if oldest < o.minor else o.minor_line)
    if (t.major, t.minor) > (o.major, o.minor):
        why = f"newer than this operator ({o}), as after a rollback (helm rollback)"
    else:
        why = f"older than this operator ({o}) supports"
    return (f"The job's trainer is kubetrain {t}, {why}: operator {o} supports trainers {window} (n-1). The job "
            "runs on, unsupported; let it finish before the next upgrade, or submit it again to run it on the "
            "operator's own trainer (docs/operating.md#upgrades).")
