"""Golden checkpoints of earlier releases (tests/assets/golden/README.md): what each kind of job is, how a release
made its checkpoints, and how a run's result is read, for the generator (tests/local/make_golden_checkpoints.py,
run by hack/golden-checkpoints) and the test that resumes them (tests/local/test_golden_checkpoints.py) alike."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

GOLDEN = Path(__file__).parent / "assets" / "golden"
MANIFESTS = GOLDEN / "manifests"


@dataclass(frozen=True)
class Kind:
    """One kind of job: its manifest (and the files beside it it needs), the fault that stops it half-way with a
    checkpoint behind it, and how its resumed result is compared with the one its release reached itself."""

    name: str
    fault: str
    files: tuple[str, ...] = ()
    exact: bool = True
    """The weights (every tensor of the final checkpoint) and the summary's figures equal to the last bit; else
    the eval accuracy within ACCURACY_TOLERANCE (a parameter server's arrival order, torchft's quorums)."""
    since: str = "2026-12-04"
    """The first release that has this kind (LoRA fine-tuning came with 0.1.0)."""

    @property
    def manifest(self) -> Path:
        return MANIFESTS / f"{self.name}.yaml"


KINDS = [
    Kind("single", "single-0:kill@step=25"),
    Kind("ddp", "ddp-0:kill@step=25"),
    Kind("ps", "ps-0:kill@step=25", exact=False),
    Kind("fsdp", "ddp-0:kill@step=25"),
    Kind("ft", "ddp-0:kill@step=50", exact=False),
    Kind("script", "single-0:kill@step=35", files=("train.py",)),
    Kind("lora", "single-0:kill@step=15", files=("base-model", "finetune.jsonl"), since="0.1.0"),
]
def _releases() -> dict[str, str]:
    """kubetrain before its first release (the commit of 2026-12-04 whose checkpoints issue 53 found refused),
    then every release of hack/releases, oldest first: each needs its goldens (hack/golden-checkpoints)."""
    found = {"2026-12-04": "69d6222d6b9ffe43b10a325f49ca59bcad5d0853"}
    for line in (Path(__file__).parents[1] / "hack" / "releases").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            version, commit = line.split()[:2]
            found[version] = commit
    return found


RELEASES = _releases()
"""Each release whose checkpoints are kept, with its commit."""
ACCURACY_TOLERANCE = 0.02
"""As the recovery check's for ParameterServer and DDP runs (kubetrain/trainer/verify.py RECOVERY_TOLERANCE)."""
SUMMARY_FIELDS = ("state", "steps", "eval_accuracy", "eval_loss", "final_train_loss")


def kinds_of(release: str) -> list[Kind]:
    order = list(RELEASES)
    return [k for k in KINDS if order.index(k.since) <= order.index(release)]


def workdir(kind: Kind, into: Path) -> Path:
    """A working directory holding the kind's manifest and the files it names (a script, a model, a corpus)."""
    into.mkdir(parents=True, exist_ok=True)
    shutil.copy(kind.manifest, into / kind.manifest.name)
    for name in kind.files:
        source = MANIFESTS / name
        (shutil.copytree if source.is_dir() else shutil.copy)(source, into / name)
    return into


def run(kubetrain: list[str], kind: Kind, cwd: Path, run_dir: Path, *extra: str,
        timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """`kubetrain run` of the kind's manifest in `cwd` (`kubetrain`: the command, a release's or today's)."""
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    return subprocess.run([*kubetrain, "run", kind.manifest.name, "--run-dir", str(run_dir), "--quiet", *extra],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def keep(run_dir: Path, golden: Path) -> None:
    """What a golden holds of a stopped run: its job.yaml (as that release wrote it) and its checkpoints, nothing a
    kill left half-written."""
    if golden.exists():
        shutil.rmtree(golden)
    golden.mkdir(parents=True)
    shutil.copy(run_dir / "job.yaml", golden / "job.yaml")
    shutil.copytree(run_dir / "checkpoints", golden / "checkpoints",
                    ignore=shutil.ignore_patterns(".*.tmp", ".sharded-*", "*.corrupt"))


def tensors(value: Any, path: str = "") -> list[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        return [(path, value)]
    if isinstance(value, dict):
        return [t for k in sorted(value, key=str) for t in tensors(value[k], f"{path}/{k}")]
    if isinstance(value, (list, tuple)):
        return [t for i, v in enumerate(value) for t in tensors(v, f"{path}/{i}")]
    return []


def final_state(checkpoint_dir: Path) -> tuple[int, dict[str, Any]]:
    """The step and state of the newest checkpoint of one replica's directory, plain or sharded (read whole)."""
    from kubetrain.trainer import sharded
    from kubetrain.trainer.checkpoint import read_valid

    plain = next(read_valid(checkpoint_dir), None)
    whole = sharded.complete(checkpoint_dir)
    if whole and (plain is None or whole[-1][0] > plain[0].step):
        step, path = whole[-1]
        return step, sharded.load_whole(path)
    assert plain is not None, f"{checkpoint_dir}: no checkpoint"
    return plain[0].step, plain[1]


def result(run_dir: Path) -> dict[str, Any]:
    """A finished run's figures: its summary's, the step of each replica's newest checkpoint and a sha256 of every
    tensor in it (its model, optimizer state, RNG states and data position)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    out: dict[str, Any] = {"summary": {k: summary.get(k) for k in SUMMARY_FIELDS}, "checkpoints": {}}
    for replica in sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.is_dir()):
        directory = run_dir / "checkpoints" / replica
        if not any(p.name.startswith(("ckpt-", "sharded-")) for p in directory.iterdir()):
            continue
        step, state = final_state(directory)
        sha = hashlib.sha256()
        for name, tensor in tensors(state):
            sha.update(name.encode())
            sha.update(str(tensor.dtype).encode())
            sha.update(tensor.detach().contiguous().cpu().numpy().tobytes())
        out["checkpoints"][replica] = {"step": step, "sha256": sha.hexdigest()}
    return out


def differences(kind: Kind, expected: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """How `got` differs from `expected` beyond what the kind allows; empty when it is the same result."""
    if got["summary"]["state"] != "Succeeded":
        return [f"state {got['summary']['state']}"]
    if kind.exact:
        return [f"{k}: expected {expected[k]!r}, got {got[k]!r}" for k in ("summary", "checkpoints")
                if expected[k] != got[k]]
    a, b = expected["summary"]["eval_accuracy"], got["summary"]["eval_accuracy"]
    if a is not None and (b is None or abs(a - b) > ACCURACY_TOLERANCE):
        return [f"eval_accuracy: expected {a} within {ACCURACY_TOLERANCE}, got {b}"]
    return []
