"""Reading a DCP checkpoint (torch.distributed.checkpoint) as untrusted input: no pickle runs code, no name
leaves its folder, no size in it makes a reader allocate more than the checkpoint holds.

torch's own reader trusts the files it reads: `FileSystemReader.read_metadata` is `pickle.load` of
`.metadata`, and `DefaultLoadPlanner.load_bytes` is `torch.load(weights_only=False)` of each non-tensor
value of a state. A sharded checkpoint on a claim or in a bucket that other jobs' code can write is no
such trusted file (DESIGN.md, "Stored state is untrusted input"): a replaced `.metadata` would run its
writer's code in every trainer that resumes the job and on the machine of whoever exports it. So every
kubetrain read of a DCP checkpoint (a restore from a volume or a bucket, verify, compare, export, the
Hugging Face export) goes through this module:

- `read_metadata(data, files)`: `.metadata` unpickled by an Unpickler that resolves only the names DCP's
  metadata is made of (its metadata classes, `_StorageInfo`, `torch.Size`, dtypes, layouts): the standard
  library's documented way of restricting globals, so no other callable can be named, and so none can be
  called. The result is then checked as DCP writes it, field by field (`MetadataError` names the first
  fault): every piece in one of the checkpoint's own files (`files`, from its commit) and within that
  file's length; no transforms (kubetrain writes none; they decompress); every tensor's elements within
  the bytes the checkpoint holds (DCP stores every element, so a tensor larger than the files is a lie
  that would only allocate memory); planner paths of plain keys and bounded list indices (DCP's
  `set_element` grows a list up to an index it reads).
- `Reader`: DCP's FileSystemReader with that metadata, for a directory; object_checkpoints subclasses it for
  a bucket.
- `load` (into a template, resharded) and `load_whole` (every tensor in one process): DCP's loads with
  planners whose non-tensor values go through `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import contextlib
import errno
import io
import math
import os
import pathlib
import pickle
import stat
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata, _MEM_FORMAT_ENCODING)
from torch.distributed.checkpoint.planner import ReadItem

from kubetrain.shared.files import PLAIN_NAME, read_regular

METADATA = ".metadata"
"""DCP's index of every piece of a checkpoint, written by its coordinator."""
MAX_METADATA_BYTES = 256 << 20
"""The largest `.metadata` read: about 200 bytes per piece, so some million pieces (a model of 10,000
tensors over 100 ranks); a larger one is not a checkpoint kubetrain wrote."""
MAX_PATH_DEPTH = 64
"""The deepest key path of a state's value (kubetrain.userapi refuses deeper states when saving)."""
MAX_LIST_INDEX = 1 << 20
"""The largest list index a planner path may hold: DCP's set_element appends None up to it."""
MAX_DIMS = 64
"""The most dimensions of a tensor (torch's own limit is 64)."""

_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch.distributed.checkpoint.metadata", cls.__name__): cls
    for cls in (Metadata, TensorStorageMetadata, BytesStorageMetadata, ChunkStorageMetadata, TensorProperties,
                StorageMeta, MetadataIndex, _MEM_FORMAT_ENCODING)
}
_ALLOWED[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
_ALLOWED[("torch", "Size")] = torch.Size
# torch pickles a layout as a call of this lookup by name (torch.serialization: copyreg), a dtype as a name.
_ALLOWED[("torch.serialization", "_get_layout")] = getattr(torch.serialization, "_get_layout")
# StorageMeta.checkpoint_id is the writer's path: kept as a pure path, which touches no file.
_ALLOWED[("pathlib", "PosixPath")] = pathlib.PurePosixPath
_ALLOWED[("pathlib", "PurePosixPath")] = pathlib.PurePosixPath
_DTYPES = {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)}
_ENUMS = (_MEM_FORMAT_ENCODING,)


def _enum_member(cls: Any, name: Any) -> Any:
    """What `builtins.getattr` may do in DCP's metadata: look up a member of DCP's own enum by name (Python
    3.12's pickle, and Debian's 3.11 in the trainer image, pickle an enum member as `getattr(cls, name)`; the
    host's 3.11.7 as a call of the class). Anything else is refused."""
    if cls in _ENUMS and isinstance(name, str) and name in cls.__members__:
        return cls.__members__[name]
    raise MetadataError(f"getattr({getattr(cls, '__name__', type(cls).__name__)}, {str(name)[:60]!r}): not a member "
                        "of DCP's metadata enums (refused: unpickling it could run code)")
_LAYOUTS = (torch.strided,)


class MetadataError(Exception):
    """A `.metadata` that is not DCP's metadata of this checkpoint's files; the message names the fault."""


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        raise MetadataError(f"names {module}.{name}, which DCP's metadata does not hold (refused: unpickling it "
                            "could run code)")


def read_metadata(data: bytes, files: Mapping[str, int]) -> Metadata:
    """The Metadata in `data` (the bytes of `.metadata`), checked against `files` (each file of the checkpoint
    with its length, as its commit lists them); MetadataError for anything else."""
    if len(data) > MAX_METADATA_BYTES:
        raise MetadataError(f"{len(data)} bytes, more than the {MAX_METADATA_BYTES} a checkpoint's index takes")
    try:
        metadata = _Unpickler(io.BytesIO(data)).load()
    except MetadataError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, KeyError, IndexError,
            RecursionError, MemoryError, RuntimeError, UnicodeDecodeError) as err:
        raise MetadataError(f"does not unpickle as DCP's metadata: {type(err).__name__}: {str(err)[:200]}") from None
    check_metadata(metadata, files)
    return metadata


def check_metadata(metadata: Any, files: Mapping[str, int]) -> None:
    """MetadataError unless `metadata` is DCP's Metadata of a checkpoint made of `files` (name -> length)."""
    if type(metadata) is not Metadata:
        raise MetadataError(f"holds a {type(metadata).__name__}, not DCP's Metadata")
    entries = metadata.state_dict_metadata
    if type(entries) is not dict:
        raise MetadataError("its state_dict_metadata is not a dict")
    total = sum(files.values())
    elements = 0
    for fqn, entry in entries.items():
        if type(fqn) is not str:
            raise MetadataError(f"a key {fqn!r} that is not a string")
        if type(entry) is BytesStorageMetadata:
            continue
        if type(entry) is not TensorStorageMetadata:
            raise MetadataError(f"{fqn}: a {type(entry).__name__}, not tensor or bytes metadata")
        elements += _tensor_bytes(fqn, entry)
    if elements > total:
        raise MetadataError(f"its tensors hold {elements} bytes, more than the {total} bytes of the checkpoint's "
                            "files")
    _check_storage(metadata.storage_data, files)
    _check_planner(metadata.planner_data, entries)
    if metadata.storage_meta is not None and type(metadata.storage_meta) is not StorageMeta:
        raise MetadataError("its storage_meta is not DCP's StorageMeta")
    if metadata.version is not None and type(metadata.version) is not str:
        raise MetadataError("its version is not a string")


def _size(where: str, size: Any) -> tuple[int, ...]:
    if type(size) is not torch.Size or len(size) > MAX_DIMS:
        raise MetadataError(f"{where}: not a torch.Size of at most {MAX_DIMS} dimensions")
    for dim in size:
        if type(dim) is not int or dim < 0:
            raise MetadataError(f"{where}: a dimension {dim!r}")
    return tuple(size)


def _tensor_bytes(fqn: str, entry: TensorStorageMetadata) -> int:
    """The bytes of the tensor at `fqn` (its elements times its dtype's size), its chunks checked."""
    props = entry.properties
    if type(props) is not TensorProperties or props.dtype not in _DTYPES.values() or props.layout not in _LAYOUTS:
        raise MetadataError(f"{fqn}: properties that are not a strided tensor's of a torch dtype")
    size = _size(fqn, entry.size)
    if type(entry.chunks) is not list:
        raise MetadataError(f"{fqn}: chunks that are not a list")
    for chunk in entry.chunks:
        if type(chunk) is not ChunkStorageMetadata:
            raise MetadataError(f"{fqn}: a chunk that is not DCP's")
        offsets, sizes = _size(fqn, chunk.offsets), _size(fqn, chunk.sizes)
        if len(offsets) != len(size) or len(sizes) != len(size) or any(
                o + s > d for o, s, d in zip(offsets, sizes, size)):
            raise MetadataError(f"{fqn}: a chunk at {offsets} of {sizes} outside the tensor's {size}")
    itemsize = torch.empty((), dtype=props.dtype).element_size()
    return math.prod(size) * itemsize


def _check_storage(storage: Any, files: Mapping[str, int]) -> None:
    if type(storage) is not dict:
        raise MetadataError("its storage_data is not a dict")
    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(index.fqn) is not str:
            raise MetadataError("a storage key that is not DCP's MetadataIndex")
        if type(info) is not _StorageInfo:
            raise MetadataError(f"{index.fqn}: storage that is not DCP's _StorageInfo")
        name = info.relative_path
        if type(name) is not str or PLAIN_NAME.fullmatch(name) is None or name not in files:
            raise MetadataError(f"{index.fqn}: in {name!r}, which is not one of the checkpoint's files "
                                f"({', '.join(sorted(files)[:4])}{', ...' if len(files) > 4 else ''})")
        offset, length = info.offset, info.length
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0 \
                or offset + length > files[name]:
            raise MetadataError(f"{index.fqn}: bytes {offset!r}+{length!r} outside {name} ({files[name]} bytes)")
        if getattr(info, "transform_descriptors", None):
            raise MetadataError(f"{index.fqn}: transforms {info.transform_descriptors!r} (kubetrain writes none)")


def _check_planner(planner: Any, entries: Mapping[str, Any]) -> None:
    if planner is None:
        return
    if type(planner) is not dict:
        raise MetadataError("its planner_data is not a dict")
    for fqn, path in planner.items():
        if fqn not in entries:
            raise MetadataError(f"planner data for {fqn!r}, which the checkpoint does not hold")
        if type(path) not in (tuple, list) or not path or len(path) > MAX_PATH_DEPTH:
            raise MetadataError(f"{fqn}: a key path that is not 1 to {MAX_PATH_DEPTH} keys")
        for key in path:
            if type(key) is str:
                continue
            if type(key) is not int or not 0 <= key <= MAX_LIST_INDEX:
                raise MetadataError(f"{fqn}: a key {key!r} in its path (strings, or list indices up to "
                                    f"{MAX_LIST_INDEX})")


def check_values(reader: FileSystemReader, metadata: Metadata, files: Collection[str] | None = None) -> None:
    """Every non-tensor value the checkpoint holds (those in `files` only, when given: a rank's share) loads
    weights-only; MetadataError naming the first that does not (a pickle that names a class or function), so
    that a checkpoint whose files verify against a commit its writer also rewrote is set aside at the check,
    not found out in the middle of a collective load. Values are small (a step, an RNG state, a cursor)."""
    for index, info in metadata.storage_data.items():
        entry = metadata.state_dict_metadata.get(index.fqn)
        if type(entry) is not BytesStorageMetadata or (files is not None and info.relative_path not in files):
            continue
        with reader.fs.create_stream(reader.fs.concat_path(reader.path, info.relative_path), "rb") as stream:
            piece = reader._slice_file(stream, info).read(info.length)
        try:
            _load_bytes_safely(io.BytesIO(piece))
        except Exception as err:  # noqa: BLE001 - whatever the weights-only loader refuses, the value is refused
            raise MetadataError(f"{index.fqn}: its value in {info.relative_path} does not load as plain data "
                                f"({type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}); "
                                "refused: unpickling it could run code") from None


def _load_bytes_safely(value: io.BytesIO) -> Any:
    """A non-tensor value of a state (a number, a string, the RNG's tuples): torch's weights-only loader."""
    return torch.load(value, weights_only=True)


class Planner(DefaultLoadPlanner):
    """DCP's load planner into a template, with non-tensor values loaded weights-only."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        loaded = _load_bytes_safely(value)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class WholePlanner(_EmptyStateDictLoadPlanner):
    """DCP's planner that builds the whole state from the metadata (an export), non-tensor values weights-only."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        Planner.load_bytes(self, read_item, value)  # type: ignore[arg-type]  # the same state fields


class _NoLinks(FileSystem):
    """DCP's file system of a checkpoint directory, opening regular files only (a link planted in the
    directory could point anywhere on the node)."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        if mode != "rb":
            raise MetadataError(f"{path}: a checkpoint being read is opened read-only, asked {mode!r}")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        with os.fdopen(fd, "rb") as stream:
            yield stream


class Reader(FileSystemReader):
    """DCP's reader of a checkpoint directory whose `.metadata` is read by `read_metadata`, against `files`
    (name -> length, from the checkpoint's commit), and whose files are opened as regular files only."""

    def __init__(self, path: str | Path, files: Mapping[str, int]):
        super().__init__(str(path))
        self.fs = _NoLinks()
        self.path = self.fs.init_path(str(path))
        self.files = dict(files)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(self.metadata_bytes(), self.files)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def metadata_bytes(self) -> bytes:
        """`.metadata`'s bytes: a regular file, no link, at most MAX_METADATA_BYTES."""
        try:
            return read_regular(Path(str(self.path)) / METADATA, MAX_METADATA_BYTES + 1)
        except OSError as err:
            raise MetadataError(f"cannot be read: {err.strerror or err}") from None


def load(template: dict[str, Any], reader: FileSystemReader, group: Any, no_dist: bool) -> None:
    """DCP's collective load of `reader`'s checkpoint into `template` in place (each rank reads its pieces)."""
    import torch.distributed.checkpoint as dcp

    dcp.load(template, storage_reader=reader, planner=Planner(), process_group=group, no_dist=no_dist)


def load_whole(reader: FileSystemReader, keys: set[str] | None = None) -> dict[str, Any]:
    """Every tensor of `reader`'s checkpoint (those under `keys` only, when given) whole, in this process."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    reader.read_metadata()  # its fault named here (MetadataError), not inside DCP's wrapped exceptions
    state: dict[str, Any] = {}
    _load_state_dict(state_dict=state, storage_reader=reader, process_group=None, no_dist=True,
                     planner=WholePlanner(keys=keys))
    return state
