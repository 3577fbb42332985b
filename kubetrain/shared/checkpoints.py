"""The layout of a checkpoint directory: what the trainer writes there, and what a supervisor reads back.

A run directory (a local run's `runs/<name>/`, or `<job>/` on a claim that replicas or jobs share)
holds the job's manifest and one checkpoint directory per replica:

    job.yaml
    checkpoints/<replica>/             (a DDP group with one shared claim: ddp-0's, for the group)

A checkpoint directory:

    ckpt-<step:08d>.pt                 a checkpoint of one process (kubetrain/trainer/checkpoint.py)
    sharded-<step:08d>/                a sharded one, every rank's files and COMMIT (kubetrain/trainer/sharded.py)
    .sharded-<step:08d>-<token>.tmp/   a sharded save in flight, or one a crash cut short: no COMMIT
    <name>.corrupt                     one that failed its checks at a restore, set aside
    latest                             the name of the newest durable checkpoint, one line

The trainer writes `latest` (kubetrain.shared.files.atomic_write) only once the checkpoint it names
is durable and verified, so a supervisor (the local backend, `kubetrain checkpoints`) that reads the
step from it never reports a checkpoint that a crash could still take back.

In object storage (spec.checkpoint.storage.uri), the job's URI holds one prefix per replica, as a run
directory holds checkpoints/<replica>/ (a DDP group's is ddp-0/, which every node shares):

    <uri>/job.yaml                                   the job's manifest (what export needs to know the job)
    <uri>/owner.json                                 the job that owns the prefix, written once (its first writer)
    <uri>/<replica>/ckpt-<step:08d>-<token>.pt        a plain checkpoint's object (the bytes of a ckpt file)
    <uri>/<replica>/sharded-<step:08d>-<token>/<file> a sharded one's objects (DCP's files)
    <uri>/<replica>/commits/<name>.json               the commit of checkpoint <name> (ckpt-<step>.pt or
                                                      sharded-<step>): every object with its length and
                                                      sha256, written last
    <uri>/<replica>/commits/<name>.json.corrupt       a commit whose objects failed their checks, set aside
                                                      (its objects kept, for a person to look at)

An object is immutable once written (a new save of the same step has a new token), so a commit never
names an object that a later save changes; objects that no commit names are a save cut short, removed
by the prefix's writer. The replica's local checkpoint directory keeps `latest`, moved only once the
commit is written, and the newest checkpoint's file, so that a supervisor reads progress as from a volume.
"""

from __future__ import annotations

import re
from pathlib import Path

from .files import PLAIN_NAME, read_regular

RUN_CHECKPOINTS = "checkpoints"
"""The folder of a run directory that holds a checkpoint directory per replica."""
RUN_JOB_FILE = "job.yaml"
"""The job's manifest in a run directory."""

LATEST = "latest"
"""The pointer file: the name of the newest durable checkpoint (a file or a sharded directory)."""
LATEST_MAX_BYTES = 4096
"""The most of `latest` read: a checkpoint's name is under 30 bytes; a larger file is not one the trainer wrote."""
COMMIT = "COMMIT"
"""In a sharded checkpoint's directory: the list of every rank's files, written last (the save's commit)."""
CORRUPT_SUFFIX = ".corrupt"
"""Appended to a checkpoint's name when a restore sets it aside."""

FILE_PATTERN = re.compile(r"ckpt-([0-9]{8})\.pt")
SHARDED_PATTERN = re.compile(r"sharded-([0-9]{8})")
SHARDED_TMP_PATTERN = re.compile(r"\.sharded-([0-9]{8})-([0-9a-f]+)\.tmp")
FILE_TMP_GLOB = ".ckpt-*.tmp"
"""The temporary files of checkpoint files being written (atomic_write's `.<name>.<pid>.<random>.tmp`)."""


COMMITS = "commits"
"""In object storage, the folder of a replica's prefix that holds its checkpoints' commits."""
COMMIT_SUFFIX = ".json"
COMMIT_KEY_PATTERN = re.compile(r"commits/(ckpt-[0-9]{8}\.pt|sharded-[0-9]{8})\.json")
OBJECT_PATTERN = re.compile(r"(ckpt|sharded)-([0-9]{8})-([0-9a-f]+)(\.pt|/" + PLAIN_NAME.pattern + ")")
"""A checkpoint's object key in a replica's prefix: its kind, step, token and the rest (a sharded one's
file: one plain name in its folder, never a `/`, `..` or an absolute path)."""
JOB_OBJECT = "job.yaml"
"""In object storage, the job's manifest at the root of its checkpoint URI."""
MIRROR_PROBLEMS = ".mirror-problems.json"
"""In a local copy of a bucket's checkpoints (`kubetrain checkpoints verify|compare|export s3://...`): what the
copy left out, objects missing or not what their commits say, for verify to report."""
OWNER_OBJECT = "owner.json"
"""In object storage, at the root of a job's checkpoint URI: which job owns the prefix (its namespace and
name, spec hash and identity), written once by the job's first writer; another job refuses the prefix."""


def object_key(name: str, token: str) -> str:
    """The key (in a replica's prefix) of the object or folder that holds checkpoint `name`, saved with
    `token`: `ckpt-<step>-<token>.pt`, or `sharded-<step>-<token>/` for a sharded one."""
    if name.endswith(".pt"):
        return f"{name.removesuffix('.pt')}-{token}.pt"
    return f"{name}-{token}/"


def commit_key(name: str) -> str:
    """The key (in a replica's prefix) of checkpoint `name`'s commit."""
    return f"{COMMITS}/{name}{COMMIT_SUFFIX}"


def file_name(step: int) -> str:
    return f"ckpt-{step:08d}.pt"


def sharded_name(step: int) -> str:
    return f"sharded-{step:08d}"


def sharded_tmp_name(step: int, token: str) -> str:
    return f".sharded-{step:08d}-{token}.tmp"


def step_of(name: str) -> int | None:
    """The step of the checkpoint named `name` (`ckpt-<step>.pt` or `sharded-<step>`); None for any other name."""
    match = FILE_PATTERN.fullmatch(name) or SHARDED_PATTERN.fullmatch(name)
    return int(match.group(1)) if match else None


def read_latest(directory: str | Path) -> str | None:
    """The name `latest` holds in `directory`; None when there is no pointer.

    OSError when it cannot be read or is not a regular file (a link, a FIFO: the volume is writable by
    the job's own code); the checkpoints themselves still count then.
    """
    try:
        raw = read_regular(Path(directory) / LATEST, LATEST_MAX_BYTES)
    except FileNotFoundError:
        return None
    return raw.decode(errors="replace").strip()


def latest_step(directory: str | Path) -> int | None:
    """The step of the checkpoint `latest` names in `directory` (a file or a sharded one); None if none.

    OSError as `read_latest`.
    """
    name = read_latest(directory)
    return None if name is None else step_of(name)


def replica_dir(run_dir: str | Path, replica: str) -> Path:
    """The checkpoint directory of `replica` in run directory `run_dir`."""
    return Path(run_dir) / RUN_CHECKPOINTS / replica


def replica_dirs(run_dir: str | Path) -> dict[str, Path] | None:
    """The checkpoint directories of the replicas of run directory `run_dir`, by replica, in name order;
    None when `run_dir` holds no checkpoints folder (it is then no run directory)."""
    root = Path(run_dir) / RUN_CHECKPOINTS
    if not root.is_dir():
        return None
    return {p.name: p for p in sorted(root.iterdir()) if p.is_dir()}
