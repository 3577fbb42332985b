"""Tampering with stored checkpoints as any writer of a claim or a bucket can (issue 52, docs/security.md "Stored
state is untrusted input"): a copy of one replica's checkpoints on a volume or under a bucket prefix, read and
rewritten file by file (`VolumeCopy`, `BucketCopy`), and a catalog of seeded random changes to it (`MUTATIONS`).

Each change is what a writer of the storage can do: flip, cut or extend bytes, delete a file or an object,
rewrite a commit's fields (its length and sha256 recomputed or not), name files outside the checkpoint, replace
DCP's `.metadata` or a value inside a shard with a pickle that runs code, replace a plain checkpoint's payload.
Code that runs leaves a file named `ran-*` in the canary folder (`Canary.marker`); a name that leads out points
into the canary folder or at the decoy file, so that anything written there is seen.
"""

from __future__ import annotations

import builtins
import hashlib
import io
import json
import os
import pickle
import random
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kubetrain.shared.checkpoints import COMMIT, FILE_PATTERN, LATEST, SHARDED_PATTERN, commit_key, step_of
from kubetrain.trainer import dcp_reader
from kubetrain.trainer.checkpoint import MAGIC
from kubetrain.trainer.objstore import ObjectURI

# --- pickles that run code when anything trusting unpickles them ----------------------------------------------


class Marker:
    """REDUCE of builtins' open: writes the marker file."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


class ShellMarker(Marker):
    """REDUCE of os.system: a shell touches the marker file."""

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.path))}",))


class ExecMarker(Marker):
    """REDUCE of builtins.exec: Python source that writes the marker file."""

    def __reduce__(self):
        return (builtins.exec, (f"open({str(self.path)!r}, 'w').close()",))


MARKERS = (Marker, ShellMarker, ExecMarker)


def shell_pickle(path: Path) -> bytes:
    """A hand-written protocol 0 pickle: GLOBAL os.system, called (REDUCE) to touch `path`."""
    return f"cos\nsystem\n(V{shlex.join(['touch', str(path)])}\ntR.".encode()


@dataclass(frozen=True)
class Canary:
    """Where the sandbox's tools must never write: `folder` (outside the sandbox) stays empty but for `ran-*`
    markers of code that ran; `decoy`, a file outside too, keeps its bytes (links and names point at both)."""

    folder: Path
    decoy: Path

    def marker(self, n: int, label: str) -> Path:
        return self.folder / f"ran-{n:04d}-{label}"

    def executions(self) -> list[str]:
        return sorted(p.name for p in self.folder.iterdir() if p.name.startswith("ran-"))

    def escapes(self) -> list[str]:
        return sorted(p.name for p in self.folder.iterdir() if not p.name.startswith("ran-"))


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- a plain checkpoint file: magic, header line, payload ------------------------------------------------------


def split_plain(data: bytes) -> tuple[dict[str, Any], bytes]:
    """The header and payload of a pristine `ckpt-<step>.pt` file's bytes."""
    end = data.index(b"\n", len(MAGIC))
    return json.loads(data[len(MAGIC):end]), data[end + 1:]


def join_plain(header: dict[str, Any], payload: bytes, recompute: bool) -> bytes:
    """A plain checkpoint file of `header` and `payload`; `recompute`: the header's length and sha256 made the
    payload's, as a writer who knows the format does."""
    if recompute:
        header = {**header, "length": len(payload), "sha256": sha256(payload)}
    line = json.dumps(header).encode()
    return MAGIC + line.ljust(512 * -(-(len(line) + 1) // 512) - 1) + b"\n" + payload


# --- one replica's checkpoints, on a volume or in a bucket ------------------------------------------------------


class VolumeCopy:
    """A replica's checkpoint directory in a run directory: names are paths relative to it
    (`ckpt-00000030.pt`, `sharded-00000030/.metadata`, `latest`)."""

    bucket = False

    def __init__(self, run: Path, replica: str):
        self.run = run
        self.dir = run / "checkpoints" / replica
        self.where = str(self.dir)

    def names(self) -> list[str]:
        return sorted(str(p.relative_to(self.dir)) for p in self.dir.rglob("*") if p.is_file() or p.is_symlink())

    def checkpoints(self) -> list[str]:
        return sorted(p.name for p in self.dir.iterdir()
                      if FILE_PATTERN.fullmatch(p.name) or SHARDED_PATTERN.fullmatch(p.name))

    def read(self, name: str) -> bytes:
        return (self.dir / name).read_bytes()

    def write(self, name: str, data: bytes) -> bool:
        (self.dir / name).write_bytes(data)
        return True

    def delete(self, name: str) -> None:
        (self.dir / name).unlink()

    def rename(self, old: str, new: str) -> None:
        os.rename(self.dir / old, self.dir / new)

    def link(self, name: str, target: Path) -> None:
        """`name` replaced by a symbolic link to `target` (outside the sandbox)."""
        (self.dir / name).unlink()
        (self.dir / name).symlink_to(target)

    def folder(self, ckpt: str) -> str:
        """What prefixes a checkpoint's member names."""
        return f"{ckpt}/" if SHARDED_PATTERN.fullmatch(ckpt) else ""

    def local_folder(self, ckpt: str) -> Path:
        """The folder a name of `ckpt`'s record is joined to when it is read."""
        return self.dir / ckpt if SHARDED_PATTERN.fullmatch(ckpt) else self.dir

    def members(self, ckpt: str) -> list[str]:
        if FILE_PATTERN.fullmatch(ckpt):
            return [ckpt]
        return sorted(f"{ckpt}/{p.name}" for p in (self.dir / ckpt).iterdir() if p.name != COMMIT)

    def record_name(self, ckpt: str) -> str:
        """The file holding the fields of `ckpt`: a plain one's own header, a sharded one's COMMIT."""
        return ckpt if FILE_PATTERN.fullmatch(ckpt) else f"{ckpt}/{COMMIT}"

    def read_record(self, ckpt: str) -> dict[str, Any]:
        if FILE_PATTERN.fullmatch(ckpt):
            return split_plain(self.read(ckpt))[0]
        return json.loads(self.read(f"{ckpt}/{COMMIT}"))

    def write_record(self, ckpt: str, doc: dict[str, Any]) -> None:
        if FILE_PATTERN.fullmatch(ckpt):
            self.write(ckpt, join_plain(doc, split_plain(self.read(ckpt))[1], recompute=False))
        else:
            self.write(f"{ckpt}/{COMMIT}", json.dumps(doc, indent=1).encode())

    def entries(self, doc: dict[str, Any]) -> dict[str, Any]:
        """A sharded record's {name in the record: {length, sha256}}."""
        return doc["files"]

    def entry_key(self, ckpt: str, member: str) -> str:
        return member.removeprefix(self.folder(ckpt))

    def payload(self, ckpt: str, member: str) -> bytes:
        """The bytes a member's record entry covers (a plain file's payload; a sharded file whole)."""
        data = self.read(member)
        return split_plain(data)[1] if FILE_PATTERN.fullmatch(ckpt) else data

    def set_payload(self, ckpt: str, member: str, data: bytes, consistent: bool) -> None:
        """Replace what a member's record covers with `data`; `consistent`: its record entry recomputed."""
        if FILE_PATTERN.fullmatch(ckpt):
            self.write(member, join_plain(split_plain(self.read(member))[0], data, recompute=consistent))
            return
        self.write(member, data)
        if consistent:
            self.set_entry(ckpt, self.entry_key(ckpt, member), data)

    def set_entry(self, ckpt: str, key: str, data: bytes, drop: str | None = None) -> None:
        """The record of `ckpt` lists `key` with the length and sha256 of `data` (and no longer `drop`)."""
        doc = self.read_record(ckpt)
        if drop is not None:
            self.entries(doc).pop(drop, None)
        self.entries(doc)[key] = {"length": len(data), "sha256": sha256(data)}
        self.write_record(ckpt, doc)


class BucketCopy:
    """A replica's prefix in a bucket (`<root><replica>/`): names are keys relative to it
    (`ckpt-00000030-<token>.pt`, `sharded-00000030-<token>/.metadata`, `commits/ckpt-00000030.pt.json`)."""

    bucket = True

    def __init__(self, client: Any, bucket: str, root: str, replica: str, mirror: Path):
        self.client = client
        self.root = ObjectURI(bucket, root)
        self.prefix = ObjectURI(bucket, f"{root}{replica}/")
        self.replica = replica
        self.mirror = mirror
        """Where `mirror` copies the prefix (what the tools read): `..` names are made relative to its folders."""
        self.where = str(self.prefix)

    def names(self) -> list[str]:
        return [i.uri.key[len(self.prefix.key):] for i in self.client.list(self.prefix)]

    def checkpoints(self) -> list[str]:
        return sorted(n.removeprefix("commits/").removesuffix(".json") for n in self.names()
                      if n.startswith("commits/") and n.endswith(".json"))

    def read(self, name: str) -> bytes:
        return self.client.get_bytes(self.prefix.child(name), 64 << 20)

    def write(self, name: str, data: bytes) -> bool:
        """False when the store refuses the key (a NUL, a `..`): the commit may still name it."""
        try:
            self.client.put_bytes(self.prefix.child(name), data)
        except Exception:  # noqa: BLE001 - whatever the server says of an odd key, the commit is what is tested
            return False
        return True

    def delete(self, name: str) -> None:
        self.client.delete([self.prefix.child(name)])

    def rename(self, old: str, new: str) -> None:
        data = self.read(old)
        self.write(new, data)
        self.delete(old)

    def folder(self, ckpt: str) -> str:
        keys = list(self.entries(self.read_record(ckpt)))
        return keys[0].split("/", 1)[0] + "/" if "/" in keys[0] else ""

    def local_folder(self, ckpt: str) -> Path:
        local = self.mirror / "checkpoints" / self.replica
        return local / ckpt if SHARDED_PATTERN.fullmatch(ckpt) else local

    def members(self, ckpt: str) -> list[str]:
        return sorted(self.entries(self.read_record(ckpt)))

    def record_name(self, ckpt: str) -> str:
        return commit_key(ckpt)

    def read_record(self, ckpt: str) -> dict[str, Any]:
        return json.loads(self.read(commit_key(ckpt)))

    def write_record(self, ckpt: str, doc: dict[str, Any]) -> None:
        self.write(commit_key(ckpt), json.dumps(doc, indent=1).encode())

    def entries(self, doc: dict[str, Any]) -> dict[str, Any]:
        return doc["objects"]

    def entry_key(self, ckpt: str, member: str) -> str:
        return member

    def payload(self, ckpt: str, member: str) -> bytes:
        data = self.read(member)
        return split_plain(data)[1] if FILE_PATTERN.fullmatch(ckpt) else data

    def set_payload(self, ckpt: str, member: str, data: bytes, consistent: bool) -> None:
        if FILE_PATTERN.fullmatch(ckpt):
            data = join_plain(split_plain(self.read(member))[0], data, recompute=consistent)
        self.write(member, data)
        if consistent:
            self.set_entry(ckpt, member, data)

    def set_entry(self, ckpt: str, key: str, data: bytes, drop: str | None = None) -> None:
        doc = self.read_record(ckpt)
        if drop is not None:
            self.entries(doc).pop(drop, None)
        self.entries(doc)[key] = {"length": len(data), "sha256": sha256(data)}
        self.write_record(ckpt, doc)


Copy = VolumeCopy | BucketCopy


# --- the catalog of changes -------------------------------------------------------------------------------------


@dataclass
class Tamper:
    """What one mutation is given: its number and random source, the copy, and where code or writes would show."""

    n: int
    rng: random.Random
    copy: Copy
    canary: Canary
    other_identity: tuple[str, dict[str, Any] | None]
    """(spec_hash, identity) of another kind's job: a valid checkpoint of another job."""

    def marker(self, label: str) -> Path:
        return self.canary.marker(self.n, label)

    def outside(self, ckpt: str, base: str) -> dict[str, str]:
        """Names of `base` that lead out of `ckpt`'s folder into the canary folder, by how they lead out."""
        target = self.canary.folder / base
        return {"absolute": str(target), "dotdot": os.path.relpath(target, self.copy.local_folder(ckpt)),
                "double-slash": f"x//{target}", "nul": f"{base}\0", "slash": f"sub/{base}", "empty": "",
                "dot": ".", "dotdot-alone": "..", "long": "a" * 300}

    def checkpoint(self) -> str:
        """One of the copy's checkpoints, the newest (the one a restore reads first) as often as the others
        together."""
        found = self.copy.checkpoints()
        return self.rng.choices(found, weights=[1] * (len(found) - 1) + [max(1, len(found) - 1)])[0]


def flip_bytes(t: Tamper) -> str:
    name = t.rng.choice(t.copy.names())
    data = bytearray(t.copy.read(name))
    spots = sorted(t.rng.randrange(len(data)) for _ in range(t.rng.randint(1, 4)))
    for i in spots:
        data[i] ^= t.rng.randint(1, 255)
    t.copy.write(name, bytes(data))
    return f"{name}: bytes {spots} flipped"


def cut_or_extend(t: Tamper, cut: bool) -> str:
    consistent = t.rng.random() < 0.5
    ckpt = t.checkpoint()
    if consistent:  # the writer recomputed what the record says of it
        member = t.rng.choice(t.copy.members(ckpt))
        data = t.copy.payload(ckpt, member)
    else:
        member = t.rng.choice([*t.copy.members(ckpt), t.copy.record_name(ckpt)])
        data = t.copy.read(member)
    new = data[:t.rng.randrange(len(data))] if cut else data + t.rng.randbytes(t.rng.randint(1, 64))
    if consistent:
        t.copy.set_payload(ckpt, member, new, consistent=True)
    else:
        t.copy.write(member, new)
    what = f"cut to {len(new)} of {len(data)} bytes" if cut else f"{len(new) - len(data)} bytes appended"
    return f"{member}: {what}{', its record recomputed' if consistent else ''}"


def truncate(t: Tamper) -> str:
    return cut_or_extend(t, cut=True)


def append(t: Tamper) -> str:
    return cut_or_extend(t, cut=False)


def delete(t: Tamper) -> str:
    name = t.rng.choice(t.copy.names())
    t.copy.delete(name)
    return f"{name}: deleted"


def bad_values(t: Tamper, field: str, current: Any) -> list[Any]:
    """Values a writer may put in a record's `field` instead of `current`."""
    if field == "step":
        return [current + 10, current - 10, current + 1, 0, -1, str(current), 10 ** 12, True, float(current), None]
    if field == "length":
        return [current + 1, current - 1, 0, -1, str(current), 2 ** 64, None, float(current)]
    if field == "sha256":
        return ["0" * 64, sha256(b"x"), str(current).upper(), str(current)[:-1], 5, None]
    if field == "spec_hash":
        return [t.other_identity[0], "", "0" * 16, 7, None]
    if field == "identity":
        deep: dict[str, Any] = {}
        for _ in range(500):
            deep = {"model": deep}
        return [t.other_identity[1], {}, {"model": {"name": "other"}}, "x", [1], deep, None]
    if field == "world_size":
        return [0, -1, 2, 64, "1", None, 2 ** 40]
    if field == "name":
        step = int(str(current).split("-")[1].split(".")[0])
        other = "sharded" if str(current).startswith("ckpt") else "ckpt"
        return [str(current).replace(f"{step:08d}", f"{step + 10:08d}"),
                f"{other}-{step:08d}" + (".pt" if other == "ckpt" else ""), f"../{current}", "", 5, None]
    if field == "version":
        return [2, "1", None]
    if field == "kubetrain":
        return [5, "9.9.9"]
    if field in ("files", "objects"):
        return [[], "x", {k: "x" for k in current}, {}]
    return [None]


def commit_field(t: Tamper) -> str:
    """A field of a record (a plain file's header, a COMMIT, a bucket's commit) changed, without the rest."""
    ckpt = t.checkpoint()
    doc = t.copy.read_record(ckpt)
    fields = [f for f in doc if f not in ("time",)] + ["remove a key"]
    field = t.rng.choice(fields)
    if field == "remove a key":
        gone = t.rng.choice(list(doc))
        del doc[gone]
        t.copy.write_record(ckpt, doc)
        return f"{t.copy.record_name(ckpt)}: {gone!r} removed"
    if field in ("files", "objects") and t.rng.random() < 0.6:  # one entry's length or sha256
        key = t.rng.choice(list(doc[field]))
        sub = t.rng.choice(["length", "sha256"])
        value = t.rng.choice(bad_values(t, sub, doc[field][key][sub]))
        doc[field][key][sub] = value
        t.copy.write_record(ckpt, doc)
        return f"{t.copy.record_name(ckpt)}: {key}'s {sub} set to {str(value)[:80]!r}"
    value = t.rng.choice(bad_values(t, field, doc[field]))
    doc[field] = value
    t.copy.write_record(ckpt, doc)
    return f"{t.copy.record_name(ckpt)}: {field} set to {str(value)[:80]!r}"


def rename_checkpoint(t: Tamper) -> str:
    """A checkpoint (a volume's file or folder, a bucket's commit key) under another step's name, its contents
    unchanged."""
    ckpt = t.checkpoint()
    steps = {step_of(c) for c in t.copy.checkpoints()}
    step = t.rng.choice([s for s in (5, 15, 25, 35, 40, 99999999) if s not in steps])
    new = ckpt.replace(f"{step_of(ckpt):08d}", f"{step:08d}")
    t.copy.rename(t.copy.record_name(ckpt) if t.copy.bucket else ckpt,
                  t.copy.record_name(new) if t.copy.bucket else new)
    return f"{ckpt}: renamed {new}"


def move_object(t: Tamper) -> str:
    """A bucket: an object under another key of its checkpoint's (another token), its commit updated or not."""
    ckpt = t.checkpoint()
    member = t.rng.choice(t.copy.members(ckpt))
    folder, _, rest = member.partition("/")
    if rest:  # sharded-<step>-<token>/<name>: a new token for one object splits the checkpoint in two folders
        new = f"{folder.rsplit('-', 1)[0]}-beef/{rest}"
    else:
        new = f"{member.rsplit('-', 1)[0]}-beef.pt"
    data = t.copy.read(member)
    t.copy.rename(member, new)
    consistent = t.rng.random() < 0.5
    if consistent:
        t.copy.set_entry(ckpt, new, data, drop=member)
    return f"{member}: moved to {new}{', its commit updated' if consistent else ''}"


def name_outside(t: Tamper) -> str:
    """A record naming a member by a name that leads out of the checkpoint (into the canary folder), the bytes
    there (a bucket) as the record says."""
    ckpt = t.checkpoint()
    member = t.rng.choice(t.copy.members(ckpt))
    base = member.rsplit("/", 1)[-1]
    how, name = t.rng.choice(sorted(t.outside(ckpt, base).items()))
    if t.copy.bucket:
        folder = t.copy.folder(ckpt)
        key = t.rng.choice([f"{folder}{name}", name])
        data = t.copy.read(member)
        stored = t.copy.write(key, data)
        keep = t.rng.random() < 0.5
        t.copy.set_entry(ckpt, key, data, drop=None if keep else member)
        where = "beside" if keep else "for"
        return f"{t.copy.record_name(ckpt)}: names {key!r} ({how}; stored: {stored}) {where} {member}"
    if FILE_PATTERN.fullmatch(ckpt):  # a plain file's header names no file: its name in `latest` instead
        t.copy.write(LATEST, name.encode() + b"\n")
        return f"{LATEST}: names {name!r} ({how})"
    data = t.copy.read(member)
    keep = t.rng.random() < 0.5
    t.copy.set_entry(ckpt, name, data, drop=None if keep else t.copy.entry_key(ckpt, member))
    return f"{t.copy.record_name(ckpt)}: lists {name!r} ({how}){' beside' if keep else ' for'} {member}"


def link_outside(t: Tamper) -> str:
    """A volume: a file of a checkpoint (or `latest`, or a COMMIT) replaced by a link to the decoy outside."""
    assert isinstance(t.copy, VolumeCopy)
    name = t.rng.choice(t.copy.names())
    target = t.rng.choice([t.canary.decoy, t.canary.folder / "missing"])
    t.copy.link(name, target)
    return f"{name}: a link to {target}"


def header_identity(t: Tamper) -> str:
    """A plain checkpoint's header rewritten for another job (its payload and the payload's sha256 unchanged);
    in a bucket the commit's entry recomputed, and its own fields too or not."""
    ckpt = t.checkpoint()
    data = t.copy.read(t.copy.members(ckpt)[0])
    header, payload = split_plain(data)
    how = t.rng.choice(["another job's identity", "a bare hash", "no identity"])
    if how == "another job's identity":
        header["spec_hash"], header["identity"] = t.other_identity
    elif how == "a bare hash":
        header["spec_hash"] = "h"
        header.pop("identity", None)
    else:
        header.pop("identity", None)
    if header.get("identity") is None:
        header.pop("identity", None)
    new = join_plain(header, payload, recompute=False)
    member = t.copy.members(ckpt)[0]
    t.copy.write(member, new)
    also = ""
    if t.copy.bucket and t.rng.random() < 0.8:
        doc = t.copy.read_record(ckpt)
        doc["objects"][member] = {"length": len(new), "sha256": sha256(new)}
        if t.rng.random() < 0.5:
            doc["spec_hash"] = header["spec_hash"]
            doc.pop("identity", None)
            if "identity" in header:
                doc["identity"] = header["identity"]
            also = ", the commit rewritten to match"
        else:
            also = ", the commit's entry recomputed"
        t.copy.write_record(ckpt, doc)
    return f"{member}: header rewritten with {how}{also}"


def evil_pickle(t: Tamper, label: str) -> tuple[str, bytes]:
    """(what, bytes) of a pickle that would run code or name a callable."""
    how = t.rng.choice(["GLOBAL posix.system", "GLOBAL io.open", "REDUCE open", "REDUCE os.system",
                        "REDUCE exec", "protocol 0 os.system"])
    marker = t.marker(label)
    if how == "GLOBAL posix.system":
        return how, pickle.dumps(os.system)
    if how == "GLOBAL io.open":
        return how, pickle.dumps(builtins.open)
    if how == "protocol 0 os.system":
        return how, shell_pickle(marker)
    cls = {"REDUCE open": Marker, "REDUCE os.system": ShellMarker, "REDUCE exec": ExecMarker}[how]
    return how, pickle.dumps(cls(marker))


def marker_payload(t: Tamper) -> str:
    """A plain checkpoint's payload replaced by torch.save of code (a marker alone or inside the state), its
    header's length and sha256 recomputed, and a bucket's commit."""
    ckpt = t.checkpoint()
    member = t.copy.members(ckpt)[0]
    cls = t.rng.choice(MARKERS)
    marker = cls(t.marker("payload"))
    shape = t.rng.choice(["alone", "in the state", "raw pickle"])
    if shape == "raw pickle":
        payload = pickle.dumps(marker)
    else:
        buffer = io.BytesIO()
        torch.save(marker if shape == "alone" else {"model": {"w": torch.zeros(2)}, "step": marker}, buffer)
        payload = buffer.getvalue()
    t.copy.set_payload(ckpt, member, payload, consistent=True)
    return f"{member}: payload replaced by {cls.__name__} ({shape}), its record recomputed"


def read_metadata(t: Tamper, ckpt: str) -> tuple[str, Any]:
    """(member name, Metadata) of a sharded checkpoint's `.metadata`, read as kubetrain reads it."""
    member = next(m for m in t.copy.members(ckpt) if m.endswith(dcp_reader.METADATA))
    doc = t.copy.read_record(ckpt)
    folder = t.copy.folder(ckpt)
    lengths = {k.removeprefix(folder) if t.copy.bucket else k: v["length"] for k, v in t.copy.entries(doc).items()}
    return member, dcp_reader.read_metadata(t.copy.read(member), lengths)


def evil_metadata(t: Tamper) -> str:
    """`.metadata` replaced (its record entry recomputed) by a pickle that runs code, or by DCP's Metadata that
    names files outside, declares tensors larger than the files, or indexes lists past any bound."""
    ckpt = t.checkpoint()
    member, metadata = read_metadata(t, ckpt)
    how = t.rng.choice(["code", "code inside Metadata", "outside dotdot", "outside absolute", "huge tensor",
                        "piece past its file", "planner index"])
    if how == "code":
        what, data = evil_pickle(t, "metadata")
        how = f"code ({what})"
    else:
        if how == "code inside Metadata":
            metadata.version = t.rng.choice(MARKERS)(t.marker("metadata"))
        elif how.startswith("outside"):
            names = t.outside(ckpt, "x")
            for info in metadata.storage_data.values():
                if t.rng.random() < 0.5 or how == "outside absolute":
                    info.relative_path = names["dotdot" if how == "outside dotdot" else "absolute"]
        elif how == "huge tensor":
            fqn, entry = t.rng.choice([(k, v) for k, v in metadata.state_dict_metadata.items() if hasattr(v, "size")])
            entry.size = torch.Size([1 << 20] * max(1, len(entry.size)))
            for chunk in entry.chunks:
                chunk.sizes = entry.size
            how += f" ({fqn})"
        elif how == "piece past its file":
            info = t.rng.choice(list(metadata.storage_data.values()))
            info.offset += 1 << 30
        else:
            metadata.planner_data = {k: (k, 10 ** 9) for k in metadata.state_dict_metadata}
        data = pickle.dumps(metadata)
    t.copy.set_payload(ckpt, member, data, consistent=True)
    return f"{member}: replaced by {how}, its record recomputed"


def evil_value(t: Tamper) -> str:
    """A non-tensor value inside a shard (DCP unpickles those) replaced by a pickle that runs code: the shard,
    `.metadata` and the record rewritten consistently."""
    ckpt = t.checkpoint()
    meta_member, metadata = read_metadata(t, ckpt)
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    values = [(i, s) for i, s in metadata.storage_data.items()
              if type(metadata.state_dict_metadata.get(i.fqn)) is BytesStorageMetadata]
    index, info = t.rng.choice(values)
    marker = t.rng.choice(MARKERS)(t.marker("value"))
    if t.rng.random() < 0.7:
        buffer = io.BytesIO()
        torch.save(marker, buffer)
        evil = buffer.getvalue()
    else:
        evil = pickle.dumps(marker)
    member = t.copy.folder(ckpt) + info.relative_path
    data = t.copy.read(member) + evil
    info.offset, info.length = len(data) - len(evil), len(evil)
    t.copy.set_payload(ckpt, member, data, consistent=True)
    t.copy.set_payload(ckpt, meta_member, pickle.dumps(metadata), consistent=True)
    return f"{member}: the value of {index.fqn!r} replaced by {type(marker).__name__}, .metadata and record rewritten"


@dataclass(frozen=True)
class Mutation:
    """One kind of change: its name, where it applies, how often it is drawn."""

    name: str
    apply: Callable[[Tamper], str]
    plain: bool = True
    sharded: bool = True
    volume: bool = True
    bucket: bool = True
    weight: int = 2


MUTATIONS = [
    Mutation("flip", flip_bytes, weight=3),
    Mutation("truncate", truncate),
    Mutation("append", append),
    Mutation("delete", delete),
    Mutation("commit field", commit_field, weight=4),
    Mutation("rename checkpoint", rename_checkpoint, weight=1),
    Mutation("move object", move_object, volume=False, weight=1),
    Mutation("name outside", name_outside, weight=3),
    Mutation("link outside", link_outside, bucket=False, weight=1),
    Mutation("header identity", header_identity, sharded=False),
    Mutation("marker payload", marker_payload, sharded=False),
    Mutation("evil metadata", evil_metadata, plain=False, weight=4),
    Mutation("evil value", evil_value, plain=False),
]


def fitting(sharded: bool, bucket: bool) -> list[Mutation]:
    """The kinds of change that apply to a kind of checkpoint in a kind of storage."""
    return [m for m in MUTATIONS if (m.sharded if sharded else m.plain) and (m.bucket if bucket else m.volume)]


def draw(rng: random.Random, sharded: bool, bucket: bool) -> Mutation:
    fits = fitting(sharded, bucket)
    return rng.choices(fits, weights=[m.weight for m in fits])[0]
