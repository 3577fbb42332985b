"""Files that a reader sees whole or not at all: the one atomic write, and reads that trust no link.

Every writer of a file another process reads (a checkpoint and its `latest` pointer, a COMMIT, an
exported model, a replica's results, the local run's state, plan and summary) goes through
`atomic_write`, so they share one durability: a crash at any moment leaves the old file or the new
one, whole, and once `atomic_write` returns the new one survives a power cut too.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

Content = bytes | str | Callable[[BinaryIO], object]
"""What `atomic_write` writes: bytes, text (UTF-8), or a function that writes into the open file (its result unused)."""


def atomic_write(path: str | Path, content: Content, verify: Callable[[Path], None] | None = None) -> int:
    """Write `content` to `path` atomically and durably; the number of bytes written.

    The steps: a temporary file in the same directory (a rename is atomic only within one
    filesystem), written and fsynced; `verify(temporary path)` when given (a checkpoint is read
    back before it may replace anything); renamed over `path`; the directory fsynced (the rename
    is durable only once the directory entry is on disk). The directory must exist: it is never
    created here, so a checkpoint volume that went away fails the write instead of being recreated
    empty on the node's disk.

    The temporary name is unique (`.<name>.<pid>.<random>.tmp`) and created with O_EXCL, which never
    follows a link: two writers never share one, and a link planted under the name by code that
    shares the volume is refused, not written through. Its mode is 0666 less the umask (as `open`
    makes files; mkstemp's 0600 would make an exported model unreadable to others). On any error,
    `verify`'s included, the temporary file is removed and the error raised; `path` is as it was.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(content):
                content(f)
            else:
                f.write(content.encode() if isinstance(content, str) else content)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        if verify is not None:
            verify(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # no half-written file left taking room
        raise
    fsync_dir(path.parent)
    return size


def fsync_dir(directory: str | Path) -> None:
    """Make the entries of `directory` (a rename, a new file) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_regular(path: str | Path, max_bytes: int | None = None) -> bytes:
    """The bytes of a regular file (at most `max_bytes`), never following a symlink or blocking on a FIFO.

    OSError (ELOOP for a link, EINVAL for anything not regular) otherwise: a checkpoint volume is
    writable by the job's own code, and a link there could point anywhere on the node.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read() if max_bytes is None else f.read(max_bytes)
    finally:
        os.close(fd)


def unreadable(err: OSError) -> str:
    """Why read_regular refused a file, for a person."""
    if err.errno == errno.ELOOP:
        return "a symbolic link, refused (checkpoints are read from regular files only: a link could point anywhere)"
    if err.errno == errno.EINVAL:
        return "not a regular file (a FIFO, device or directory), refused"
    return f"cannot be read: {err.strerror or err}"


PLAIN_NAME = re.compile(r"(?!\.\.?\Z)[A-Za-z0-9._+=@,-]{1,255}")
"""One file name as kubetrain and the libraries it reads write them (`ckpt-00000050.pt`, DCP's
`__0_0.distcp` and `.metadata`, `model-00001-of-00002.safetensors`, `tokenizer.json`): no `/`, no `..`,
no NUL, not empty, at most 255 bytes (a file name's limit on Linux)."""


class OutsideFolder(ValueError):
    """A name read from storage that is not one plain name inside its folder."""


def confined(folder: str | Path, name: str) -> Path:
    """`folder / name` for a `name` read from storage (a commit's object, an index's shard, a SHA256SUMS
    line): OutsideFolder unless `name` is one PLAIN_NAME and the joined path, resolved, lies directly in
    `folder` resolved. `Path(folder) / "/etc/x"` is `/etc/x` and `folder/../x` leaves it: both are refused
    here before anything is read or written, whoever wrote the name."""
    if not isinstance(name, str) or PLAIN_NAME.fullmatch(name) is None:
        raise OutsideFolder(f"{name!r} is not a plain file name (letters, digits, '._+=@,-'; no '/', no '..')")
    base = Path(folder).resolve()
    path = (base / name).resolve()
    if path.parent != base:
        raise OutsideFolder(f"{name!r} leads outside {base} (to {path})")
    return Path(folder) / name
