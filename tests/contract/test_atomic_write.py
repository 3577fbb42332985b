"""kubetrain.shared.files.atomic_write: the one atomic write of every file another process reads."""

import os
import stat

import pytest

from kubetrain.shared.files import atomic_write, read_regular, unreadable


@pytest.mark.parametrize("content,expected", [
    (b"\x00bytes\n", b"\x00bytes\n"),
    ("text, é\n", "text, é\n".encode()),
    (lambda f: (f.write(b"written "), f.write(b"by a function")), b"written by a function"),
], ids=["bytes", "text", "writer"])
def test_writes_bytes_text_or_a_writer_and_says_how_many_bytes(tmp_path, content, expected):
    path = tmp_path / "file"
    assert atomic_write(path, content) == len(expected)
    assert path.read_bytes() == expected
    assert sorted(p.name for p in path.parent.iterdir()) == ["file"]


def test_replaces_an_existing_file_whole(tmp_path):
    path = tmp_path / "latest"
    path.write_text("ckpt-00000001.pt\n")
    atomic_write(path, "ckpt-00000002.pt\n")
    assert path.read_text() == "ckpt-00000002.pt\n"
    assert os.listdir(tmp_path) == ["latest"]


@pytest.mark.parametrize("fail", ["writer", "verify"])
def test_a_failure_leaves_the_old_file_and_no_temporary_one(tmp_path, fail):
    path = tmp_path / "state.json"
    path.write_text("old")

    def writer(f):
        f.write(b"half of it")
        if fail == "writer":
            raise OSError(28, "No space left on device")

    def verify(tmp):
        assert tmp.parent == tmp_path and tmp.name.startswith(".state.json.") and tmp.read_bytes() == b"half of it"
        raise ValueError("read back, the sha256 differs")

    with pytest.raises(OSError if fail == "writer" else ValueError):
        atomic_write(path, writer, verify=verify if fail == "verify" else None)
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["state.json"]


def test_the_file_is_readable_as_the_umask_allows_not_only_by_its_owner(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write(tmp_path / "model.pt", b"weights")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "model.pt").stat().st_mode) == 0o644


def test_reads_refuse_links_and_fifos(tmp_path):
    (tmp_path / "real").write_bytes(b"0123456789")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    os.mkfifo(tmp_path / "fifo")
    assert read_regular(tmp_path / "real", 4) == b"0123"
    for name, why in (("link", "symbolic link"), ("fifo", "not a regular file")):
        with pytest.raises(OSError) as err:
            read_regular(tmp_path / name)
        assert why in unreadable(err.value)


def test_a_missing_directory_fails_the_write_and_is_not_created(tmp_path):
    with pytest.raises(FileNotFoundError):
        atomic_write(tmp_path / "gone" / "latest", b"ckpt-00000001.pt\n")
    assert not (tmp_path / "gone").exists()
