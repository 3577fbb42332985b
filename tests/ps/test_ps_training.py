"""Parameter-server jobs as real processes on loopback: accuracy, faults and recovery, shards, compression.

Each job is ps-0 (and ps-1) and two workers started with
`python -m kubetrain.trainer ps|worker` and the environment of
docs/internals.md, on the digits MLP of the quickstart with batches of 16:
450 updates in 10 epochs, enough for TopK at 1% to catch up with None (at
120 updates each weight would be sent about once). Figures the issue asks
for (accuracies, recovery times, steps lost) are printed; run with -s.
"""

import time

import pytest

from cluster import JOB_SECONDS, Job, manifest
from cluster import run_job as run

pytestmark = pytest.mark.slow
STEPS = 450  # 10 epochs of ceil((1438 // 2) / 16) = 45 steps per worker


def accuracy(job: Job) -> float:
    return job.result("worker-0")["eval_accuracy"]


def test_sync_reaches_95_percent_and_every_replica_reports_its_bytes(sync_job):
    print(f"\nSync eval accuracy: {accuracy(sync_job):.4f}")
    assert accuracy(sync_job) >= 0.95
    ps = sync_job.result("ps-0")
    workers = [sync_job.result(f"worker-{i}") for i in range(2)]
    # One averaged update per step of both workers, unless a worker stalled past
    # syncTimeoutSeconds (a starved process on a busy machine) and was dropped.
    assert ps["steps"] == STEPS or ps["sync_dropped_workers"] > 0
    assert ps["bytes_received"] == sum(w["bytes_sent"] for w in workers)
    assert all(w["raw_gradient_bytes"] == w["compressed_gradient_bytes"] > 0 for w in workers)
    # The shard writes a final checkpoint and exits 0 once both workers finished.
    assert sync_job.events("ps-0", "checkpoint")[-1]["step"] == ps["steps"]


def test_async_with_max_staleness_4_lands_within_2_points_of_sync(async_job, sync_job):
    job = async_job
    print(f"\nAsync eval accuracy: {accuracy(job):.4f} (Sync {accuracy(sync_job):.4f})")
    assert accuracy(job) >= accuracy(sync_job) - 0.02
    assert job.result("ps-0")["steps"] == 2 * STEPS  # every push is an update


def first_after(events: list[dict], moment: float) -> dict:
    return next(e for e in events if e["time"] > moment)


def test_killed_worker_restarts_from_its_cursor_and_the_job_completes(tmp_path, sync_job):
    # The shard waits for the restarted worker rather than dropping it after 5 s: its restart takes 5-9 s
    # with the machine's load, and the steps that went on meanwhile with one worker's half batch moved the
    # accuracy by up to 3 points with that load (0.9415 and 0.9443 in two loaded runs, 0.9582 idle).
    # That is syncTimeoutSeconds' trade (a Sync step without a silent worker), not the restart's.
    job = Job(tmp_path / "worker-fault", manifest("worker-fault", syncTimeoutSeconds=60))
    job.start_all({"worker-1": "kill@step=40"})
    try:
        code, killed_at = job.wait_for_exit("worker-1", JOB_SECONDS)
        assert code == -9, job.logs()
        job.start("worker-1")  # as the supervisor does: no fault on the second attempt
        codes = job.wait(JOB_SECONDS)
    finally:
        job.stop()
    assert codes == {r: 0 for r in job.replicas}, job.logs()
    resumed = job.events("worker-1", "resume")[0]["worker_step"]
    next_step = first_after(job.events("ps-0", "step"), killed_at)
    restarted = first_after(job.events("worker-1", "train"), killed_at)
    print(f"\nworker kill: accuracy {accuracy(job):.4f} (Sync {accuracy(sync_job):.4f}); steps lost {40 - resumed}; "
          f"next completed step {next_step['time'] - killed_at:.2f} s after the kill; "
          f"restarted worker's first step {restarted['time'] - killed_at:.2f} s after it")
    assert 40 - resumed <= 20  # checkpoint.intervalSteps
    assert job.result("worker-1")["steps"] == STEPS  # its whole shard, no batch twice
    assert accuracy(job) >= accuracy(sync_job) - 0.02


def test_killed_parameter_server_resumes_and_workers_reconnect(tmp_path, sync_job):
    job = Job(tmp_path / "ps-fault", manifest("ps-fault"))
    job.start_all({"ps-0": "kill@step=50"})
    try:
        code, killed_at = job.wait_for_exit("ps-0", JOB_SECONDS)
        assert code == -9, job.logs()
        job.start("ps-0")
        codes = job.wait(JOB_SECONDS)
    finally:
        job.stop()
    # The workers were never restarted: they waited for the shard and reconnected.
    assert codes == {r: 0 for r in job.replicas}, job.logs()
    resumed = job.events("ps-0", "resume")[0]["step"]
    next_step = first_after(job.events("ps-0", "step"), killed_at)
    print(f"\nps kill: accuracy {accuracy(job):.4f} (Sync {accuracy(sync_job):.4f}); resumed at step {resumed}, "
          f"steps lost {50 - resumed}; next completed step {next_step['time'] - killed_at:.2f} s after the kill")
    assert 50 - resumed <= 20
    assert accuracy(job) >= accuracy(sync_job) - 0.02


def test_two_shards_split_the_parameters_and_train_to_95_percent(tmp_path):
    job = run(tmp_path, "two-shards", replicas=2)
    shards = [job.result("ps-0"), job.result("ps-1")]
    print(f"\n2 shards: accuracy {accuracy(job):.4f}; gradient bytes per shard "
          f"{[s['raw_gradient_bytes'] for s in shards]}")
    assert accuracy(job) >= 0.95
    assert all(s["steps"] >= STEPS and s["raw_gradient_bytes"] > 0 for s in shards)
    assert shards[0]["raw_gradient_bytes"] + shards[1]["raw_gradient_bytes"] == sum(
        job.result(f"worker-{i}")["raw_gradient_bytes"] for i in range(2))


def total_bytes(job: Job) -> int:
    """Every byte of the job's pushes and pulls, counted once, by its sender (summary.json's bytes_sent)."""
    return sum(job.result(r)["bytes_sent"] for r in job.replicas)


def test_topk_both_ways_sends_20x_fewer_bytes_in_all_and_stays_within_1_point(tmp_path, sync_job):
    job = run(tmp_path, "topk", compression={"algorithm": "TopK", "ratio": 0.01, "minTensorBytes": 0})
    none = sync_job.result("worker-0")
    topk = job.result("worker-0")
    # Counted by the sender as it framed the payloads, and by the shard as it received them.
    ratio = none["compressed_gradient_bytes"] / topk["compressed_gradient_bytes"]
    received = sync_job.result("ps-0")["compressed_gradient_bytes"] / job.result("ps-0")["compressed_gradient_bytes"]
    # Pushes and pulls together: pulls carry the change since each worker's copy.
    total = total_bytes(sync_job) / total_bytes(job)
    pulls = sync_job.result("ps-0")["bytes_sent"] / job.result("ps-0")["bytes_sent"]
    print(f"\nTopK 0.01: {ratio:.1f}x fewer gradient bytes sent ({received:.1f}x received by ps-0); "
          f"{pulls:.1f}x fewer pull bytes, {total:.1f}x fewer bytes in all; "
          f"accuracy {accuracy(job):.4f} (None {accuracy(sync_job):.4f})")
    assert ratio >= 40 and received >= 40
    # 21.6x with Ternary pulls; 30.1x with a sparse change pulled exact (Sparse), measured 2026-12-01.
    assert total >= 25
    shard = job.result("ps-0")
    assert shard["whole_pulls"] <= 3  # each worker's first, and the chief's final one
    # Under momentum correction the shard's update is as sparse as the pushes: both weight matrices'
    # changes go exact in every compressed pull (the 10-element bias's is smaller as Ternary).
    assert shard["sparse_pull_tensors"] >= 2 * shard["compressed_pulls"], shard
    assert all(job.result(f"worker-{i}")["pull_copy_mismatches"] == 0 for i in range(2))
    assert accuracy(job) >= accuracy(sync_job) - 0.01


def test_sigterm_checkpoints_the_shard_at_its_step_and_a_restart_loses_nothing(tmp_path):
    job = Job(tmp_path / "sigterm", manifest("sigterm"))
    job.start_all()
    try:
        deadline = time.monotonic() + JOB_SECONDS
        while not any(e["step"] >= 30 for e in job.events("ps-0", "step")):
            assert time.monotonic() < deadline, job.logs()
            time.sleep(0.1)
        job.procs["ps-0"].terminate()
        code, _ = job.wait_for_exit("ps-0", 30)
        assert code == 143, job.logs()
        stopped = job.events("ps-0", "stop")[-1]["step"]
        assert job.events("ps-0", "checkpoint")[-1]["step"] == stopped
        job.start("ps-0")
        codes = job.wait(JOB_SECONDS)
    finally:
        job.stop()
    assert codes == {r: 0 for r in job.replicas}, job.logs()
    # A push in flight when SIGTERM landed may still be applied (and checkpointed)
    # after the stop checkpoint: the restart then resumes past it, never before.
    assert job.events("ps-0", "resume")[0]["step"] >= stopped
    assert accuracy(job) >= 0.95
