"""The operator's index: jobs, their pods, claims and Kueue Workloads as its watches last showed them.

Fed by the watch events (drivers/cluster/handlers.py) and corrected by the periodic resync
(drivers/cluster/workers.py); read by every round, so that no round lists anything itself.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from kubetrain.engine.children import LABEL_JOB
from kubetrain.engine.engine import ReplicaObservation
from . import observe

GONE_SECONDS = 600.0
"""How long the uid of a deleted pod is remembered. kopf hands each pod (each uid) its own worker, so a
deleted pod's last events can be handled after the first events of its replacement of the same name:
remembered, they neither remove the replacement from the index nor put the dead pod back over it (which
made the operator take the replacement for failed and delete it). One pod's events come within seconds
of each other; an entry is a few dozen bytes, so even 1,000 replacements a minute keep well under a MB."""

Key = tuple[str, str]  # (namespace, job name)
Seen = tuple[observe.Owner, ReplicaObservation]  # a pod: its owner, and the replica the engine sees in it


class Index:
    """Jobs, their pods and their claims as the watches last showed them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.jobs: dict[Key, dict[str, Any]] = {}
        self.pods: dict[Key, dict[str, Seen]] = {}  # job -> pod name -> (its owner, observation)
        self.versions: dict[Key, dict[str, tuple[str, float]]] = {}  # job -> pod name -> (resourceVersion, indexed at)
        self.claims: dict[Key, dict[str, str]] = {}  # job -> claim name -> phase
        self.workloads: dict[Key, dict[str, dict[str, Any]]] = {}  # job -> Kueue Workload name -> object
        self.statefulsets: dict[Key, tuple[str, str]] = {}  # DDP job -> (its uid, its StatefulSet's uid)
        self.gone: dict[str, float] = {}  # uid of a pod deleted -> when (monotonic), for GONE_SECONDS
        self._pruned = time.monotonic()

    def job(self, key: Key) -> dict[str, Any] | None:
        with self.lock:
            return self.jobs.get(key)

    def set_job(self, key: Key, raw: dict[str, Any]) -> None:
        with self.lock:
            self.jobs[key] = raw

    def replicas(self, key: Key, uid: str) -> dict[str, ReplicaObservation]:
        """The replicas of the job `key` whose uid is `uid`: pods labelled with its name, owned by it
        (or by its StatefulSet, of the uid the API server gave: `statefulsets`) and named as the job
        names that replica's pod. A label is anyone's to set; a pod another job's template (or another tenant)
        labelled as this job's replica once made the job Succeeded, or restarted. An owner reference is
        anyone's to write too, the job's uid included (anyone who may read the job reads it): the name
        `<job>-<replica>` is the one thing another pod cannot take while the replica's own pod exists."""
        with self.lock:
            statefulset = self._statefulset(key, uid) or ""
            return {o.replica: o for pod, (owner, o) in (self.pods.get(key) or {}).items()
                    if observe.names_its_replica(pod, key[1], o.replica)
                    and observe.owned_by(owner, key[1], uid, statefulset)}

    def statefulset_unknown(self, key: Key, uid: str) -> bool:
        """Whether a pod of the job `key` (uid `uid`) names as its controller the job's StatefulSet
        (`<job>-ddp`) while the index holds no uid for it: the StatefulSet is new to this operator (it
        started, or made the StatefulSet, since it last asked), or the pod's owner is forged. Only the
        API server can say which (kube.statefulset_uid), once; a pod whose owner's uid differs from
        the one it said is not the job's, and costs no call."""
        with self.lock:
            if self._statefulset(key, uid) is not None:
                return False
            name = observe.statefulset_name(key[1])
            return any(owner.kind == "StatefulSet" and owner.name == name
                       for owner, _ in (self.pods.get(key) or {}).values())

    def set_statefulset(self, key: Key, uid: str, statefulset: str | None) -> None:
        """The API server's answer: the job's StatefulSet has the uid `statefulset`; None: it has none
        that is the job's (none yet, or one another owns: ChildConflict), or the operator just made or
        rendered it again, so the next round that meets its pods asks again."""
        with self.lock:
            if statefulset is None:
                self.statefulsets.pop(key, None)
            else:
                self.statefulsets[key] = (uid, statefulset)

    def _statefulset(self, key: Key, uid: str) -> str | None:
        held = self.statefulsets.get(key)
        return held[1] if held is not None and held[0] == uid else None

    def set_pod(self, key: Key, name: str, seen: Seen | None, version: str = "") -> None:
        with self.lock:
            self._set_pod(key, name, seen, version)

    def forget_pod(self, key: Key, name: str, uid: str) -> None:
        """The pod `name` (the incarnation `uid`) is gone: deleted without grace by this operator."""
        with self.lock:
            self._gone(key, name, uid)

    def _gone(self, key: Key, name: str, uid: str) -> None:
        now = time.monotonic()
        if uid:
            self.gone[uid] = now
        if now - self._pruned > GONE_SECONDS / 10:
            self.gone = {u: t for u, t in self.gone.items() if now - t < GONE_SECONDS}
            self._pruned = now
        held = (self.pods.get(key) or {}).get(name)
        if held is None or not uid or not held[1].uid or held[1].uid == uid:
            self._set_pod(key, name, None, "")
        # else: the name is held by a newer incarnation, made since; it stays

    def _set_pod(self, key: Key, name: str, seen: Seen | None, version: str) -> None:
        pods, versions = self.pods.setdefault(key, {}), self.versions.setdefault(key, {})
        if seen is None:
            pods.pop(name, None)
            versions.pop(name, None)
        else:
            pods[name] = seen
            versions[name] = (version, time.monotonic())
        if not pods:
            del self.pods[key]
            self.versions.pop(key, None)

    def resync(self, listed: dict[Key, dict[str, tuple[Seen | None, str]]], started: float) -> set[Key]:
        """Correct the index from a LIST begun at `started` (monotonic): what a watch missed. Returns the
        jobs whose pods changed.

        A pod the list has and the index lacks is added; one whose resourceVersion differs is taken from
        the list; one the index has and the list lacks is removed; but an entry the watch wrote after the
        list began is newer than the list and stays (a pod just created or changed).
        """
        changed: set[Key] = set()
        with self.lock:
            for key in set(listed) | set(self.pods):
                mine, versions = self.pods.get(key) or {}, self.versions.get(key) or {}
                theirs = listed.get(key) or {}
                for name, (seen, version) in theirs.items():
                    have = versions.get(name)
                    if name not in mine or (have is not None and have[0] != version and have[1] < started):
                        self._set_pod(key, name, seen, version)
                        changed.add(key)
                for name in [n for n in mine if n not in theirs]:
                    if versions.get(name, ("", 0.0))[1] < started:
                        self._set_pod(key, name, None, "")
                        changed.add(key)
        return changed

    def pending_claims(self, key: Key) -> list[str]:
        with self.lock:
            return sorted(n for n, phase in (self.claims.get(key) or {}).items() if phase == "Pending")

    def claim_holder(self, namespace: str, claim: str) -> str | None:
        """The job whose checkpoint claim `claim` is (by its label), in `namespace`; None for a claim
        kubetrain did not make (or has not seen)."""
        with self.lock:
            return next((job for (ns, job), claims in self.claims.items() if ns == namespace and claim in claims),
                        None)

    def set_claim(self, key: Key, name: str, phase: str | None) -> None:
        with self.lock:
            claims = self.claims.setdefault(key, {})
            if phase is None:
                claims.pop(name, None)
            else:
                claims[name] = phase

    def workload(self, key: Key, name: str) -> dict[str, Any] | None:
        with self.lock:
            return (self.workloads.get(key) or {}).get(name)

    def workloads_of(self, key: Key) -> dict[str, dict[str, Any]]:
        """Every Workload of the job, by name (a fault-tolerant job resized by slices has several)."""
        with self.lock:
            return dict(self.workloads.get(key) or {})

    def set_workload(self, key: Key, name: str, raw: dict[str, Any] | None) -> None:
        with self.lock:
            workloads = self.workloads.setdefault(key, {})
            if raw is None:
                workloads.pop(name, None)
                if not workloads:
                    del self.workloads[key]
            else:
                workloads[name] = raw

    def forget(self, key: Key) -> None:
        with self.lock:
            self.jobs.pop(key, None)
            self.statefulsets.pop(key, None)

    # -- fed by the watches ------------------------------------------------------------

    def index_pod(self, kind: str | None, raw: dict[str, Any]) -> Key | None:
        """A pod's watch event (kind: ADDED, MODIFIED, DELETED) into the index; its job's key, or None
        for a pod of no job."""
        found = job_of(raw)
        if found is None:
            return None
        key, name = found
        meta = raw.get("metadata") or {}
        uid = meta.get("uid", "")
        with self.lock:
            if kind == "DELETED":
                self._gone(key, name, uid)
            elif not uid or uid not in self.gone:  # else a late event of a pod already deleted
                self._set_pod(key, name, observed_pod(raw), meta.get("resourceVersion", ""))
        return key

    def index_claim(self, kind: str | None, raw: dict[str, Any]) -> Key | None:
        found = job_of(raw)
        if found is None:
            return None
        key, name = found
        self.set_claim(key, name, None if kind == "DELETED" else ((raw.get("status") or {}).get("phase") or "Pending"))
        return key

    def index_workload(self, kind: str | None, raw: dict[str, Any]) -> tuple[Key, str] | None:
        """A Kueue Workload's event into the index; (its job's key, its name), or None for one of no job."""
        found = job_of(raw)
        if found is None:
            return None
        key, name = found
        self.set_workload(key, name, None if kind == "DELETED" else raw)
        return found


def job_of(raw: dict[str, Any]) -> tuple[Key, str] | None:
    """(the job's key, the object's name) of a pod or claim labelled with its job; None otherwise."""
    meta = raw.get("metadata") or {}
    job = (meta.get("labels") or {}).get(LABEL_JOB)
    return ((meta.get("namespace", ""), job), meta.get("name", "")) if job else None


def observed_pod(raw: dict[str, Any]) -> Seen | None:
    seen = observe.pod_observation(raw)
    return None if seen is None else (observe.owner_of(raw), seen)
