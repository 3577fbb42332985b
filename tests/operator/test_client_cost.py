"""What the client costs the API server: a `list()` of 1,000 jobs, and `wait` in requests per second.

Figures, not timed assertions (the machine is shared): what is asserted is the number of requests, which the
design fixes (a paged list, one watch per WATCH_SECONDS); seconds, bytes and memory are printed
(`-s`, or the report's captured output) and recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import time
import tracemalloc
import uuid

import pytest
import yaml

import kubetrain
from kubetrain.client import WaitTimeout
from kubetrain.client.cluster_backend import LIST_PAGE, WATCH_SECONDS
from support import EXAMPLES
from test_client import Counting, api_client

pytestmark = pytest.mark.cluster

JOBS = 1000


def test_a_list_of_1000_jobs_is_two_pages(cluster, crd):
    namespace = f"cost-{uuid.uuid4().hex[:6]}"  # no operator watches it: the jobs stay as created
    cluster.kubectl("create", "namespace", namespace)
    try:
        doc = yaml.safe_load((EXAMPLES / "parameter-server.yaml").read_text())
        api = api_client(cluster)
        client = kubetrain.Client(namespace=namespace, api_client=api)
        started = time.monotonic()
        for i in range(JOBS):
            doc["metadata"]["name"] = f"job-{i:04d}"
            client.create(doc)
        created = time.monotonic() - started
        sizes: list[int] = []  # the bytes of each response: one entry a request
        real = api.call_api

        def sized(*args, **kwargs):
            resp = real(*args, **kwargs)
            sizes.append(len(getattr(resp, "response", resp).data or b""))  # RESTResponse wraps urllib3's
            return resp

        api.call_api = sized
        tracemalloc.start()
        started = time.monotonic()
        jobs = client.list()
        seconds = time.monotonic() - started
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert len(jobs) == JOBS and {j.mode for j in jobs} == {"ParameterServer"}
        assert len(sizes) == -(-JOBS // LIST_PAGE) == 2  # pages of LIST_PAGE
        figure = {"jobs": JOBS, "requests": len(sizes), "seconds": round(seconds, 3), "bytes": sum(sizes),
                  "python_peak_bytes": peak, "create_seconds_each": round(created / JOBS, 4)}
        print("client list cost:", json.dumps(figure))
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=false")


def test_wait_makes_one_request_per_watch_period(operator, cluster):
    """A job that runs (and whose status the operator rewrites) for a while: wait() holds one watch."""
    doc = yaml.safe_load((EXAMPLES / "single.yaml").read_text())
    doc["metadata"]["name"] = f"cost-{uuid.uuid4().hex[:5]}"
    api = api_client(cluster)
    client = kubetrain.Client(namespace=operator.namespace, api_client=api)
    name = client.create(doc).name
    client.wait(name, until="Running", timeout=60, progress=False)
    counting = Counting(api)
    seconds = 20
    started = time.monotonic()
    with pytest.raises(WaitTimeout):
        client.wait(name, timeout=seconds, progress=False)
    elapsed = time.monotonic() - started
    assert len(counting.calls) == 2, counting.calls  # the list, then one watch (WATCH_SECONDS > 20 s)
    assert WATCH_SECONDS >= 60
    print("client wait cost:", json.dumps({"seconds": round(elapsed, 1), "requests": len(counting.calls),
                                           "steady_requests_per_second": round(1 / WATCH_SECONDS, 4)}))
