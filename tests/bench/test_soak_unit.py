"""kubetrain/bench/soak.py's pure half: the seeded schedule (replayable, every class tried, bounded) and the
invariants computed from what the driver recorded, each broken one named."""

from __future__ import annotations

import pytest

from kubetrain.bench.soak import (
    FAULTS, MAX_FAULTS, Injected, JobRecord, schedule, summarize,
)


def test_a_seed_gives_the_same_schedule_and_another_seed_another():
    assert schedule(7, 1200) == schedule(7, 1200)
    assert schedule(7, 1200) != schedule(8, 1200)


def test_every_class_is_tried_once_before_any_twice():
    faults = schedule(3, 1200, mean_gap=5)
    assert sorted(f.kind for f in faults[:len(FAULTS)]) == sorted(FAULTS)
    assert all(0 <= f.pick < 1 for f in faults)
    assert [f.at for f in faults] == sorted(f.at for f in faults) and faults[-1].at < 1200


def test_the_schedule_is_bounded_however_long_the_soak():
    assert len(schedule(1, 10**9, mean_gap=1)) == MAX_FAULTS


@pytest.mark.parametrize("seconds,gap", [(0, 20), (60, 0), (-1, 20)])
def test_a_soak_without_time_or_gap_is_refused(seconds, gap):
    with pytest.raises(ValueError, match="positive duration and gap"):
        schedule(1, seconds, gap)


def test_every_invariant_held_when_the_record_is_clean():
    jobs = [JobRecord("a", "single", "Succeeded", restarts=1, checkpoints=[50, 100], replica_faults=1)]
    faults = [Injected(10, "kill", "a", "a-single-0", steps={"a": 60}, recovered_after=12.5),
              Injected(30, "operator", "", "kubetrain-x", steps={"a": 90}, recovered_after=4.0),
              Injected(40, "lighthouse", skipped="no running job to hit"),
              Injected(5, "apiserver", "", "kube-apiserver")]  # before any job trained: nothing to measure
    result = summarize(1, 60, faults, jobs, [], 150.0, 512.0)
    assert result["held"], result["invariants"]
    assert result["faults"]["kill"] == {"injected": 1, "skipped": 0, "recovered": 1, "seconds_lost_median": 12.5,
                                        "seconds_lost_max": 12.5}
    assert result["faults"]["lighthouse"]["skipped"] == 1 and result["jobs"]["single"] == 1


def test_each_broken_invariant_is_named_with_what_broke_it():
    jobs = [JobRecord("a", "ps", "Failed", restarts=3, checkpoints=[50, 100, 50], replica_faults=1)]
    faults = [Injected(10, "delete", "a", "a-worker-0", steps={"a": 60})]
    result = summarize(1, 60, faults, jobs, ["pods/a-ps-0"], 600.0, 512.0)
    broken = {name: inv["broken"] for name, inv in result["invariants"].items() if not inv["held"]}
    assert broken == {
        "every job Succeeded": ["a (ps) ended Failed"],
        "no checkpoint regressed": ["a: checkpoints [50, 100, 50]"],
        "restarts counted once per fault": ["a (ps): 3 restarts for 1 faults"],
        "no orphaned child": ["pods/a-ps-0"],
        "operator memory bounded": ["peak 600 MiB, limit 512 MiB"],
        "every fault recovered": ["delete at 10 s on a"],
    }
    assert not result["held"]
