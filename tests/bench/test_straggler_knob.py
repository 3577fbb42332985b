"""KUBETRAIN_BENCH_SLOWDOWN through `kubetrain run`: the named replica, and only it, runs slower by its factor."""

from __future__ import annotations

import json

from helpers.jsonl import read_events
from kubetrain.shared.launch import SLOWDOWN_VAR

from support import job_doc, kubetrain


def _result(run, replica: str) -> dict:
    return json.loads((run / "results" / f"{replica}.json").read_text())


def _seconds_per_step(run, replica: str) -> float:
    """The worker's own loop: from its first step's train event to its last, per step. Not the result's
    samples_per_second, which counts from the worker's start: on a loaded machine both workers waited
    7.6 s for the shard before their first step (a CI run), which made their rates nearly equal."""
    times = [e["time"] for e in read_events(run / "metrics" / f"{replica}.jsonl", "train")]
    return (times[-1] - times[0]) / (len(times) - 1)


def test_the_slowed_ps_worker_steps_slower_than_its_peer(tmp_path, write_job):
    # Async with no staleness bound in reach, so neither worker waits for the other: each
    # one's loop rate is its own. A CNN, so a step is mostly compute (what the factor stretches).
    # Epochs, not maxSteps: each worker runs its own epoch of its shard (23 steps), however
    # many seconds apart the two processes start on a loaded machine.
    job = write_job(job_doc(
        "straggle", "ParameterServer",
        model={"name": "cnn", "args": {"channels": 16, "hidden": 64}},
        training={"epochs": 1, "batchSize": 32},
        parameterServer={"workers": 2, "aggregation": "Async", "maxStaleness": 1000},
        checkpoint={"intervalSteps": 1000}, metrics={"port": 0},
    ))
    run = tmp_path / "run"
    done = kubetrain("run", str(job), "--run-dir", str(run), env={SLOWDOWN_VAR: "worker-1:20"}, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    fast, slow = _result(run, "worker-0"), _result(run, "worker-1")
    # Per step: compute + push for the peer, compute + 19 x its CPU time + push for the slowed
    # one; 1/20 on a quiet machine, about 0.5 where other processes make a step's wall time
    # 16 times its CPU time. (At 10x a loaded CI run measured 0.646: a step's wall time was about
    # 16 times its CPU time there, so 9 x the CPU time stretched it by little more than half.)
    ratio = _seconds_per_step(run, "worker-0") / _seconds_per_step(run, "worker-1")
    assert ratio < 0.6, (ratio, fast, slow)
    assert fast["steps"] == slow["steps"] == 23
    assert "worker-1: slowed 20x" in (run / "logs" / "worker-1.log").read_text()
    assert "slowed" not in (run / "logs" / "worker-0.log").read_text()


def test_a_ddp_rank_is_named_by_its_global_rank(tmp_path, write_job):
    job = write_job(job_doc("straggle-ddp", "DDP", training={"maxSteps": 3, "batchSize": 16},
                            ddp={"nodes": 2, "procsPerNode": 1}, metrics={"port": 0}))
    run = tmp_path / "run"
    done = kubetrain("run", str(job), "--run-dir", str(run), env={SLOWDOWN_VAR: "ddp-1:2"}, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    # c10d decides which node holds rank 1: one of the two node logs says so, once.
    logs = "".join(p.read_text() for p in (run / "logs").glob("ddp-*.log"))
    assert logs.count("ddp-1: slowed 2x") == 1 and "ddp-0: slowed" not in logs
