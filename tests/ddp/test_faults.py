"""A rank killed or stopped mid-run: torchrun restarts the group and it resumes from the newest checkpoint."""

import os
import signal
from dataclasses import dataclass

import pytest

from ddp_group import Group, Nodes, assert_ok, run_group, write_job
from helpers.jsonl import read_events
from helpers.metrics import samples, scrape
from helpers.net import free_ports
from helpers.wait import wait_for


@dataclass(frozen=True)
class Fault:
    name: str
    target: str
    nodes: int
    procs_per_node: int
    step: int
    resumed_from: int
    """The last checkpoint begun before the fault (every CHECKPOINT_EVERY steps; the fault fires before step's
    own). Saves are written in the background: under load that one may still be in flight when the kill lands,
    and the newest durable checkpoint is then the one before it."""


CHECKPOINT_EVERY = 20  # ddp_group.BASE_SPEC's intervalSteps


FAULTS = [
    Fault("rank 0 of 2 nodes", target="ddp-0", nodes=2, procs_per_node=1, step=70, resumed_from=60),
    Fault("rank 1 of 1 node x 2 ranks", target="ddp-1", nodes=1, procs_per_node=2, step=110, resumed_from=100),
]


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_killed_rank_restarts_the_group_from_the_newest_checkpoint(fault: Fault, baseline: Group, tmp_path):
    job = write_job(tmp_path, ddp={"nodes": fault.nodes, "procsPerNode": fault.procs_per_node})
    group = run_group(job, tmp_path / "run", env={"KUBETRAIN_FAULT": f"kill@step={fault.step}",
                                                  "KUBETRAIN_FAULT_REPLICA": fault.target})
    assert_ok(group)
    # The group resumed from the newest durable checkpoint: at least the newest that rank 0 (the writer) reported
    # durable before the kill, at most the last one begun.
    durable = group.attempts(0, "checkpoint")[0]
    resumed = group.events(0, "resume")[0]["step"]
    assert max(durable, default=0) <= resumed <= fault.resumed_from and resumed % CHECKPOINT_EVERY == 0, \
        (durable, resumed)
    for rank in (0, 1):
        # Two attempts of every rank: torchrun restarted the whole group once.
        assert [e["step"] for e in group.events(rank, "start")] == [0, resumed]
        assert [e["step"] for e in group.events(rank, "resume")] == [resumed]
        assert group.result(rank)["samples"] == baseline.result(rank)["samples"]  # none repeated, none skipped
    # The first attempt got to the fault step (the killed rank logs up to the
    # step before, as it dies before its event); the second carried on after
    # the checkpoint.
    for rank in (0, 1):
        first, second = group.attempts(rank, "train")
        assert first in (list(range(1, fault.step)), list(range(1, fault.step + 1)))
        assert second == list(range(resumed + 1, 231))
    accuracy, reference = group.result(0)["eval_accuracy"], baseline.result(0)["eval_accuracy"]
    print(f"{fault.name}: accuracy {accuracy:.4f} vs uninterrupted {reference:.4f}; final loss "
          f"{group.result(0)['final_train_loss']:.6f} vs {baseline.result(0)['final_train_loss']:.6f}")
    assert abs(accuracy - reference) <= 0.02


def wait_for_event(group_dir, rank: int, event: str, min_step: int, timeout: float = 90) -> dict:
    """The first `event` at `min_step` or later in rank's live event log."""
    path = group_dir / "metrics" / f"ddp-{rank}.jsonl"
    return wait_for(f"ddp-{rank} to write an {event!r} event at step >= {min_step}",
                    lambda: next((r for r in read_events(path, event) if r["step"] >= min_step), None),
                    timeout=timeout, every=0.05)


def scraped(port: int) -> dict:
    """The samples of one rank's /metrics on loopback, keyed by name and label set."""
    return samples(scrape(f"127.0.0.1:{port}"))


def test_sigterm_on_one_rank_checkpoints_the_group_which_resumes_there(tmp_path):
    # Twice the epochs: the group must still be training when the signal lands.
    ports = free_ports(2)
    # device cpu: ranks on CPUs are forked from their agent (asserted below), whatever GPUs this machine has.
    nodes = Nodes(write_job(tmp_path, training={"epochs": 20, "device": "cpu"}), tmp_path / "run",
                  metrics_ports=ports).start()
    run_dir = nodes.run_dir
    pid = wait_for_event(run_dir, 1, "start", 0)["pid"]
    # The built-in loop's rank was forked from its node's agent (kubetrain/trainer/ddp/agent.py), not started as
    # an interpreter of its own: its command line is the agent's, and the agent is its parent.
    agent = nodes.procs[1].pid
    assert b"kubetrain.trainer.ddp.agent" in open(f"/proc/{pid}/cmdline", "rb").read()
    assert int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1]) == agent
    wait_for_event(run_dir, 1, "train", 30)
    # Every rank serves the shared metric names, labelled with its own replica.
    series = {**scraped(ports[0]), **scraped(ports[1])}
    for rank in (0, 1):
        labels = {("namespace", "default"), ("job", "ddp-test"), ("role", "ddp"), ("replica", f"ddp-{rank}")}
        assert series["kubetrain_steps_total", frozenset(labels)] >= 30
        assert series["kubetrain_total_steps", frozenset(labels)] == 460
        assert series["kubetrain_network_bytes_total", frozenset(labels | {("direction", "sent")})] > 0
    os.kill(pid, signal.SIGTERM)
    group = nodes.wait()
    assert_ok(group)
    stops = [group.events(rank, "stop") for rank in (0, 1)]
    assert len(stops[0]) == len(stops[1]) == 1 and stops[0][0]["step"] == stops[1][0]["step"]
    stopped_at = stops[0][0]["step"]
    assert stopped_at < 460
    # The checkpoint of the stop step was durable before any rank exited.
    assert stopped_at in {e["step"] for e in group.events(0, "checkpoint")}
    for rank in (0, 1):
        assert [e["step"] for e in group.events(rank, "start")] == [0, stopped_at]
        assert [e["step"] for e in group.events(rank, "resume")] == [stopped_at]
        assert group.result(rank)["steps"] == 460


def test_sigterm_on_the_agents_stops_the_group_with_143_and_a_rerun_resumes(tmp_path):
    # What a supervisor's stop (kubetrain run interrupted, a pod deleted) does.
    job = write_job(tmp_path, training={"epochs": 20})
    nodes = Nodes(job, tmp_path / "run").start()
    wait_for_event(nodes.run_dir, 0, "train", 30)
    for proc in nodes.procs:
        proc.send_signal(signal.SIGTERM)
    stopped = nodes.wait()
    assert stopped.returncodes == [143, 143], "\n".join(log[-3000:] for log in stopped.logs)
    stop_step = stopped.events(0, "stop")[0]["step"]
    assert [e["step"] for e in stopped.events(1, "stop")] == [stop_step]
    assert stop_step in {e["step"] for e in stopped.events(0, "checkpoint")}
    resumed = run_group(job, tmp_path / "run")
    assert_ok(resumed)
    for rank in (0, 1):
        assert [e["step"] for e in resumed.events(rank, "resume")] == [stop_step]
        assert resumed.result(rank)["steps"] == 460
