"""The operator's work queue: one entry per job, never one job on two workers, delays, backoff."""

from __future__ import annotations

import threading
import time

from kubetrain.drivers.cluster.workqueue import ERROR_BACKOFF_CAP_SECONDS, URGENT_STREAK, WorkQueue


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_key_added_many_times_is_queued_once():
    q = WorkQueue()
    for _ in range(1000):
        q.add("a")
    q.add("b")
    assert len(q) == 2
    assert [q.get(timeout=0), q.get(timeout=0), q.get(timeout=0)] == ["a", "b", None]


def test_a_key_being_processed_is_not_handed_out_again_until_done():
    q = WorkQueue()
    q.add("a")
    assert q.get(timeout=0) == "a"
    q.add("a")  # changed while a worker holds it
    assert q.get(timeout=0) is None  # not to a second worker
    q.done("a")
    assert q.get(timeout=0) == "a"  # the change is not lost


def test_add_after_waits_and_the_earliest_time_wins():
    clock = Clock()
    q = WorkQueue(clock=clock)
    q.add_after("a", 10)
    q.add_after("a", 5)
    q.add_after("a", 20)
    assert q.get(timeout=0) is None
    clock.now = 5.0
    assert q.get(timeout=0) == "a"
    q.done("a")
    clock.now = 30.0
    assert q.get(timeout=0) is None  # the later entries were superseded


def test_error_backoff_doubles_to_its_cap_and_forget_resets_it():
    q = WorkQueue()
    delays = [q.backoff("a") for _ in range(12)]
    assert delays[:4] == [0.5, 1.0, 2.0, 4.0]
    assert delays[-1] == ERROR_BACKOFF_CAP_SECONDS and max(delays) == ERROR_BACKOFF_CAP_SECONDS
    assert q.failures("a") == 12
    q.forget("a")
    assert q.backoff("a") == 0.5


def test_workers_never_hold_one_key_at_once_and_every_change_is_processed():
    """8 workers, 200 keys, 20,000 adds from 4 threads: at most one worker per key at any time,
    and after the last add every key is processed once more (no change lost)."""
    q = WorkQueue()
    holding: dict[str, int] = {}
    lock = threading.Lock()
    overlap = []
    last_processed: dict[str, int] = {}
    version: dict[str, int] = {}

    def worker() -> None:
        while (key := q.get()) is not None:
            with lock:
                holding[key] = holding.get(key, 0) + 1
                if holding[key] > 1:
                    overlap.append(key)
                seen = version.get(key, 0)
            time.sleep(0.0005)
            with lock:
                holding[key] -= 1
                last_processed[key] = max(last_processed.get(key, 0), seen)
            q.done(key)

    def producer(offset: int) -> None:
        for i in range(5000):
            key = f"job-{(i * 7 + offset) % 200}"
            with lock:
                version[key] = version.get(key, 0) + 1
            q.add(key)

    workers = [threading.Thread(target=worker) for _ in range(8)]
    for w in workers:
        w.start()
    producers = [threading.Thread(target=producer, args=(n,)) for n in range(4)]
    for p in producers:
        p.start()
    for p in producers:
        p.join()
    deadline = time.monotonic() + 30
    while len(q) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    q.close()
    for w in workers:
        w.join(timeout=10)
    assert not overlap, f"keys held by two workers at once: {overlap[:5]}"
    assert last_processed == version, "a change made after a key's last processing was lost"


def test_close_wakes_a_waiting_worker():
    q = WorkQueue()
    got = []
    t = threading.Thread(target=lambda: got.append(q.get()))
    t.start()
    time.sleep(0.05)
    q.close()
    t.join(timeout=5)
    assert got == [None] and not t.is_alive()


def test_an_urgent_key_goes_before_every_routine_one_and_an_urgent_add_moves_a_waiting_key_up():
    q = WorkQueue()
    for key in ("a", "b", "c"):
        q.add(key)
    q.add("z", urgent=True)
    q.add("b", urgent=True)  # waiting routine: moves up, still once
    assert q.depth() == {"urgent": 2, "routine": 2}
    assert [q.get(timeout=0) for _ in range(5)] == ["z", "b", "a", "c", None]


def test_a_key_made_urgent_while_processed_comes_back_urgent():
    q = WorkQueue()
    q.add("a")
    q.add("r")
    assert q.get(timeout=0) == "a"
    q.add("a", urgent=True)  # its pod died while a worker held it
    q.done("a")
    assert q.get(timeout=0) == "a" and q.get(timeout=0) == "r"


def test_routine_keys_get_one_turn_after_urgent_streak_urgent_ones_past_the_edge():
    q = WorkQueue()
    q.add("routine")
    for i in range(URGENT_STREAK + 5):
        q.add(f"u{i}", urgent=True)
    order = [q.get(timeout=0) for _ in range(URGENT_STREAK + 6)]
    assert order[:URGENT_STREAK] == [f"u{i}" for i in range(URGENT_STREAK)]
    assert order[URGENT_STREAK] == "routine"  # the streak's edge: one routine key goes
    assert order[URGENT_STREAK + 1:] == [f"u{i}" for i in range(URGENT_STREAK, URGENT_STREAK + 5)]


def test_an_urgent_only_worker_leaves_routine_keys_to_the_others_and_takes_an_urgent_one_at_once():
    q = WorkQueue()
    q.add("routine")
    assert q.get(timeout=0, urgent_only=True) is None
    got = []
    worker = threading.Thread(target=lambda: got.append(q.get(timeout=5, urgent_only=True)))
    worker.start()
    time.sleep(0.1)  # the worker waits on the queue's condition
    q.add("replace", urgent=True)
    worker.join(5)
    assert got == ["replace"] and q.get(timeout=0) == "routine"


def test_the_wait_of_each_key_is_told_by_lane():
    clock = Clock()
    waits = []
    q = WorkQueue(clock=clock, on_wait=lambda lane, seconds: waits.append((lane, seconds)))
    q.add("a")
    clock.now = 2.0
    q.add("b", urgent=True)
    clock.now = 3.0
    assert q.get(timeout=0) == "b" and q.get(timeout=0) == "a"
    assert waits == [("urgent", 1.0), ("routine", 3.0)]


# --- the index's resync (drivers/cluster/index.py Index.resync): what a missed watch event leaves right ----

def _seen(replica: str, phase: str = "Running"):
    from kubetrain.drivers.cluster import observe
    from kubetrain.engine.engine import ReplicaObservation

    return (observe.Owner("TrainingJob", "j", "uid"), ReplicaObservation(replica, phase))


def test_a_resync_adds_a_missed_pod_drops_a_gone_one_and_takes_a_newer_version():
    from kubetrain.drivers.cluster.index import Index

    index = Index()
    key = ("ns", "j")
    index.set_pod(key, "j-worker-0", _seen("worker-0"), "10")
    index.set_pod(key, "j-worker-1", _seen("worker-1"), "11")  # its DELETED event was missed
    index.set_pod(key, "j-ps-0", _seen("ps-0"), "12")  # its Failed status was missed
    started = time.monotonic()
    listed = {key: {"j-worker-0": (_seen("worker-0"), "10"), "j-ps-0": (_seen("ps-0", "Failed"), "20"),
                    "j-worker-2": (_seen("worker-2"), "21")}}  # its ADDED event was missed
    assert index.resync(listed, started) == {key}
    assert set(index.pods[key]) == {"j-worker-0", "j-ps-0", "j-worker-2"}
    assert index.pods[key]["j-ps-0"][1].phase == "Failed"
    assert index.resync(listed, time.monotonic()) == set()  # nothing left to correct


def test_a_resync_keeps_what_the_watch_wrote_after_the_list_began():
    from kubetrain.drivers.cluster.index import Index

    index = Index()
    key = ("ns", "j")
    started = time.monotonic()
    time.sleep(0.01)
    index.set_pod(key, "j-worker-0", _seen("worker-0", "Failed"), "30")  # newer than the list
    index.set_pod(key, "j-worker-1", _seen("worker-1"), "31")  # created after the list began
    listed = {key: {"j-worker-0": (_seen("worker-0"), "29")}}
    assert index.resync(listed, started) == set()
    assert index.pods[key]["j-worker-0"][1].phase == "Failed" and "j-worker-1" in index.pods[key]


def _pod_event(uid: str, phase: str = "Running", exit_code: int | None = None) -> dict:
    state = {"terminated": {"exitCode": exit_code}} if exit_code is not None else {"running": {}}
    return {"metadata": {"name": "j-worker-0", "namespace": "ns", "uid": uid, "resourceVersion": "1",
                         "labels": {"kubetrain.dev/job-name": "j", "kubetrain.dev/replica": "worker-0"},
                         "ownerReferences": [{"kind": "TrainingJob", "name": "j", "uid": "job", "controller": True}]},
            "status": {"phase": phase, "containerStatuses": [{"name": "trainer", "state": state}]}}


def test_a_dead_pods_late_events_do_not_touch_its_replacement():
    """kopf hands each pod (uid) its own worker: the old incarnation's last events can be handled after the
    replacement's first. The round that deleted the dead pod without grace made its replacement at once:
    neither a late status of the old one nor its DELETED event touches the replacement."""
    from kubetrain.drivers.cluster.index import Index

    index, key = Index(), ("ns", "j")
    index.index_pod("ADDED", _pod_event("old"))
    index.forget_pod(key, "j-worker-0", "old")  # deleted without grace by the round that makes the new one
    assert index.replicas(key, "job") == {}
    index.index_pod("ADDED", _pod_event("new"))
    index.index_pod("MODIFIED", _pod_event("old", "Failed", 137))  # late: the kubelet's report of the old one
    index.index_pod("DELETED", _pod_event("old", "Failed", 137))
    seen = index.replicas(key, "job")
    assert seen["worker-0"].uid == "new" and seen["worker-0"].phase == "Running"
    index.index_pod("DELETED", _pod_event("new"))
    assert index.replicas(key, "job") == {}


def test_a_pods_deletion_seen_after_its_successor_leaves_the_successor():
    """A pod made again by someone else (a StatefulSet) can show up before the old one's DELETED event."""
    from kubetrain.drivers.cluster.index import Index

    index, key = Index(), ("ns", "j")
    index.index_pod("ADDED", _pod_event("old"))
    index.index_pod("ADDED", _pod_event("new"))
    index.index_pod("DELETED", _pod_event("old"))
    assert index.replicas(key, "job")["worker-0"].uid == "new"


def test_a_deleted_pods_uid_is_forgotten_after_a_while(monkeypatch):
    from kubetrain.drivers.cluster import index as index_module

    index = index_module.Index()
    clock = [1000.0]
    monkeypatch.setattr(index_module.time, "monotonic", lambda: clock[0])
    index._pruned = clock[0]
    index.index_pod("DELETED", _pod_event("a"))
    clock[0] += index_module.GONE_SECONDS + 1
    index.index_pod("DELETED", _pod_event("b"))  # past GONE_SECONDS / 10 since the last pruning: pruned
    assert set(index.gone) == {"b"}


def test_routine_requests_wait_for_urgent_work_and_no_longer_than_their_bound():
    q = WorkQueue()
    assert q.wait_urgent_clear(5.0) is True  # nothing urgent: at once
    q.add("routine")
    assert q.wait_urgent_clear(5.0) is True  # routine work makes nobody wait
    q.add("u", urgent=True)
    started = time.monotonic()
    assert q.wait_urgent_clear(0.2) is False  # urgent work that stays (a storm): the wait ends at its bound
    assert time.monotonic() - started >= 0.2
    assert q.get(timeout=0) == "u" and q.handed_urgent("u")  # being processed: still urgent work
    assert q.get(timeout=0) == "routine" and not q.handed_urgent("routine")
    cleared = []
    waiter = threading.Thread(target=lambda: cleared.append(q.wait_urgent_clear(30.0)))
    waiter.start()
    time.sleep(0.1)
    assert cleared == []  # still waiting while "u" is processed
    q.done("u")
    waiter.join(timeout=10)
    assert cleared == [True] and not q.handed_urgent("u")
    q.close()
    q.add("v", urgent=True)  # a closed queue takes nothing and holds nobody
    assert q.wait_urgent_clear(30.0) is True
