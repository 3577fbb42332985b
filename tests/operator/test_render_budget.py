"""drivers/cluster/budget.py: the bytes of pods every round together may render, tested past its edges."""

from __future__ import annotations

import threading

from kubetrain.api.load import from_spec_dict
from kubetrain.drivers.cluster.budget import OWN_POD_BYTES, RenderBudget, render_weight, template_bytes


def test_rounds_together_never_hold_more_than_the_budget():
    budget = RenderBudget(total=100)
    inside, most, lock = [0], [0], threading.Lock()
    go = threading.Barrier(12)

    def round_(weight: int) -> None:
        go.wait()
        for _ in range(50):
            with budget.hold(weight):
                with lock:
                    inside[0] += weight
                    most[0] = max(most[0], inside[0])
                with lock:
                    inside[0] -= weight

    threads = [threading.Thread(target=round_, args=(w,)) for w in (30, 30, 30, 40, 40, 40, 60, 60, 70, 70, 10, 10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert most[0] <= 100 and budget.peak_held <= 100, (most, budget.peak_held)
    assert budget.free == 100  # every hold gave its share back


def test_a_weight_past_the_budget_takes_all_of_it_and_zero_never_waits():
    budget = RenderBudget(total=100)
    with budget.hold(10**9):  # one job larger than the budget still runs, alone
        assert budget.free == 0
        done = threading.Event()
        threading.Thread(target=lambda: (budget.hold(0).__enter__(), done.set())).start()
        assert done.wait(5)  # a round that renders nothing does not wait for it
        blocked = threading.Event()

        def small() -> None:
            with budget.hold(1):
                blocked.set()

        t = threading.Thread(target=small)
        t.start()
        assert not blocked.wait(0.2)  # one byte more waits for the whole budget back
    t.join(5)
    assert blocked.is_set() and budget.free == 100


def test_a_round_weighs_the_pods_its_job_lacks():
    spec = {"mode": "ParameterServer", "parameterServer": {"replicas": 2, "workers": 8},
            "podTemplate": {"metadata": {"labels": {"team": "a"}}}}
    job = from_spec_dict("j", spec, "ns")
    each = template_bytes(job) + OWN_POD_BYTES
    assert template_bytes(job) == len('{"metadata":{"labels":{"team":"a"}}}')
    assert render_weight(job, 0) == 10 * each
    assert render_weight(job, 9) == each
    assert render_weight(job, 10) == render_weight(job, 12) == 0  # running (or more pods seen): nothing
