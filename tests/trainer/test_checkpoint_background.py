"""Background checkpoints: one write in flight, reported only once durable and verified, killed writes harmless."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kubetrain.trainer import checkpoint
from kubetrain.trainer.checkpoint import HEADER_BYTES, MAGIC, CheckpointInfo, CheckpointStore, SnapshotBuffers
from kubetrain.trainer.errors import TransientError

# Generous: a loaded 2-core machine may take seconds to start a Python process with torch.
SUBPROCESS_SECONDS = 120


def state(step: int) -> dict:
    return {"weights": torch.full((64, 64), float(step)), "step": step, "nested": {"list": [torch.ones(3) * step]}}


class Gate:
    """Holds every write of a store just before its read-back (fsynced, not yet renamed) until released."""

    def __init__(self, real):
        self.real = real
        self.entered = threading.Event()
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.active = 0
        self.most = 0

    def __call__(self, path: Path, *args) -> None:
        with self.lock:
            self.active += 1
            self.most = max(self.most, self.active)
        try:
            self.entered.set()
            assert self.release.wait(60), "the test never released the write"
            self.real(path, *args)
        finally:
            with self.lock:
                self.active -= 1


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    held = Gate(checkpoint._verify_written)
    monkeypatch.setattr(checkpoint, "_verify_written", held)
    yield held
    held.release.set()


def test_a_save_while_a_write_is_in_flight_waits_for_it(tmp_path: Path, gate: Gate) -> None:
    store = CheckpointStore(tmp_path, keep_last=3, identity="h")
    store.save(1, state(1))
    assert gate.entered.wait(30) and store.in_flight
    second = threading.Thread(target=store.save, args=(2, state(2)))
    second.start()
    second.join(0.5)
    assert second.is_alive(), "a second save must wait for the write in flight, not start another"
    gate.release.set()
    second.join(30)
    store.wait()
    assert gate.most == 1, "at most one write in flight"
    assert [i.step for i in store.list()] == [1, 2]
    assert store.stall_seconds >= 0.4, "the wait for the write in flight counts as the loop's stall"


def test_the_reported_step_only_ever_names_a_durable_verified_file(tmp_path: Path, gate: Gate) -> None:
    reported: list[int] = []

    def on_persisted(info: CheckpointInfo, seconds: float) -> None:
        # What the metrics and the event log are told: the file is in place,
        # `latest` names it, it verifies, and no temporary file is left.
        assert (tmp_path / "latest").read_text().strip() == info.path.name
        assert CheckpointStore._read(info.path)[0].step == info.step
        assert not list(tmp_path.glob(".ckpt-*.tmp"))
        reported.append(info.step)

    store = CheckpointStore(tmp_path, keep_last=3, identity="h", on_persisted=on_persisted)
    gate.release.set()
    store.save(1, state(1))
    store.wait()
    gate.release.clear()
    gate.entered.clear()
    store.save(2, state(2))
    assert gate.entered.wait(30)
    # Fsynced under its temporary name, not yet read back: nothing names step 2.
    assert (reported, store.durable_step, store.latest_step()) == ([1], 1, 1)
    assert not store.path_of(2).exists()
    gate.release.set()
    store.wait()
    assert (reported, store.durable_step, store.latest_step()) == ([1, 2], 2, 2)


def test_a_file_that_reads_back_wrong_is_never_named_and_fails_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = checkpoint._verify_written

    def bad_disk(path: Path, *args) -> None:
        with open(path, "r+b") as f:  # one payload byte changes on its way to the device
            f.seek(len(MAGIC) + HEADER_BYTES + 100)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        real(path, *args)

    store = CheckpointStore(tmp_path, keep_last=3, identity="h")
    store.save(1, state(1))
    store.wait()
    monkeypatch.setattr(checkpoint, "_verify_written", bad_disk)
    store.save(2, state(2))
    with pytest.raises(TransientError, match="sha256 differs"):
        store.save(3, state(3))
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["ckpt-00000001.pt", "latest"]
    assert (store.durable_step, store.latest_step()) == (1, 1)
    monkeypatch.setattr(checkpoint, "_verify_written", real)
    store.save(3, state(3))  # the failure was reported once; the next save writes
    store.wait()
    assert [i.step for i in store.list()] == [1, 3]


def test_a_failed_background_write_surfaces_at_the_next_save_which_writes_nothing(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    store = CheckpointStore(directory, keep_last=3, identity="h")
    directory.rmdir()  # the volume went away under the writer
    store.save(1, state(1))
    with pytest.raises(TransientError, match="could not be written"):
        store.save(2, state(2))
    assert not directory.exists(), "the failed save's successor wrote nothing"
    directory.mkdir()
    store.save(2, state(2))
    store.wait()
    assert [i.step for i in store.list()] == [2]


def test_the_copy_is_deep_and_its_buffers_are_reused_without_leaking_into_earlier_files(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=5, identity="h")
    weights, history, meta = torch.zeros(1000), [0.5], {"epoch": 1, "names": ["a"]}
    user_state = {"weights": weights, "history": history, "meta": meta, "shape": torch.Size([2, 3])}
    store.save(1, user_state)
    # The script moves on while step 1 is written: none of this may reach the file.
    weights += 1
    history.append(0.25)
    meta["epoch"] = 2
    meta["names"].append("b")
    store.save(2, user_state)  # refills the buffers of step 1, once step 1 is on disk
    weights += 1
    user_state["extra"] = torch.arange(4)  # a new entry gets a buffer of its own
    store.save(3, user_state)
    store.wait()
    one, two, three = (CheckpointStore._read(store.path_of(s))[1] for s in (1, 2, 3))
    assert float(one["weights"].sum()) == 0.0 and one["history"] == [0.5] and one["meta"] == {"epoch": 1, "names": ["a"]}
    assert float(two["weights"].sum()) == 1000.0 and two["history"] == [0.5, 0.25]
    assert two["meta"] == {"epoch": 2, "names": ["a", "b"]} and two["shape"] == torch.Size([2, 3])
    assert float(three["weights"].sum()) == 2000.0 and torch.equal(three["extra"], torch.arange(4))


def test_snapshot_buffers_follow_changed_shapes_and_release_removed_entries() -> None:
    buffers = SnapshotBuffers()
    first = buffers.copy({"a": torch.ones(4), "b": torch.ones(2)})
    second = buffers.copy({"a": torch.ones(4) * 2})
    assert second["a"].data_ptr() == first["a"].data_ptr(), "the same entry refills the same buffer"
    third = buffers.copy({"a": torch.ones(5)})
    assert third["a"].shape == (5,) and buffers._buffers.keys() == {("a",)}
    assert buffers.copy({"a": torch.ones(5, dtype=torch.float64)})["a"].dtype == torch.float64


def test_a_synchronous_store_is_durable_when_save_returns(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=3, identity="h", background=False)
    store.save(4, state(4))
    assert not store.in_flight and store.durable_step == 4 and store.latest_step() == 4


def test_files_with_the_earlier_unpadded_header_still_load(tmp_path: Path) -> None:
    import hashlib
    import io
    import json

    payload = io.BytesIO()
    torch.save(state(9), payload)
    data = payload.getvalue()
    header = {"step": 9, "spec_hash": "h", "length": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (tmp_path / "ckpt-00000009.pt").write_bytes(MAGIC + json.dumps(header).encode() + b"\n" + data)
    step, loaded = CheckpointStore(tmp_path, keep_last=3, identity="h").load_latest()
    assert step == 9 and float(loaded["weights"][0, 0]) == 9.0


# A process that checkpoints step 1, then is held inside the background write
# of step 2 at the named stage until the test SIGKILLs it.
KILLED_WRITER = textwrap.dedent("""
    import sys, threading
    from pathlib import Path
    import torch
    from kubetrain.trainer import checkpoint

    directory, stage = Path(sys.argv[1]), sys.argv[2]
    marker = directory.parent / "held"
    armed = threading.Event()  # set once step 1 is durable: only the write of step 2 is held

    def hold():
        marker.write_text(stage)
        threading.Event().wait()  # until SIGKILL

    if stage == "mid-payload":
        real_write = checkpoint._HashingWriter.write
        def write(self, data):
            if armed.is_set() and self.length > 0:  # part of the payload is in the file
                hold()
            return real_write(self, data)
        checkpoint._HashingWriter.write = write
    elif stage == "before-read-back":
        real_verify = checkpoint._verify_written
        def verify(path, *args):
            if armed.is_set():
                hold()
            return real_verify(path, *args)
        checkpoint._verify_written = verify
    elif stage == "before-latest":
        real_atomic = checkpoint.atomic_write
        def atomic(path, write, verify=None):
            if armed.is_set() and path.name == checkpoint.LATEST:
                hold()
            return real_atomic(path, write, verify)
        checkpoint.atomic_write = atomic

    store = checkpoint.CheckpointStore(directory, keep_last=3, identity="h")
    store.save(1, {"w": torch.full((1 << 20,), 1.0), "step": 1})
    store.wait()
    armed.set()
    store.save(2, {"w": torch.full((1 << 20,), 2.0), "step": 2})
    threading.Event().wait()  # the training loop goes on; the kill comes
""")


@pytest.mark.parametrize(
    "stage, resumed",
    [
        pytest.param("mid-payload", 1, id="mid-payload"),
        pytest.param("before-read-back", 1, id="fsynced, not yet verified or renamed"),
        # Verified and renamed: the file is whole, so it is the newest valid one.
        pytest.param("before-latest", 2, id="renamed, latest not yet moved"),
    ],
)
def test_a_process_killed_during_a_background_write_resumes_from_the_newest_valid_checkpoint(
    tmp_path: Path, stage: str, resumed: int
) -> None:
    directory = tmp_path / "ckpt"
    child = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(directory), stage],
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + SUBPROCESS_SECONDS
        while not (tmp_path / "held").exists():
            assert child.poll() is None, child.stderr.read()
            assert time.monotonic() < deadline, "the writer never reached its stage"
            time.sleep(0.05)
        child.kill()
    finally:
        child.kill()
        child.wait(SUBPROCESS_SECONDS)
    assert child.returncode == -9
    leftovers = list(directory.glob(".ckpt-*.tmp"))
    assert bool(leftovers) == (stage != "before-latest")
    store = CheckpointStore(directory, keep_last=3, identity="h")  # the restarted process
    step, loaded = store.load_latest()
    assert not list(directory.glob(".ckpt-*.tmp"))  # removed once the restore knows the directory is its job's
    assert step == resumed and loaded["step"] == resumed
    assert torch.equal(loaded["w"], torch.full((1 << 20,), float(resumed)))
