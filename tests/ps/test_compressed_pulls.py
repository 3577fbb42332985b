"""Compressed pulls against a real shard on loopback: the worker's copy, restarts of either side, the final pull.

The worker side is the real Worker.pull (client, Assembler, CRC check) on a
worker without a model: its parameters are plain tensors.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from test_hostile_clients import PARAMS, frames, gradient, push, serving
from kubetrain.api.spec import Compression
from kubetrain.trainer.ps.psclient import PSClient
from kubetrain.trainer.ps.transport import Backoff
from kubetrain.trainer.ps.worker import Worker
from cluster import TOKEN

TOPK = Compression(algorithm="TopK", ratio=0.01, min_tensor_bytes=0)


def puller(address: str, index: int = 0) -> Worker:
    """A Worker's pulling half: its parameters (zeros until pulled), client and copies, no model or data."""
    worker = Worker.__new__(Worker)
    worker.ctx = SimpleNamespace(index=index, replica=f"worker-{index}")
    worker.device = torch.device("cpu")
    worker.params = {n: torch.zeros_like(t) for n, t in PARAMS.items()}
    worker.landing = worker.params
    worker.shards = [list(PARAMS)]
    worker.scratch = [{}]
    worker.client = PSClient([address], TOKEN, 1 << 20, Backoff(budget=5.0), call_timeout=5.0, wait_timeout=5.0)
    worker.ps_step, worker.ps_incarnation, worker.min_step, worker.shard_done = [0], [0], [0], [False]
    worker.copy, worker.copy_mismatches, worker.worker_step = [0], 0, 1
    worker.membership, worker.world = 0, 1
    return worker


def step(ps, worker_step: int, value: float) -> None:
    """One Async update on the shard, pushed by a hand-made client as worker 1."""
    push(ps.stub, frames(gradient(value), worker=1, worker_step=worker_step, base_step=ps.shard.step))


def exact(worker: Worker, ps) -> bool:
    return all(torch.equal(worker.params[n], ps.shard.published[1][n]) for n in PARAMS)


def held(worker: Worker, ps) -> bool:
    """The worker's parameters are, bit for bit, the copy the shard believes it holds."""
    copy = ps.shard.pulls.copies[worker.ctx.index]
    return worker.copy[0] == copy.copy and all(torch.equal(worker.params[n], copy.tensors[n]) for n in PARAMS)


def test_a_worker_pulls_whole_once_then_the_change_and_holds_the_shards_copy_bit_for_bit(tmp_path):
    with serving(tmp_path, aggregation="Async", workers=2, worker_steps=100, compression=TOPK) as ps:
        worker = puller(ps.address)
        try:
            worker.pull()
            assert exact(worker, ps) and held(worker, ps) and ps.shard.pulls.whole_pulls == 1
            whole = worker.client.counter.received
            for n in range(1, 4):
                step(ps, n, value=0.5 * n)
                before = worker.client.counter.received
                worker.pull()
                assert held(worker, ps) and worker.copy_mismatches == 0
            assert ps.shard.pulls.compressed_pulls == 3
            assert not exact(worker, ps)  # Ternary of the change: what it dropped waits in the shard's copy
            assert worker.client.counter.received - before < whole
        finally:
            worker.client.close()


def test_a_restarted_worker_and_a_restarted_shard_each_get_a_whole_exact_pull(tmp_path):
    with serving(tmp_path / "a", aggregation="Async", workers=2, worker_steps=100, compression=TOPK) as ps:
        worker = puller(ps.address)
        try:
            worker.pull()
            step(ps, 1, value=1.0)
            worker.pull()
            assert ps.shard.pulls.compressed_pulls == 1
            restarted = puller(ps.address)  # a new process: no copy
            restarted.pull()
            assert exact(restarted, ps) and held(restarted, ps) and ps.shard.pulls.whole_pulls == 2
            worker.pull()  # the old process names a copy the shard replaced: whole again, never wrong
            assert exact(worker, ps) and held(worker, ps) and ps.shard.pulls.whole_pulls == 3
            old_copy = worker.copy[0]
        finally:
            worker.client.close()
            restarted.client.close()
    # Copies are not checkpointed: a shard restored from a checkpoint holds none.
    with serving(tmp_path / "b", aggregation="Async", workers=2, worker_steps=100, compression=TOPK) as ps:
        worker = puller(ps.address)
        worker.copy = [old_copy]
        try:
            worker.params["w"].add_(7.0)
            worker.pull()
            assert exact(worker, ps) and held(worker, ps) and ps.shard.pulls.whole_pulls == 1
        finally:
            worker.client.close()


def test_the_final_pull_gives_the_exact_parameters_and_drops_the_copy(tmp_path):
    with serving(tmp_path, aggregation="Async", workers=1, worker_steps=100, compression=TOPK) as ps:
        worker = puller(ps.address)
        try:
            worker.pull()
            worker.ctx.index = 0
            for n in range(1, 3):
                push(ps.stub, frames(gradient(0.3 * n), worker=0, worker_step=n, base_step=ps.shard.step))
                worker.pull()
            assert not exact(worker, ps)
            worker.pull(final=True)
            assert exact(worker, ps) and worker.copy == [0] and ps.shard.pulls.copies == {}
        finally:
            worker.client.close()


def test_a_worker_whose_parameters_drifted_from_the_copy_notices_and_pulls_whole(tmp_path):
    with serving(tmp_path, aggregation="Async", workers=2, worker_steps=100, compression=TOPK) as ps:
        worker = puller(ps.address)
        try:
            worker.pull()
            worker.params["b"][0] = torch.nextafter(worker.params["b"][0], torch.tensor(10.0))  # one ulp off
            step(ps, 1, value=1.0)
            worker.pull()
            assert worker.copy_mismatches == 1 and worker.copy == [0]
            worker.pull()
            assert exact(worker, ps) and held(worker, ps) and worker.copy_mismatches == 1
        finally:
            worker.client.close()


def test_without_compression_every_pull_is_whole_and_no_copy_is_kept(tmp_path):
    with serving(tmp_path, aggregation="Async", workers=2, worker_steps=100) as ps:
        worker = puller(ps.address)
        try:
            for n in range(1, 3):
                worker.pull()
                assert exact(worker, ps) and worker.copy == [0]
                step(ps, n, value=1.0)
            assert ps.shard.pulls.copies == {}
        finally:
            worker.client.close()
