"""The report of a job read through its status and Prometheus (report/from_cluster.py), with real parts: a real
Prometheus scraping a real local run's replicas, the job read through the client's local backend (a cluster
job goes through its cluster backend the same way: tests/e2e/test_e2e_client.py)."""

from __future__ import annotations

import json
import os
import re
import signal

import pytest
import yaml

import kubetrain
from helpers.process import require_program
from helpers.prometheus import start_prometheus
from helpers.wait import wait_for
from kubetrain.reports import build_report
from kubetrain.reports.from_cluster import cluster_run, counter_total
from kubetrain.shared.launch import SLOWDOWN_VAR
from live import run_scrape_config
from support import EXAMPLES

NAME = "promjob"
SLOWDOWN_FACTOR = 20


def test_a_counter_is_totalled_across_its_resets():
    assert counter_total([(1, 5.0), (2, 9.0), (3, 2.0), (4, 6.0)]) == 9.0 + 6.0
    assert counter_total([]) == 0.0


@pytest.mark.slow
def test_the_report_of_a_job_from_prometheus_has_its_status_figures_and_its_curves(tmp_path, monkeypatch):
    require_program("prometheus", "apt-get install -y --no-install-recommends prometheus (hack/deps)")
    runs = tmp_path / "runs"
    (runs / NAME).mkdir(parents=True)
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [run_scrape_config(NAME, runs / NAME)]}))
    prom = start_prometheus("prometheus", config, tmp_path)
    try:
        doc = yaml.safe_load((EXAMPLES / "single.yaml").read_text())
        doc["metadata"]["name"] = NAME
        # Some seconds of steps at 1 s scrapes, and a restart among them, whatever the machine's speed: the
        # straggler knob makes the replica sleep 19 times each step's compute (~30 steps a second here).
        monkeypatch.setenv(SLOWDOWN_VAR, f"single-0:{SLOWDOWN_FACTOR}")
        doc["spec"]["training"]["epochs"] = 20
        client = kubetrain.Client(local=True, runs_dir=runs)
        client.create(doc)
        # SIGKILL the replica once, after a few scrapes and its first checkpoint (step 50): the report shows
        # the restart, and the steps go back once, to the checkpoint's.
        wait_for("the job's first scrapes past its first checkpoint",
                 lambda: prom.query(f'kubetrain_training_step{{job="{NAME}"}} > 60'), timeout=120)
        log = runs / NAME / "logs" / "single-0.log"
        pid = int(re.search(r'"milestone": "process".*?"pid": (\d+)', log.read_text()).group(1))
        os.kill(pid, signal.SIGKILL)
        job = client.wait(NAME, timeout=600, progress=False)
        assert job.state == "Succeeded"
        run = cluster_run(client.backend, NAME, prom.url)
        report = build_report([run], tmp_path / "report")
    finally:
        prom.stop()
    figures = json.loads((tmp_path / "report" / "report.json").read_text())["runs"][0]["summary"]
    # The figures are the job's status.
    assert figures["steps"] == job.progress.step and figures["final_train_loss"] == job.progress.loss
    assert figures["eval_accuracy"] == job.progress.eval_accuracy
    assert figures["restarts"] == job.restarts and figures["state"] == "Succeeded"
    # The curves are Prometheus's: the chief's steps in order but where the restart took them back to the
    # checkpoint, its loss falling, samples counted.
    train = [e for e in run.events["single-0"] if e["event"] == "train"]
    steps = [e["step"] for e in train]
    back = [i for i in range(1, len(steps)) if steps[i] < steps[i - 1]]
    assert len(train) >= 3 and len(back) <= job.restarts and all(steps[i] >= 50 for i in back), steps
    # A scrape before the first step, or of a replica just restarted before its first step, has a step and
    # no loss yet (the gauge is NaN until a step sets it): that event carries none.
    losses = [e["loss"] for e in train if "loss" in e]
    assert train[-1]["step"] <= job.progress.step and len(losses) >= 3 and losses[0] > losses[-1]
    assert run.sample_points() and any(e["event"] == "eval" for e in run.events["single-0"])
    for plot in ("loss.png", "accuracy.png", "throughput.png"):
        assert (tmp_path / "report" / plot).stat().st_size > 10_000
    assert "| steps | " + str(job.progress.step) in report.read_text()
    assert job.restarts == 1 and [r.replica for r in run.recoveries] == ["single-0"]
    assert run.recoveries[0].reason == "Killed" and run.recoveries[0].recovery_seconds is not None
