"""Sharded checkpoints of a script job (examples/llm/fsdp_mlp.py: FSDP2, every rank writing its own shards).

One clean run of 2 ranks is shared by the tests (module fixture); each fault
run is compared with it. The script's batches depend on the step and the rank
alone, so a run resumed from a checkpoint must end with the very same weights
(its digest: a sha256 of the gathered weights) and eval loss as the clean run.
"""

from __future__ import annotations

import json
import re
import shutil
import sys

import pytest
import torch
import yaml

from support import EXAMPLES, ROOT, job_doc, kubetrain

LLM = EXAMPLES / "llm"
STEPS, SAVE_EVERY = 120, 40
# Small enough to train in seconds on 2 cores, big enough that every layer is split.
MODEL_ARGS = ["--hidden", "64", "--layers", "2"]


def fsdp_job(name, *extra, nodes=2, procs=1, access="ReadWriteMany", steps=STEPS, script="fsdp_mlp.py",
             working_dir=LLM):
    return job_doc(name, "DDP", ddp={"nodes": nodes, "procsPerNode": procs},
                   script={"command": ["python", script], "workingDir": str(working_dir),
                           "args": ["--steps", str(steps), "--save-every", str(SAVE_EVERY), *MODEL_ARGS,
                                    "--print-digest", *extra]},
                   checkpoint={"keepLast": 2, "storage": {"accessMode": access}})


def run(write_job, tmp_path, doc, *args, name=None):
    path = write_job(doc, f"{name or doc['metadata']['name']}.yaml")
    run_dir = tmp_path / (name or doc["metadata"]["name"])
    proc = kubetrain("run", str(path), "--run-dir", str(run_dir), "--quiet", *args)
    return proc, run_dir


def logs(run_dir):
    return "".join(p.read_text() for p in sorted((run_dir / "logs").glob("*.log")))


def final_digest(run_dir):
    [digest] = set(re.findall(r"done: \d+ steps, eval loss [0-9.]+, digest ([0-9a-f]+)", logs(run_dir)))
    return digest


def restored_digests(run_dir):
    return re.findall(r"restored step (\d+) digest ([0-9a-f]+)", logs(run_dir))


def resumed(run_dir):
    return [int(s) for s in re.findall(r"resumed from step (\d+)", logs(run_dir))]


def summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def checkpoint_names(run_dir):
    return sorted(p.name for p in (run_dir / "checkpoints" / "ddp-0").iterdir())


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The fault-free run: 2 ranks, a sharded save every 40 steps, committed before each save returns."""
    tmp = tmp_path_factory.mktemp("sharded-clean")
    path = tmp / "clean.yaml"
    path.write_text(yaml.safe_dump(fsdp_job("clean", "--wait-saves")))
    run_dir = tmp / "clean"
    proc = kubetrain("run", str(path), "--run-dir", str(run_dir), "--quiet")
    assert proc.returncode == 0, proc.stderr + logs(run_dir)
    return run_dir


def test_a_clean_run_keeps_its_last_sharded_checkpoints_whole_and_verified(clean):
    # keepLast 2 applies to whole checkpoints: each a directory of every rank's files and one COMMIT.
    assert checkpoint_names(clean) == ["latest", "sharded-00000080", "sharded-00000120"]
    assert (clean / "checkpoints" / "ddp-0" / "latest").read_text().strip() == "sharded-00000120"
    commit = json.loads((clean / "checkpoints" / "ddp-0" / "sharded-00000120" / "COMMIT").read_text())
    assert (commit["step"], commit["world_size"]) == (120, 2)
    assert set(commit["files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp"}  # every rank wrote its own
    assert all(len(f["sha256"]) == 64 and f["length"] > 0 for f in commit["files"].values())
    verified = kubetrain("checkpoints", "verify", str(clean))
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "sharded-00000120/  step 120  3 files of 2 ranks" in verified.stdout
    # Reported once durable: rank 0's checkpoint events name each committed step.
    events = [json.loads(line) for line in (clean / "metrics" / "ddp-0.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [40, 80, 120]


def test_a_rank_killed_right_after_a_sharded_save_resumes_from_it_and_ends_where_the_clean_run_ends(
        clean, tmp_path, write_job):
    proc, faulty = run(write_job, tmp_path, fsdp_job("killed", "--wait-saves"), "--fault", "ddp-1:kill@step=81")
    assert proc.returncode == 0, proc.stderr + logs(faulty)
    # Both ranks of the new group restored step 80's checkpoint, the save just before the kill.
    assert resumed(faulty) == [80, 80], logs(faulty)
    assert summary(faulty)["restarts"] == 1
    assert final_digest(faulty) == final_digest(clean)
    assert summary(faulty)["eval_loss"] == summary(clean)["eval_loss"]


def test_a_rank_killed_while_writing_a_sharded_save_leaves_the_previous_checkpoint_restored(
        clean, tmp_path, write_job):
    # kill@save=80: rank 1 dies once its shards of step 80 are written, before rank 0 can commit them.
    proc, faulty = run(write_job, tmp_path, fsdp_job("midsave"), "--fault", "ddp-1:kill@save=80")
    assert proc.returncode == 0, proc.stderr + logs(faulty)
    assert resumed(faulty) == [40, 40], logs(faulty)
    assert re.search(r"sharded checkpoint .*\.sharded-00000080-[0-9a-f]+\.tmp never completed \(a rank stopped in the middle of the save\); removed", logs(faulty))
    # The incomplete save was cleaned up; the run then wrote and committed 80 and 120 itself.
    assert checkpoint_names(faulty) == ["latest", "sharded-00000080", "sharded-00000120"]
    assert final_digest(faulty) == final_digest(clean)


@pytest.mark.parametrize("procs", [1, 4], ids=["into 1 rank", "into 4 ranks"])
def test_a_sharded_checkpoint_of_two_ranks_restores_resharded(clean, tmp_path, write_job, procs):
    # A job of another size finds the 2-rank checkpoint in its directory (as after a resize) and loads it,
    # each rank reading only the pieces of its own shards.
    target = tmp_path / f"into-{procs}"
    shutil.copytree(clean / "checkpoints", target / "checkpoints")
    proc, run_dir = run(write_job, tmp_path, fsdp_job("resharded", nodes=1, procs=procs), name=f"into-{procs}")
    assert proc.returncode == 0, proc.stderr + logs(run_dir)
    assert set(restored_digests(run_dir)) == {("120", final_digest(clean))}


def test_a_plain_checkpoint_restores_into_a_sharded_template(tmp_path, write_job):
    proc, plain = run(write_job, tmp_path, fsdp_job("plain", "--no-shard", nodes=1, steps=SAVE_EVERY))
    assert proc.returncode == 0, proc.stderr + logs(plain)
    assert checkpoint_names(plain) == ["ckpt-00000040.pt", "latest"]  # written whole, by rank 0
    shutil.copytree(plain / "checkpoints", tmp_path / "sharded" / "checkpoints")
    proc, run_dir = run(write_job, tmp_path, fsdp_job("plain", steps=SAVE_EVERY), name="sharded")
    assert proc.returncode == 0, proc.stderr + logs(run_dir)
    # Each of the 2 ranks took its shards of the whole tensors: the gathered weights are the plain ones.
    assert set(restored_digests(run_dir)) == {("40", final_digest(plain))}


def test_a_sharded_save_on_a_volume_per_node_fails_naming_the_access_mode(tmp_path, write_job):
    proc, run_dir = run(write_job, tmp_path, fsdp_job("per-node", access="ReadWriteOnce"))
    # The script's kubetrain error ends it with exit code 2, permanent: the job fails, not restarted.
    assert proc.returncode == 2, proc.stderr
    # Every rank meets the error; whichever node's agent ends first is the one named.
    assert re.search(r"InvalidConfiguration: ddp-[01] exited with code 2; not restarted", proc.stderr), proc.stderr
    text = logs(run_dir)
    assert ("kubetrain: kubetrain.save: a sharded state (DTensors) is written by every rank into one directory that "
            "every rank reads, but this job's 2 nodes each have a checkpoint volume of their own: set "
            "spec.checkpoint.storage.accessMode: ReadWriteMany") in text, text[-3000:]
    assert "Traceback" not in text
    assert summary(run_dir)["restarts"] == 0


def test_restoring_a_sharded_checkpoint_without_a_template_says_to_pass_one(clean, tmp_path, write_job):
    shutil.copytree(clean / "checkpoints", tmp_path / "no-template" / "checkpoints")
    doc = fsdp_job("no-template", script="restore_without_template.py",
                   working_dir=ROOT / "tests" / "assets" / "scripts")
    doc["spec"]["script"]["args"] = []
    proc, run_dir = run(write_job, tmp_path, doc)
    assert proc.returncode == 2, proc.stderr
    text = logs(run_dir)
    assert "the newest checkpoint (step 120, sharded-00000120) is sharded: pass a template" in text, text[-3000:]
    assert "Traceback" not in text


def test_export_of_a_sharded_checkpoint_loads_into_an_unsharded_model_with_equal_outputs(clean, tmp_path):
    out = tmp_path / "model.pt"
    proc = kubetrain("checkpoints", "export", str(clean), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "at step 120" in proc.stdout and "sharded-00000120" in proc.stdout
    state = torch.load(out, weights_only=True)
    sys.path.insert(0, str(LLM))
    try:
        import fsdp_mlp
    finally:
        sys.path.remove(str(LLM))
    model = fsdp_mlp.build(64, 2)
    model.load_state_dict(state["model"])  # plain tensors, whole: the model gathered from both ranks' shards
    assert fsdp_mlp.digest(model) == final_digest(clean)
    x, y = fsdp_mlp.batch(0, 10_000, 1024)  # the script's held-out batch
    with torch.no_grad():
        eval_loss = torch.nn.functional.mse_loss(model(x), y).item()
    assert eval_loss == pytest.approx(summary(clean)["eval_loss"], rel=1e-6)


def test_a_damaged_shard_fails_verify_and_the_restore_falls_back_to_the_previous_checkpoint(
        clean, tmp_path, write_job):
    run_dir = tmp_path / "damaged"
    shutil.copytree(clean / "checkpoints", run_dir / "checkpoints")
    shard = run_dir / "checkpoints" / "ddp-0" / "sharded-00000120" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    verified = kubetrain("checkpoints", "verify", str(run_dir / "checkpoints" / "ddp-0"))
    assert verified.returncode == 1
    assert "sharded-00000120/  step 120" in verified.stdout and "__1_0.distcp: sha256 differs from COMMIT" in verified.stdout
    assert "sharded-00000080/  step 80  3 files of 2 ranks, " in verified.stdout
    proc, run_dir = run(write_job, tmp_path, fsdp_job("damaged"), name="damaged")
    assert proc.returncode == 0, proc.stderr + logs(run_dir)
    assert resumed(run_dir) == [80, 80], logs(run_dir)
    assert (run_dir / "checkpoints" / "ddp-0" / "sharded-00000120.corrupt").is_dir()  # set aside, kept to look at
    assert final_digest(run_dir) == final_digest(clean)
