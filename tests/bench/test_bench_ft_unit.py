"""`kubetrain bench ft`'s reading of a run (kubetrain/bench/ft.py), on a run directory written by hand: the
survivors' stall and the replacement's time to take part per kill, where that time went, and the plain
group's lost steps; and the arguments it refuses. The benchmark itself runs real jobs for minutes: it is
a command (docs/benchmarks.md), not a test."""

from __future__ import annotations

import json

import pytest

from kubetrain.bench.ft import Variant, bench_ft, job_doc
from support import kubetrain

KILL = 1_000.0


def write(run, replica, events):
    (run / "metrics").mkdir(parents=True, exist_ok=True)
    (run / "metrics" / f"{replica}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def milestone(name, t, **fields):
    return "kubetrain-startup " + json.dumps({"milestone": name, "time": t, **fields}) + "\n"


def test_each_kill_of_a_fault_tolerant_job_is_broken_into_its_parts(tmp_path):
    variant = Variant(tmp_path, "ft", 3)
    run = variant.dir
    for survivor in ("ddp-0", "ddp-2"):
        write(run, survivor, [{"time": KILL - 50, "event": "quorum", "participants": 3, "previous": None},
                              {"time": KILL + 1.05, "event": "quorum", "participants": 2, "previous": 3,
                               "stall_seconds": 1.1 if survivor == "ddp-0" else 1.0},
                              {"time": KILL + 9.5, "event": "quorum", "participants": 3, "previous": 2,
                               "stall_seconds": 0.02}])
    write(run, "ddp-1", [{"time": KILL - 60, "event": "start", "pid": 1},
                         {"time": KILL + 8.0, "event": "start", "pid": 2},
                         {"time": KILL + 9.2, "event": "heal", "step": 500, "seconds": 0.07},
                         {"time": KILL + 9.3, "event": "quorum", "participants": 2, "previous": None}])
    (run / "logs").mkdir()
    (run / "logs" / "ddp-1.log").write_text(
        milestone("process", KILL - 61) + "--- kubetrain: attempt 2 of ddp-1\n" + milestone("process", KILL + 0.4)
        + milestone("main", KILL + 0.6, role="agent") + milestone("imports", KILL + 4.4, role="agent")
        + milestone("process", KILL + 4.5) + milestone("model", KILL + 7.9, rank=0)
        + milestone("manager", KILL + 8.6, rank=1) + milestone("joined", KILL + 9.2, rank=1, step=500))
    (run / "state.json").write_text(json.dumps({"restart_log": [{"replica": "ddp-1", "time": KILL + 0.3}]}))
    variant.kills = [("ddp-1", KILL)]
    [kill] = variant.ft_kills()
    assert kill["survivor_stall_seconds"] == 1.1 and kill["rejoin_seconds"] == 9.3
    assert kill["back_to_full_width_seconds"] == 9.5  # the first commit of 3 groups: the replacement back
    assert kill["healed"] and not kill["read_checkpoint"] and kill["heal_seconds"] == 0.07
    assert kill["breakdown_seconds"] == {"noticed_and_restarted": 0.4, "agent_python_and_torch": 4.0,
                                         "rank_started_model_and_data": 4.2,
                                         "torchft_manager_and_quorum_or_heal": 0.6, "first_commit": 0.1}


def test_with_a_spare_the_job_is_back_at_full_width_at_the_survivors_first_commit(tmp_path):
    """2 nodes and a spare: the kill of ddp-1 leaves ddp-0 and the spare, 2 groups training, at their next
    commit; the replacement's return (3 groups) is later and does not count."""
    variant = Variant(tmp_path, "spare", 2, spares=1)
    assert variant.groups == ["ddp-0", "ddp-1", "ddp-2"]
    for group in ("ddp-0", "ddp-2"):
        write(variant.dir, group, [{"time": KILL - 50, "event": "quorum", "participants": 3, "previous": None},
                                   {"time": KILL + 1.07, "event": "quorum", "participants": 2, "previous": 3,
                                    "stall_seconds": 1.08},
                                   {"time": KILL + 12.0, "event": "quorum", "participants": 3, "previous": 2,
                                    "stall_seconds": 0.02},
                                   {"time": KILL + 20.0, "event": "train", "step": 900, "job_samples": 57_000}])
    write(variant.dir, "ddp-1", [{"time": KILL - 60, "event": "start", "pid": 1}])
    (variant.dir / "state.json").write_text(json.dumps({"restart_log": []}))
    variant.kills = [("ddp-1", KILL)]
    [kill] = variant.ft_kills()
    assert kill["back_to_full_width_seconds"] == 1.07 and kill["survivor_stall_seconds"] == 1.08
    assert variant.samples_at(KILL + 30) == 57_000  # the cursor's count, not steps x nodes x batch
    assert variant.samples_at(KILL) == 0


def test_a_plain_group_loses_the_steps_since_its_checkpoint_and_the_time_to_restart(tmp_path):
    variant = Variant(tmp_path, "plain", 2)
    write(variant.dir, "ddp-0", [{"time": KILL - 1, "event": "train", "step": 140},
                                 {"time": KILL + 6, "event": "resume", "step": 100},
                                 {"time": KILL + 7, "event": "train", "step": 105}])
    write(variant.dir, "ddp-1", [{"time": KILL - 0.5, "event": "train", "step": 145}])
    variant.kills = [("ddp-1", KILL)]
    assert variant.plain_kills() == [{"node": "ddp-1", "until_training_again_seconds": 7.0, "steps_lost_at_least": 45}]
    assert variant.step_at(KILL) == 145 and variant.step_at(KILL + 6.5) == 100


def test_the_fault_tolerant_variant_is_the_plain_job_with_fault_tolerance():
    plain, tolerant, spare = (job_doc("b", 100, 3, ft, 64, 2.0, spares)["spec"]
                              for ft, spares in ((False, 0), (True, 0), (True, 1)))
    assert tolerant["ddp"].pop("faultTolerance") == {"heartbeatTimeoutSeconds": 2.0, "spareGroups": 0}
    assert spare["ddp"].pop("faultTolerance") == {"heartbeatTimeoutSeconds": 2.0, "spareGroups": 1}
    assert plain == tolerant == spare


@pytest.mark.parametrize("kwargs, words", [({"groups": 1}, "--groups 1: a kill needs a survivor"),
                                           ({"kill_every": 1.0}, "--kill-every 1.0: must exceed the heartbeat")])
def test_bad_arguments_are_refused_before_anything_runs(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        bench_ft(**kwargs)


def test_the_command_refuses_them_with_exit_2():
    out = kubetrain("bench", "ft", "--groups", "1")
    assert out.returncode == 2 and "--groups 1: a kill needs a survivor" in out.stderr and "Traceback" not in out.stderr


def test_no_kill_lands_in_the_last_steps_or_after_a_node_ended(tmp_path):
    variant = Variant(tmp_path, "end", 2, steps=1000)
    write(variant.dir, "ddp-0", [{"time": KILL, "event": "train", "step": 970}])
    write(variant.dir, "ddp-1", [{"time": KILL, "event": "train", "step": 969}])
    assert not variant.near_end()
    write(variant.dir, "ddp-1", [{"time": KILL, "event": "train", "step": 980}])
    assert variant.near_end()  # the last 2 %
    write(variant.dir, "ddp-1", [{"time": KILL, "event": "end", "step": 500}])
    assert variant.near_end()  # a node ended, whatever its step
