"""Leader election's decision, as a pure function of the observed Lease, the identity and the clock;
then the elector's I/O against an in-memory Lease that answers as the API server does."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from types import SimpleNamespace

import pytest
from kubernetes.client.rest import ApiException

from kubetrain.drivers.cluster.leader import (
    LEASE_SECONDS, RENEW_SECONDS, RETRY_SECONDS, Decision, LeaderElector, LeaseRecord, Observation, acquired, decide,
    expired, lease_body, new_identity, observe, record_from, released, renewed,
)

T0 = datetime(2026, 11, 29, 10, 0, 0, tzinfo=timezone.utc)


def held_by(holder: str, duration: int = LEASE_SECONDS, transitions: int = 3) -> LeaseRecord:
    return LeaseRecord(holder=holder, acquire_time=T0, renew_time=T0, lease_duration_seconds=duration,
                       transitions=transitions)


@dataclass(frozen=True)
class Case:
    name: str
    record: LeaseRecord | None
    seen_since: float
    now: float
    expected: Decision
    leading: bool = False


CASES = [
    Case("no lease yet: create it", None, 100.0, 100.0, Decision.ACQUIRE),
    Case("released lease: taken at once", held_by(""), 100.0, 100.0, Decision.ACQUIRE),
    Case("held lease, just renewed: respected", held_by("a"), 100.0, 100.0, Decision.STANDBY),
    Case("held lease, a moment before expiry: respected", held_by("a"), 100.0, 114.999, Decision.STANDBY),
    Case("held lease, exactly at expiry: taken", held_by("a"), 100.0, 115.0, Decision.ACQUIRE),
    Case("expired lease: taken", held_by("a"), 100.0, 160.0, Decision.ACQUIRE),
    Case("the holder's own duration counts, not ours", held_by("a", duration=30), 100.0, 129.0, Decision.STANDBY),
    Case("the holder's own duration counts, expired", held_by("a", duration=30), 100.0, 130.0, Decision.ACQUIRE),
    Case("own lease: renewed", held_by("me"), 100.0, 105.0, Decision.RENEW, leading=True),
    Case("own lease past expiry, nobody took it: renewed", held_by("me"), 100.0, 200.0, Decision.RENEW, leading=True),
    Case("own lease found while standing by (a write whose answer was lost): ours", held_by("me"), 100.0, 101.0,
         Decision.RENEW),
    Case("leading, but the lease names another: lost", held_by("a"), 100.0, 101.0, Decision.LOST, leading=True),
    Case("leading, but the lease was released by someone: lost", held_by(""), 100.0, 101.0, Decision.LOST,
         leading=True),
    Case("leading, but the lease was deleted: lost", None, 100.0, 101.0, Decision.LOST, leading=True),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_decision(case):
    assert decide(Observation(case.record, case.seen_since), "me", case.now, case.leading) is case.expected


def test_expiry_is_counted_from_when_the_candidate_saw_the_record_not_from_its_renew_time():
    # The record says it was renewed an hour before our wall clock's now: a candidate whose clock
    # runs ahead must not take a live lease. Only our own observation of it counts.
    stale_looking = LeaseRecord(holder="a", renew_time=datetime(2026, 11, 29, 9, 0, tzinfo=timezone.utc))
    first = observe(None, stale_looking, now=500.0)
    assert decide(first, "me", 500.0) is Decision.STANDBY
    assert decide(observe(first, stale_looking, now=514.9), "me", 514.9) is Decision.STANDBY
    assert decide(observe(first, stale_looking, now=515.0), "me", 515.0) is Decision.ACQUIRE


def test_a_renewal_restarts_the_count():
    seen = observe(None, held_by("a"), now=100.0)
    assert observe(seen, held_by("a"), now=110.0) is seen  # unchanged: the count goes on from 100
    renewal = LeaseRecord(holder="a", acquire_time=T0, renew_time=T0.replace(second=10), transitions=3)
    again = observe(seen, renewal, now=110.0)
    assert again.since == 110.0
    assert decide(again, "me", 115.0) is Decision.STANDBY
    assert decide(again, "me", 125.0) is Decision.ACQUIRE


def test_expired_at_exactly_since_plus_duration():
    seen = Observation(held_by("a", duration=15), 0.0)
    assert not expired(seen, 14.999999)
    assert expired(seen, 15.0)


def test_taking_over_counts_a_transition_and_renewing_does_not():
    later = T0.replace(second=20)
    taken = acquired(held_by("a", transitions=3), "me", later)
    assert taken == LeaseRecord(holder="me", acquire_time=later, renew_time=later,
                                lease_duration_seconds=LEASE_SECONDS, transitions=4)
    assert acquired(None, "me", later).transitions == 0  # a new lease: no transition yet
    assert acquired(released(held_by("a", transitions=3), later), "me", later).transitions == 4
    again = renewed(taken, later.replace(second=30))
    assert (again.holder, again.acquire_time, again.transitions) == ("me", later, 4)
    assert again.renew_time == later.replace(second=30)


def test_a_released_lease_has_no_holder_and_keeps_its_history():
    free = released(held_by("me", transitions=5), T0)
    assert free.holder == "" and free.transitions == 5
    assert decide(Observation(free, 0.0), "b", 0.0) is Decision.ACQUIRE


def test_the_lease_json_round_trips_with_micro_times():
    record = LeaseRecord(holder="op-1_abc", acquire_time=T0, renew_time=T0.replace(microsecond=123456),
                         lease_duration_seconds=15, transitions=2)
    body = lease_body("kubetrain-operator", "kt", record, "42")
    assert body["metadata"] == {"name": "kubetrain-operator", "namespace": "kt", "resourceVersion": "42"}
    # metav1.MicroTime: six fractional digits always, even at a whole second.
    assert body["spec"]["acquireTime"] == "2026-11-29T10:00:00.000000Z"
    assert body["spec"]["renewTime"] == "2026-11-29T10:00:00.123456Z"
    assert record_from(body) == record
    assert "resourceVersion" not in lease_body("x", "kt", record, None)["metadata"]  # a create


def test_an_empty_lease_spec_reads_as_free():
    assert record_from({"spec": {}}) == LeaseRecord()
    assert decide(Observation(record_from({}), 0.0), "me", 0.0) is Decision.ACQUIRE


def test_identity_is_the_pod_name_and_a_random_part():
    a, b = new_identity("kubetrain-7d9f-x2"), new_identity("kubetrain-7d9f-x2")
    assert a.startswith("kubetrain-7d9f-x2_") and b.startswith("kubetrain-7d9f-x2_")
    assert a != b  # a restarted container does not take its previous life's lease for its own


def test_the_timings_are_controller_runtimes_and_a_leader_stops_before_a_standby_starts():
    assert (LEASE_SECONDS, RENEW_SECONDS, RETRY_SECONDS) == (15, 10, 2)
    assert RETRY_SECONDS < RENEW_SECONDS < LEASE_SECONDS


# -- The elector's I/O against an in-memory Lease with the API server's optimistic concurrency --


class FakeLeases:
    """One Lease, as the API server keeps it: a write must carry the current resourceVersion (else 409),
    and every call must name a timeout."""

    def __init__(self):
        self.lease: dict | None = None
        self.version = 0
        self.down = False

    def _answer(self):
        return SimpleNamespace(data=json.dumps(self.lease).encode())

    def _check(self, timeout):
        assert timeout is not None and timeout > 0, "every Lease call must carry _request_timeout"
        if self.down:
            raise ApiException(status=503, reason="Service Unavailable")

    def _store(self, body):
        self.version += 1
        self.lease = {**body, "metadata": {**body["metadata"], "resourceVersion": str(self.version)}}
        return self._answer()

    def read_namespaced_lease(self, name, namespace, *, _preload_content, _request_timeout=None):
        self._check(_request_timeout)
        if self.lease is None:
            raise ApiException(status=404, reason="Not Found")
        return self._answer()

    def create_namespaced_lease(self, namespace, body, *, _preload_content, _request_timeout=None):
        self._check(_request_timeout)
        if self.lease is not None:
            raise ApiException(status=409, reason="AlreadyExists")
        return self._store(body)

    def replace_namespaced_lease(self, name, namespace, body, *, _preload_content, _request_timeout=None):
        self._check(_request_timeout)
        if self.lease is None:
            raise ApiException(status=404, reason="Not Found")
        if body["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]:
            raise ApiException(status=409, reason="Conflict")
        return self._store(body)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def elector(store, name, clock, lost=None, **timings):
    e = LeaderElector("kubetrain-operator", "kt", name, api=object(), clock=clock,
                      on_lost=lost if lost is not None else (lambda reason: None), **timings)
    e.coordination = store
    return e


def test_of_two_candidates_that_read_the_same_expired_lease_only_one_writes():
    store, clock = FakeLeases(), Clock()
    a, b = elector(store, "a", clock), elector(store, "b", clock)
    assert a.try_acquire_or_renew() is Decision.ACQUIRE
    # A leader that stopped renewing; both standbys watched it expire.
    c, d = elector(store, "c", clock), elector(store, "d", clock)
    for x in (c, d):
        assert x.try_acquire_or_renew() is Decision.STANDBY
    clock.now += LEASE_SECONDS
    # Both read the expired lease at the same resourceVersion, then both write: one is refused.
    record, version = c._read(1.0)
    c.seen = d.seen = observe(c.seen, record, clock.now)
    c._resource_version = d._resource_version = version
    c._write(acquired(record, "c", T0), 1.0)
    with pytest.raises(ApiException) as refused:
        d._write(acquired(record, "d", T0), 1.0)
    assert refused.value.status == 409
    assert record_from(store.lease).holder == "c"
    assert b.try_acquire_or_renew() is Decision.STANDBY


def test_a_standby_takes_a_released_lease_at_its_next_look():
    store, clock = FakeLeases(), Clock()
    a, b = elector(store, "a", clock), elector(store, "b", clock)
    a.try_acquire_or_renew()
    assert b.try_acquire_or_renew() is Decision.STANDBY
    a.release()
    assert record_from(store.lease).holder == ""
    assert b.try_acquire_or_renew() is Decision.ACQUIRE
    assert record_from(store.lease).holder == "b" and record_from(store.lease).transitions == 1


def test_a_leader_whose_lease_was_taken_learns_it_at_its_next_renewal():
    store, clock = FakeLeases(), Clock()
    lost = []
    a = elector(store, "a", clock, lost=lost.append)
    a.try_acquire_or_renew()
    store.lease["spec"]["holderIdentity"] = "intruder"
    store.version += 1
    store.lease["metadata"]["resourceVersion"] = str(store.version)
    a.renew_once()  # its write at its old resourceVersion is refused; it reads and finds the intruder
    assert lost and "intruder" in lost[0]
    assert not a.leading


def test_a_leader_that_cannot_renew_gives_up_at_the_renew_deadline():
    store = FakeLeases()
    gave_up = threading.Event()
    reasons = []
    a = LeaderElector("kubetrain-operator", "kt", "a", api=object(), lease_seconds=5, renew_seconds=0.6,
                      retry_seconds=0.1, on_lost=lambda r: (reasons.append(r), gave_up.set()))
    a.coordination = store
    assert a.try_acquire_or_renew() is Decision.ACQUIRE
    started = time.monotonic()
    a.start_renewing()
    try:
        time.sleep(0.3)
        assert not gave_up.is_set()  # renewing fine
        store.down = True
        broke = time.monotonic()
        assert gave_up.wait(5)
        took = time.monotonic() - broke
    finally:
        a.stop_renewing()
    assert "not renewed for 0.6 s" in reasons[0]
    # It renewed up to the outage, so it gives up one renew deadline after its last renewal: well
    # before its lease (5 s) could expire for a standby. The bound is generous for a loaded machine.
    assert 0.3 <= took <= 2.5, (took, time.monotonic() - started)


def test_renew_deadline_must_be_shorter_than_the_lease():
    with pytest.raises(ValueError, match=r"renew_seconds \(15\) must be less than lease_seconds \(15\)"):
        LeaderElector("l", "kt", "a", api=object(), lease_seconds=15, renew_seconds=15)


def test_a_leader_whose_lease_was_deleted_learns_it_at_its_next_renewal():
    store, clock = FakeLeases(), Clock()
    lost = []
    a = elector(store, "a", clock, lost=lost.append)
    a.try_acquire_or_renew()
    store.lease = None
    a.renew_once()
    assert lost == ["lease kt/kubetrain-operator was deleted"]
