"""examples/hf/train_fsdp.py: a Trainer with FSDP2 over 2 ranks, killed after a sharded save, resumes from it and
ends on the weights of a run that was never killed.

One fault-free run is shared by the tests (module fixture). The Trainer's
batches and RNG are functions of the step once it has skipped the batches
trained, so the run resumed from a checkpoint must log the very same losses
and end on the very same weights (a sha256 of them, gathered from both ranks).
"""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch
import yaml

from helpers.jsonl import read_events
from support import EXAMPLES, kubetrain

HF = EXAMPLES / "hf"
# Killed at step 30, in the report that precedes that step's save: the save of step 20 has had 10 steps to be
# committed (about 0.15 s of a 1 s margin here), so the resume is from step 20, not 10.
STEPS, SAVE_EVERY, KILL = 40, 10, 30


def run(tmp_path, name: str, *fault: str) -> tuple:
    """examples/hf/fsdp.yaml (2 nodes of 1 rank), the Trainer's own output in this run's directory."""
    run_dir = tmp_path / name
    doc = yaml.safe_load((HF / "fsdp.yaml").read_text())
    doc["metadata"]["name"] = f"hf-fsdp-{name}"
    doc["spec"]["script"]["workingDir"] = str(HF)
    doc["spec"]["script"]["args"] = ["--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
                                     "--output-dir", str(tmp_path / f"{name}-output")]
    job = tmp_path / f"{name}.yaml"
    job.write_text(yaml.safe_dump(doc, sort_keys=False))
    proc = kubetrain("run", str(job), "--run-dir", str(run_dir), "--quiet", *fault)
    logs = {p.stem: p.read_text() for p in sorted((run_dir / "logs").glob("*.log"))}
    assert proc.returncode == 0, proc.stderr + "".join(text[-3000:] for text in logs.values())
    summary = json.loads((run_dir / "summary.json").read_text())
    return run_dir, summary, logs, read_events(run_dir / "metrics" / "ddp-0.jsonl")


def weights(log: str) -> str:
    [digest] = re.findall(rf"done: step {STEPS}, last logged loss [0-9.]+, weights ([0-9a-f]+)", log)
    return digest


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The fault-free run: 2 ranks, a sharded save every 10 steps."""
    return run(tmp_path_factory.mktemp("hf-fsdp"), "clean")


@pytest.mark.slow
def test_a_sharded_trainer_killed_after_a_save_resumes_from_its_shards_and_ends_on_the_fault_free_weights(
        clean, tmp_path):
    _, clean, clean_logs, clean_events = clean
    faulted_dir, faulted, logs, events = run(tmp_path, "faulted", "--fault", f"ddp-1:kill@step={KILL}")
    assert (clean["state"], clean["restarts"], faulted["state"], faulted["restarts"]) == \
        ("Succeeded", 0, "Succeeded", 1)
    # Both ranks of the new group resumed the Trainer from kubetrain's sharded checkpoint of step 20: its state
    # and RNG files first, then (once the model was sharded again) each rank's own shards of the model and
    # optimizer, a second restore of the same step.
    for replica in ("ddp-0", "ddp-1"):
        assert logs[replica].count("kubetrain: resuming the Trainer from kubetrain's checkpoint of step 20 "
                                   "(sharded)") == 1, logs[replica][-3000:]
    resumes = [e for e in events if e["event"] == "resume"]
    assert [(e["step"], e["sharded"]) for e in resumes] == [(20, True), (20, True)]
    assert {e["path"].rsplit("/", 1)[-1] for e in resumes} == {"sharded-00000020"}
    # Every loss after the restart is the fault-free run's bit for bit (the Trainer skipped the batches trained
    # and restored its RNG and schedule), and so are the last loss and the whole weights, gathered at the end.
    losses = {e["step"]: e["loss"] for e in clean_events if e["event"] == "train" and "loss" in e}
    after = [e for e in events[events.index(resumes[0]):] if e["event"] == "train" and "loss" in e]
    assert [e["step"] for e in after][:3] == [25, 30, 35]
    assert all(losses[e["step"]] == e["loss"] for e in after), (after, losses)
    assert faulted["final_train_loss"] == clean["final_train_loss"] < 3.5  # bytes: log(256) = 5.5 at the start
    assert weights(logs["ddp-0"]) == weights(clean_logs["ddp-0"])
    # On disk: kubetrain's sharded checkpoints, each rank's own shards and one COMMIT (keepLast 2).
    ckpts = faulted_dir / "checkpoints" / "ddp-0"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "sharded-00000030", "sharded-00000040"]
    commit = json.loads((ckpts / "sharded-00000040" / "COMMIT").read_text())
    assert (commit["step"], commit["world_size"]) == (STEPS, 2)
    assert set(commit["files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [10, 20, 30, 40]


@pytest.mark.slow
def test_the_export_of_a_sharded_trainer_checkpoint_is_the_model_it_trained(clean, tmp_path):
    run_dir, _, logs, _ = clean
    out = tmp_path / "model.pt"
    proc = kubetrain("checkpoints", "export", str(run_dir), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    state = torch.load(out, weights_only=True)
    # What the callback saved beside the shards: the Trainer's state of that step, every rank's RNG file.
    assert json.loads(state["trainer_state"])["global_step"] == STEPS
    assert sorted(name for name, _ in state["files"]) == ["rng_state_0.pth", "rng_state_1.pth"]
    sys.path.insert(0, str(HF))
    try:
        import train_fsdp
    finally:
        sys.path.remove(str(HF))
    model = train_fsdp.build_model()
    model.load_state_dict(state["model"])  # the whole tensors, gathered from both ranks' shards
    assert train_fsdp.digest(model) == weights(logs["ddp-0"])
