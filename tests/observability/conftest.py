"""A real Prometheus on loopback scraping three real `kubetrain run` jobs (Single, with its data and checkpoints
in the session's S3 server; ParameterServer; fault-tolerant DDP).

Started once for test_prometheus.py (module scope, so that its busy jobs do
not slow down the tests after it), which checks the replicas' exposition
against the catalogue, queries the dashboards and waits for the alerts. Prometheus finds the replicas through the
`targets.json` each run directory carries (file_sd), so the ports the local
backend picks at start need no guessing.
"""

from __future__ import annotations

import contextlib

import pytest
from helpers.jsonl import read_events
from helpers.metrics import try_scrape
from helpers.process import require_program
from helpers.prometheus import start_prometheus
from helpers.wait import wait_for
from live import FT, PS, SINGLE, LiveRun, Observed, jobs, prometheus_config, start_run
from objstorelib import put_digits


@pytest.fixture(scope="module")
def observed(tmp_path_factory, s3) -> Observed:
    require_program("prometheus", "apt-get install -y --no-install-recommends prometheus (hack/deps)")
    root = tmp_path_factory.mktemp("observed")
    bucket = s3.bucket("obs")
    docs = jobs(put_digits(s3.store(), bucket), f"s3://{bucket}/obs-single/")
    run_dirs = {name: root / "runs" / name for name in docs}
    for path in run_dirs.values():
        path.mkdir(parents=True)  # file_sd watches these directories from the start
    # Every part is stopped, last started first, even when stopping another one failed.
    with contextlib.ExitStack() as stack:
        config = prometheus_config(root, run_dirs)
        prom = start_prometheus("prometheus", config, root)
        stack.callback(prom.stop)
        runs: dict[str, LiveRun] = {}
        # The first attempt of single-0 dies by SIGKILL at step 100 (~13 s: the jobs are slowed, live.py), before
        # the tests begin: the restarts of the alert test begin.
        replicas = {SINGLE: ["single-0"], PS: ["ps-0", "worker-0", "worker-1"]}
        runs[SINGLE] = start_run(root, SINGLE, docs[SINGLE], replicas[SINGLE], ["--fault", "single-0:kill@step=100"],
                                 environ=s3.env)
        stack.callback(runs[SINGLE].stop)
        # Below single-0's priority, so that its restarts are not slowed down by three busy PS processes.
        runs[PS] = start_run(root, PS, docs[PS], replicas[PS], [], nice=10)
        stack.callback(runs[PS].stop)
        replicas[FT] = ["ddp-0", "ddp-1", "lighthouse-0"]
        runs[FT] = start_run(root, FT, docs[FT], replicas[FT], ["--fault", "ddp-1:kill@step=100"], nice=10)
        stack.callback(runs[FT].stop)

        wanted = {(job, r) for job, rs in replicas.items() for r in rs}

        def missing() -> set[tuple[str, str]]:
            seen = prom.query("count_over_time(kubetrain_training_step[30s]) > 3")
            return wanted - {(s["metric"]["job"], s["metric"]["replica"]) for s in seen}

        def all_training():
            for run in runs.values():
                assert run.popen.poll() is None, f"{run.name} ended early:\n{run.log.read_text()[-3000:]}"
            return not missing()

        # 300 s: seven processes that import torch start beside the e2e lane's tests on 2 cores (120 s was
        # once too few in CI); the wait ends as soon as each replica is scraped, and says which were not.
        wait_for("every replica to be scraped while training", all_training, timeout=300,
                 explain=lambda: f"not scraped while training: {sorted(missing())}")
        # The faults above have had their effect before the first test (the jobs are slowed, live.py, so they
        # come seconds in): single-0 trains again after a restart, and obs-ft's new ddp-1 healed from ddp-0
        # (the dashboards' restart and heal panels have data; every job is listed).
        def since_restart(name: str, replica: str) -> list[str]:
            """The kinds of the replica's events in its second attempt ([] before it began)."""
            kinds = [e["event"] for e in read_events(runs[name].run_dir / "metrics" / f"{replica}.jsonl")]
            starts = [i for i, kind in enumerate(kinds) if kind == "start"]
            return kinds[starts[1]:] if len(starts) > 1 else []

        # (Single logs no `train` event at this pace: its second attempt's resume or first eval.)
        wait_for("single-0 to run again after its fault", lambda: len(since_restart(SINGLE, "single-0")) > 1,
                 timeout=180)
        wait_for("obs-ft's new ddp-1 to heal", lambda: "heal" in since_restart(FT, "ddp-1"), timeout=180)
        observed = Observed(prom, runs)
        for run in runs.values():
            for target in run.targets():
                replica = target["labels"]["replica"]
                # A replica between two attempts (single-0 after its fault) refuses for a moment.
                observed.expositions[f"{run.name}/{replica}"] = wait_for(
                    f"{run.name}/{replica} to serve /metrics", lambda: try_scrape(target["targets"][0]), timeout=60
                )
        yield observed
