"""The model initializer: a pretrained Hugging Face model directory fetched once, checked, and read by every replica.

`spec.model.pretrained` names a directory of the Hugging Face layout:
`config.json`, the weights as `model.safetensors` or as shards named by
`model.safetensors.index.json`, and the tokenizer's files. It may lie

- at a local path (`kubetrain run`; relative to the manifest's directory): used
  where it is, after the checks;
- on a claim, `pvc://CLAIM/PATH`: in a cluster the claim is mounted read-only
  and the path used where it is; locally refused (there is no claim);
- in object storage, `s3://BUCKET/PREFIX/`: downloaded into the run's cache
  (a pod's own disk), every object's length and sha256 recorded;
- on the Hugging Face Hub, `hf://ORG/NAME`: downloaded with huggingface_hub
  (unreachable from the machines kubetrain is tested on: not tested).

The checks (`check`), the same wherever the files came from: config.json
parses; there are weights; an index names only files that are there and
every tensor's file; every .safetensors file's header parses and the file
is as long as its header says (a truncated download fails here, not at the
first forward); and, when the directory holds a `SHA256SUMS` file (what
`sha256sum` writes), every file it lists has that digest. A fetched
directory gets READY_FILE last: a replica that finds it reads the files
without fetching or hashing them again.

`python -m kubetrain.trainer initializer` runs this before any training
process starts (locally `kubetrain run` runs it first; in a cluster an init
container of each pod): a missing file, a config without weights or a
checksum mismatch fails the job there with the URI named (exit 3).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kubetrain.shared.files import PLAIN_NAME, OutsideFolder, atomic_write, confined
from kubetrain.shared.launch import MODEL_DIR_VAR, MODEL_MAX_BYTES_VAR, PRETRAINED_CLAIM_MOUNT, pretrained_in_place

from .errors import EXIT_OK, ConfigError, LoadError

if TYPE_CHECKING:
    from .context import ReplicaContext

log = logging.getLogger(__name__)

CONFIG = "config.json"
SINGLE_WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
SUMS = "SHA256SUMS"
READY_FILE = ".kubetrain-ready.json"
"""Written last into a fetched directory: its source and every file's size; a directory without it is refetched."""
PVC, S3, HF = "pvc://", "s3://", "hf://"
# Bounds on what a model directory may hold: a listing past them is not a model directory.
MAX_FILES = 10_000
MAX_SMALL_FILE_BYTES = 64 << 20
"""config.json, the index and SHA256SUMS are read whole: at most this many bytes each."""
MAX_HEADER_BYTES = 100 << 20
"""A safetensors header (its JSON) is at most this long; safetensors itself refuses more."""


@dataclass(frozen=True)
class Checked:
    """A model directory that passed `check`: its weight files and its config."""

    path: Path
    weights: list[str]
    config: dict[str, Any]


def inside(directory: Path, name: Any, uri: str, what: str) -> Path:
    """`directory / name` for a file name read from the model directory itself (an index's shard, a SHA256SUMS
    line): LoadError unless it is one plain name that stays inside (no '/', '..', absolute path, or a link that
    leads out)."""
    try:
        return confined(directory, name)
    except OutsideFolder as err:
        raise LoadError(f"{uri}: {what} names a file outside the model directory: {err}") from None


def read_json(path: Path, uri: str) -> Any:
    if path.stat().st_size > MAX_SMALL_FILE_BYTES:
        raise LoadError(f"{uri}: {path.name} is larger than {MAX_SMALL_FILE_BYTES} bytes")
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise LoadError(f"{uri}: {path.name} is not valid JSON ({type(err).__name__}: {str(err)[:200]})") from None


def safetensors_tensors(path: Path, uri: str) -> dict[str, Any]:
    """The tensors a .safetensors file's header lists (name -> dtype, shape, data_offsets); LoadError when the
    header does not parse or the file is shorter or longer than its header says."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise LoadError(f"{uri}: {path.name} is {size} bytes, too short for a safetensors file")
        (length,) = struct.unpack("<Q", raw)
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise LoadError(f"{uri}: {path.name}: its header claims {length} bytes in a file of {size}: not a "
                            "safetensors file, or truncated")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise LoadError(f"{uri}: {path.name}: the safetensors header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise LoadError(f"{uri}: {path.name}: the safetensors header is not a JSON object")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    for name, entry in tensors.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)
                and offsets[0] <= offsets[1] and isinstance(entry.get("dtype"), str)
                and isinstance(entry.get("shape"), list)):
            raise LoadError(f"{uri}: {path.name}: the safetensors header's entry for {str(name)[:100]!r} is not a "
                            "tensor's (dtype, shape and two data_offsets)")
    end = max((v["data_offsets"][1] for v in tensors.values()), default=0)
    if 8 + length + end != size:
        raise LoadError(f"{uri}: {path.name} is {size} bytes, its header says {8 + length + end}: truncated or "
                        "damaged")
    return tensors


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def read_sums(path: Path, uri: str) -> dict[str, str]:
    """SHA256SUMS as `sha256sum` writes it (`<hex>  <name>`, a `*` before binary names): name -> digest."""
    if path.stat().st_size > MAX_SMALL_FILE_BYTES:
        raise LoadError(f"{uri}: {SUMS} is larger than {MAX_SMALL_FILE_BYTES} bytes")
    sums = {}
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        digest, _, name = line.partition(" ")
        name = name.strip().lstrip("*")
        if len(digest) != 64 or not name or any(c not in "0123456789abcdef" for c in digest.lower()):
            raise LoadError(f"{uri}: {SUMS} line {number}: expected '<sha256>  <file>', got {line[:80]!r}")
        inside(path.parent, name, uri, f"{SUMS} line {number}")
        sums[name] = digest.lower()
    return sums


def check(path: Path, uri: str, digests: dict[str, str] | None = None) -> Checked:
    """Check the model directory `path` (fetched from `uri`); LoadError naming `uri` and the file at the first fault.

    `digests`: sha256 of files already computed while downloading them (not read again).
    """
    if not path.is_dir():
        raise LoadError(f"{uri}: no such directory")
    if not (path / CONFIG).is_file():
        raise LoadError(f"{uri}: no {CONFIG}: not a Hugging Face model directory")
    config = read_json(path / CONFIG, uri)
    if not isinstance(config, dict) or "model_type" not in config:
        raise LoadError(f"{uri}: {CONFIG} has no model_type: not a Hugging Face model config")
    if (path / INDEX).is_file():
        index = read_json(path / INDEX, uri)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise LoadError(f"{uri}: {INDEX} has no weight_map")
        weights = sorted(set(map(str, weight_map.values())))
        missing = [name for name in weights if not inside(path, name, uri, INDEX).is_file()]
        if missing:
            raise LoadError(f"{uri}: {INDEX} names {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}, "
                            "not in the directory")
        held = {name: safetensors_tensors(path / name, uri) for name in weights}
        for tensor, name in weight_map.items():
            if tensor not in held[name]:
                raise LoadError(f"{uri}: {INDEX} puts {tensor} in {name}, which does not hold it")
    elif (path / SINGLE_WEIGHTS).is_file():
        weights = [SINGLE_WEIGHTS]
        safetensors_tensors(path / SINGLE_WEIGHTS, uri)
    else:
        other = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt*"))
        hint = (f" (found {', '.join(other[:3])}: kubetrain reads safetensors only, which cannot hold code; "
                "convert with save_pretrained(..., safe_serialization=True))") if other else ""
        raise LoadError(f"{uri}: {CONFIG} but no weights: expected {SINGLE_WEIGHTS} or {INDEX}{hint}")
    if (path / SUMS).is_file():
        known = digests or {}
        for name, digest in read_sums(path / SUMS, uri).items():
            file = inside(path, name, uri, SUMS)
            if not file.is_file():
                raise LoadError(f"{uri}: {SUMS} lists {name}, not in the directory")
            if (known.get(name) or file_sha256(file)) != digest:
                raise LoadError(f"{uri}: {name}: checksum mismatch (its sha256 is not the one {SUMS} lists)")
    return Checked(path, weights, config)


# --- where the directory comes from ------------------------------------------------------------------------


def local_path(uri: str) -> Path | None:
    """The directory a path or pvc:// pretrained is read from in place; None when it is fetched (s3://, hf://)."""
    if uri.startswith(PVC):
        if not Path(PRETRAINED_CLAIM_MOUNT).is_dir():
            raise ConfigError(f"spec.model.pretrained: {uri}: a claim is mounted in a cluster's pods only; "
                              "with `kubetrain run` name a local path")
        return Path(PRETRAINED_CLAIM_MOUNT) / uri[len(PVC):].partition("/")[2]
    if not pretrained_in_place(uri):
        return None
    return Path(uri).expanduser()  # relative: to the working directory, as spec.dataset.path


def fetch(uri: str, cache: Path) -> Checked:
    """The checked model directory of `uri`: in place (a path, a claim) or fetched into `cache` (once: a cache
    with READY_FILE for the same source is used as it is)."""
    place = local_path(uri)
    if place is not None:
        return check(place, uri)
    ready = _ready(cache, uri)
    if ready is not None:
        return ready
    cache.mkdir(parents=True, exist_ok=True)
    for left in cache.iterdir():  # what an interrupted fetch left (the directory itself may be a pod's mount)
        shutil.rmtree(left) if left.is_dir() and not left.is_symlink() else left.unlink()
    digests = _fetch_object_store(uri, cache) if uri.startswith(S3) else _fetch_hub(uri, cache)
    checked = check(cache, uri, digests)
    files = {p.name: p.stat().st_size for p in sorted(cache.iterdir()) if p.is_file()}
    atomic_write(cache / READY_FILE, lambda f: f.write(json.dumps({"uri": uri, "files": files}).encode()))
    return checked


def _ready(cache: Path, uri: str) -> Checked | None:
    """The cache as it is when a whole fetch of `uri` ended in it (READY_FILE, every file of its size)."""
    try:
        ready = json.loads((cache / READY_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(ready, dict) or ready.get("uri") != uri or not isinstance(ready.get("files"), dict):
        return None
    for name, size in ready["files"].items():
        try:
            file = confined(cache, name)
        except OutsideFolder:
            return None
        if not file.is_file() or file.stat().st_size != size:
            return None
    config = read_json(cache / CONFIG, uri)
    weights = ([SINGLE_WEIGHTS] if (cache / SINGLE_WEIGHTS).is_file() else
               sorted(set(read_json(cache / INDEX, uri)["weight_map"].values())))
    return Checked(cache, weights, config)


def _fetch_object_store(uri: str, cache: Path) -> dict[str, str]:
    """Download every object directly under the prefix `uri` into `cache`; their sha256 by name."""
    from .objstore import parse_uri, shared_store

    store = shared_store()
    prefix = parse_uri(uri, "spec.model.pretrained").prefix()
    store.check_bucket(prefix)
    # The objects directly under the prefix: not a "folder" (a zero-byte key ending in '/', as consoles make
    # them, the prefix's own included), not one below. A name that is not one plain file name is not a
    # Hugging Face file, and would not stay in the cache: left out, with a warning.
    found = []
    for info in store.list(prefix):
        name = info.uri.key[len(prefix.key):]
        if not name or "/" in name:
            continue
        if PLAIN_NAME.fullmatch(name) is None:
            log.warning("pretrained %s: %r is not a plain file name; left out", uri, name[:100])
            continue
        found.append(info)
    if not found:
        raise LoadError(f"{uri}: no objects under this prefix")
    if len(found) > MAX_FILES:
        raise LoadError(f"{uri}: {len(found)} objects, more than a model directory's {MAX_FILES}")
    names = {info.uri.key[len(prefix.key):] for info in found}
    if CONFIG not in names:
        raise LoadError(f"{uri}: no {CONFIG}: not a Hugging Face model directory")
    total = sum(info.size for info in found)
    check_disk(uri, total)
    log.info("pretrained %s: %d objects, %d bytes, into %s", uri, len(found), total, cache)
    digests = {}
    for info in found:
        name = info.uri.key[len(prefix.key):]
        digests[name] = store.download(info.uri, confined(cache, name), size=info.size)[1]
    return digests


def check_disk(uri: str, total: int) -> None:
    """LoadError, before anything is downloaded, when the model is larger than the disk its copy may take
    (spec.model.diskSize, as KUBETRAIN_MODEL_MAX_BYTES: a pod's `model` volume is bounded to it, and a larger
    copy would be evicted for it, or fill a node shared with other tenants)."""
    raw = os.environ.get(MODEL_MAX_BYTES_VAR, "")
    if not raw:
        return
    try:
        limit = int(raw)
    except ValueError:
        raise ConfigError(f"{MODEL_MAX_BYTES_VAR}: expected a number of bytes, got {raw!r}") from None
    if total > limit:
        raise LoadError(f"{uri}: the model is {total} bytes ({total / 2**30:.2f} GiB), more than spec.model.diskSize "
                        f"allows its copy ({limit} bytes, {limit / 2**30:.2f} GiB): raise spec.model.diskSize")


def _fetch_hub(uri: str, cache: Path) -> dict[str, str]:  # pragma: no cover - the Hub is unreachable in tests
    """hf://ORG/NAME[@REVISION]: the repository's safetensors, config and tokenizer files (huggingface_hub)."""
    from huggingface_hub import snapshot_download

    repo, _, revision = uri[len(HF):].partition("@")
    try:
        snapshot_download(repo, revision=revision or None, local_dir=cache,
                          allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", SUMS])
    except Exception as err:  # noqa: BLE001 - the Hub's errors are many; the message names the model
        raise LoadError(f"{uri}: download from the Hugging Face Hub failed: {type(err).__name__}: {err}") from None
    return {}


def model_dir(uri: str | None = None) -> Path:
    """The pretrained model's directory a replica reads: KUBETRAIN_MODEL_DIR, set by the plan and filled by the
    initializer; unset (a tool that rebuilds the job's model: verify, compare), `uri` fetched and checked here,
    into ~/.cache/kubetrain/models/ when it is not read in place."""
    raw = os.environ.get(MODEL_DIR_VAR)
    if raw:
        return Path(raw)
    if not uri:
        raise ConfigError(f"{MODEL_DIR_VAR}: not set, and the job names no spec.model.pretrained")
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    cache = Path(base) / "kubetrain" / "models" / hashlib.sha256(uri.encode()).hexdigest()[:16]
    return fetch(uri, cache).path


def run_initializer(ctx: ReplicaContext) -> int:
    """The initializer role: fetch and check spec.model.pretrained into KUBETRAIN_MODEL_DIR before training."""
    spec = ctx.spec
    uri = spec.model.pretrained if spec.model is not None else None
    if not uri:
        raise ConfigError("spec.model.pretrained: not set; the initializer has nothing to fetch")
    checked = fetch(uri, model_dir())
    print(f"pretrained {uri}: checked ({len(checked.weights)} weight file(s), model_type "
          f"{checked.config.get('model_type')}) in {checked.path}", flush=True)
    return EXIT_OK
