"""The pure parts of hack/bench-scale: metric parsing, rates, percentiles, ratios, targets."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load():
    loader = importlib.machinery.SourceFileLoader("bench_scale", str(ROOT / "hack/bench-scale"))
    spec = importlib.util.spec_from_loader("bench_scale", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


bs = _load()

SCRAPE_1 = """\
# HELP apiserver_request_total [STABLE] Counter of apiserver requests broken out for each verb, ...
# TYPE apiserver_request_total counter
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="pods",scope="namespace",subresource="",verb="LIST",version="v1"} 10
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="pods",scope="resource",subresource="status",verb="PATCH",version="v1"} 5
apiserver_request_total{code="201",component="apiserver",dry_run="",group="coordination.k8s.io",resource="leases",scope="resource",subresource="",verb="PUT",version="v1"} 1e+02
apiserver_request_total_other{verb="GET"} 999
apiserver_request_duration_seconds_bucket{verb="GET",le="0.005"} 7
"""

SCRAPE_2 = """\
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="pods",scope="namespace",subresource="",verb="LIST",version="v1"} 70
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="pods",scope="resource",subresource="status",verb="PATCH",version="v1"} 5
apiserver_request_total{code="201",component="apiserver",dry_run="",group="coordination.k8s.io",resource="leases",scope="resource",subresource="",verb="PUT",version="v1"} 160
apiserver_request_total{code="404",component="apiserver",dry_run="",group="",resource="pods",scope="resource",subresource="",verb="GET",version="v1"} 6
"""


def test_parse_counter_reads_only_the_named_metric():
    series = bs.parse_counter(SCRAPE_1, "apiserver_request_total")
    assert len(series) == 3
    assert sum(series.values()) == 115
    (labels,) = [k for k in series if dict(k)["verb"] == "PATCH"]
    assert dict(labels)["subresource"] == "status"


def test_parse_counter_handles_escaped_quotes_and_no_labels():
    text = 'm{a="x\\"y",b="z"} 3\nm 4\nm{a="q"} NaN_not_a_number\n'
    series = bs.parse_counter(text, "m")
    assert series[(("a", 'x\\"y'), ("b", "z"))] == 3
    assert series[()] == 4
    assert len(series) == 2


def test_request_rate_sums_every_series_and_counts_new_ones_from_zero():
    before = bs.parse_counter(SCRAPE_1, "apiserver_request_total")
    after = bs.parse_counter(SCRAPE_2, "apiserver_request_total")
    # LIST pods +60, PATCH +0, PUT leases +60, a new GET series +6 over 60 s
    assert bs.request_rate(before, after, 60.0) == pytest.approx(126 / 60)


def test_request_rate_treats_a_counter_that_went_down_as_reset():
    before = {(("verb", "GET"),): 100.0}
    after = {(("verb", "GET"),): 30.0}
    assert bs.request_rate(before, after, 10.0) == pytest.approx(3.0)


def test_request_rate_refuses_an_empty_window():
    with pytest.raises(ValueError):
        bs.request_rate({}, {}, 0)


def test_rate_by_request_kind():
    before = bs.parse_counter(SCRAPE_1, "apiserver_request_total")
    after = bs.parse_counter(SCRAPE_2, "apiserver_request_total")
    by = bs.rate_by(before, after, 60.0)
    assert by["LIST pods"] == pytest.approx(1.0)
    assert by["PUT leases"] == pytest.approx(1.0)
    assert by["PATCH pods/status"] == 0
    assert by["GET pods"] == pytest.approx(0.1)


def test_operator_rate_is_the_difference_of_two_windows():
    base = bs.request_rate({(): 0.0}, {(): 192.0}, 60.0)  # 3.2/s without the operator
    with_op = bs.request_rate({(): 1000.0}, {(): 1000.0 + 60 * 45.6}, 60.0)
    assert with_op - base == pytest.approx(42.4)


@pytest.mark.parametrize(
    "values, q, expected",
    [
        ([0.3], 0.95, 0.3),
        (list(range(1, 21)), 0.95, 19),  # ceil(0.95 * 20) = 19th value
        (list(range(1, 41)), 0.95, 38),
        (list(range(1, 41)), 0.5, 20),
        ([5, 1, 4, 2, 3], 0.95, 5),
        ([5, 1, 4, 2, 3], 1.0, 5),
        ([5, 1, 4, 2, 3], 0.2, 1),
    ],
)
def test_nearest_rank(values, q, expected):
    assert bs.nearest_rank(values, q) == expected


def test_nearest_rank_refuses_nonsense():
    with pytest.raises(ValueError):
        bs.nearest_rank([], 0.95)
    with pytest.raises(ValueError):
        bs.nearest_rank([1.0], 0)


def test_ratio():
    assert bs.ratio(59.6, 179.5) == pytest.approx(0.332)
    assert bs.ratio(None, 1.0) is None
    assert bs.ratio(1.0, None) is None
    assert bs.ratio(1.0, 0.0) is None
    assert bs.ratio(1.0, 0.02, floor=0.05) is None  # a ratio to noise is no figure


def test_pod_names():
    assert bs.job_of("scale-0012-worker-7") == "scale-0012"
    assert bs.job_of("scale-0012-master-0") == "scale-0012"
    assert bs.job_of("scale-0012-ps-0") == "scale-0012"
    assert bs.job_of("scale-0012-launcher") is None
    assert bs.job_of("other-pod") is None
    assert bs.is_chief("scale-0001-ps-0") and bs.is_chief("scale-0001-master-0")
    assert not bs.is_chief("scale-0001-worker-0")


def test_never_reconciled_needs_pods_and_a_status():
    jobs = {"scale-0000": True, "scale-0001": False, "scale-0002": True}
    pods = {"scale-0000": 3, "scale-0001": 3}
    assert bs.never_reconciled(jobs, pods) == ["scale-0001", "scale-0002"]


def test_targets_running_are_issue_33s_aims():
    results = {"kubetrain": {"jobs": 1000, "replacement_seconds": {"p50": 0.25, "p95": 0.9}}, "kubeflow": {}}
    ratios = {"all_pods_running_seconds": 0.4, "replacement_p95_seconds": 1.2, "quiet_api_requests_per_second": 0.5,
              "operator_peak_rss_mb": 0.9}
    out = bs.targets("running", results, ratios)
    assert out["all_pods_running_vs_kubeflow"]["met"] is False  # 0.4 > 0.35
    assert out["replacement_p50_seconds"]["met"] is True
    assert out["replacement_p95_vs_kubeflow"]["met"] is False
    assert out["quiet_api_requests_vs_kubeflow"]["met"] is True
    assert out["operator_peak_rss_vs_kubeflow"]["met"] is True
    assert "jobs_never_reconciled" not in out  # the 5,000-job aims only at 5,000


def test_targets_at_five_thousand_jobs_add_the_absolute_aims():
    kt = {"jobs": 5000, "replacement_seconds": {"p50": 0.4, "p95": 1.5}, "operator_peak_rss_mb": 550.0,
          "jobs_never_reconciled": {"count": 0}}
    out = bs.targets("running", {"kubetrain": kt}, {})
    assert out["replacement_p50_seconds"]["met"] is False
    assert out["replacement_p95_seconds"]["met"] is False
    assert out["operator_peak_rss_mb"]["met"] is True
    assert out["jobs_never_reconciled"]["met"] is True
    assert out["all_pods_running_vs_kubeflow"]["met"] is None  # no Kubeflow run: not measured


def test_targets_finished():
    kt = {"all_pods_running_seconds": None, "jobs_never_reconciled": {"count": 88},
          "api_requests_per_second": {"operator": 0.4}}
    out = bs.targets("finished", {"kubetrain": kt}, {})
    assert out["every_pod_running"]["met"] is False
    assert out["jobs_never_reconciled"]["met"] is False
    assert out["quiet_minute_api_rate"]["met"] is True
    assert bs.targets("finished", {"kubeflow": {}}, {}) == {}


def test_pod_status_is_what_a_kubelet_reports():
    body = bs.pod_status("pytorch", "busybox", "Succeeded", 0, "Completed")["status"]
    assert body["phase"] == "Succeeded"
    (cs,) = body["containerStatuses"]
    assert cs["name"] == "pytorch" and cs["state"]["terminated"]["exitCode"] == 0


def test_request_rate_can_leave_out_leases():
    before = bs.parse_counter(SCRAPE_1, "apiserver_request_total")
    after = bs.parse_counter(SCRAPE_2, "apiserver_request_total")
    assert bs.request_rate(before, after, 60.0, exclude_resources=("leases",)) == pytest.approx(66 / 60)


def test_request_rate_of_writes_only():
    before = bs.parse_counter(SCRAPE_1, "apiserver_request_total")
    after = bs.parse_counter(SCRAPE_2, "apiserver_request_total")
    # of LIST +60, PATCH +0, PUT leases +60, GET +6: the writes are PATCH and PUT
    assert bs.request_rate(before, after, 60.0, verbs=bs.WRITE_VERBS) == pytest.approx(1.0)
    assert bs.request_rate(before, after, 60.0, exclude_resources=("leases",), verbs=bs.WRITE_VERBS) == 0


def test_request_rate_leaves_out_a_subresource_only():
    before = {(("resource", "nodes"), ("subresource", "status"), ("verb", "PATCH")): 0.0,
              (("resource", "nodes"), ("subresource", ""), ("verb", "GET")): 0.0}
    after = {(("resource", "nodes"), ("subresource", "status"), ("verb", "PATCH")): 50.0,
             (("resource", "nodes"), ("subresource", ""), ("verb", "GET")): 10.0}
    assert bs.request_rate(before, after, 10.0, exclude_resources=bs.HEARTBEATS) == pytest.approx(1.0)


def test_round_costs_from_the_operators_own_metrics():
    text = "\n".join([
        "# TYPE kubetrain_operator_reconcile_duration_seconds histogram",
        'kubetrain_operator_reconcile_duration_seconds_bucket{le="0.1"} 3.0',
        "kubetrain_operator_reconcile_duration_seconds_count 4.0",
        "kubetrain_operator_reconcile_duration_seconds_sum 0.2",
        'kubetrain_operator_api_requests_total{verb="POST",resource="pods"} 6.0',
        'kubetrain_operator_api_requests_total{verb="PATCH",resource="trainingjobs/status"} 2.0',
        'kubetrain_operator_workqueue_wait_seconds_count{lane="urgent"} 2.0',
        'kubetrain_operator_workqueue_wait_seconds_sum{lane="urgent"} 0.01',
        'kubetrain_operator_workqueue_wait_seconds_count{lane="routine"} 0.0',
        'kubetrain_operator_workqueue_wait_seconds_sum{lane="routine"} 0.0',
    ])
    out = bs.round_costs(text)
    assert out["rounds"] == 4 and out["mean_round_seconds"] == 0.05
    assert out["api_requests_per_round"] == {"POST pods": 1.5, "PATCH trainingjobs/status": 0.5}
    assert out["mean_queue_wait_seconds_by_lane"] == {"urgent": 0.005}
    assert bs.round_costs("") == {}
