"""The replica context comes from the KUBETRAIN_* environment; events and results are plain JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kubetrain.trainer.context import ReplicaContext
from kubetrain.trainer.errors import ConfigError
from kubetrain.trainer.events import EventLog, write_result


def test_from_env_reads_every_variable(write_job, tmp_path: Path) -> None:
    ctx = ReplicaContext.from_env("worker", {
        "KUBETRAIN_JOB_FILE": str(write_job(name="digits")),
        "KUBETRAIN_JOB_NAME": "digits",
        "KUBETRAIN_NAMESPACE": "team-a",
        "KUBETRAIN_REPLICA": "worker-3",
        "KUBETRAIN_RUN_DIR": str(tmp_path / "run"),
        "KUBETRAIN_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
        "KUBETRAIN_METRICS_PORT": "9191",
        "KUBETRAIN_PS_ADDRS": "ps-0:50051,ps-1:50051",
        "KUBETRAIN_PS_PORT": "50051",
        "KUBETRAIN_JOB_TOKEN": "secret",
        "KUBETRAIN_FAULT": "kill@step=12",
    })
    assert (ctx.role, ctx.index, ctx.replica) == ("worker", 3, "worker-3")
    assert (ctx.namespace, ctx.job_name, ctx.spec.mode) == ("team-a", "digits", "Single")
    assert ctx.ps_addrs == ["ps-0:50051", "ps-1:50051"] and ctx.ps_port == 50051 and ctx.token == "secret"
    assert ctx.fault_step == 12 and ctx.metrics_port == 9191 and ctx.checkpoint_dir == tmp_path / "ckpt"
    assert ctx.fault_save is None  # kill@step: right after the step, not inside a save


def test_kill_at_save_arms_the_save_fault_not_the_step_fault(write_job) -> None:
    ctx = ReplicaContext.from_env("single", {"KUBETRAIN_JOB_FILE": str(write_job()), "KUBETRAIN_FAULT": "kill@save=30"})
    assert (ctx.fault_step, ctx.fault_save) == (None, 30)


def test_from_env_defaults(write_job) -> None:
    ctx = ReplicaContext.from_env("single", {"KUBETRAIN_JOB_FILE": str(write_job(name="digits"))})
    assert ctx.replica == "single-0" and ctx.fault_step is None and ctx.ps_addrs == []
    assert ctx.run_dir == Path("runs/digits") and ctx.checkpoint_dir == Path("runs/digits/checkpoints/single-0")
    assert ctx.metrics_port == 0  # the spec's metrics.port (0 in the test spec)


@pytest.mark.parametrize(
    "env, message",
    [
        ({"KUBETRAIN_REPLICA": "worker"}, "expected '<role>-<index>' such as 'worker-1', got 'worker'"),
        ({"KUBETRAIN_METRICS_PORT": "http"}, "KUBETRAIN_METRICS_PORT: expected an integer, got 'http'"),
        ({"KUBETRAIN_FAULT": "kill@40"}, "KUBETRAIN_FAULT: expected 'kill@step=N' or 'kill@save=N', got 'kill@40'"),
    ],
    ids=["replica without index", "port not a number", "fault without step="],
)
def test_bad_environment_is_a_config_error(write_job, env: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ReplicaContext.from_env("single", {"KUBETRAIN_JOB_FILE": str(write_job()), **env})


def test_events_are_json_lines_and_nan_becomes_null(tmp_path: Path) -> None:
    log = EventLog(tmp_path, "worker-0")
    log.write("eval", step=3, eval_accuracy=float("nan"))
    log.close()
    (record,) = [json.loads(line) for line in (tmp_path / "metrics" / "worker-0.jsonl").read_text().splitlines()]
    assert record["event"] == "eval" and record["replica"] == "worker-0" and record["eval_accuracy"] is None
    path = write_result(tmp_path, "worker-0", {"steps": 3, "eval_loss": float("inf")})
    assert json.loads(path.read_text()) == {"steps": 3, "eval_loss": None}
    assert sorted(p.name for p in path.parent.iterdir()) == ["worker-0.json"]


def test_termination_log_gets_the_headline_figures_and_leaves_out_unmeasured_ones(tmp_path: Path) -> None:
    message = tmp_path / "termination-log"
    write_result(tmp_path / "run", "worker-0", {"steps": 5, "global_step": 10, "eval_accuracy": float("nan"),
                                                "bytes_sent": 123, "comm_hook": {"powersgd": 1}},
                 termination_log=message)
    assert json.loads(message.read_text()) == {"steps": 5, "global_step": 10}


def test_termination_log_comes_from_the_environment(write_job) -> None:
    env = {"KUBETRAIN_JOB_FILE": str(write_job())}
    assert ReplicaContext.from_env("single", env).termination_log is None
    ctx = ReplicaContext.from_env("single", {**env, "KUBETRAIN_TERMINATION_LOG": "/dev/termination-log"})
    assert ctx.termination_log == Path("/dev/termination-log")


def test_a_scripts_reported_values_ride_in_the_termination_message_within_4_kib(tmp_path: Path) -> None:
    from kubetrain.trainer.events import TERMINATION_MESSAGE_BYTES, termination_message

    small = json.loads(termination_message({"steps": 9, "metrics": {"acc": 0.5, "bad": float("nan")}}))
    assert small == {"steps": 9, "metrics": {"acc": 0.5}}
    many = {f"a_rather_long_metric_name_number_{i:02d}": 0.123456789 * i for i in range(32)}
    text = termination_message({"steps": 9, "final_train_loss": 0.25, "metrics": {**many, "x" * 3000: 1.0}})
    assert len(text.encode()) <= TERMINATION_MESSAGE_BYTES
    doc = json.loads(text)
    # The headline figures always fit; reported values are dropped from the end until the rest does.
    assert doc["steps"] == 9 and doc["final_train_loss"] == 0.25
    assert 0 < len(doc["metrics"]) < 33 and "x" * 3000 not in doc["metrics"]


def test_a_fine_tune_s_perplexity_rides_in_the_termination_message() -> None:
    """The status's evalPerplexity comes from the chief's termination message at the end (a scrape is up to
    10 s old): it is one of its headline keys, beside the eval loss."""
    import json

    from kubetrain.trainer.events import termination_message

    said = json.loads(termination_message({"steps": 30, "eval_loss": 3.99, "eval_perplexity": 54.05,
                                           "baseline_eval_loss": 4.1, "rank": 0}))
    assert said == {"steps": 30, "eval_loss": 3.99, "eval_perplexity": 54.05}
