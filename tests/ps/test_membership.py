"""A live resize, one call at a time: a real shard server (ps-0, with its coordinator) on loopback, ticked
as serve.py ticks it, and hand-made calls of the generated stub standing for the workers. The job's size
comes from a value the test changes, as ps-0 reads it from its job file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from types import SimpleNamespace

import grpc
import pytest
import torch
import yaml

from cluster import TOKEN, manifest
from helpers.wait import wait_for
from test_hostile_clients import AUTH, frames, gradient, push, serving
from kubetrain.api import load_one
from kubetrain.trainer.data import ShardCursor
from kubetrain.trainer.ps import ps_pb2 as pb
from kubetrain.trainer.ps.coordinator import Coordinator
from kubetrain.trainer.ps.psclient import PSClient
from kubetrain.trainer.ps.transport import MEMBERSHIP, REFUSAL_KEY, Backoff
from kubetrain.trainer.ps.worker import Released, Worker

SAMPLES, BATCH = 100, 5


@contextmanager
def ps0(tmp_path, aggregation: str = "Sync") -> Iterator[SimpleNamespace]:
    """ps-0 of a job of 2 workers, its size read from `size["now"]`, and a pool for calls that wait."""
    size = {"now": 2}
    with serving(tmp_path, Coordinator(2, 30.0), aggregation=aggregation, worker_steps=100,
                 size_source=lambda: size["now"], worker_steps_for=lambda w: 100) as ps, ThreadPoolExecutor(4) as pool:
        ps.size, ps.pool = size, pool
        yield ps


def cursor_after(rank: int, world: int, batches: int) -> str:
    cursor = ShardCursor(SAMPLES, rank, world, BATCH, 0)
    for _ in range(batches):
        cursor.next_batch()
    return json.dumps(cursor.state_dict())


def step_push(ps, worker: int, worker_step: int, base_step: int, membership: int = 1, world: int = 2) -> pb.PushReply:
    """A worker's push of one step, its cursor after `worker_step` batches."""
    [frame] = frames(gradient(), worker=worker, worker_step=worker_step, base_step=base_step)
    frame.push.membership, frame.push.world_size = membership, world
    frame.push.cursor_json = cursor_after(worker, world, worker_step)
    return push(ps.stub, [frame])


def pull(ps, worker: int, min_step: int, membership: int = 1, world: int = 2) -> Future:
    """A worker's pull, in the background: its header when it is answered."""
    request = pb.PullRequest(worker=worker, min_step=min_step, membership=membership, world_size=world)
    return ps.pool.submit(lambda: list(ps.stub.Pull(request, metadata=AUTH, timeout=20))[0].pull)


def test_sync_cut_lets_the_step_in_progress_complete_then_deals_the_rest_among_the_new_set(tmp_path):
    with ps0(tmp_path) as ps:
        assert step_push(ps, 0, 1, 0).outcome == pb.PushReply.APPLIED  # step 0: worker 0 in, worker 1 to come
        ps.size["now"] = 3
        wait_for("ps-0 to read size 3", lambda: ps.shard.target_size == 3, timeout=5, every=0.05)
        held = pull(ps, 0, min_step=1)
        # Worker 1 has not pushed step 0: the cut lets its pull through (the step waits for its push).
        free = pull(ps, 1, min_step=0).result(timeout=5)
        assert free.step == 0 and free.membership == 1
        assert not held.done()
        step_push(ps, 1, 1, 0)  # step 0 complete
        assert ps.shard.step == 1 and not held.done()  # worker 0 waits for the cut
        last = pull(ps, 1, min_step=1)
        header = held.result(timeout=5)
        assert header.membership == 2 and last.result(timeout=5).membership == 2
        assert ps.shard.config.workers == 3 and ps.shard.step == 1
        # The new set's cursors: what the two had not taken of epoch 0, dealt among three, none twice.
        taken = {w: set(ShardCursor(SAMPLES, w, 2, BATCH, 0).positions(0)[:BATCH]) for w in range(2)}
        dealt = []
        for w in range(3):
            reply = ps.coordinator.Register(pb.RegisterRequest(worker=w, incarnation=9, membership=1, world_size=3),
                                            metadata=AUTH, timeout=5)
            assert reply.membership == 2 and reply.world_size == 3 and not reply.released
            cursor = ShardCursor(SAMPLES, w, 3, BATCH, 0)
            cursor.load_state_dict(json.loads(reply.cursor_json))
            dealt += cursor.positions(0)
        assert len(dealt) == len(set(dealt)) == SAMPLES - 2 * BATCH
        assert not set(dealt) & (taken[0] | taken[1])


def test_a_call_of_the_old_set_is_refused_and_a_worker_past_the_size_is_released(tmp_path):
    with ps0(tmp_path, aggregation="Async") as ps:
        step_push(ps, 0, 1, 0)
        step_push(ps, 1, 1, 1)
        ps.size["now"] = 1
        wait_for("ps-0 to read size 1", lambda: ps.shard.target_size == 1, timeout=5, every=0.05)
        waiting = [pull(ps, 0, 0), pull(ps, 1, 0)]
        assert {f.result(timeout=5).membership for f in waiting} == {2}
        assert ps.shard.config.workers == 1
        with pytest.raises(grpc.RpcError) as refused:
            step_push(ps, 0, 2, 2)  # membership 1: another set
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert dict(refused.value.trailing_metadata())[REFUSAL_KEY] == MEMBERSHIP
        assert ps.shard.step == 2  # nothing of the old set applied
        gone = ps.coordinator.Register(pb.RegisterRequest(worker=1, incarnation=9, membership=1, world_size=2),
                                       metadata=AUTH, timeout=5)
        assert gone.released
        stays = ps.coordinator.Register(pb.RegisterRequest(worker=0, incarnation=9, membership=1, world_size=2),
                                        metadata=AUTH, timeout=5)
        assert not stays.released and stays.membership == 2 and stays.world_size == 1
        assert step_push(ps, 0, 3, 2, membership=2, world=1).outcome == pb.PushReply.APPLIED


def test_a_joiner_waits_for_the_resize_its_job_file_asks_for(tmp_path):
    with ps0(tmp_path, aggregation="Async") as ps:
        request = pb.RegisterRequest(worker=2, incarnation=9, membership=0, world_size=3)
        with pytest.raises(grpc.RpcError) as early:
            ps.coordinator.Register(request, metadata=AUTH, timeout=5)
        assert early.value.code() == grpc.StatusCode.UNAVAILABLE  # retried by a worker: the resize is coming
        ps.size["now"] = 3
        wait_for("the resize to 3", lambda: ps.shard.config.workers == 3, timeout=5, every=0.05)  # no worker computing: the cut is at once
        joined = ps.coordinator.Register(request, metadata=AUTH, timeout=5)
        assert not joined.released and joined.membership == 2 and joined.world_size == 3


def released_worker(tmp_path, ps, size_in_file: int) -> Worker:
    """worker-1 as a process is when ps-0's answer releases it, its job file saying `size_in_file` workers."""
    doc = manifest("flip", replicas=size_in_file)
    doc["spec"]["parameterServer"]["workers"] = size_in_file
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(doc))
    job = load_one(job_file)
    worker = Worker.__new__(Worker)
    worker.ctx = SimpleNamespace(index=1, replica="worker-1", job=job, spec=job.spec, job_file=job_file)
    worker.client = PSClient([ps.address], TOKEN, 1 << 20, Backoff(budget=20.0), call_timeout=5.0)
    worker.incarnation, worker.world, worker.membership = 9, 2, 1
    worker.train_x = torch.zeros(SAMPLES)
    worker.cursor = ShardCursor(SAMPLES, 1, 2, BATCH, 0)
    worker.epochs, worker.local_total, worker.shards = None, None, [["w", "b"]]
    return worker


def test_a_released_worker_leaves(tmp_path):
    with ps0(tmp_path, aggregation="Async") as ps:
        worker = released_worker(tmp_path, ps, size_in_file=1)
        with pytest.raises(Released):
            worker._join(pb.RegisterReply(rank=1, world_size=1, membership=2, released=True))
        worker.client.close()


def test_a_ps0_restarted_at_another_size_deals_its_checkpoints_cursors_and_numbers_a_new_set():
    """ps-0 restored from a checkpoint of 2 workers with its job file saying 3 (restarted while a resize was
    due): the cursors of the checkpoint are dealt among 3, and the set is numbered past the checkpoint's,
    so every worker of the old set registers again."""
    old = Coordinator(2, 30.0)
    for w in range(2):
        old.record(w, 4, cursor_after(w, 2, 4))
    state = old.state_dict()
    restored = Coordinator(3, 30.0)
    assert restored.load_state_dict(state) is True
    assert restored.membership == old.membership + 1
    taken = {p for w in range(2) for p in ShardCursor(SAMPLES, w, 2, BATCH, 0).positions(0)[:4 * BATCH]}
    dealt = []
    for w in range(3):
        cursor = ShardCursor(SAMPLES, w, 3, BATCH, 0)
        cursor.load_state_dict(json.loads(restored.members[w].cursor_json))
        dealt += cursor.positions(0)
    assert len(dealt) == len(set(dealt)) == SAMPLES - len(taken) and not set(dealt) & taken
    # The same size: the checkpoint's set and cursors as they were.
    same = Coordinator(2, 30.0)
    assert same.load_state_dict(state) is False and same.membership == old.membership
