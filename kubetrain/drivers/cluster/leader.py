"""Leader election on a coordination.k8s.io/v1 Lease: one operator acts, the others stand by.

The decision (take the lease, renew it, wait, or step down) is the pure function
`decide`; `LeaderElector` reads and writes the Lease and enforces the renew
deadline. The rules and the timings are controller-runtime's (client-go's
leaderelection package), so an operator of Kubernetes finds what they know:

- A candidate judges a lease expired by its own monotonic clock, counted from
  the moment it first saw the record as it is now, never by comparing the
  record's renewTime with its wall clock: the record was written with another
  pod's clock, and a candidate whose clock ran 20 s ahead would otherwise see
  every live lease as expired and take it.
- Every write carries the resourceVersion it was decided on, so of two
  candidates that both see an expired lease, the API server lets one write
  and answers the other 409 Conflict: never two leaders from one race.
- The leader that cannot renew for RENEW_SECONDS exits the process at once
  (os._exit): RENEW_SECONDS < LEASE_SECONDS, so it has stopped acting before
  any standby can consider the lease expired. Kubernetes restarts it as a
  standby.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from kubetrain.shared.timestamps import iso

log = logging.getLogger(__name__)

LEASE_SECONDS = 15
"""How long a lease holds without renewal (controller-runtime's LeaseDuration). A
standby waits this long after it saw the last renewal, then takes the lease at its
next look: with the leader SIGKILLed, 14 to 18 s later (LEASE_SECONDS, give or take the
RETRY_SECONDS between looks; 16.3 to 17.2 s in four runs on the test cluster). Shorter
means quicker failover, but a leader that stalls (a GC pause, a slow API server) loses
the lease sooner."""

RENEW_SECONDS = 10
"""The leader gives up (exits) when it has not renewed for this long (controller-runtime's
RenewDeadline). The LEASE_SECONDS - RENEW_SECONDS = 5 s between them is the margin
by which a leader that cannot renew has stopped acting before a standby may take over."""

RETRY_SECONDS = 2
"""How often a standby tries to take the lease and the leader renews it
(controller-runtime's RetryPeriod): 0.5 requests/s per candidate, and it bounds
how late a standby notices a released or expired lease."""

REQUEST_SECONDS = 5.0
"""Timeout of one Lease request. A renewal gets at most what is left of the renew
deadline, so a hanging request cannot hold the leader past it."""

LOST_EXIT_CODE = 1
"""The exit status of a leader that lost its lease: non-zero, so the kubelet restarts
the container (restartPolicy Always) and it comes back as a standby."""


class Decision(enum.Enum):
    ACQUIRE = "acquire"
    """The lease is free, missing or expired: write it with us as the holder."""
    RENEW = "renew"
    """We hold the lease: write a new renewTime."""
    STANDBY = "standby"
    """Another candidate holds a live lease: wait and look again."""
    LOST = "lost"
    """We were leading and the lease now names someone else: stop acting at once."""


@dataclass(frozen=True)
class LeaseRecord:
    """The fields of a Lease's spec that leader election reads and writes."""

    holder: str = ""
    """spec.holderIdentity; empty: released, free for anyone at once."""
    acquire_time: datetime | None = None
    renew_time: datetime | None = None
    lease_duration_seconds: int = LEASE_SECONDS
    """The holder's own duration: a standby honours what the holder declared."""
    transitions: int = 0
    """spec.leaseTransitions: how many times the holder changed."""


@dataclass(frozen=True)
class Observation:
    """A lease record as a candidate saw it, and since when (its own monotonic clock)."""

    record: LeaseRecord | None
    """None: no Lease object exists yet."""
    since: float
    """When this candidate first saw exactly this record; a renewal changes the
    record (its renewTime) and so restarts the count."""


def observe(previous: Observation | None, record: LeaseRecord | None, now: float) -> Observation:
    """The observation after reading `record` at `now`: unchanged keeps its `since`."""
    if previous is not None and previous.record == record:
        return previous
    return Observation(record, now)


def expired(seen: Observation, now: float) -> bool:
    """Whether the lease in `seen` has run out at `now`; exactly at since + duration it has
    (client-go: held while `observedTime + leaseDuration` is after now)."""
    assert seen.record is not None
    return now >= seen.since + seen.record.lease_duration_seconds


def decide(seen: Observation, identity: str, now: float, leading: bool = False) -> Decision:
    """What candidate `identity` does with the lease it observed, at `now` on the clock of `seen.since`.

    `leading` says whether this candidate believes it is the leader (it wrote the
    lease last): a leader that finds another name, or none, in the lease has lost it.
    """
    record = seen.record
    if record is None:
        return Decision.LOST if leading else Decision.ACQUIRE
    if record.holder == identity:
        # Also when not `leading`: our own earlier write went through but its answer was lost.
        return Decision.RENEW
    if leading:
        return Decision.LOST
    if not record.holder or expired(seen, now):
        return Decision.ACQUIRE
    return Decision.STANDBY


def acquired(record: LeaseRecord | None, identity: str, wall: datetime,
             lease_seconds: int = LEASE_SECONDS) -> LeaseRecord:
    """The record that makes `identity` the holder at wall-clock time `wall`."""
    # client-go counts a transition whenever an existing lease gets a new holder (a released one too).
    transitions = 0 if record is None else record.transitions + (record.holder != identity)
    return LeaseRecord(holder=identity, acquire_time=wall, renew_time=wall, lease_duration_seconds=lease_seconds,
                       transitions=transitions)


def renewed(record: LeaseRecord, wall: datetime) -> LeaseRecord:
    return replace(record, renew_time=wall)


def released(record: LeaseRecord, wall: datetime) -> LeaseRecord:
    """The record a leader writes on a clean exit: no holder, so a standby takes it at its next look."""
    return replace(record, holder="", renew_time=wall)


def new_identity(pod_name: str | None = None) -> str:
    """`<pod name>_<random>`: the pod name says which pod leads (`kubectl logs` it); the random
    part keeps a restarted container, which has the same pod name, from mistaking the lease
    its previous life held for its own."""
    name = pod_name or os.environ.get("POD_NAME") or socket.gethostname()
    return f"{name}_{uuid.uuid4().hex[:8]}"


# -- The Lease's JSON ---------------------------------------------------------------------


def _time(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


def _micro_time(value: datetime | None) -> str | None:
    # metav1.MicroTime: RFC 3339 with exactly six fractional digits, as the API server parses it.
    return iso(value, micro=True) if value else None


def record_from(lease: dict[str, Any]) -> LeaseRecord:
    spec = lease.get("spec") or {}
    return LeaseRecord(
        holder=spec.get("holderIdentity") or "",
        acquire_time=_time(spec.get("acquireTime")),
        renew_time=_time(spec.get("renewTime")),
        lease_duration_seconds=spec.get("leaseDurationSeconds") or LEASE_SECONDS,
        transitions=spec.get("leaseTransitions") or 0,
    )


def lease_body(name: str, namespace: str, record: LeaseRecord, resource_version: str | None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": namespace}
    if resource_version:
        metadata["resourceVersion"] = resource_version
    return {
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata,
        "spec": {
            "holderIdentity": record.holder, "acquireTime": _micro_time(record.acquire_time),
            "renewTime": _micro_time(record.renew_time), "leaseDurationSeconds": record.lease_duration_seconds,
            "leaseTransitions": record.transitions,
        },
    }


def _wall() -> datetime:
    return datetime.now(timezone.utc)


def api_client() -> client.ApiClient:
    """An ApiClient of its own (in-cluster, else the kubeconfig), shared with nothing else."""
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        config.load_kube_config(client_configuration=configuration)
    return client.ApiClient(configuration)


def _exit_lost(reason: str) -> None:
    log.error("lost leadership: %s; exiting so that this operator restarts as a standby", reason)
    logging.shutdown()
    os._exit(LOST_EXIT_CODE)


class LeaderElector:
    """Takes, renews and releases one Lease. `acquire()` blocks until this process leads;
    `start_renewing()` keeps the lease in a background thread and calls `on_lost` (by
    default: exit the process) when it is lost or cannot be renewed in time."""

    def __init__(
        self, name: str, namespace: str, identity: str, api: client.ApiClient | None = None, *,
        lease_seconds: int = LEASE_SECONDS, renew_seconds: float = RENEW_SECONDS,
        retry_seconds: float = RETRY_SECONDS, clock: Callable[[], float] = time.monotonic,
        on_lost: Callable[[str], None] = _exit_lost,
    ) -> None:
        if not renew_seconds < lease_seconds:
            raise ValueError(f"renew_seconds ({renew_seconds}) must be less than lease_seconds ({lease_seconds}): "
                             "a leader must stop before a standby may take over")
        self.name, self.namespace, self.identity = name, namespace, identity
        self.coordination = client.CoordinationV1Api(api or api_client())
        self.lease_seconds, self.renew_seconds, self.retry_seconds = lease_seconds, renew_seconds, retry_seconds
        self.clock, self.on_lost = clock, on_lost
        self.leading = False
        self.seen: Observation | None = None
        self._resource_version: str | None = None
        self._renewed_at = 0.0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def where(self) -> str:
        return f"lease {self.namespace}/{self.name}"

    # -- I/O ------------------------------------------------------------------------------

    def _read(self, timeout: float) -> tuple[LeaseRecord | None, str | None]:
        try:
            answer = self.coordination.read_namespaced_lease(
                self.name, self.namespace, _preload_content=False, _request_timeout=timeout)
        except ApiException as err:
            if err.status == 404:
                return None, None
            raise
        lease = json.loads(answer.data)  # type: ignore[attr-defined]  # _preload_content=False: the raw response
        return record_from(lease), lease["metadata"]["resourceVersion"]

    def _write(self, record: LeaseRecord, timeout: float) -> None:
        """Create the Lease, or replace it at the resourceVersion last read: a 409 means
        someone else wrote in between, and this write did not happen."""
        body = lease_body(self.name, self.namespace, record, self._resource_version)
        if self._resource_version is None:
            answer = self.coordination.create_namespaced_lease(
                self.namespace, body, _preload_content=False, _request_timeout=timeout)  # type: ignore[arg-type]  # the client takes a plain dict body
        else:
            answer = self.coordination.replace_namespaced_lease(
                self.name, self.namespace, body, _preload_content=False, _request_timeout=timeout)  # type: ignore[arg-type]  # the client takes a plain dict body
        self._resource_version = json.loads(answer.data)["metadata"]["resourceVersion"]  # type: ignore[attr-defined]  # _preload_content=False: the raw response
        self.seen = Observation(record, self.clock())

    # -- One round ----------------------------------------------------------------------

    def try_acquire_or_renew(self, timeout: float = REQUEST_SECONDS) -> Decision:
        """Read the lease, decide, write if the decision is to: one round. Returns the decision;
        ACQUIRE or RENEW means this process now leads. Raises on API errors (409 included)."""
        record, self._resource_version = self._read(timeout)
        now = self.clock()
        self.seen = observe(self.seen, record, now)
        decision = decide(self.seen, self.identity, now, self.leading)
        if decision is Decision.ACQUIRE:
            self._write(acquired(record, self.identity, _wall(), self.lease_seconds), timeout)
            if record is not None and record.holder:
                log.info("took over %s from %s", self.where, record.holder)
        elif decision is Decision.RENEW:
            assert record is not None
            self._write(renewed(record, _wall()), timeout)
        if decision in (Decision.ACQUIRE, Decision.RENEW):
            self.leading = True
            self._renewed_at = now
        return decision

    def acquire(self) -> None:
        """Block until this process holds the lease."""
        announced: str | None = None
        while True:
            try:
                if self.try_acquire_or_renew() in (Decision.ACQUIRE, Decision.RENEW):
                    assert self.seen is not None and self.seen.record is not None
                    log.info("became leader: %s held by %s (transitions: %d)",
                             self.where, self.identity, self.seen.record.transitions)
                    return
            except ApiException as err:
                if err.status != 409:  # 409: another candidate won this round; it is a standby's normal
                    log.warning("%s: %s %s; retrying in %s s", self.where, err.status, err.reason, self.retry_seconds)
            except Exception as err:  # noqa: BLE001 - a standby outlives API outages: it only waits
                log.warning("%s: %s; retrying in %s s", self.where, err, self.retry_seconds)
            holder = self.seen.record.holder if self.seen is not None and self.seen.record is not None else ""
            if holder and holder != announced:
                log.info("waiting to become leader; %s holds the lease", holder)
                announced = holder
            time.sleep(self.retry_seconds)

    def renew_once(self) -> None:
        """One renewal by the leader. Writes at the resourceVersion of its own last write, without
        reading first; a 409 (the lease changed under it) or a 404 (deleted) falls back to a full
        round, which finds out whether it still holds the lease. Raises on other errors; calls
        on_lost on LOST."""
        timeout = max(0.1, min(REQUEST_SECONDS, self._renewed_at + self.renew_seconds - self.clock()))
        now = self.clock()
        assert self.seen is not None and self.seen.record is not None
        try:
            self._write(renewed(self.seen.record, _wall()), timeout)
            decision = Decision.RENEW
        except ApiException as err:
            if err.status not in (404, 409):
                raise
            decision = self.try_acquire_or_renew(timeout)
        if decision is Decision.LOST:
            record = self.seen.record
            self.leading = False
            self.on_lost(f"{self.where} was deleted" if record is None else
                         f"{self.where} is now held by {record.holder or 'nobody (released)'}")
            return
        self._renewed_at = now

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.retry_seconds):
            try:
                self.renew_once()
            except Exception as err:  # noqa: BLE001 - one failed renewal is retried; the watchdog holds the deadline
                log.warning("%s: renewal failed: %s", self.where, err)

    def _watchdog(self) -> None:
        """Holds the renew deadline apart from the renewing thread, so a request that hangs where
        no timeout reaches (name resolution) cannot keep a leader acting past it."""
        while True:
            remaining = self._renewed_at + self.renew_seconds - self.clock()
            if remaining <= 0:
                self.leading = False
                self.on_lost(f"{self.where} not renewed for {self.renew_seconds} s")
                return
            if self._stop.wait(min(remaining, self.retry_seconds)):
                return

    def start_renewing(self) -> None:
        assert self.leading, "start_renewing() before acquire()"
        self._stop.clear()
        self._threads = [threading.Thread(target=self._renew_loop, name="lease-renew", daemon=True),
                         threading.Thread(target=self._watchdog, name="lease-watchdog", daemon=True)]
        for thread in self._threads:
            thread.start()

    def stop_renewing(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=REQUEST_SECONDS + 1)
        self._threads = []

    def release(self) -> None:
        """Stop renewing and write the lease free, so a standby takes over at its next look
        (RETRY_SECONDS) instead of after LEASE_SECONDS. Only once this process has stopped acting."""
        self.stop_renewing()
        if not self.leading or self.seen is None or self.seen.record is None:
            return
        self.leading = False
        try:
            self._write(released(self.seen.record, _wall()), REQUEST_SECONDS)
            log.info("released %s", self.where)
        except Exception as err:  # noqa: BLE001 - the lease then expires by itself
            log.warning("%s: could not release it (%s); a standby takes over when it expires", self.where, err)
