"""The pieces of `kubetrain bench modes`: the straggler knob's parsing, the variants, time to accuracy from JSONL."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from kubetrain.api import from_object
from kubetrain.shared.launch import SLOWDOWN_VAR
from kubetrain.bench.modes import (
    CNN_ARGS,
    KEEP_ALL,
    MAX_EPOCHS,
    bench_modes,
    checkpoint_times,
    mode_variants,
    read_events,
    time_to_accuracy,
    training_span,
)
from kubetrain.trainer.errors import ConfigError
from kubetrain.trainer.testhooks import MAX_FACTOR, Slowdown, parse_slowdown

from support import kubetrain

# --- the straggler knob ------------------------------------------------------------------


def test_slowdown_names_replicas_with_their_factors():
    assert parse_slowdown("worker-1:3") == {"worker-1": 3.0}
    assert parse_slowdown("worker-1:3, ddp-0:1.5,") == {"worker-1": 3.0, "ddp-0": 1.5}
    assert parse_slowdown("") == {}


@pytest.mark.parametrize("value", ["worker1:3", "worker-1", "worker-1:x", "worker-1:-2", "Worker-1:3", "worker-1:3:4"])
def test_a_malformed_slowdown_is_refused_naming_the_variable_and_value(value):
    with pytest.raises(ConfigError, match=rf"^{SLOWDOWN_VAR}: expected REPLICA:FACTOR.*{value!r}") as err:
        parse_slowdown(value)
    assert err.value.exit_code == 2


@pytest.mark.parametrize("factor", ["0.5", "0", f"{MAX_FACTOR + 0.01:g}", "1000"])
def test_a_factor_outside_one_to_the_maximum_is_refused(factor):
    with pytest.raises(ConfigError, match=rf"^{SLOWDOWN_VAR}: the factor of worker-1 must be between 1 and 100, "
                                          rf"got {factor}"):
        parse_slowdown(f"worker-1:{factor}")


def test_the_factor_at_the_edges_is_taken():
    assert parse_slowdown(f"worker-1:{MAX_FACTOR:g}") == {"worker-1": MAX_FACTOR}
    assert parse_slowdown("worker-1:1") == {"worker-1": 1.0}


def test_a_replica_named_twice_is_refused():
    with pytest.raises(ConfigError, match=f"{SLOWDOWN_VAR}: worker-1 is named twice"):
        parse_slowdown("worker-1:2,worker-1:3")


def _spin(seconds: float) -> None:
    """Burn CPU in this thread for about `seconds` of CPU time."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


def test_only_the_named_replica_is_slowed_by_its_own_compute_time():
    env = {SLOWDOWN_VAR: "worker-1:3"}
    assert Slowdown.for_replica("worker-0", env).factor == 1.0
    assert Slowdown.for_replica("worker-1", env).factor == 3.0
    assert Slowdown.for_replica("worker-1", {}).factor == 1.0
    slowed = Slowdown.for_replica("worker-1", env)
    slowed.begin()
    _spin(0.05)
    started = time.perf_counter()
    slowed.after()
    assert time.perf_counter() - started >= 0.1  # (3 - 1) x 0.05 s of CPU; a sleep is never shorter
    other = Slowdown.for_replica("worker-0", env)
    other.begin()
    _spin(0.05)
    started = time.perf_counter()
    other.after()
    assert time.perf_counter() - started < 0.05


def test_waiting_is_not_compute_and_is_not_stretched():
    # A DDP rank blocked on its peer, or a process waiting for a core: wall time, no CPU time.
    slowed = Slowdown(100.0)
    slowed.begin()
    time.sleep(0.1)
    started = time.perf_counter()
    slowed.after()
    assert time.perf_counter() - started < 1.0  # 99 x 0.1 s would be 9.9 s


def test_a_replica_started_with_a_bad_slowdown_exits_2_with_one_line(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(
        {"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "slow"},
         "spec": {"mode": "Single", "training": {"maxSteps": 1}}}))
    env = {"KUBETRAIN_JOB_FILE": str(job), "KUBETRAIN_RUN_DIR": str(tmp_path / "run"), "KUBETRAIN_METRICS_PORT": "0",
           SLOWDOWN_VAR: "single-0:fast", "PYTHONSAFEPATH": "1"}
    done = subprocess.run([sys.executable, "-m", "kubetrain.trainer", "single"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"{SLOWDOWN_VAR}: expected REPLICA:FACTOR" in done.stderr
    assert "'single-0:fast'" in done.stderr and "Traceback" not in done.stderr


# --- the variants ----------------------------------------------------------------------


def _samples(doc: dict) -> int:
    spec = doc["spec"]
    replicas = 2 if spec["mode"] == "DDP" else 1
    return spec["training"]["maxSteps"] * spec["training"]["batchSize"] * replicas


@pytest.mark.parametrize("case", ["small", "cnn", "straggler"])
def test_every_mode_of_a_case_trains_the_same_samples_of_the_same_model(case):
    variants = mode_variants(case, epochs=5, batch=64, steps_per_epoch=23)
    assert list(variants) == ["Single", "PS-Sync", "PS-Async", "DDP"]
    for v in variants.values():
        from_object(v.doc)  # a valid manifest
        assert v.doc["spec"]["checkpoint"]["keepLast"] == KEEP_ALL
    # PS Sync's step is both workers' batches; PS Async's is one worker's push.
    assert {_samples(v.doc) * (2 if label == "PS-Sync" else 1) for label, v in variants.items()} == {5 * 23 * 64}
    models = {json.dumps(v.doc["spec"]["model"], sort_keys=True) for v in variants.values()}
    expected = {"name": "mlp", "args": {"hidden": 128}} if case == "small" else {"name": "cnn", "args": CNN_ARGS}
    assert models == {json.dumps(expected, sort_keys=True)}
    # Checkpoints every quarter epoch (of the global batch's samples) in every mode.
    assert [v.doc["spec"]["checkpoint"]["intervalSteps"] for v in variants.values()] == [5, 5, 10, 5]


def test_only_the_straggler_case_slows_a_ps_worker_and_a_ddp_rank():
    straggler = mode_variants("straggler", 5, 64, 23, slow_factor=3)
    assert straggler["Single"].env == {}
    for label in ("PS-Sync", "PS-Async", "DDP"):
        assert straggler[label].env == {SLOWDOWN_VAR: "worker-1:3,ddp-1:3"}
    # The fast worker may run ahead for the whole run; elsewhere maxStaleness keeps its default.
    assert straggler["PS-Async"].doc["spec"]["parameterServer"]["maxStaleness"] == 2 * 5 * 23
    cnn = mode_variants("cnn", 5, 64, 23)
    assert all(v.env == {} for v in cnn.values())
    assert cnn["PS-Async"].doc["spec"]["parameterServer"]["maxStaleness"] == 4


def test_bad_bench_arguments_are_refused_before_any_run():
    with pytest.raises(ValueError, match="--case 'huge'"):
        mode_variants("huge", 5, 64, 23)
    with pytest.raises(ValueError, match=f"--epochs {MAX_EPOCHS + 1}: expected 1 to {MAX_EPOCHS}"):
        mode_variants("small", MAX_EPOCHS + 1, 64, 23)
    mode_variants("small", MAX_EPOCHS, 64, 23)
    with pytest.raises(ValueError, match="--batch 63"):
        mode_variants("small", 5, 63, 23)
    with pytest.raises(ValueError, match="--modes: unknown PS"):
        bench_modes(["small"], 5, 64, modes=["PS"])
    with pytest.raises(ValueError, match="--target 1.5"):
        bench_modes(["small"], 5, 64, target=1.5)
    with pytest.raises(ValueError, match="--slow-factor 101: expected a factor from 1 to 100"):
        bench_modes(["straggler"], 5, 64, slow_factor=101)
    with pytest.raises(ValueError, match="--rounds 0: expected at least 1"):
        bench_modes(["small"], 5, 64, rounds=0)


def test_the_command_refuses_a_bad_slow_factor_with_exit_2():
    done = kubetrain("bench", "modes", "--case", "straggler", "--slow-factor", "0.5", timeout=120)
    assert done.returncode == 2
    assert "--slow-factor 0.5: expected a factor from 1 to 100" in done.stderr
    assert "Traceback" not in done.stderr


# --- time to accuracy from the JSONL -------------------------------------------------------


def _write(metrics: Path, replica: str, events: list[dict]) -> None:
    metrics.mkdir(parents=True, exist_ok=True)
    with open(metrics / f"{replica}.jsonl", "w") as f:
        for e in events:
            f.write(json.dumps({"replica": replica, **e}) + "\n")


def _ps_run(metrics: Path) -> None:
    """A PS job as its JSONL reads: a shard writing checkpoints, two workers training."""
    _write(metrics, "ps-0", [
        {"time": 99.0, "event": "start", "step": 0},
        {"time": 101.5, "event": "checkpoint", "step": 10, "seconds": 0.5},
        {"time": 103.2, "event": "checkpoint", "step": 20, "seconds": 0.2},
        {"time": 105.0, "event": "checkpoint", "step": 30, "seconds": 0.0},
        {"time": 105.5, "event": "checkpoint", "step": 30, "seconds": 0.1},  # the end's, of the same step
    ])
    _write(metrics, "worker-0", [
        {"time": 100.0, "event": "start", "step": 0},
        {"time": 100.1, "event": "train", "step": 1, "samples": 32},
        {"time": 104.9, "event": "train", "step": 30, "samples": 480},
        {"time": 106.0, "event": "eval", "step": 30, "eval_accuracy": 0.95},
    ])
    with open(metrics / "worker-1.jsonl", "w") as f:
        f.write(json.dumps({"time": 100.4, "event": "start", "step": 0}) + "\n")
        f.write(json.dumps({"time": 104.0, "event": "train", "step": 29, "samples": 448}) + "\n")
        f.write('{"time": 104.5, "event": "tra')  # cut by a kill


def test_time_to_accuracy_is_the_first_checkpoint_at_the_target_from_the_first_training_start(tmp_path):
    _ps_run(tmp_path / "metrics")
    events = read_events(tmp_path / "metrics")
    span = training_span(events)
    # The shard trains nothing: the span runs from worker-0's start to the last train event.
    assert (span.start, span.end, span.samples) == (100.0, 104.9, 480 + 448)
    assert span.samples_per_second == pytest.approx(928 / 4.9)
    times = checkpoint_times(events)
    assert times == {10: 101.0, 20: 103.0, 30: 105.0}
    evaluations = [{"step": 30, "eval_accuracy": 0.95}, {"step": 10, "eval_accuracy": 0.6},
                   {"step": 20, "eval_accuracy": 0.91}]
    assert time_to_accuracy(evaluations, times, span.start, 0.9) == (3.0, 20)
    assert time_to_accuracy(evaluations, times, span.start, 0.95) == (5.0, 30)
    assert time_to_accuracy(evaluations, times, span.start, 0.96) is None


def test_with_several_shards_a_step_counts_once_every_shard_has_its_snapshot(tmp_path):
    _write(tmp_path, "ps-0", [{"time": 10.0, "event": "checkpoint", "step": 5, "seconds": 0.0}])
    _write(tmp_path, "ps-1", [{"time": 12.0, "event": "checkpoint", "step": 5, "seconds": 1.0}])
    assert checkpoint_times(read_events(tmp_path)) == {5: 11.0}


def test_a_run_that_trained_nothing_has_no_span(tmp_path):
    _write(tmp_path, "ps-0", [{"time": 1.0, "event": "start", "step": 0}])
    assert training_span(read_events(tmp_path)) is None
