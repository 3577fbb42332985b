"""The alert rules' logic over hours of series, in Prometheus's own rule engine (`promtool test rules`).

test_prometheus.py provokes each alert with real jobs, on a clock 30 times faster; here the rules as shipped
(charts/kubetrain/files/alerts.yaml, no duration scaled) meet the histories a live test cannot afford to wait
for: a job that never checkpoints, one that checkpoints every 10 minutes, one whose replica restarted in
place after its only checkpoint. The series follow the trainer's exposition: every replica exports its
checkpoint count and checkpoint-step gauge from its start, at 0 (kubetrain/trainer/metrics.py).
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

import pytest
import yaml
from catalogue import ALERTS, alert_rules
from helpers.process import require_program

LABELS = 'namespace="ml", job="{job}", role="single", replica="single-0"'
STEP = "kubetrain_training_step{%s}" % LABELS
CHECKPOINTS = "kubetrain_checkpoint_duration_seconds_count{%s}" % LABELS
CHECKPOINT_STEP = "kubetrain_last_checkpoint_step{%s}" % LABELS
STALE = "KubetrainCheckpointStale"


@dataclass(frozen=True)
class Case:
    name: str
    series: dict[str, str]
    """Series (with {job} for the job's name) and their values, one a minute from 0 (promtool's notation)."""
    silent_at: str | None
    """A time at which the alert must not fire."""
    firing_at: str | None
    """A time at which it must fire."""


CASES = [
    # Never checkpointed: the checkpoint-step gauge stays 0 (no change), the count 0. The rule's 30 minutes
    # run from the job's start (its step series 30 minutes back), then 5 minutes pending.
    Case("a job that never checkpoints fires 35 minutes after it started",
         {STEP: "0+10x90", CHECKPOINTS: "0x90", CHECKPOINT_STEP: "0x90"}, silent_at="34m", firing_at="36m"),
    # A checkpoint every 10 minutes: never 30 minutes without one.
    Case("a job that checkpoints every 10 minutes never fires",
         {STEP: "0+10x90", CHECKPOINTS: "0x9 1x9 2x9 3x9 4x9 5x9 6x9 7x9 8x9 9x9",
          CHECKPOINT_STEP: "0x9 90x9 190x9 290x9 390x9 490x9 590x9 690x9 790x9 890x9"},
         silent_at="89m", firing_at=None),
    # One checkpoint at 5 minutes, then the replica restarts in place at 20 minutes (the same target, so the
    # same series) and trains on without a checkpoint: its counter and gauge start again from 0. That fall
    # of the gauge is a change, not a checkpoint: 30 minutes after the checkpoint (35m) plus 5 pending, the
    # alert fires (read from the gauge's changes, it would wait until 55m).
    Case("a replica restarted after its only checkpoint fires 40 minutes after that checkpoint",
         {STEP: "0+10x19 50+10x70", CHECKPOINTS: "0x4 1x14 0x70", CHECKPOINT_STEP: "0x4 50x14 0x70"},
         silent_at="39m", firing_at="45m"),
]


def annotations(alert: str, labels: dict[str, str]) -> dict[str, str]:
    """The rule's annotations as Prometheus renders them for `labels` (promtool compares them whole)."""
    [rule] = [r for r in alert_rules() if r["alert"] == alert]
    rendered = {}
    for key, text in rule["annotations"].items():
        for name, value in labels.items():
            text = text.replace("{{ $labels.%s }}" % name, value)
        assert "{{" not in text, f"{alert}'s {key} uses more than $labels.{', $labels.'.join(labels)}: {text}"
        rendered[key] = text
    return rendered


def promtool_test(case: Case, job: str) -> dict:
    alerts = []
    if case.silent_at is not None:
        alerts.append({"eval_time": case.silent_at, "alertname": STALE, "exp_alerts": []})
    if case.firing_at is not None:
        alerts.append({"eval_time": case.firing_at, "alertname": STALE,
                       "exp_alerts": [{"exp_labels": {"namespace": "ml", "job": job, "severity": "warning"},
                                       "exp_annotations": annotations(STALE, {"namespace": "ml", "job": job})}]})
    series = [{"series": name.replace("{job}", job), "values": values} for name, values in case.series.items()]
    return {"rule_files": [str(ALERTS)], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": alerts}]}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_checkpoint_stale(case, tmp_path):
    promtool = require_program("promtool", "apt-get install -y --no-install-recommends prometheus (hack/deps)")
    path = tmp_path / "test.yaml"
    path.write_text(yaml.safe_dump(promtool_test(case, "j"), sort_keys=False))
    done = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{case.name}:\n{done.stdout}{done.stderr}"
    assert "SUCCESS" in done.stdout, done.stdout
