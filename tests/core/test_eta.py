"""The ETA: steps left at the recent steps per second, computed by the engine for both drivers."""

import math

import pytest

from kubetrain.shared.timestamps import iso
from kubetrain.engine import eta
from kubetrain.engine.reconcile import PodObservation as Pod
from kubetrain.engine.engine import ProgressReading
from kubetrain.engine.reconcile import reconcile
from kubetrain.api.status import to_dict
from test_reconcile import T0, job


def test_the_first_reading_sets_the_rate_and_later_ones_move_it_by_their_time_weight():
    rate = eta.steps_per_second(None, 50, 5.0)
    assert rate == 10.0
    slower = eta.steps_per_second(rate, 25, 5.0)  # 5 steps/s for 5 s
    weight = 1 - math.exp(-5.0 / eta.RATE_SECONDS)
    assert slower == pytest.approx(10.0 + weight * (5.0 - 10.0))
    assert 9.5 < slower < 10.0  # one slow scrape does not swing it
    long_slow = eta.steps_per_second(rate, 5 * 600, 600.0)  # ten minutes at 5 steps/s: the new pace
    assert long_slow == pytest.approx(5.0, abs=0.01)


@pytest.mark.parametrize("steps, seconds", [(0, 5.0), (-3, 5.0), (10, 0.0)])
def test_no_progress_or_no_time_leaves_the_rate(steps, seconds):
    assert eta.steps_per_second(4.0, steps, seconds) == 4.0
    assert eta.steps_per_second(None, steps, seconds) is None


@pytest.mark.parametrize("step, total, rate, expected", [
    (100, 1000, 10.0, 90), (1000, 1000, 10.0, 0), (1200, 1000, 10.0, 0),
    (100, None, 10.0, None), (100, 1000, None, None), (100, 1000, 0.0, None), (100, 1000, math.nan, None),
])
def test_eta_seconds(step, total, rate, expected):
    assert eta.eta_seconds(step, total, rate) == expected


@pytest.mark.parametrize("seconds, text", [(None, "--:--"), (math.nan, "--:--"), (-1, "--:--"), (0, "00:00"),
                                           (75, "01:15"), (3725, "1:02:05")])
def test_format_eta(seconds, text):
    assert eta.format_eta(seconds) == text


def test_the_engine_writes_the_eta_into_the_status_from_the_steps_it_reads():
    j = job("Single")
    status = {"state": "Running", "startTime": iso(T0)}
    pods = {"single-0": Pod("single-0", "Running")}
    first = reconcile(j, "u", "t", pods, status, T0 + 5, ProgressReading(step=10, total_steps=1010))
    assert "etaSeconds" not in to_dict(first.status)["progress"]  # one reading is no rate yet
    second = reconcile(j, "u", "t", pods, first.status, T0 + 10, ProgressReading(step=60, total_steps=1010))
    assert to_dict(second.status)["progress"]["etaSeconds"] == 95  # 950 steps left at 10 steps/s
    assert to_dict(second.status)["memory"]["stepsPerSecond"] == 10.0
    # No new step: the status is not rewritten (the ETA of the last step stands).
    same = reconcile(j, "u", "t", pods, second.status, T0 + 12, ProgressReading(step=60, total_steps=1010))
    assert to_dict(same.status)["progress"] == to_dict(second.status)["progress"]
    done = {"single-0": Pod("single-0", "Succeeded", exit_code=0)}
    end = reconcile(j, "u", "t", done, second.status, T0 + 20, ProgressReading(step=1010, total_steps=1010))
    assert to_dict(end.status)["state"] == "Succeeded" and to_dict(end.status)["progress"]["etaSeconds"] == 0
    failed = reconcile(j, "u", "t", {"single-0": Pod("single-0", "Failed", exit_code=2)}, second.status, T0 + 20,
                       ProgressReading(step=60, total_steps=1010))
    assert to_dict(failed.status)["state"] == "Failed" and "etaSeconds" not in to_dict(failed.status)["progress"]
