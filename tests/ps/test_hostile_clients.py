"""A shard refuses what would corrupt the model or end the job, whatever a client holding the token sends.

The hostile clients are hand-made: the generated stub (plain protobuf, none of
kubetrain's transport) against a real shard server on loopback, ticked as
serve.py ticks it. The last tests run a whole job as real processes with a
hostile client beside it.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import grpc
import pytest
import torch

from cluster import TOKEN, Job, manifest, shard_checkpoints, ticking
from helpers.net import free_port
from helpers.wait import wait_for
from test_bad_input import pulled
from kubetrain.api.spec import Compression
from kubetrain.trainer.compression import GradientCompressor
from kubetrain.trainer.errors import ConfigError
from kubetrain.trainer.events import EventLog
from kubetrain.trainer.metrics import TrainerMetrics
from kubetrain.trainer.ps import ps_pb2 as pb
from kubetrain.trainer.ps import ps_pb2_grpc
from kubetrain.trainer.ps.psclient import PSClient
from kubetrain.trainer.ps.server import DEDUP_WINDOW_STEPS, TICK_SECONDS, ParameterShard, ShardConfig, TakenSteps, build_server
from kubetrain.trainer.ps.transport import NON_FINITE, REFUSAL_KEY, TOKEN_KEY, Backoff
from kubetrain.trainer.ps.worker import MAX_CONSECUTIVE_NON_FINITE_STEPS, Worker

PARAMS = {"w": torch.arange(12, dtype=torch.float32).reshape(4, 3), "b": torch.ones(3)}
AUTH = ((TOKEN_KEY, TOKEN),)
LABELS = {"namespace": "default", "job": "hostile", "role": "ps", "replica": "ps-0"}


@contextmanager
def serving(tmp_path, coordinator=None, **config) -> Iterator[SimpleNamespace]:
    """A shard server on loopback, ticked every TICK_SECONDS as serve.py does; its stub and metrics (and, with a
    coordinator, ps-0: the coordinator's stub)."""
    settings = dict(replica="ps-0", workers=2, aggregation="Sync", sync_timeout=30.0, max_staleness=4,
                    max_steps=None, interval_steps=1000, chunk_bytes=1 << 20, worker_steps=3)
    settings.update(config)
    metrics = TrainerMetrics(LABELS)
    shard = ParameterShard(ShardConfig(**settings), PARAMS, lambda p: torch.optim.SGD(p, lr=0.1),
                           shard_checkpoints(tmp_path, metrics), metrics=metrics,
                           coordinator=coordinator)
    server = build_server(shard, TOKEN, max_workers=16)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        with ticking(shard, TICK_SECONDS):
            yield SimpleNamespace(shard=shard, stub=ps_pb2_grpc.ParameterShardStub(channel), metrics=metrics,
                                  address=f"127.0.0.1:{port}", coordinator=ps_pb2_grpc.CoordinatorStub(channel))
    finally:
        channel.close()
        server.stop(None)


def counted(metrics: TrainerMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, {**LABELS, **labels}) or 0.0


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().tobytes()


def frames(payloads: dict[str, tuple[str, bytes]], worker=0, worker_step=1, base_step=0, incarnation=7,
           no_gradient=False) -> list[pb.Frame]:
    """One push: a frame with the header and every (codec, payload) by tensor name."""
    header = pb.PushHeader(worker=worker, incarnation=incarnation, worker_step=worker_step, base_step=base_step,
                           no_gradient=no_gradient)
    pieces = [
        pb.TensorPiece(name=name, dtype="float32", shape=PARAMS[name].shape, codec=codec, total_bytes=len(data),
                       offset=0, length=len(data))
        for name, (codec, data) in payloads.items()
    ]
    return [pb.Frame(push=header, pieces=pieces, data=b"".join(d for _, d in payloads.values()))]


def gradient(value: float = 1.0, **overrides: tuple[str, bytes]) -> dict[str, tuple[str, bytes]]:
    plain = {n: ("None", tensor_bytes(torch.full_like(t, value))) for n, t in PARAMS.items()}
    return {**plain, **overrides}


def push(stub, push_frames) -> pb.PushReply:
    return stub.Push(iter(push_frames), metadata=AUTH, timeout=5)


# --- non-finite gradients ------------------------------------------------------------------

NAN, INF = float("nan"), float("inf")
NON_FINITE_PUSHES = [
    ("NaN, raw", "w", ("None", tensor_bytes(torch.full((4, 3), NAN)))),
    ("-Inf, raw", "b", ("None", tensor_bytes(torch.tensor([1.0, -INF, 1.0])))),
    ("Inf in FP16", "w", ("FP16", tensor_bytes(torch.full((4, 3), INF, dtype=torch.float16)))),
    ("Int8 with a NaN scale", "w", ("Int8", tensor_bytes(torch.tensor([NAN])) + bytes(12))),
    ("TopK with a NaN value", "w", ("TopK", tensor_bytes(torch.tensor([0, 5], dtype=torch.int32))
                                    + tensor_bytes(torch.tensor([NAN, 1.0])))),
    # Every byte finite, the product P Q^T is not: judged after decoding.
    ("PowerSGD overflowing when decoded", "w", ("PowerSGD", tensor_bytes(torch.full((4, 1), 3e38))
                                                + tensor_bytes(torch.full((3, 1), 10.0)))),
]


@pytest.mark.parametrize("aggregation", ["Sync", "Async"])
@pytest.mark.parametrize("name, payload", [c[1:] for c in NON_FINITE_PUSHES], ids=[c[0] for c in NON_FINITE_PUSHES])
def test_a_non_finite_push_is_refused_and_the_parameters_stay_finite(tmp_path, aggregation, name, payload):
    with serving(tmp_path, aggregation=aggregation, workers=1) as ps:
        before = pulled(ps.stub)
        with pytest.raises(grpc.RpcError) as err:
            push(ps.stub, frames(gradient(**{name: payload})))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"tensor {name!r}" in err.value.details() and "NaN or Inf" in err.value.details()
        assert dict(err.value.trailing_metadata())[REFUSAL_KEY] == NON_FINITE
        assert ps.shard.step == 0 and not ps.shard.pending
        after = pulled(ps.stub)
        assert all(torch.equal(before[n], after[n]) and torch.isfinite(after[n]).all() for n in PARAMS)
        assert counted(ps.metrics, "kubetrain_ps_rejected_pushes_total", reason="non_finite") == 1
        # Refused, not taken: the same step with a finite gradient goes through.
        assert push(ps.stub, frames(gradient())).outcome == pb.PushReply.APPLIED
        assert ps.shard.step == 1 and all(torch.isfinite(t).all() for t in pulled(ps.stub).values())


def test_a_push_without_a_gradient_counts_the_worker_in_a_sync_step_without_waiting(tmp_path):
    # syncTimeoutSeconds 30: the step below completes at once, or not within the test.
    with serving(tmp_path, workers=2, sync_timeout=30.0) as ps:
        before = pulled(ps.stub)
        skipped = push(ps.stub, frames({}, worker=1, no_gradient=True))
        applied = push(ps.stub, frames(gradient(), worker=0))
        assert (skipped.outcome, applied.outcome) == (pb.PushReply.SKIPPED, pb.PushReply.APPLIED)
        assert ps.shard.step == 1 and ps.shard.dropped_total == 0
        # The average is over the one gradient, not two.
        assert torch.allclose(pulled(ps.stub)["w"], before["w"] - 0.1)
        with pytest.raises(grpc.RpcError) as err:
            push(ps.stub, frames(gradient(), worker=1, worker_step=2, base_step=1, no_gradient=True))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "carries no tensors" in err.value.details()


# --- at most once per (worker, step) ------------------------------------------------------------


@pytest.mark.parametrize("aggregation", ["Sync", "Async"])
def test_a_push_replayed_under_a_fresh_incarnation_is_acknowledged_and_applied_once(tmp_path, aggregation):
    with serving(tmp_path, aggregation=aggregation, workers=1) as ps:
        first = push(ps.stub, frames(gradient(), incarnation=7))
        once = pulled(ps.stub)
        # The same (worker, worker_step) from "a restarted worker", at the shard's current step.
        replay = push(ps.stub, frames(gradient(), incarnation=8, base_step=ps.shard.step))
        assert (first.outcome, replay.outcome) == (pb.PushReply.APPLIED, pb.PushReply.DUPLICATE)
        assert ps.shard.step == 1 and not ps.shard.pending
        assert all(torch.equal(once[n], t) for n, t in pulled(ps.stub).items())
        assert counted(ps.metrics, "kubetrain_ps_rejected_pushes_total", reason="duplicate") == 1
        # Its next step is new, whatever the incarnation.
        assert push(ps.stub, frames(gradient(), incarnation=8, worker_step=2, base_step=1)).outcome == pb.PushReply.APPLIED


def test_a_restored_shard_takes_again_only_what_its_checkpoint_lacks(tmp_path):
    with serving(tmp_path, aggregation="Async", workers=1, interval_steps=1) as ps:
        push(ps.stub, frames(gradient(), worker_step=1))
        ps.shard.store.wait()
    with serving(tmp_path, aggregation="Async", workers=1, interval_steps=1) as ps:
        assert ps.shard.restore() and ps.shard.step == 1
        assert push(ps.stub, frames(gradient(), worker_step=1, incarnation=9, base_step=1)).outcome == pb.PushReply.DUPLICATE
        assert push(ps.stub, frames(gradient(), worker_step=2, incarnation=9, base_step=1)).outcome == pb.PushReply.APPLIED


def test_the_dedup_window_is_bounded_and_refuses_replays_past_its_edge():
    taken = TakenSteps()
    for step in range(1, DEDUP_WINDOW_STEPS + 11):
        taken.add(step)
    assert len(taken) == DEDUP_WINDOW_STEPS and taken.floor == 10
    assert all(step in taken for step in range(1, DEDUP_WINDOW_STEPS + 11))  # evicted ones too
    assert DEDUP_WINDOW_STEPS + 11 not in taken
    # A far-future step sits in the window; the honest sequence goes on below it.
    taken.add(10**12)
    for step in range(DEDUP_WINDOW_STEPS + 11, 2 * DEDUP_WINDOW_STEPS):
        assert step not in taken
        taken.add(step)
    # It stayed; the window holds the latest honest steps beside it.
    assert taken.state_dict()["steps"] == list(range(DEDUP_WINDOW_STEPS + 1, 2 * DEDUP_WINDOW_STEPS)) + [10**12]
    restored = TakenSteps.from_state(taken.state_dict())
    assert restored.state_dict() == taken.state_dict()


def test_past_the_window_edge_a_shard_still_applies_each_step_once(tmp_path):
    with serving(tmp_path, aggregation="Async", workers=1) as ps:
        steps = DEDUP_WINDOW_STEPS + 5
        for step in range(1, steps + 1):
            assert push(ps.stub, frames(gradient(0.0), worker_step=step, base_step=step - 1)).outcome == pb.PushReply.APPLIED
        assert len(ps.shard.workers[0].taken) == DEDUP_WINDOW_STEPS
        for step in (1, 5, steps):  # evicted, evicted, remembered
            replay = push(ps.stub, frames(gradient(0.0), worker_step=step, incarnation=99, base_step=steps))
            assert replay.outcome == pb.PushReply.DUPLICATE
        assert ps.shard.step == steps


# --- Finish -------------------------------------------------------------------------------------


def finish(stub, worker: int, incarnation: int = 0) -> pb.FinishReply:
    return stub.Finish(pb.FinishRequest(worker=worker, incarnation=incarnation), metadata=AUTH, timeout=5)


def refused_finish(stub, worker: int, incarnation: int = 0) -> str:
    with pytest.raises(grpc.RpcError) as err:
        finish(stub, worker, incarnation)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"worker {worker} cannot finish" in err.value.details()
    return err.value.details()


def test_an_early_finish_is_refused_and_does_not_end_the_job(tmp_path):
    with serving(tmp_path, workers=2, worker_steps=3) as ps:
        push(ps.stub, frames(gradient(), worker=0, incarnation=7))
        push(ps.stub, frames(gradient(), worker=1, incarnation=8))
        for worker, incarnation in ((0, 7), (1, 8)):  # a hostile client finishing every worker
            assert "does not come from the process" in refused_finish(ps.stub, worker)
            assert "does not come from the process" in refused_finish(ps.stub, worker, incarnation=1234)
            # Even the worker's own process: it has pushed 1 step of 3.
            assert "up to its step 1 on record, of 3 planned" in refused_finish(ps.stub, worker, incarnation)
        assert not ps.shard.job_finished.is_set()
        assert not any(s.finished for s in ps.shard.workers.values())
        # Sync still waits for both: the next step completes with both gradients.
        push(ps.stub, frames(gradient(), worker=0, worker_step=2, base_step=1, incarnation=7))
        assert ps.shard.step == 1
        push(ps.stub, frames(gradient(), worker=1, worker_step=2, base_step=1, incarnation=8))
        assert ps.shard.step == 2


def test_a_worker_that_pushed_its_last_step_finishes_itself_and_the_last_one_ends_the_job(tmp_path):
    with serving(tmp_path, workers=2, worker_steps=2) as ps:
        for step in (1, 2):
            push(ps.stub, frames(gradient(), worker=0, worker_step=step, base_step=step - 1, incarnation=7))
            push(ps.stub, frames(gradient(), worker=1, worker_step=step, base_step=step - 1, incarnation=8))
        # Done pushing, but the chief still pulls and evaluates: only its own process may finish it.
        refused_finish(ps.stub, 0)
        assert not finish(ps.stub, 0, incarnation=7).job_finished
        assert finish(ps.stub, 1, incarnation=8).job_finished


def test_with_max_steps_only_the_end_of_training_lets_workers_finish(tmp_path):
    with serving(tmp_path, aggregation="Async", workers=1, worker_steps=None, max_steps=2) as ps:
        push(ps.stub, frames(gradient(), worker_step=1))
        assert "runs to step 2" in refused_finish(ps.stub, 0, incarnation=7)
        push(ps.stub, frames(gradient(), worker_step=2, base_step=1))
        refused_finish(ps.stub, 0)
        assert finish(ps.stub, 0, incarnation=7).job_finished


# --- stalled streams -------------------------------------------------------------------------------


def stalled_push(stub, worker: int, release: threading.Event):
    """A push that sends its header and half a tensor, then stops sending until `release` (no deadline)."""
    half = tensor_bytes(torch.ones(4, 3))[:24]

    def messages():
        header = pb.PushHeader(worker=worker, incarnation=666, worker_step=1)
        yield pb.Frame(push=header, pieces=[pb.TensorPiece(name="w", dtype="float32", shape=(4, 3), codec="None",
                                                           total_bytes=48, offset=0, length=24)], data=half)
        release.wait()

    return stub.Push.future(messages(), metadata=AUTH)


@pytest.mark.parametrize("aggregation", ["Sync", "Async"])
def test_a_stalled_push_does_not_hold_up_other_workers_and_is_cancelled(tmp_path, aggregation):
    release = threading.Event()
    with serving(tmp_path, aggregation=aggregation, workers=2, sync_timeout=1.0, push_stall_seconds=1.0) as ps:
        try:
            # One staller claims the honest worker's own id, one the other worker's.
            stalled = [stalled_push(ps.stub, worker, release) for worker in (0, 1)]
            wait_for("both stalled streams open", lambda: len(ps.shard.streams) == 2, timeout=5, every=0.05)
            started = time.monotonic()
            reply = push(ps.stub, frames(gradient(), worker=0))
            assert reply.outcome == pb.PushReply.APPLIED
            assert time.monotonic() - started < 0.9  # not behind the staller's lock
            if aggregation == "Sync":
                # Worker 1's push never arrives: the step completes without it after syncTimeoutSeconds.
                wait_for("the step without the staller", lambda: ps.shard.step == 1, timeout=5, every=0.05)
                assert ps.shard.dropped_total == 1
            else:
                assert ps.shard.step == 1
            for call in stalled:
                with pytest.raises(grpc.RpcError) as err:
                    call.result(timeout=5)
                assert err.value.code() == grpc.StatusCode.CANCELLED
            released = time.monotonic() - started
            print(f"\n{aggregation}: stalled pushes cancelled {released:.2f} s after they stalled")
            wait_for("the stalled streams' handlers to end", lambda: not ps.shard.streams, timeout=5, every=0.05)
            assert counted(ps.metrics, "kubetrain_ps_cancelled_streams_total") == 2
            assert not any(s.receive_lock.locked() for s in ps.shard.workers.values())
            assert ps.shard.step == 1  # nothing of the stalled pushes was taken
        finally:
            release.set()


def test_a_pull_held_past_any_honest_deadline_is_cancelled(tmp_path):
    with serving(tmp_path, workers=1, stream_seconds=1.0) as ps:
        started = time.monotonic()
        # Sync: waits for step 100, which never comes, and sets no deadline.
        with pytest.raises(grpc.RpcError) as err:
            list(ps.stub.Pull(pb.PullRequest(worker=0, min_step=100), metadata=AUTH))
        assert err.value.code() == grpc.StatusCode.CANCELLED
        assert 1.0 <= time.monotonic() - started < 5.0
        wait_for("the held pull's handler to end", lambda: not ps.shard.streams, timeout=5, every=0.05)


def test_every_client_call_has_a_deadline_against_a_shard_that_never_answers():
    """A server that takes every call and never replies (a hung shard, a black hole)."""
    from concurrent import futures

    hang = threading.Event()

    def never(request_or_iterator, context):
        hang.wait(30)
        return None

    handlers = {name: grpc.stream_unary_rpc_method_handler(never) if name == "Push" else
                grpc.unary_stream_rpc_method_handler(never) if name == "Pull" else
                grpc.unary_unary_rpc_method_handler(never)
                for name in ("Pull", "Push", "Status", "Finish")}
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    server.add_generic_rpc_handlers([
        grpc.method_handlers_generic_handler("kubetrain.ps.v1.ParameterShard", handlers),
        grpc.method_handlers_generic_handler("kubetrain.ps.v1.Coordinator", {
            name: grpc.unary_unary_rpc_method_handler(never) for name in ("Register", "Heartbeat")}),
    ])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = PSClient([f"127.0.0.1:{port}"], TOKEN, 1 << 20, Backoff(budget=0.0), call_timeout=0.5, wait_timeout=0.5)
    calls = {
        "Register": lambda: client.register(0, 1),
        "Heartbeat": lambda: client.heartbeat(0, 1, 0),
        "Pull": lambda: client.pull(0, pb.PullRequest(worker=0), lambda: None),
        "Push": lambda: client.push(0, pb.PushHeader(worker=0, worker_step=1), []),
        "Finish": lambda: client.finish(0, 0, 1, ""),
        "Status": lambda: client.status(0),
    }
    try:
        for name, call in calls.items():
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, name
            assert time.monotonic() - started < 3.0, name
    finally:
        hang.set()
        client.close()
        server.stop(None)


# --- the honest worker's side: a step with non-finite gradients is skipped -----------------------------


def bare_worker(tmp_path, address: str, compression: str = "None") -> Worker:
    """A Worker's pushing half, without a model or data: the client, compressor, metrics and events it uses."""
    worker = Worker.__new__(Worker)
    worker.ctx = SimpleNamespace(index=0, replica="worker-0")
    worker.ps = SimpleNamespace(aggregation="Sync")
    worker.shards = [list(PARAMS)]
    worker.client = PSClient([address], TOKEN, 1 << 20, Backoff(budget=5.0), call_timeout=5.0, wait_timeout=5.0)
    worker.compressor = GradientCompressor(Compression(algorithm=compression, min_tensor_bytes=0))
    worker.metrics = TrainerMetrics({**LABELS, "role": "worker", "replica": "worker-0"})
    worker.events = EventLog(tmp_path, "worker-0")
    worker.cursor = SimpleNamespace(state_dict=lambda: {"epoch": 0, "position": 0})
    worker.incarnation, worker.loss = 5, float("nan")
    worker.ps_step, worker.ps_incarnation, worker.min_step, worker.shard_done = [0], [0], [0], [False]
    worker.worker_step, worker.non_finite_streak = 0, 0
    worker.membership, worker.world = 0, 1
    return worker


def test_a_worker_skips_a_non_finite_step_without_holding_up_the_sync_step_and_gives_up_when_it_persists(tmp_path):
    with serving(tmp_path, workers=2, sync_timeout=30.0, worker_steps=100) as ps:
        worker = bare_worker(tmp_path, ps.address)
        try:
            nan = {n: torch.full_like(t, NAN) for n, t in PARAMS.items()}
            worker.worker_step = 1
            worker.step(nan)
            assert worker.min_step == [1]  # counted in step 0: it waits for step 1
            assert push(ps.stub, frames(gradient(), worker=1)).outcome == pb.PushReply.APPLIED
            assert ps.shard.step == 1  # at once, not after syncTimeoutSeconds
            assert counted(worker.metrics, "kubetrain_non_finite_steps_total", role="worker", replica="worker-0") == 1
            with pytest.raises(ConfigError, match=f"{MAX_CONSECUTIVE_NON_FINITE_STEPS} steps in a row.*diverged"):
                for step in range(2, MAX_CONSECUTIVE_NON_FINITE_STEPS + 1):
                    worker.worker_step, worker.ps_step = step, [ps.shard.step]
                    worker.step(nan)
                    push(ps.stub, frames(gradient(), worker=1, worker_step=step, base_step=ps.shard.step))
            assert all(math.isfinite(v) for t in pulled(ps.stub).values() for v in t.flatten().tolist())
        finally:
            worker.client.close()
            worker.metrics.close()
            worker.events.close()


def test_a_gradient_a_codec_makes_non_finite_is_skipped_and_its_error_feedback_forgotten(tmp_path):
    with serving(tmp_path, aggregation="Async", workers=1, worker_steps=100) as ps:
        worker = bare_worker(tmp_path, ps.address, compression="FP16")
        try:
            worker.worker_step = 1
            worker.step({n: torch.full_like(t, 1e6) for n, t in PARAMS.items()})  # finite; FP16 makes it Inf
            assert worker.non_finite_streak == 1 and worker.compressor.residuals == {}
            assert ps.shard.workers[0].progress == 1 and ps.shard.step == 0
            worker.worker_step = 2
            worker.step({n: torch.ones_like(t) for n, t in PARAMS.items()})
            assert worker.non_finite_streak == 0 and ps.shard.step == 1
        finally:
            worker.client.close()
            worker.metrics.close()
            worker.events.close()


def test_a_restarted_worker_whose_last_push_is_on_record_reports_it_and_finishes(tmp_path):
    with serving(tmp_path, aggregation="Async", workers=1, worker_steps=2) as ps:
        for step in (1, 2):  # its previous process, incarnation 7, pushed every step, then died
            push(ps.stub, frames(gradient(), worker_step=step, base_step=step - 1, incarnation=7))
        worker = bare_worker(tmp_path, ps.address)  # incarnation 5
        try:
            worker.worker_step = 2  # from its cursor
            assert worker._finish_shard(0, "{}").job_finished
            assert ps.shard.step == 2  # the report applied nothing
        finally:
            worker.client.close()
            worker.metrics.close()
            worker.events.close()


# --- a whole job with a hostile client beside it ----------------------------------------------------------

EPOCHS = 10
STEPS = EPOCHS * 45  # ceil((1438 // 2) / 16) steps per epoch and worker


@pytest.mark.slow
def test_a_hostile_client_finishing_every_worker_early_does_not_end_the_job(tmp_path):
    job = Job(tmp_path / "hostile-finish", manifest("hostile-finish", training={"epochs": EPOCHS}))
    refused, accepted, others, stop = [], [], [], threading.Event()

    def hostile() -> None:
        # Redial fast: ps-0 takes seconds to start, the job trains in a few more.
        channel = grpc.insecure_channel(f"127.0.0.1:{job.ports[0]}", options=[
            ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 200)])
        stub = ps_pb2_grpc.ParameterShardStub(channel)
        while not stop.wait(0.05):
            for worker in (0, 1):
                try:
                    # Incarnations are random per worker process: a guess is all a client without one has.
                    stub.Finish(pb.FinishRequest(worker=worker, incarnation=worker + 1), metadata=AUTH, timeout=2,
                                wait_for_ready=True)
                    accepted.append((worker, time.monotonic()))
                except grpc.RpcError as err:
                    if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                        refused.append(worker)
                    else:
                        others.append((err.code(), err.details()))
        channel.close()

    thread = threading.Thread(target=hostile)
    job.start_all()
    thread.start()
    try:
        codes = job.wait(120)
    finally:
        stop.set()
        thread.join()
        job.stop()
    assert codes == {r: 0 for r in job.replicas}, job.logs()
    assert set(refused) == {0, 1} and accepted == [], (accepted, others[-5:])
    # Both workers trained their whole shard, and every step was taken.
    assert [job.result(f"worker-{i}")["steps"] for i in (0, 1)] == [STEPS, STEPS]
    ps = job.result("ps-0")
    assert ps["steps"] == STEPS or ps["sync_dropped_workers"] > 0
    print(f"\nhostile Finish: {len(refused)} refused; "
          f"accuracy {job.result('worker-0')['eval_accuracy']:.4f}")
