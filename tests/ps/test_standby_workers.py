"""Standby workers (kubetrain/trainer/ps/standby.py, coordinator.py `Stand`): places held and handed over.

ps-0's coordinator served by a real gRPC server on loopback, and `Place`s, the
client every worker and standby process holds, calling it as those processes
do. A process's death is its call's end: here its Place is closed (the call
cancelled); in tests/ps/test_ps_training.py's standby job it is a SIGKILL.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
import yaml

from cluster import JOB_SECONDS, TOKEN, Job, manifest
from helpers.net import free_port
from helpers.wait import wait_for
from kubetrain.api import load_one
from kubetrain.trainer.context import ReplicaContext
from kubetrain.trainer.errors import TransientError
from kubetrain.trainer.ps import ps_pb2 as pb
from kubetrain.trainer.ps import ps_pb2_grpc
from kubetrain.trainer.ps.coordinator import Coordinator
from kubetrain.trainer.ps.standby import Place, as_worker
from kubetrain.trainer.metrics import TrainerMetrics
from kubetrain.trainer.ps.transport import GRPC_OPTIONS, TOKEN_KEY
from test_hostile_clients import LABELS, counted

WORKERS = 3
STEPS = 450  # the job's steps per worker (test_ps_training.py)


def job(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest("standby", workers=WORKERS, standbyWorkers=2)))
    return load_one(path)


class Ps0:
    """ps-0's coordinator behind a real gRPC server on a fixed loopback port; `restart` serves a fresh one."""

    def __init__(self, tmp_path, coordinator: Coordinator | None = None):
        self.tmp_path = tmp_path
        self.port = free_port()
        self.server: grpc.Server | None = None
        self.places: list[Place] = []
        self.restart(coordinator or Coordinator(WORKERS, 30.0))

    def restart(self, coordinator: Coordinator) -> None:
        if self.server is not None:
            self.server.stop(None)  # every call breaks, as when ps-0's process dies
        self.coordinator = coordinator
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=GRPC_OPTIONS)
        ps_pb2_grpc.add_CoordinatorServicer_to_server(coordinator, self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        self.server.start()

    def place(self, replica: str) -> Place:
        ctx = ReplicaContext(job=job(self.tmp_path), replica=replica, ps_addrs=[f"127.0.0.1:{self.port}"],
                             token=TOKEN)
        self.places.append(Place(ctx))
        return self.places[-1]

    def close(self) -> None:
        for p in self.places:
            p.close()
        if self.server is not None:
            self.server.stop(None)


@pytest.fixture
def ps0(tmp_path) -> Iterator[Ps0]:
    served = Ps0(tmp_path)
    try:
        yield served
    finally:
        served.close()


def taking(p: Place, worker: int) -> futures.Future:
    """`p.take(worker)` in a thread: a standby's take returns only when it is handed a place."""
    pool = futures.ThreadPoolExecutor(1)
    result = pool.submit(p.take, worker)
    pool.shutdown(wait=False)
    return result


def waiting(coordinator: Coordinator, *places: Place) -> list[int]:
    with coordinator.lock:
        return [p.incarnation for p in places if p.incarnation in coordinator.waiting]


def test_a_dead_workers_place_goes_to_the_waiting_standby_at_once(tmp_path):
    metrics = TrainerMetrics(LABELS)
    ps0 = Ps0(tmp_path, Coordinator(WORKERS, 30.0, metrics=metrics))
    try:
        worker = ps0.place("worker-1")
        assert worker.take(1) == 1
        standby = ps0.place("standby-0")
        handed = taking(standby, -1)
        wait_for("the standby waiting", lambda: waiting(ps0.coordinator, standby), 10, every=0.02)
        assert not handed.done()
        assert counted(metrics, "kubetrain_ps_standby_workers") == 1
        worker.close()  # the process died: its Stand call ended
        assert handed.result(timeout=10) == 1
        assert ps0.coordinator.places == {1: standby.incarnation}
        assert not standby.lost.is_set()
        assert counted(metrics, "kubetrain_ps_takeovers_total") == 1
        assert counted(metrics, "kubetrain_ps_standby_workers") == 0
    finally:
        ps0.close()


def test_the_chiefs_place_and_a_finished_workers_place_are_never_handed_over(ps0):
    chief, finished = ps0.place("worker-0"), ps0.place("worker-2")
    assert chief.take(0) == 0 and finished.take(2) == 2
    standby = ps0.place("standby-0")
    handed = taking(standby, -1)
    wait_for("the standby waiting", lambda: waiting(ps0.coordinator, standby), 10, every=0.02)
    ps0.coordinator.record(2, 45, "", finished=True)
    chief.close()
    finished.close()
    wait_for("both calls ended", lambda: not ps0.coordinator.places, 10, every=0.02)
    assert ps0.coordinator.vacated == set()
    assert waiting(ps0.coordinator, standby) == [standby.incarnation] and not handed.done()


def test_a_waiting_standby_leaves_when_every_worker_finished(ps0):
    standby = ps0.place("standby-0")
    handed = taking(standby, -1)
    wait_for("the standby waiting", lambda: waiting(ps0.coordinator, standby), 10, every=0.02)
    for w in range(WORKERS):
        ps0.coordinator.record(w, 45, "", finished=True)
    assert handed.result(timeout=10) is None


def test_a_replacement_finding_its_place_held_waits_and_is_next_in_line(ps0):
    """worker-1's pod replaced after a standby took its place: the new pod waits as the next standby."""
    dead, standby = ps0.place("worker-1"), ps0.place("standby-0")
    assert dead.take(1) == 1
    handed = taking(standby, -1)
    wait_for("the standby waiting", lambda: waiting(ps0.coordinator, standby), 10, every=0.02)
    dead.close()
    assert handed.result(timeout=10) == 1
    replacement = ps0.place("worker-1")
    second = taking(replacement, 1)
    wait_for("the replacement waiting", lambda: waiting(ps0.coordinator, replacement), 10, every=0.02)
    other = ps0.place("worker-2")
    assert other.take(2) == 2
    other.close()  # worker-2 dies: the replacement of worker-1, waiting, takes worker-2's place
    assert second.result(timeout=10) == 2
    assert as_worker(replacement.ctx, 2).replica == "worker-2"
    assert ps0.coordinator.places == {1: standby.incarnation, 2: replacement.incarnation}


def test_places_are_asked_again_from_a_restarted_ps0_and_a_place_taken_meanwhile_is_lost(ps0):
    holder, standby, superseded = ps0.place("worker-1"), ps0.place("standby-0"), ps0.place("worker-2")
    assert holder.take(1) == 1 and superseded.take(2) == 2
    handed = taking(standby, -1)
    wait_for("the standby waiting", lambda: waiting(ps0.coordinator, standby), 10, every=0.02)
    # ps-0 restarts with nothing of the old one's places; another process got worker-2's place first.
    fresh = Coordinator(WORKERS, 30.0)
    fresh.places[2] = 12345
    ps0.restart(fresh)
    wait_for("worker-1 holding its place again, the standby waiting again",
             lambda: fresh.places.get(1) == holder.incarnation and waiting(fresh, standby), 20, every=0.05)
    assert superseded.lost.wait(20)
    assert "worker-2's place went to another process" in superseded.why_lost
    assert not holder.lost.is_set() and not handed.done()
    assert fresh.places == {1: holder.incarnation, 2: 12345}


def test_a_process_that_lost_its_place_while_waiting_for_one_stops_with_the_reason(ps0):
    """A waiting process whose ps-0 never answers again gives up after its budget (progressDeadlineSeconds):
    a TransientError naming the call, not a hang."""
    standby = ps0.place("standby-0")
    standby.backoff.budget = 1.0
    handed = taking(standby, -1)
    wait_for("the standby waiting", lambda: waiting(ps0.coordinator, standby), 10, every=0.02)
    ps0.server.stop(None)
    ps0.server = None
    with pytest.raises(TransientError, match="Stand at 127.0.0.1:[0-9]+ failed: UNAVAILABLE"):
        handed.result(timeout=30)


def test_a_stand_without_an_incarnation_is_refused(ps0):
    channel = grpc.insecure_channel(f"127.0.0.1:{ps0.port}")
    try:
        call = ps_pb2_grpc.CoordinatorStub(channel).Stand(pb.StandRequest(worker=1, incarnation=0),
                                                          metadata=((TOKEN_KEY, TOKEN),), timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            next(call)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "incarnation" in err.value.details()
    finally:
        channel.close()


@pytest.mark.slow
def test_a_killed_workers_standby_trains_on_at_once_and_its_replacement_waits(tmp_path, sync_job):
    """A real job (cluster.py): 1 shard, 2 workers, 1 standby. worker-1 is SIGKILLed at its step 40; the
    standby takes its place and trains on from its cursor; worker-1 started again (as the operator
    replaces its pod) finds its place held, waits as the next standby, and leaves when the job ends.

    40 epochs, 4 times the reference job: the replacement must reach ps-0 while the job still trains,
    and its start (an interpreter, torch: 3-4 s on a busy 2-core machine) outlasted the 10 epochs' last
    410 steps once the data plane carried them (2.2 s in a CI run)."""
    epochs = 40
    job = Job(tmp_path / "standby", manifest("standby", syncTimeoutSeconds=60, standbyWorkers=1,
                                             training={"epochs": epochs}))
    job.start_all({"worker-1": "kill@step=40"})
    try:
        code, killed_at = job.wait_for_exit("worker-1", JOB_SECONDS)
        assert code == -9, job.logs()
        took_over = wait_for("a step of worker-1's place after the kill",
                             lambda: [e for e in job.events("worker-1", "train") if e["time"] > killed_at],
                             60, every=0.05, explain=job.logs)[0]
        assert job.procs["standby-0"].poll() is None, job.logs()  # the standby, not a restart, is training
        job.start("worker-1")  # the operator's replacement of the killed pod
        wait_for("the replacement to find worker-1's place held",
                 lambda: "worker-1's place is held by another process" in (job.run_dir / "worker-1.log").read_text(),
                 JOB_SECONDS, every=0.1, explain=lambda: f"ps-0 exit code {job.procs['ps-0'].poll()} (None: "
                                                        f"still serving); {job.logs()}")
        codes = job.wait(JOB_SECONDS)
    finally:
        job.stop()
    assert codes == {r: 0 for r in job.replicas}, job.logs()
    standby_log = (job.run_dir / "standby-0.log").read_text()
    replacement_log = (job.run_dir / "worker-1.log").read_text().split('"milestone": "main"')[-1]
    assert "standby-0: takes worker-1's place" in standby_log
    assert "worker-1's place is held by another process" in replacement_log
    resumed = job.events("worker-1", "resume")[-1]["worker_step"]
    next_step = next(e for e in job.events("ps-0", "step") if e["time"] > killed_at)
    print(f"\nstandby: worker-1 killed at its step 40, resumed at {resumed} by the standby; its first step "
          f"{took_over['time'] - killed_at:.3f} s after the kill (the process reaped), the next completed step "
          f"{next_step['time'] - killed_at:.3f} s; accuracy {accuracy(job):.4f} (Sync {accuracy(sync_job):.4f})")
    assert 40 - resumed <= 20  # checkpoint.intervalSteps: ps-0's record of its cursor
    assert job.result("worker-1")["steps"] == STEPS * epochs // 10  # the standby wrote worker-1's result: its whole shard
    assert accuracy(job) >= accuracy(sync_job) - 0.02


def accuracy(job: Job) -> float:
    return job.result("worker-0")["eval_accuracy"]
