"""A replica that dies while a burst of new jobs is queued is replaced first (the work queue's urgent lane).

One `kubetrain operator` with a single routine worker (`--workers 1`) beside
its urgent-only one, so that a burst of jobs created at once is worked through
one at a time and is still queued when a running job's pod fails: the failure
must be handled (the operator logs "restarting it") while burst jobs are still
waiting for their first round, not after the whole burst. Without the urgent
lane the failed job's round queues behind every burst job (the test then finds
no burst job left). The queue's own metric says which lane the round came from.
"""

from __future__ import annotations

import re
import uuid

import pytest
import yaml

from helpers.metrics import scrape
from test_lifecycle import manifest, running_pods
from test_tenants import shared_claim

pytestmark = pytest.mark.cluster

BURST = 120  # jobs created in one `kubectl create`; one routine worker takes seconds to make them all


@pytest.fixture
def namespace(cluster):
    ns = f"prio-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    yield ns
    cluster.kubectl("delete", "namespace", ns, "--wait=false")


def test_a_failed_replica_is_handled_before_a_queued_burst_of_new_jobs(spawn_operator, cluster, namespace):
    proc = spawn_operator(namespace, "--workers", "1", "--no-scrape")
    op = proc.handle(cluster, namespace)
    # One bound claim for every job: a claim of its own each would outnumber the session's volumes, and
    # pods waiting for one are unschedulable: their retries fill the scheduler's queue of status writes
    # for a minute and more, and the next test's pods waited behind them.
    storage = shared_claim(op)
    victim = manifest("Single", "victim", checkpoint=storage)
    op.apply(victim)
    [pod] = running_pods(op, "victim", 1)

    burst = [manifest("Single", f"burst-{i:03d}", checkpoint=storage) for i in range(BURST)]
    op.kube.run("create", "-f", "-", input=yaml.safe_dump_all(burst, sort_keys=False), timeout=120)
    op.set_pod_status(pod, "Failed", exit_code=137)
    op.wait("the victim's failure handled", lambda: "victim: single-0 failed" in proc.log.read_text(), timeout=120)
    op.wait("every burst job's pod", lambda: len(re.findall(r"burst-\d+: created pod", proc.log.read_text())) >= BURST,
            timeout=600)

    lines = proc.log.read_text().splitlines()
    handled = next(i for i, line in enumerate(lines) if "victim: single-0 failed" in line)
    after = {m.group(1) for line in lines[handled:] if (m := re.search(r"(burst-\d+): created pod", line))}
    # Burst jobs still waiting for their first round when the failure was handled: it jumped the queue.
    assert len(after) >= BURST // 4, f"only {len(after)} of {BURST} burst jobs were made after the failure was handled"
    exposition = scrape(f"127.0.0.1:{proc.metrics_port}")
    urgent = re.search(r'kubetrain_operator_workqueue_wait_seconds_count\{lane="urgent"\} (\S+)', exposition)
    assert urgent and float(urgent.group(1)) >= 1, exposition
    print(f"\nthe failure was handled with {len(after)} of {BURST} burst jobs still to be made")
