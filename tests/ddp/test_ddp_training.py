"""A 2-node gloo group trains digits to >= 0.95, writes per-rank results, and matches Single at twice the batch."""

import json
import os
import subprocess
import sys

from ddp_group import BASE_SPEC, Group
from helpers.jsonl import read_events

# Both runs see the same samples in the same order (rank r's batch k holds the
# epoch permutation's positions 2Bk + r, 2Bk + r + 2, ...; Single's batch k
# holds 2Bk .. 2Bk + 2B - 1, the union), so the gradients agree but for the
# order of float32 sums (two means of B averaged by gloo vs one mean of 2B):
# ~1e-7 relative per step. SGD with momentum carries that forward; over the
# 230 steps the curves stayed within 3.6e-7 of each other (measured). A real
# bug (a shard repeated, the sum not divided by the world size, a batch
# misaligned) moves the loss by more than 1e-2 within a few steps.
EQUIVALENCE_TOLERANCE = 1e-5


def test_two_ranks_reach_eval_accuracy_of_095(baseline: Group):
    assert baseline.result(0)["eval_accuracy"] >= 0.95, baseline.result(0)


def test_every_rank_writes_its_results_with_the_bytes_it_all_reduced(baseline: Group):
    chief, other = baseline.result(0), baseline.result(1)
    for result in (chief, other):
        assert result["steps"] == 230 and result["epochs"] == 10.0
        assert result["samples"] == 10 * (1438 // 2)  # each rank: half the training split, every epoch
        assert result["bytes_sent"] == result["bytes_received"] == result["raw_gradient_bytes"] > 0
        assert result["wall_seconds"] > 0
    # An MLP 64-64-10 has 4810 float32 parameters: one bucket of them per step.
    assert chief["bytes_sent"] == other["bytes_sent"] == 230 * 4810 * 4
    assert "eval_accuracy" in chief and "eval_accuracy" not in other
    evals = baseline.events(0, "eval")
    assert [e["epoch"] for e in evals] == list(range(1, 11))
    assert baseline.events(1, "eval") == []


def test_only_rank_0_writes_checkpoints_on_its_own_node(baseline: Group):
    start = baseline.events(0, "start")[-1]
    assert start["rank"] == 0 and start["world_size"] == 2
    holders = {
        node.name: sorted(p.name for p in node.glob("ckpt-*.pt"))
        for node in (baseline.run_dir / "checkpoints").iterdir()
    }
    assert holders[start["node_replica"]] == ["ckpt-00000200.pt", "ckpt-00000220.pt", "ckpt-00000230.pt"]
    assert [files for node, files in holders.items() if node != start["node_replica"]] == [[]]
    assert {e["step"] for e in baseline.events(0, "checkpoint")} >= {20, 40, 220, 230}


def test_two_ranks_of_batch_b_follow_single_of_batch_2b(baseline: Group, tmp_path):
    spec = {k: v for k, v in BASE_SPEC.items() if k != "ddp"}
    spec["mode"] = "Single"
    spec["training"] = {**spec["training"], "batchSize": 2 * BASE_SPEC["training"]["batchSize"]}
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob",
                               "metadata": {"name": "single-ref"}, "spec": spec}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBETRAIN_")}
    env.update(KUBETRAIN_JOB_FILE=str(job), KUBETRAIN_RUN_DIR=str(tmp_path / "run"), KUBETRAIN_METRICS_PORT="0")
    done = subprocess.run([sys.executable, "-m", "kubetrain.trainer", "single"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    single = {e["step"]: e["loss"] for e in read_events(tmp_path / "run" / "metrics" / "single-0.jsonl", "train")}
    ddp = baseline.losses()
    assert sorted(single) == sorted(ddp) == list(range(1, 231))
    worst = max(abs(single[s] - ddp[s]) for s in ddp)
    print(f"max |loss_single - loss_ddp| over {len(ddp)} steps: {worst:.3e}")
    assert worst <= EQUIVALENCE_TOLERANCE
