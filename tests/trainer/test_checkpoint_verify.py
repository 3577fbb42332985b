"""`kubetrain checkpoints verify` and the trainer judge a checkpoint alike: a file that does not load
is corrupt, and a link or FIFO named like a checkpoint is refused, never followed or read."""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
from pathlib import Path

import torch

from kubetrain.trainer.checkpoint import MAGIC, CheckpointStore, read_valid
from kubetrain.trainer.verify import EXIT_INVALID, main_verify, verify_checkpoints


def state(step: int) -> dict:
    return {"weights": torch.full((2, 2), float(step)), "step": step}


def store_with(tmp_path: Path, *steps: int) -> tuple[Path, CheckpointStore]:
    directory = tmp_path / "single-0"
    store = CheckpointStore(directory, keep_last=5, identity="h", background=False)
    for step in steps:
        store.save(step, state(step))
    return directory, store


def verify(directory: Path) -> tuple[int, str, str]:
    """main_verify in a thread that must finish: a FIFO read by mistake would block it for ever."""
    out, err, codes = io.StringIO(), io.StringIO(), []
    thread = threading.Thread(target=lambda: codes.append(main_verify(directory, out=out, err=err)), daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "kubetrain checkpoints verify hangs"
    return codes[0], out.getvalue(), err.getvalue()


def verdicts(directory: Path) -> dict[str, str | None]:
    report = verify_checkpoints(directory)
    return {Path(c["file"]).name: c["error"] for c in report["replicas"][directory.name]["checkpoints"]}


def test_a_payload_that_hashes_right_but_does_not_load_is_corrupt_to_verify_and_to_the_trainer(tmp_path):
    directory, store = store_with(tmp_path, 10)
    payload = b"not a torch file at all"  # its length and sha256 match the header
    header = {"step": 20, "spec_hash": "h", "length": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    (directory / "ckpt-00000020.pt").write_bytes(MAGIC + json.dumps(header).encode() + b"\n" + payload)
    (directory / "latest").write_text("ckpt-00000020.pt\n")

    code, out, err = verify(directory)
    assert code == EXIT_INVALID
    assert "ckpt-00000020.pt: corrupt: payload does not load" in err, err
    assert "ckpt-00000020.pt  step 20" in out and "BAD: corrupt: payload does not load" in out
    assert verdicts(directory)["ckpt-00000010.pt"] is None  # the previous one is good

    # The trainer resumes from the previous one and sets the bad one aside; verify then says so.
    step, _ = store.load_latest()
    assert step == 10
    code, out, _ = verify(directory)
    assert "set aside earlier as corrupt by the trainer: ckpt-00000020.pt.corrupt" in out


def test_a_symlink_named_like_a_checkpoint_is_refused_not_followed(tmp_path):
    directory, _ = store_with(tmp_path, 10)
    # A valid checkpoint elsewhere: followed, it would pass as step 30.
    _, elsewhere_store = store_with(tmp_path / "elsewhere", 30)
    (directory / "ckpt-00000030.pt").symlink_to(elsewhere_store.path_of(30))
    (directory / "ckpt-00000040.pt").symlink_to(tmp_path / "nowhere.pt")  # dangling

    code, out, err = verify(directory)
    assert code == EXIT_INVALID
    for name in ("ckpt-00000030.pt", "ckpt-00000040.pt"):
        assert f"{name}: corrupt: a symbolic link, refused" in err, err
    assert "Traceback" not in err
    assert verdicts(directory)["ckpt-00000010.pt"] is None

    # Export reads the same way: the newest regular, valid file.
    skipped: list[tuple[str, str]] = []
    found = list(read_valid(directory, on_skip=lambda path, why: skipped.append((path.name, why))))
    assert [info.step for info, _ in found] == [10]
    assert sorted(name for name, _ in skipped) == ["ckpt-00000030.pt", "ckpt-00000040.pt"]
    assert all("symbolic link" in why for _, why in skipped)


def test_a_fifo_named_like_a_checkpoint_or_the_pointer_neither_hangs_nor_passes(tmp_path):
    directory, _ = store_with(tmp_path, 10)
    os.mkfifo(directory / "ckpt-00000020.pt")
    (directory / "latest").unlink()
    os.mkfifo(directory / "latest")

    code, _, err = verify(directory)
    assert code == EXIT_INVALID
    assert "ckpt-00000020.pt: corrupt: not a regular file (a FIFO, device or directory), refused" in err, err
    assert f"{directory / 'latest'}: not a regular file" in err


def test_a_link_at_the_temporary_name_is_replaced_not_written_through(tmp_path):
    directory, store = store_with(tmp_path)
    outside = tmp_path / "outside"
    outside.write_text("precious")
    # Planted by code sharing the volume after the store cleared the leftovers of a killed writer.
    (directory / ".ckpt-00000020.pt.tmp").symlink_to(outside)
    (directory / ".latest.tmp").symlink_to(outside)
    store.save(20, state(20))
    assert outside.read_text() == "precious"
    assert not (directory / "ckpt-00000020.pt").is_symlink() and not (directory / "latest").is_symlink()
    assert store.load_latest()[0] == 20 and store.latest_step() == 20
