"""Checkpoints in object storage (spec.checkpoint.storage.uri): every guarantee of a checkpoint volume.

A bucket has no rename and no fsync, so the volume's "write a temporary file, verify, rename" becomes
"write immutable objects, verify, then write one commit object": a checkpoint exists once its commit
exists, and the commit lists every object with its length and sha256 (kubetrain.shared.checkpoints has
the layout). The newest checkpoint is resolved from the commits alone, never from a listing of objects,
so an upload cut short (a replica killed mid-upload: an object of a save with no commit, or a multipart
upload never completed) is never restored; the prefix's writer removes such leftovers at its next start
and after each commit, and aborts the incomplete multipart uploads, whose parts cost storage.

Saves stay off the training loop's path: the stores of checkpoint.py and sharded.py write the checkpoint
into the replica's local directory exactly as on a volume (the loop waits only for the copy into
memory), and their writer threads then upload the files and write the commit. Every rank of a sharded
state uploads its own shards in parallel; rank 0 writes the commit once every rank's objects are up.
A restore reads the newest commit, downloads a plain checkpoint (or uses the local copy when it is the
same bytes) and checks it against the commit; a sharded one is verified by every rank hashing its share
of the objects, then loaded straight from the store, each rank reading only the byte ranges of its
own shards (`ObjectReader`).

The local directory keeps `latest` (moved only once the commit is written, so the local backend reads
progress from it as from a volume) and the newest checkpoint's file (a restart on the same node or
pod, whose emptyDir survives a container restart, needs no download).
"""

from __future__ import annotations

import io
import json
import logging
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from kubetrain.shared.checkpoints import (COMMIT_KEY_PATTERN, COMMITS, CORRUPT_SUFFIX, JOB_OBJECT, LATEST,
                                          MIRROR_PROBLEMS, OBJECT_PATTERN, OWNER_OBJECT, commit_key, file_name,
                                          object_key, step_of)
from kubetrain.shared.files import OutsideFolder, atomic_write, confined
from kubetrain.shared.timestamps import iso
from kubetrain.api.identity import JobIdentity

from . import dcp_reader
from .checkpoint import CheckpointInfo, CheckpointStore, CorruptCheckpoint, Records, Written, another_spec
from .errors import ConfigError, LoadError, TransientError
from .objstore import CorruptObject, ObjectStore, ObjectURI, RangeReader, file_digest, shared_store
from .sharded import (METADATA, SHA256_HEX, Commit, CorruptSharded, ShardedCheckpointError, ShardedStore,
                      alone_is_meant, check_contents, rank_files, unfit)

log = logging.getLogger(__name__)

COMMIT_VERSION = 1
ANOTHER_URI = "Use another checkpoint.storage.uri, or delete the prefix's objects,"
# A commit lists a sharded checkpoint's objects, about 120 bytes each: 4 MiB holds some 30,000 ranks.
MAX_COMMIT_BYTES = 4 << 20
# Commits older than keepLast go with their objects; a listing of more commits than this in one prefix
# is not kubetrain's (keepLast is at most 1,000, two kinds, and those set aside).
MAX_COMMITS = 4096


@dataclass(frozen=True)
class ObjectCommit(Records):
    """A checkpoint in object storage: its name, what it says of the job it was written for (its step, spec hash
    and, since 0.2.0, identity: checkpoint.Written), and every object (a key relative to the replica's prefix)
    with its length and sha256."""

    name: str
    written: Written
    objects: dict[str, tuple[int, str]]
    world_size: int = 1

    @property
    def sharded(self) -> bool:
        return not self.name.endswith(".pt")

    @property
    def folder(self) -> str:
        """A sharded checkpoint's folder (`sharded-<step>-<token>/`), relative to the replica's prefix."""
        first = next(iter(self.objects), "")
        return first.split("/", 1)[0] + "/" if "/" in first else ""

    @property
    def size(self) -> int:
        return sum(n for n, _ in self.objects.values())

    def to_json(self) -> bytes:
        return json.dumps({"version": COMMIT_VERSION, "name": self.name, **self.written.to_json(),
                           "world_size": self.world_size, "time": iso(time.time()),
                           "objects": {k: {"length": n, "sha256": h} for k, (n, h) in sorted(self.objects.items())}},
                          indent=1).encode() + b"\n"

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> "ObjectCommit":
        """A commit's bytes (untrusted: anyone with the bucket's credentials writes them); CorruptObject naming
        `where` and the fault."""
        try:
            doc = json.loads(raw)
            written = Written.from_json(doc)
            objects = {k: (v["length"], v["sha256"]) for k, v in doc["objects"].items()}
            name, world_size = doc["name"], doc.get("world_size", 1)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
            raise CorruptObject(f"{where}: unreadable commit: {type(err).__name__}: {str(err)[:200]}") from None
        if not isinstance(name, str) or step_of(name) != written.step or not objects \
                or type(world_size) is not int or world_size < 1:
            raise CorruptObject(f"{where}: a commit of {str(name)[:60]!r} that names step {written.step}, "
                                f"{len(objects)} object(s) and world size {world_size!r}")
        kind = "ckpt" if name.endswith(".pt") else "sharded"
        folders = set()
        for key, (length, digest) in objects.items():
            match = OBJECT_PATTERN.fullmatch(key)
            if match is None or match.group(1) != kind or int(match.group(2)) != written.step:
                raise CorruptObject(f"{where}: a commit naming {key[:100]!r}, which is not an object of "
                                    f"{name}'s (refused: a key with '/', '..' or another checkpoint's name "
                                    "would lead outside it)")
            folders.add(key.split("/", 1)[0])
            if type(length) is not int or length < 0 or not isinstance(digest, str) or not SHA256_HEX.fullmatch(digest):
                raise CorruptObject(f"{where}: a commit giving {key} a length {length!r} and sha256 "
                                    f"{str(digest)[:70]!r}")
        if len(folders) != 1 or (kind == "ckpt" and len(objects) != 1):
            raise CorruptObject(f"{where}: a commit of {name} naming the objects of {len(folders)} checkpoints")
        return cls(name, written, objects, world_size)


@dataclass(frozen=True)
class CommittedCheckpoint:
    """A committed checkpoint as a restore names it: its commit and where its objects lie."""

    commit: ObjectCommit
    uri: ObjectURI

    @property
    def name(self) -> str:
        return self.commit.name

    def __str__(self) -> str:
        return str(self.uri)


class ObjectCheckpoints:
    """One replica's checkpoint prefix in the store: its commits and objects, and the cleanup its writer does.

    Every method is one or a few requests; none holds state between calls, so a restarted replica, a
    second rank or `kubetrain checkpoints` sees the same prefix the same way.
    """

    def __init__(self, prefix: ObjectURI, store: ObjectStore | None = None):
        self.prefix = prefix.prefix()
        self.store = store or shared_store()

    def uri(self, key: str) -> ObjectURI:
        return self.prefix.child(key)

    def commits(self, sharded: bool | None = None) -> list[ObjectCommit]:
        """The prefix's readable commits, oldest first (of one kind, or both); not verified. An unreadable
        commit is named in a warning and skipped."""
        return self._commits(sharded)[0]

    def _commits(self, sharded: bool | None = None) -> tuple[list[ObjectCommit], set[int]]:
        """The readable commits, and the steps of those that are not (unreadable, or set aside): nothing of
        those steps is ever removed as unreferenced (a commit of a newer release, a damaged one a person may
        want back)."""
        keys = [i.uri.key[len(self.prefix.key):] for i in self.store.list(self.prefix.child(COMMITS + "/"))]
        live = [k for k in keys if COMMIT_KEY_PATTERN.fullmatch(k)]
        if len(live) > MAX_COMMITS:
            raise LoadError(f"{self.prefix}: {len(live)} commits, more than the {MAX_COMMITS} kubetrain ever keeps: "
                            "not a checkpoint prefix of one job")
        kept = {step for k in keys if k.endswith(CORRUPT_SUFFIX)
                and (m := COMMIT_KEY_PATTERN.fullmatch(k.removesuffix(CORRUPT_SUFFIX)))
                and (step := step_of(m.group(1))) is not None}
        found = []
        for key in live:
            uri = self.uri(key)
            try:
                commit = ObjectCommit.from_json(self.store.get_bytes(uri, MAX_COMMIT_BYTES), str(uri))
            except (CorruptObject, LoadError) as err:
                log.warning("%s is unusable (%s); skipped", uri, err)
                match = COMMIT_KEY_PATTERN.fullmatch(key)
                step = step_of(match.group(1)) if match else None
                if step is not None:
                    kept.add(step)
                continue
            if sharded is None or commit.sharded == sharded:
                found.append(commit)
        return sorted(found, key=lambda c: (c.step, c.sharded)), kept

    def newest_step(self, sharded: bool | None = None) -> int | None:
        """Step of the newest commit (not verified), or None."""
        steps = [c.step for c in self.commits(sharded)]
        return max(steps) if steps else None

    def upload(self, path: Path, key: str, digest: tuple[int, str] | None = None,
               midway: Callable[[], None] | None = None) -> tuple[int, str]:
        return self.store.upload(path, self.uri(key), digest, midway)

    def commit(self, commit: ObjectCommit) -> None:
        """Write the commit: from here on the checkpoint exists."""
        self.store.put_bytes(self.uri(commit_key(commit.name)), commit.to_json())

    def verify(self, commit: ObjectCommit, keys: list[str] | None = None) -> None:
        """Check the objects of a commit (all, or `keys` among them) as the store serves them; CorruptObject
        if one is missing or differs."""
        for key in keys if keys is not None else sorted(commit.objects):
            info = self.store.head(self.uri(key))
            if info is None:
                raise CorruptObject(f"{self.uri(key)} is missing")
            if info.size != commit.objects[key][0]:
                raise CorruptObject(f"{self.uri(key)} is {info.size} bytes, its commit says {commit.objects[key][0]}")
            if self.store.digest(self.uri(key)) != commit.objects[key]:
                raise CorruptObject(f"{self.uri(key)}: sha256 differs from its commit")

    def set_aside(self, commit: ObjectCommit, reason: str) -> None:
        """A commit whose objects failed their checks: renamed `<name>.json.corrupt` (a copy, then a delete),
        so no restore tries it again; its objects are kept (no cleanup removes a step set aside), for a person
        to look at or delete."""
        log.warning("checkpoint %s is unusable (%s); falling back to the previous one",
                    self.uri(commit_key(commit.name)), reason)
        try:
            self.store.put_bytes(self.uri(commit_key(commit.name) + ".corrupt"), commit.to_json())
            self.store.delete([self.uri(commit_key(commit.name))])
        except (LoadError, TransientError) as err:
            log.warning("%s: could not be set aside (%s); it is tried again at the next start",
                        self.uri(commit_key(commit.name)), err)

    def prune(self, keep_last: int, sharded: bool) -> None:
        """The writer, after a commit: the commits of one kind beyond keepLast, then their objects. A failed
        deletion must not fail the checkpoint just committed; the next commit tries again."""
        doomed = self.commits(sharded)[:-keep_last]
        try:
            # The commit first: a checkpoint whose commit is gone is gone, whatever objects are left.
            self.store.delete([self.uri(commit_key(c.name)) for c in doomed])
            self.store.delete([self.uri(k) for c in doomed for k in c.objects])
        except (LoadError, TransientError) as err:
            log.warning("%s: old checkpoints could not be deleted: %s", self.prefix, err)

    def remove_unreferenced(self, before_step: int | None = None) -> int:
        """Objects of checkpoints that no commit names (saves cut short); with `before_step` only those of
        earlier steps (a save of a later step may be in flight). How many. Only the prefix's writer calls it,
        once the prefix is known to be its job's (`claim`), when no save of its own is older than
        `before_step`. Kept whatever their commit: keys kubetrain does not write, and every object of a step
        whose commit is set aside or unreadable."""
        commits, kept = self._commits()
        referenced = {k for c in commits for k in c.objects}
        doomed = []
        for info in self.store.list(self.prefix):
            key = info.uri.key[len(self.prefix.key):]
            match = OBJECT_PATTERN.fullmatch(key)
            if match is None or key in referenced or int(match.group(2)) in kept:
                continue
            if before_step is None or int(match.group(2)) < before_step:
                doomed.append(info.uri)
        if doomed:
            log.warning("%s: removing %d object(s) of checkpoints that were never committed", self.prefix,
                        len(doomed))
            self.store.delete(doomed)
        return len(doomed)

    def clean(self) -> None:
        """The prefix's one writer, at a start, once the prefix is known to be its job's and none of its saves
        is in flight: every upload a kill cut short goes (incomplete multipart uploads aborted, uncommitted
        objects deleted). Never a reader, never before the newest commit was judged this job's."""
        self.store.abort_incomplete(self.prefix)
        self.remove_unreferenced()

    def refusal(self, commit: ObjectCommit, identity: JobIdentity) -> ConfigError:
        """The error of a commit written for another spec (exit 2), naming the fields that differ: from its
        identity, or for a hash-only commit of an earlier release, from the manifest beside the checkpoints
        (the job URI's job.yaml, its first writer's) when one parses."""
        written_with = None
        if commit.written.identity is None:
            written_with = read_manifest_spec(job_root(self.prefix), self.store)
        verdict = commit.written.judge(identity, written_with)
        return another_spec(self.uri(commit_key(commit.name)), verdict, ANOTHER_URI)

    def plain_object(self, commit: ObjectCommit) -> tuple[str, tuple[int, str], int]:
        """A plain checkpoint's one object: (key, (length, sha256) from the commit, its size in the store);
        CorruptObject when it is gone (a lifecycle rule, a manual delete), so that the restore falls back."""
        [(key, expect)] = commit.objects.items()
        info = self.store.head(self.uri(key))
        if info is None:
            raise CorruptObject(f"{self.uri(key)} is missing")
        return key, expect, info.size


# --- who owns a job's prefix ---------------------------------------------------------------------------------

MAX_OWNER_BYTES = 64 << 10
"""An owner record is a few hundred bytes (the identity is most of it); a larger object is not one we wrote."""
MAX_MANIFEST_BYTES = 2 << 20
"""A job.yaml is a TrainingJob as the API server stores it: under etcd's 1.5 MiB request limit."""


@dataclass(frozen=True)
class Owner:
    """The job a checkpoint URI belongs to: its namespace and name (locally, the run's), as its first writer
    recorded them."""

    namespace: str
    job: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.job}"


def read_owner(root: ObjectURI, store: ObjectStore | None = None) -> tuple[Owner, str] | None:
    """(owner, where it was read) of the job URI `root`: its owner.json, or for a prefix written by 0.1.0 (no
    owner.json) its job.yaml's metadata; None when neither names one. Untrusted: bounded, and an object that
    does not parse names no owner (the commits' identities still decide)."""
    import yaml

    store = store or shared_store()
    owner_uri = root.prefix().child(OWNER_OBJECT)
    try:
        doc: Any = json.loads(store.get_bytes(owner_uri, MAX_OWNER_BYTES))
        return Owner(str(doc["namespace"]), str(doc["job"])), str(owner_uri)
    except LoadError as err:
        if "no such object" not in str(err):
            log.warning("%s is unusable (%s); ignored", owner_uri, err)
    except (ValueError, KeyError, TypeError, RecursionError) as err:
        log.warning("%s is unusable (%s: %s); ignored", owner_uri, type(err).__name__, err)
    job_uri = job_object(root)
    try:
        doc = yaml.safe_load(store.get_bytes(job_uri, MAX_MANIFEST_BYTES))
        meta = doc["metadata"]
        return Owner(str(meta.get("namespace") or "default"), str(meta["name"])), str(job_uri)
    except LoadError:
        return None
    except (yaml.YAMLError, KeyError, TypeError, AttributeError, RecursionError):
        return None


def read_manifest_spec(root: ObjectURI, store: ObjectStore) -> Any:
    """The spec of the job URI's job.yaml (its first writer's manifest), or None when there is none or it does not
    load (it is untrusted: bounded, and only ever used to name fields in a refusal)."""
    import yaml

    from kubetrain.api import InvalidSpec, from_object

    try:
        doc = yaml.safe_load(store.get_bytes(job_object(root), MAX_MANIFEST_BYTES))
        return from_object(doc, str(job_object(root))).spec
    except (LoadError, TransientError, InvalidSpec, yaml.YAMLError, ValueError, TypeError, KeyError,
            AttributeError, RecursionError):
        return None


def claim(root: ObjectURI, owner: Owner, identity: JobIdentity, writer: bool,
          store: ObjectStore | None = None) -> None:
    """Make sure the job URI `root` is `owner`'s before this job touches anything under it: ConfigError (exit 2)
    naming the owner when another job's, nothing deleted; the writer records `owner` when the prefix names
    none yet (a conditional write: of two jobs starting at once on one URI, one owns it)."""
    store = store or shared_store()
    found = read_owner(root, store)
    if found is None and writer:
        record = json.dumps({"version": 1, "namespace": owner.namespace, "job": owner.job,
                             "spec_hash": identity.spec_hash, "identity": identity.document,
                             "time": iso(time.time())}, indent=1).encode() + b"\n"
        if store.put_bytes(root.prefix().child(OWNER_OBJECT), record, if_absent=True):
            return
        found = read_owner(root, store)
    if found is not None and found[0] != owner:
        raise ConfigError(f"spec.checkpoint.storage.uri: {root.prefix()} holds job {found[0]}'s checkpoints (its "
                          f"owner, recorded in {found[1]}), not this job's ({owner}): nothing there was touched. "
                          "Use another checkpoint.storage.uri, or delete that prefix to start over")


def job_object(root: ObjectURI) -> ObjectURI:
    """Where the job's manifest lies in its checkpoint URI."""
    return root.prefix().child(JOB_OBJECT)


def job_root(replica_prefix: ObjectURI) -> ObjectURI:
    """The job's checkpoint URI (spec.checkpoint.storage.uri) of one replica's prefix (`<uri>/<replica>/`)."""
    parts = replica_prefix.key.rstrip("/").rsplit("/", 1)
    return ObjectURI(replica_prefix.bucket, parts[0] + "/" if len(parts) == 2 else "")


class ObjectCheckpointStore(CheckpointStore):
    """One replica's plain checkpoints in object storage (`ckpt-<step>.pt`, one object each).

    `directory` is the replica's local checkpoint directory (the staging area and the cache of the
    newest checkpoint); `uri` its prefix in the store. The writer thread writes the file locally as
    CheckpointStore does, uploads it, writes the commit, moves the local `latest`, and only then
    reports the checkpoint durable.
    """

    fault_in_file = False  # kill@save fires in the middle of the upload instead

    def __init__(self, directory: str | Path, uri: ObjectURI, keep_last: int, identity: JobIdentity | str,
                 background: bool = True, on_persisted: Callable[[CheckpointInfo, float], None] | None = None,
                 mid_save: Callable[[int], None] | None = None, store: ObjectStore | None = None,
                 on_upload: Callable[[float], None] | None = None, writer: bool = True):
        """`writer`: this process is the prefix's one writer (the only one that removes what a kill left)."""
        super().__init__(directory, keep_last, identity, background, on_persisted, mid_save)
        self.remote = ObjectCheckpoints(uri, store)
        self.on_upload = on_upload
        self.writer = writer

    def _publish(self, step: int, path: Path) -> CheckpointInfo:
        name = path.name
        key = object_key(name, secrets.token_hex(4))
        started = time.monotonic()
        mid_save = self.mid_save
        midway = (lambda: mid_save(step)) if mid_save is not None else None
        digest = self.remote.upload(path, key, midway=midway)
        self.remote.commit(ObjectCommit(name, Written.of(step, self.identity), {key: digest}))
        if self.on_upload is not None:
            self.on_upload(time.monotonic() - started)
        atomic_write(self.directory / LATEST, name.encode() + b"\n")
        return CheckpointInfo(step, path, digest[0], str(self.remote.uri(key)))

    def _prune(self) -> None:
        # The local copy is a cache of the newest checkpoint only.
        for info in self.list()[:-1]:
            info.path.unlink(missing_ok=True)
        self.remote.prune(self.keep_last, sharded=False)
        if self.durable_step is not None:
            try:
                self.remote.remove_unreferenced(before_step=self.durable_step)
            except (LoadError, TransientError) as err:
                log.warning("%s: leftovers could not be removed: %s", self.remote.prefix, err)

    def load_latest(self) -> tuple[int, dict[str, Any]] | None:
        """(step, state) of the newest valid checkpoint in the store, or None when there is none.

        Commits newest first: one of another job's spec is refused (ConfigError, as on a volume) before
        anything in the prefix is touched; the local copy is used when its bytes are the commit's, else the
        object is downloaded and checked against the commit; a checkpoint that fails (an object gone,
        short or changed, a file that does not load) is set aside, its objects kept, and the previous one
        tried. The writer removes what kills left once the newest commit is known to be this job's.
        """
        self.wait()
        cleaned = False
        for commit in reversed(self.remote.commits(sharded=False)):
            verdict = commit.written.judge(self.identity)
            if not verdict.ok:
                raise self.remote.refusal(commit, self.identity)
            if not cleaned:
                self._clean()
                cleaned = True
            local = self.directory / commit.name
            try:
                key, expect, size = self.remote.plain_object(commit)
                if not (local.is_file() and file_digest(local) == expect):
                    self.remote.store.download(self.remote.uri(key), local, expect, size=size)
                written, state = self._read(local)
                if written.step != commit.step or not written.judge(self.identity).ok:
                    raise CorruptObject(f"its file holds step {written.step} of spec hash {written.spec_hash}, not "
                                        f"the commit's step {commit.step}")
            except (CorruptCheckpoint, CorruptObject) as err:
                local.unlink(missing_ok=True)
                self.set_aside_commit(commit, str(err))
                continue
            self.durable_step = written.step
            atomic_write(self.directory / LATEST, commit.name.encode() + b"\n")
            return written.step, state
        if not cleaned:
            self._clean()
        return None

    def set_aside_commit(self, commit: ObjectCommit, reason: str) -> None:
        self.set_aside_log.append((str(self.remote.uri(commit_key(commit.name))), reason))
        self.remote.set_aside(commit, reason)

    def _clean(self) -> None:
        """The writer only: what kills left in the prefix (never a reader on another node: its writer may be
        uploading)."""
        if self.writer:
            self.remote.clean()


class ObjectShardedStore(ShardedStore):
    """Sharded checkpoints in object storage: every rank uploads its own shards, rank 0 commits.

    `directory` is this rank's local staging directory (a node's own disk: no volume is shared), `uri`
    the job's prefix, the same on every rank.
    """

    def __init__(self, directory: str | Path, uri: ObjectURI, keep_last: int, identity: JobIdentity | str, *,
                 timeout: timedelta = timedelta(minutes=10),
                 on_persisted: Callable[[CheckpointInfo, float], None] | None = None,
                 mid_save: Callable[[int], None] | None = None, store: ObjectStore | None = None,
                 on_upload: Callable[[float], None] | None = None):
        super().__init__(directory, keep_last, identity, timeout=timeout, on_persisted=on_persisted,
                         mid_save=mid_save)
        self.remote = ObjectCheckpoints(uri, store)
        self.on_upload = on_upload

    def _persist(self, step: int, staged: dict[str, Any], tmp: Path, group: Any) -> None:
        """Write this rank's shards locally, upload them; rank 0 commits once every rank has. In the writer
        thread."""
        import torch.distributed.checkpoint as dcp

        started = time.monotonic()
        folder = object_key(f"sharded-{step:08d}", tmp.name.rsplit("-", 1)[-1].removesuffix(".tmp"))
        mine: dict[str, tuple[int, str]] | str
        # Each rank stages in a folder of its own: ranks of one node share the directory, and one rank's
        # cleanup must not take another's files from under its upload.
        stage = tmp / f"rank-{self.rank}"
        try:
            stage.mkdir(parents=True, exist_ok=True)
            # No fsync: the local files are only staged for the upload, whose objects are checked.
            writer = dcp.FileSystemWriter(stage, single_file_per_rank=True, sync_files=False, thread_count=1)
            with alone_is_meant():
                dcp.save(staged, storage_writer=writer, process_group=group, no_dist=group is None)
            mine = {}
            mid_save = self.mid_save
            midway = (lambda: mid_save(step)) if mid_save is not None else None
            for name in rank_files(stage, self.rank):
                mine[folder + name] = self.remote.upload(stage / name, folder + name, midway=midway)
                midway = None
        except BaseException as err:  # noqa: BLE001 - told to rank 0 below, raised by this rank's next save
            self._error = err
            mine = f"rank {self.rank}: {type(err).__name__}: {err}"
        finally:
            shutil.rmtree(stage, ignore_errors=True)
            try:
                tmp.rmdir()  # the last rank of the node out removes the save's folder
            except OSError:
                pass
        try:
            everyone = self._gather(mine, group)
            if self.rank == 0:
                self._commit_objects(step, everyone, started)
        except BaseException as err:  # noqa: BLE001 - the training thread sees it in wait()
            self._error = self._error or err

    def _commit_objects(self, step: int, everyone: list[Any], started: float) -> None:
        objects = self.merged(step, everyone)
        name = f"sharded-{step:08d}"
        commit = ObjectCommit(name, Written.of(step, self.identity), objects, len(everyone))
        self.remote.commit(commit)
        if self.on_upload is not None:
            self.on_upload(time.monotonic() - started)
        atomic_write(self.directory / LATEST, name.encode() + b"\n")
        self.durable_step = step
        self.remote.prune(self.keep_last, sharded=True)
        try:
            self.remote.remove_unreferenced(before_step=step)
        except (LoadError, TransientError) as err:
            log.warning("%s: leftovers could not be removed: %s", self.remote.prefix, err)
        if self.on_persisted is not None:
            self.on_persisted(CheckpointInfo(step, self.directory / name, commit.size,
                                             str(self.remote.uri(commit.folder))), time.monotonic() - started)

    def remove_incomplete(self) -> None:
        """Rank 0, when no save is in flight on any rank (a restore) and the prefix's newest commit was judged
        this job's: every upload a crash cut short goes."""
        for path in list(self.directory.iterdir()) if self.directory.is_dir() else []:
            if path.name.startswith(".sharded-") and path.name.endswith(".tmp"):
                shutil.rmtree(path, ignore_errors=True)  # this node's staging, cut short
        if self.rank == 0:
            self.remote.clean()

    def newest(self) -> tuple[int, Any] | None:
        """Every rank: (step, CommittedCheckpoint) of the newest committed checkpoint whose objects all verify;
        None if none.

        Rank 0 names a candidate, every rank hashes its share of the objects as the store serves them and reads
        DCP's `.metadata` through the restricted reader, and a candidate any rank finds damaged is set aside by
        rank 0 (its objects kept) and the previous one tried. One of another job's spec is refused before
        anything in the prefix is touched.
        """
        while True:
            candidate = None
            if self.rank == 0:
                found = self.remote.commits(sharded=True)
                candidate = found[-1].to_json() if found else None
            candidate = self._broadcast(candidate)
            if candidate is None:
                self.remove_incomplete()
                return None
            commit = ObjectCommit.from_json(candidate, str(self.remote.prefix))
            problem = self._check_commit(commit)
            problems = [p for p in self._all_gather(problem) if p]
            if not problems:
                self.remove_incomplete()
                self.durable_step = commit.step
                return commit.step, CommittedCheckpoint(commit, self.remote.uri(commit.folder))
            if self.rank == 0:
                self.set_aside_dir(CommittedCheckpoint(commit, self.remote.uri(commit.folder)), "; ".join(problems))
            if self.distributed:
                import torch.distributed as dist

                dist.barrier(group=self.group())

    def _check_commit(self, commit: ObjectCommit) -> str | None:
        if not commit.written.judge(self.identity).ok:
            raise self.remote.refusal(commit, self.identity)
        keys = sorted(commit.objects)[self.rank :: self.world_size]
        try:
            self.remote.verify(commit, keys)
            check_contents(ObjectReader(self.remote, commit), _as_files(commit), [k[len(commit.folder):] for k in keys])
        except (CorruptObject, CorruptSharded) as err:
            return f"{self.remote.uri(commit.folder)}: {err}"
        return None

    def load(self, path: Any, template: dict[str, Any]) -> None:
        """Every rank: load checkpoint `path` (a CommittedCheckpoint) into `template` in place, reading its pieces straight
        from the store (ranged reads of its own shards only)."""
        from torch.distributed.checkpoint.api import CheckpointException

        commit: ObjectCommit = path.commit
        reader = ObjectReader(self.remote, commit)
        try:
            with alone_is_meant():
                dcp_reader.load(template, reader, self.group(), no_dist=not self.distributed)
        except (LoadError, TransientError, CorruptSharded):
            raise
        except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
            transient = _store_failure(err)
            if transient is not None:
                raise transient from None
            raise unfit(self.remote.uri(commit.folder), err) from None

    def set_aside_dir(self, path: Any, reason: str) -> None:
        """Rank 0: a committed checkpoint (a CommittedCheckpoint) whose pieces did not load: its commit set aside,
        its objects kept."""
        commit: ObjectCommit = path.commit
        self.set_aside_log.append((str(self.remote.uri(commit_key(commit.name))), reason))
        self.remote.set_aside(commit, reason)


def _as_files(commit: ObjectCommit) -> Commit:
    """A sharded commit of the store as a volume's COMMIT of its folder's files (what the checks of sharded.py
    read)."""
    return Commit(commit.written, commit.world_size,
                  {key[len(commit.folder):]: digest for key, digest in commit.objects.items()})


def _store_failure(err: BaseException) -> Exception | None:
    """The store's own error inside DCP's CheckpointException (a read that failed), if that is what it was."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict):
        for failure in failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, (LoadError, TransientError)):
                return inner
    return err if isinstance(err, (LoadError, TransientError)) else None


def _object_filesystem() -> Any:
    """torch.distributed.checkpoint's file-system interface over a committed checkpoint's objects."""
    from torch.distributed.checkpoint.filesystem import FileSystemBase

    class ObjectFileSystem(FileSystemBase):
        """Read-only: `create_stream` of a key gives a ranged reader of its object (whole for `.metadata`)."""

        def __init__(self, remote: ObjectCheckpoints, commit: ObjectCommit):
            self.remote, self.commit = remote, commit

        @contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[io.IOBase]:
            if "r" not in mode:
                raise ShardedCheckpointError("a checkpoint in object storage is read-only once committed")
            key = str(path)
            if key not in self.commit.objects:
                raise CorruptSharded(f"{self.remote.uri(key)} is not an object of its commit")
            size = self.commit.objects[key][0]
            uri = self.remote.uri(key)
            if key.endswith("/" + METADATA):
                yield io.BytesIO(self.remote.store.get_bytes(uri, max(size, 1)))
            else:
                yield RangeReader(lambda start, n, uri=uri: self.remote.store.get_range(uri, start, n), size)  # type: ignore[misc]  # a lambda's default binds the uri

        def concat_path(self, path: Any, suffix: str) -> str:
            return f"{path}{suffix}" if str(path).endswith("/") else f"{path}/{suffix}"

        def init_path(self, path: Any) -> str:
            return str(path)

        def rename(self, path: Any, new_path: Any) -> None:
            raise ShardedCheckpointError("a checkpoint in object storage is never renamed")

        def mkdir(self, path: Any) -> None:
            raise ShardedCheckpointError("a checkpoint in object storage is read-only once committed")

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return False

        def exists(self, path: Any) -> bool:
            return str(path) in self.commit.objects

        def rm_file(self, path: Any) -> None:
            raise ShardedCheckpointError("a checkpoint in object storage is read-only once committed")

    return ObjectFileSystem


def ObjectReader(remote: ObjectCheckpoints, commit: ObjectCommit) -> Any:
    """A DCP StorageReader of a committed checkpoint in the store: `.metadata` read whole through the restricted
    reader (dcp_reader), every piece of a rank's shards fetched with one ranged GET of exactly its bytes."""
    folder = commit.folder
    files = {key[len(folder):]: length for key, (length, _) in commit.objects.items()}

    class _Reader(dcp_reader.Reader):
        def __init__(self) -> None:
            super().__init__(folder.rstrip("/"), files)
            self.fs = _object_filesystem()(remote, commit)
            self.path = folder.rstrip("/")

        def metadata_bytes(self) -> bytes:
            key = folder + METADATA
            if key not in commit.objects:
                raise dcp_reader.MetadataError(f"its commit lists no {METADATA}")
            try:
                return remote.store.get_bytes(remote.uri(key), min(max(commit.objects[key][0], 1),
                                                                    dcp_reader.MAX_METADATA_BYTES))
            except LoadError as err:
                raise CorruptObject(str(err)) from None

        def _slice_file(self, file: Any, sinfo: Any) -> Any:
            # One GET of the piece's own bytes: torch.load then seeks within memory, not across the network.
            if isinstance(file, RangeReader):
                return io.BytesIO(file.read_range(sinfo.offset, sinfo.length))
            return super()._slice_file(file, sinfo)

    return _Reader()


def write_job(root: ObjectURI, manifest: bytes, store: ObjectStore | None = None) -> None:
    """The job's manifest at its checkpoint URI's root, once (what `kubetrain checkpoints export` reads)."""
    store = store or shared_store()
    uri = job_object(root)
    if store.head(uri) is None:
        store.put_bytes(uri, manifest)



# --- read-only copies, for the tools (`kubetrain checkpoints verify|compare|export`) --------------------------


def mirror(uri: ObjectURI, into: Path, store: ObjectStore | None = None) -> Path:
    """The committed checkpoints under `uri` copied into `into` as a run directory, which the tools read as
    they read a volume's: `job.yaml` (when the job's manifest is there), `checkpoints/<replica>/` with each
    plain checkpoint's file, each sharded one's folder and a COMMIT of its files' lengths and sha256 (the
    digests of the commit), and `latest`. `uri` is the job's URI (replica prefixes below it) or one replica's
    prefix. Objects are copied as the store serves them, not checked here: the tools check them, and name a
    damaged one, as they do on a volume. Only committed checkpoints are copied (uploads cut short are not).
    """
    store = store or shared_store()
    store.check_bucket(uri)
    prefix = uri.prefix()
    keys = [i.uri.key[len(prefix.key):] for i in store.list(prefix)]
    if any(COMMIT_KEY_PATTERN.fullmatch(k) for k in keys):
        replicas = {prefix.name or "checkpoints": prefix}
    else:
        names = sorted({k.split("/", 1)[0] for k in keys if COMMIT_KEY_PATTERN.fullmatch(k.split("/", 1)[-1])})
        replicas = {name: prefix.child(name + "/") for name in names}
    if not replicas:
        raise LoadError(f"{prefix}: no committed checkpoints here (expected <replica>/commits/ or commits/)")
    into.mkdir(parents=True, exist_ok=True)
    if JOB_OBJECT in keys:
        (into / JOB_OBJECT).write_bytes(store.get_bytes(prefix.child(JOB_OBJECT)))
    problems: list[str] = []
    for replica, where in replicas.items():
        remote = ObjectCheckpoints(where, store)
        local = into / "checkpoints" / replica
        local.mkdir(parents=True, exist_ok=True)
        commits = remote.commits()
        for commit in commits:
            if not commit.sharded:
                # Checked against its commit here (a plain file has no COMMIT to carry the digest to the tools):
                # one that differs is left out, and verify reports it.
                [(key, digest)] = commit.objects.items()
                _copy(store, remote.uri(key), local / commit.name, problems, commit.name, digest)
                continue
            folder = local / commit.name
            folder.mkdir(exist_ok=True)
            files = {}
            for key, digest in commit.objects.items():
                name = key.split("/", 1)[1]
                try:
                    path = confined(folder, name)  # a commit's keys are checked when read; this holds it here too
                except OutsideFolder as err:
                    raise CorruptObject(f"{remote.uri(key)}: {err}") from None
                _copy(store, remote.uri(key), path, problems, commit.name)
                files[name] = digest
            atomic_write(folder / "COMMIT", _as_files(commit).to_json())
        if commits:
            atomic_write(local / LATEST, commits[-1].name.encode() + b"\n")
    if problems:
        atomic_write(into / MIRROR_PROBLEMS, json.dumps(problems, indent=1) + "\n")
    return into


def _copy(store: ObjectStore, uri: ObjectURI, path: Path, problems: list[str], checkpoint: str,
          expect: tuple[int, str] | None = None) -> None:
    """One object of checkpoint `checkpoint`'s commit into the mirror; one that is gone, or not the (length,
    sha256) `expect`ed, is left out and named in `problems` (the tools then find its checkpoint incomplete,
    report it and use the one before, as on a volume)."""
    info = store.head(uri)
    if info is None:
        problems.append(f"{checkpoint}: {uri} is missing (its commit names it)")
        return
    try:
        store.download(uri, path, expect, size=info.size)
    except CorruptObject as err:
        problems.append(f"{checkpoint}: {str(err).removeprefix(f'{uri}: ')} ({uri})")


def job_uri(run_dir: Path) -> ObjectURI | None:
    """The checkpoint URI of the job of run directory `run_dir` (its job.yaml's spec.checkpoint.storage.uri)."""
    from kubetrain.shared.checkpoints import RUN_JOB_FILE
    from kubetrain.api import InvalidSpec, load_one

    from .objstore import parse_uri

    manifest = run_dir / RUN_JOB_FILE
    if not manifest.is_file():
        return None
    try:
        uri = load_one(manifest).spec.checkpoint.storage.uri
    except (InvalidSpec, OSError):
        return None
    return parse_uri(uri, f"{manifest}: spec.checkpoint.storage.uri") if uri else None


def stage_sources(sources: list[str], into: Path) -> list[str]:
    """SOURCE arguments of the tools with object storage made local: an `s3://` URI, and a run directory whose
    job keeps its checkpoints at a URI, become a mirror of what is committed there (a run directory's own
    checkpoints/ is only the staging of the newest)."""
    from .objstore import is_uri, parse_uri

    out = []
    for i, source in enumerate(sources):
        target = into / f"source-{i}"
        if is_uri(source):
            out.append(str(mirror(parse_uri(source, "SOURCE"), target)))
            continue
        uri = job_uri(Path(source)) if Path(source).is_dir() else None
        if uri is None:
            out.append(source)
            continue
        mirror(uri, target)
        shutil.copyfile(Path(source) / JOB_OBJECT, target / JOB_OBJECT)  # the run's manifest, defaults filled in
        out.append(str(target))
    return out
