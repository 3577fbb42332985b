"""The recovery break-down (helpers/recovery.py) from recorded logs and watch events; no cluster needed.

The e2e fault tests print it for every real fault; here its parsing and its
arithmetic are checked on what those sources look like.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from helpers.recovery import (
    KINDS, breakdown, handover_marks, json_stream, kind_of, operator_marks, startup_records, trainer_marks,
    watch_marks, workers_back,
)

T0 = 1_796_000_000.0  # 2026-11-29T...: any fixed unix time


def line(milestone: str, t: float, pid: int, **fields) -> str:
    return "kubetrain-startup " + json.dumps({"milestone": milestone, "time": T0 + t, "pid": pid, **fields})


WORKER_LOG = "\n".join([
    line("process", 2.00, 1), line("main", 2.10, 1, role="worker"),
    "2026-11-30 20:00:00,000 INFO kubetrain.trainer.ps.worker: something else",
    line("imports", 3.90, 1), line("model", 4.20, 1), line("registered", 4.30, 1, resumed=True),
    line("first_step", 4.50, 1, step=60, worker_step=30),
    "kubetrain-startup {broken json",
])

# A DDP pod: the torchrun agent (pid 1) and its rank; the rank restarted once in the pod, and the
# restart (pid 40) is the one that reached its first step.
DDP_LOG = "\n".join([
    line("process", 3.0, 1), line("main", 3.1, 1, role="agent"), line("imports", 4.9, 1, role="agent"),
    line("process", 5.2, 20), line("main", 5.3, 20, role="ddp"), line("imports", 7.0, 20),
    line("process", 9.0, 40), line("main", 9.1, 40, role="ddp"), line("imports", 10.8, 40),
    line("model", 11.0, 40, rank=1), line("joined", 11.2, 40, rank=1), line("restored", 11.4, 40, rank=1, step=50),
    line("first_step", 11.5, 40, rank=1, step=51),
])


def utc(t: float) -> str:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(T0 + t))
    return f"{stamp},{int(round((T0 + t) % 1 * 1000)):03d}"


OPERATOR_LOG = "\n".join([
    f"{utc(-30.0)} INFO kubetrain.operator: e2e/job: worker-1 failed (Killed); restarting it in 0.0 s",  # an older fault
    f"{utc(0.71)} INFO kubetrain.operator: e2e/job: worker-1 failed (Killed); restarting it in 0.0 s",
    f"{utc(0.74)} INFO kubetrain.operator: e2e/other: worker-1 failed (Killed); restarting it in 0.0 s",
    f"{utc(0.90)} INFO kubetrain.operator: e2e/job: created pod job-worker-1",
    "[2026-11-30 20:00:00,000] kopf.objects  [INFO    ] not ours",
])


def test_workers_back_is_when_the_last_worker_was_answered_again():
    def worker(*times: float) -> str:
        return "\n".join(f"{utc(t)} INFO kubetrain.trainer.ps.transport: Pull to job-ps-0.e2e:2222: answered after "
                         f"3 retries, {t:.2f} s" for t in times)

    assert workers_back([worker(-20.0, 6.5, 9.0), worker(7.25)], after=T0) == pytest.approx(
        {"workers_back": T0 + 7.25}, abs=0.002)
    assert workers_back([worker(6.5), worker(-20.0)], after=T0) == {}  # one never retried: not known


def pod(uid: str, node: str = "", phase: str = "Running", state: str = "", deleting: bool = False) -> dict:
    meta = {"name": "job-worker-1", "uid": uid, **({"deletionTimestamp": "x"} if deleting else {})}
    statuses = [{"name": "trainer", "state": {state: {}}}] if state else []
    return {"metadata": meta, "spec": {"nodeName": node} if node else {},
            "status": {"phase": phase, "containerStatuses": statuses}}


WATCH = [
    (T0 - 5.0, "ADDED", pod("old", "kt-real-0", state="running")),
    (T0 + 0.62, "MODIFIED", pod("old", "kt-real-0", "Failed", "terminated")),
    (T0 + 0.80, "MODIFIED", pod("old", "kt-real-0", "Failed", "terminated", deleting=True)),
    (T0 + 0.81, "DELETED", pod("old", "kt-real-0", "Failed", "terminated", deleting=True)),
    (T0 + 0.85, "ADDED", pod("new", phase="Pending")),
    (T0 + 0.87, "MODIFIED", pod("new", "kt-real-0", phase="Pending")),
    (T0 + 2.40, "MODIFIED", pod("new", "kt-real-0", state="running")),
    (T0 + 9.00, "DELETED", pod("new", "kt-real-0", "Succeeded", "terminated")),  # the replacement's own end
]


def test_trainer_marks_take_one_process_per_role_and_skip_other_lines():
    assert [r["milestone"] for r in startup_records(WORKER_LOG)] == [
        "process", "main", "imports", "model", "registered", "first_step"]
    assert trainer_marks(WORKER_LOG) == {
        "worker.process": T0 + 2.0, "worker.main": T0 + 2.1, "worker.imports": T0 + 3.9, "worker.model": T0 + 4.2,
        "worker.registered": T0 + 4.3, "worker.first_step": T0 + 4.5}
    ddp = trainer_marks(DDP_LOG)
    assert ddp["agent.imports"] == T0 + 4.9 and ddp["ddp.process"] == T0 + 9.0 and ddp["ddp.first_step"] == T0 + 11.5


def test_operator_marks_are_the_first_restart_of_that_replica_after_the_fault():
    assert operator_marks(OPERATOR_LOG, "e2e", "job", "worker-1", after=T0) == pytest.approx(
        {"decided": T0 + 0.71, "created_logged": T0 + 0.90}, abs=0.002)
    assert operator_marks(OPERATOR_LOG, "e2e", "job", "worker-0", after=T0) == {}


def test_watch_marks_time_the_old_pod_and_its_first_replacement():
    assert watch_marks(WATCH, "old") == {"stopped": T0 + 0.62, "gone": T0 + 0.81, "created": T0 + 0.85,
                                         "scheduled": T0 + 0.87, "running": T0 + 2.40}
    # Deleted before the kubelet reported it stopped (a DDP pod): its deletion stands for both.
    assert watch_marks([WATCH[0], WATCH[3]], "old") == {"stopped": T0 + 0.81, "gone": T0 + 0.81}


def test_a_worker_breakdown_adds_up_to_its_first_step_and_names_the_largest_part():
    marks = {"fault": T0, **watch_marks(WATCH, "old"), **operator_marks(OPERATOR_LOG, "e2e", "job", "worker-1", T0),
             **trainer_marks(WORKER_LOG)}
    parts = breakdown(kind_of("worker-1"), marks)
    assert parts.missing == [] and parts.out_of_order() == []
    assert parts.total == pytest.approx(4.5)
    assert sum(p.seconds for p in parts.parts) == pytest.approx(4.5)
    assert [p.mark for p in parts.parts] == [m for m, _ in KINDS["worker"][1:]]
    assert parts.largest().mark == "worker.imports" and parts.largest().seconds == pytest.approx(1.8)
    text = parts.describe()
    assert text.startswith("worker recovery 4.50 s: kubelet reports the container dead +0.62;")
    assert "the role's imports (torch, grpc) +1.80" in text


def test_missing_and_misordered_marks_are_reported_not_hidden():
    marks = {"fault": T0, **trainer_marks(WORKER_LOG), "created": T0 + 3.0, "scheduled": T0 + 1.0}
    parts = breakdown("worker", marks)
    assert parts.missing == ["stopped", "decided", "gone"]
    assert parts.out_of_order() == [("created", "scheduled")]
    assert parts.parts[0].seconds is None  # stopped: missing
    assert parts.parts[3].seconds == pytest.approx(3.0)  # created, from the fault (the last mark present)


def test_a_ddp_breakdown_runs_from_the_agent_through_the_rank():
    marks = {"fault": T0, "stopped": T0 + 1.5, "gone": T0 + 1.6, "created": T0 + 1.7, "scheduled": T0 + 1.72,
             **trainer_marks(DDP_LOG)}
    parts = breakdown(kind_of("ddp-1"), marks)
    assert parts.missing == [] and parts.out_of_order() == []
    assert parts.total == pytest.approx(11.5)
    rendezvous = next(p for p in parts.parts if p.mark == "ddp.process")
    assert rendezvous.seconds == pytest.approx(9.0 - 4.9)


# A standby worker: started with the job, torch imported, waiting; handed worker-1's place after the kill.
STANDBY_LOG = "\n".join([
    line("process", -40.0, 7), line("main", -39.9, 7, role="standby"), line("imports", -37.5, 7),
    line("standby", -37.4, 7), line("placed", 0.012, 7, worker=1), line("model", 0.025, 7),
    line("registered", 0.031, 7, resumed=True), line("first_step", 0.040, 7, step=60, worker_step=41),
])
PS0_LOG = "\n".join([
    f"{utc(-20.0)} INFO kubetrain.trainer.ps.coordinator: worker 2's process ended before it finished: a standby "
    "(incarnation 1f) takes its place",  # an earlier fault, of another worker
    f"{utc(0.010)} INFO kubetrain.trainer.ps.coordinator: worker 1's process ended before it finished: a standby "
    "(incarnation 2a) takes its place",
])


def test_a_handover_in_the_faults_own_millisecond_counts_at_the_faults_time():
    """ps-0 logs the handover within a millisecond of the kill; asctime truncates it below the fault's mark."""
    fault = T0 + 0.0105
    assert handover_marks(PS0_LOG, 1, after=fault) == {"handed_over": fault}
    assert handover_marks(PS0_LOG, 1, after=T0 + 0.0115) == {}  # a line a whole millisecond before: not it


def test_a_standby_breakdown_runs_from_ps0s_handover_through_the_standbys_first_step():
    assert handover_marks(PS0_LOG, 1, after=T0) == pytest.approx({"handed_over": T0 + 0.010}, abs=0.002)
    assert handover_marks(PS0_LOG, 3, after=T0) == {}
    marks = {"fault": T0, **handover_marks(PS0_LOG, 1, T0), **trainer_marks(STANDBY_LOG)}
    parts = breakdown(kind_of("standby-0"), marks)
    assert parts.missing == [] and parts.out_of_order() == []
    assert parts.total == pytest.approx(0.040)
    assert [p.mark for p in parts.parts] == [m for m, _ in KINDS["standby"][1:]]
    assert parts.describe().startswith("standby recovery 0.04 s: ps-0 hands the place over")


def test_no_breakdown_for_an_unknown_replica_kind():
    with pytest.raises(ValueError, match="no recovery breakdown for replica 'single-0'"):
        kind_of("single-0")


def test_json_stream_splits_concatenated_documents_and_keeps_the_unfinished_one():
    docs, rest = json_stream('{"a": 1}\n{\n "b": [1,\n 2]}\n{"c": ')
    assert docs == [{"a": 1}, {"b": [1, 2]}] and rest == '{"c": '
    assert json_stream("  \n") == ([], "")


def test_a_real_process_reports_its_start_and_each_milestone_once(tmp_path):
    """The trainer's own `startup` (kubetrain/trainer/events.py) in a fresh interpreter, read back by the parser."""
    script = ("from kubetrain.trainer.events import startup\n"
              "startup('main', role='worker'); startup('main'); startup('imports'); startup('imports')\n")
    before = time.time()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    after = time.time()
    records = startup_records(done.stderr)
    assert [r["milestone"] for r in records] == ["process", "main", "imports"], done.stderr
    marks = trainer_marks(done.stderr)
    # The process's start from /proc: after the spawn began (one clock tick of slack), before its milestones.
    assert before - 0.02 <= marks["worker.process"] <= marks["worker.main"] <= marks["worker.imports"] <= after
