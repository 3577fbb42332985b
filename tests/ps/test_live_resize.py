"""An elastic parameter-server job resized live: real processes on loopback, no process restarted.

The job file (what `kubetrain scale` and `kubectl scale` change) is rewritten
while the job trains: ps-0 reads the new size, holds every worker's next pull
until none holds a batch it has not pushed (the cut), deals the rest of the
epoch again among the new set, and the workers register again. A joiner
starts as a supervisor would start it; the workers past a smaller size are
released and exit 76 (EXIT_RELEASED). Two shards, so the second learns the new set from the
workers' calls. Run with -s for the figures.
"""

from __future__ import annotations

import time

import grpc
import pytest
import yaml
from kubetrain.shared.launch import SLOWDOWN_VAR
from kubetrain.trainer.errors import EXIT_RELEASED
from kubetrain.trainer.ps.psclient import PSClient
from kubetrain.trainer.ps.transport import Backoff

from cluster import TOKEN, Job, manifest

pytestmark = pytest.mark.slow
JOB_SECONDS = 240
EPOCHS = 10
TRAIN_SAMPLES = 1438  # digits with evalFraction 0.2
ASYNC_SLOWDOWN = 20  # see run_resized


def resize(job: Job, workers: int) -> None:
    """Rewrite the job file with another size, atomically (as the kubelet swaps a ConfigMap volume)."""
    job.doc["spec"]["replicas"] = workers
    job.doc["spec"]["parameterServer"]["workers"] = workers
    tmp = job.job_file.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(job.doc))
    tmp.replace(job.job_file)


def wait_until(what: str, check, job: Job, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        for replica, proc in job.procs.items():
            if replica.startswith("ps-") and proc.poll() is not None:
                raise AssertionError(f"{replica} exited {proc.returncode} while waiting for {what}:\n{job.logs()}")
        time.sleep(0.2)
    job.stop()
    raise AssertionError(f"timed out waiting for {what}:\n{job.logs()}")


def ps_step(job: Job) -> int:
    """ps-0's step now, from its Status call (0 while it is not serving yet)."""
    client = PSClient([f"127.0.0.1:{job.ports[0]}"], TOKEN, 1 << 20, Backoff(budget=1.0), call_timeout=5.0)
    try:
        return client.status(0).step
    except grpc.RpcError:
        return 0
    finally:
        client.close()


def trained(job: Job, replica: str, after: float = 0.0) -> bool:
    return any(e["time"] > after for e in job.events(replica, "train"))


def started(tmp_path, name: str, steps: int, epochs: int, environ: dict[str, str] | None = None,
            **ps_fields) -> Job:
    """A job of 2 workers (batch 16), its processes started, once ps-0 made `steps` steps."""
    job = Job(tmp_path / name, manifest(name, training={"epochs": epochs, "batchSize": 16}, **ps_fields),
              environ=environ or {})
    job.start_all()
    wait_until(f"{steps} steps", lambda: ps_step(job) >= steps, job)  # stops the job when it fails
    return job


def run_resized(tmp_path, aggregation: str) -> tuple[Job, dict]:
    """2 workers, then 3 (worker-2 joins), then 2 (worker-2 is released); two shards. (2 -> 3 -> 1, the
    issue's sequence, runs in tests/local/test_elastic.py and tests/e2e/test_e2e_elastic.py at batch 32: at
    this test's batch of 16 a last phase on one worker ends 1-2 points under the fixed-size job, the
    learning rate not being scaled with the workers; see docs/scheduling.md, Not done yet.)"""
    # Async does not wait for a joiner: workers 0 and 1 go on while worker-2 imports torch (7 s and more
    # on a loaded machine), and a worker that finished its share of the 10 epochs ends the resizes (the
    # job is ending). Unslowed they did that before worker-2's first step in one CI run. Every worker
    # sleeps ASYNC_SLOWDOWN - 1 times its compute after each step (kubetrain/trainer/testhooks.py): the same for
    # all three, so their relative speeds are unchanged, and sleeping takes no core from anything else.
    # Sync too, since the data plane: unslowed, a Sync job of this size runs 270 steps a second here, so
    # a resize (read by ps-0 every SIZE_POLL_SECONDS) could come after the job's end.
    slow = {SLOWDOWN_VAR: ",".join(f"worker-{i}:{ASYNC_SLOWDOWN}" for i in range(3))}
    job = started(tmp_path, f"live-{aggregation.lower()}", 60, EPOCHS, environ=slow, replicas=2,
                  aggregation=aggregation)
    try:
        resize(job, 3)
        job.replicas.append("worker-2")
        job.start("worker-2")
        resized = wait_until("the resize to 3", lambda: job.events("ps-0", "resize"), job)[0]
        wait_until("worker-2's first steps", lambda: trained(job, "worker-2"), job)
        joined = job.events("worker-2", "start")[0]
        mark = ps_step(job) + 40
        wait_until("40 steps of three workers", lambda: ps_step(job) >= mark, job)
        resize(job, 2)
        second = wait_until("the resize to 2", lambda: job.events("ps-0", "resize")[1:], job)[0]
        codes = job.wait(JOB_SECONDS)
    finally:
        job.stop()
    # worker-2, released at the second resize, exits EXIT_RELEASED (neither a failure nor a success).
    assert codes == {r: EXIT_RELEASED if r == "worker-2" else 0 for r in job.replicas}, job.logs()
    return job, {"resized": resized, "joined": joined, "second": second}


def samples_trained(job: Job) -> int:
    """Samples the workers trained, all of them: the results of workers 0 and 1, worker-2's last words."""
    released = job.events("worker-2", "released")[0]["samples"]
    return job.result("worker-0")["samples"] + job.result("worker-1")["samples"] + released


@pytest.mark.parametrize("aggregation", ["Sync", "Async"])
def test_a_job_resized_2_3_2_live_finishes_without_a_restart_and_no_sample_twice(tmp_path, aggregation, request):
    job, seen = run_resized(tmp_path, aggregation)
    accuracy = job.result("worker-0")["eval_accuracy"]
    # The same job at 2 workers throughout (on one shard: how the parameters are sharded does not change
    # an update), shared with test_ps_training.
    fixed = request.getfixturevalue(f"{aggregation.lower()}_job").result("worker-0")["eval_accuracy"]
    samples = samples_trained(job)
    print(f"\n{aggregation} 2 -> 3 -> 2 live: accuracy {accuracy:.4f} (fixed size {fixed:.4f}), samples trained {samples} "
          f"(10 epochs: {EPOCHS * (TRAIN_SAMPLES // 3 * 3)}..{EPOCHS * TRAIN_SAMPLES}), resizes at steps "
          f"{seen['resized']['step']} and {seen['second']['step']}, worker-2 joined at its own step {seen['joined']['worker_step']}")
    # No process restarted: each shard started once, and served three sets of workers.
    for shard in ("ps-0", "ps-1"):
        assert len(job.events(shard, "start")) == 1, job.logs()
    assert [e["workers"] for e in job.events("ps-0", "resize")] == [3, 2]
    assert [e["membership"] for e in job.events("ps-0", "resize")] == [2, 3]
    assert [e["workers"] for e in job.events("ps-1", "resize")] == [3, 2]  # taken from the workers' calls
    # The worker past the new size was released: exit 76 (checked above), no result, no Finish.
    assert job.events("worker-2", "released"), job.logs()
    assert not (job.run_dir / "results" / "worker-2.json").exists()
    assert not job.events("worker-1", "released") and job.result("worker-1")["epochs"] == EPOCHS
    # Every epoch's samples trained once: a sample seen twice (a batch in flight dealt again) or lost
    # (a batch dealt to nobody) moves the total by a batch of 16, outside the few an epoch leaves out
    # (fewer than the workers of the epoch's plan).
    assert EPOCHS * (TRAIN_SAMPLES // 3 * 3) <= samples <= EPOCHS * TRAIN_SAMPLES
    assert job.result("worker-0")["epochs"] == EPOCHS
    assert accuracy >= fixed - 0.02


# Async: the shard steps the others make past the cut before the joiner starts (and so at least before
# its first pull); Sync makes none without it.
ASYNC_AHEAD = 5


def test_async_takes_a_joiner_at_once_and_sync_waits_for_it(tmp_path):
    """Async: the workers go on while the joiner starts; Sync: the step after the cut waits for it."""
    moved = {}
    for aggregation in ("Sync", "Async"):
        # syncTimeoutSeconds 30 (the default): a Sync step waits that long for the joiner, then drops it.
        # Slowed as run_resized's Async job: unslowed, the data plane ran this job's 270 steps in 1 s, and
        # it ended before ps-0 read the resize (it reads the job file every SIZE_POLL_SECONDS).
        slow = {SLOWDOWN_VAR: ",".join(f"worker-{i}:{ASYNC_SLOWDOWN}" for i in range(3))}
        job = started(tmp_path, f"join-{aggregation.lower()}", 30, 6, environ=slow, replicas=1,
                      aggregation=aggregation, syncTimeoutSeconds=30)
        try:
            resize(job, 3)
            # The joiner comes late: the cut is made without it, then the set is three.
            resized = wait_until("the resize to 3", lambda: job.events("ps-0", "resize"), job)[0]
            if aggregation == "Async":  # the others step on past the cut before the joiner starts
                wait_until("worker-0 to step past the cut", lambda: [
                    e for e in job.events("worker-0", "train") if e["step"] >= resized["step"] + ASYNC_AHEAD], job)
            job.replicas.append("worker-2")
            job.start("worker-2")
            # Its first step's event names the shard step of the parameters it pulled first.
            at_join = wait_until("worker-2's first step", lambda: job.events("worker-2", "train"), job)[0]["step"] - 1
            codes = job.wait(JOB_SECONDS)
        finally:
            job.stop()
        assert codes == {r: 0 for r in job.replicas}, job.logs()
        moved[aggregation] = at_join - resized["step"]
        # It trained (chance is 0.1): Async's stale gradients under a loaded machine ended at 0.819 once in a
        # fresh-clone run (2026-12-05, three lanes), 0.9 and more alone; Sync's are never stale.
        assert job.result("worker-0")["eval_accuracy"] >= (0.9 if aggregation == "Sync" else 0.75)
    print(f"\nshard steps between the resize and the joiner's first pull: {moved}")
    # Sync: no step completes without the new set (the joiner is waited for, up to syncTimeoutSeconds).
    assert moved["Sync"] == 0
    assert moved["Async"] >= ASYNC_AHEAD
