"""`import kubetrain`: restore, save, report and checkpoint_dir in a script's own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch
import yaml
from torch import nn

import kubetrain
from helpers.metrics import scrape
from helpers.net import free_port
from kubetrain.api.spec import MAX_REPORTED_METRICS
from kubetrain.trainer import checkpoint, userapi
from kubetrain.trainer.events import read_events


@pytest.fixture
def script_env(tmp_path, monkeypatch):
    """The environment the plan gives a script's replica, and a fresh session for each test."""
    job = {"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "s"},
           "spec": {"mode": "Single", "script": {"command": ["python", "train.py"]}, "checkpoint": {"keepLast": 2}}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    port = free_port()
    env = {"KUBETRAIN_JOB_FILE": str(tmp_path / "job.yaml"), "KUBETRAIN_REPLICA": "single-0",
           "KUBETRAIN_RUN_DIR": str(tmp_path), "KUBETRAIN_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
           "KUBETRAIN_METRICS_PORT": str(port)}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "KUBETRAIN_FAULT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(userapi, "_session", None)
    yield tmp_path, port
    if userapi._session is not None:
        userapi._session.close()


def test_the_first_start_has_nothing_to_restore(script_env):
    assert kubetrain.restore() == (None, 0)


def test_a_saved_state_is_durable_and_restored_whole(script_env):
    tmp, _ = script_env
    model = nn.Linear(3, 2)
    state = {"model": model.state_dict(), "epoch": 4, "name": "run-a", "history": [0.5, 0.25]}
    kubetrain.save(state, 10, wait=True)
    # Durable on return with wait=True: the file is there and `latest` names it.
    assert (tmp / "ckpt" / "latest").read_text().strip() == "ckpt-00000010.pt"
    userapi._session.close()
    userapi._session = None  # a new process
    restored, step = kubetrain.restore()
    assert step == 10
    assert restored["epoch"] == 4 and restored["name"] == "run-a" and restored["history"] == [0.5, 0.25]
    fresh = nn.Linear(3, 2)
    fresh.load_state_dict(restored["model"])
    x = torch.randn(5, 3)
    torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)


def test_keep_last_applies_to_a_scripts_checkpoints(script_env):
    tmp, _ = script_env
    for step in (1, 2, 3, 4):
        kubetrain.save({"w": torch.full((2,), float(step))}, step)
    userapi.session().close()  # the last write is durable
    assert sorted(p.name for p in (tmp / "ckpt").glob("ckpt-*.pt")) == ["ckpt-00000003.pt", "ckpt-00000004.pt"]


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(script_env):
    tmp, _ = script_env
    kubetrain.save({"w": torch.ones(4)}, 1)
    kubetrain.save({"w": torch.ones(4) * 2}, 2, wait=True)
    newest = tmp / "ckpt" / "ckpt-00000002.pt"
    newest.write_bytes(newest.read_bytes()[:-5])  # torn
    userapi._session.close()
    userapi._session = None
    state, step = kubetrain.restore()
    assert step == 1 and torch.equal(state["w"], torch.ones(4))


@pytest.mark.parametrize("state,words", [
    (nn.Linear(2, 2), "state must be a dict"),
    ({"model": nn.Linear(2, 2)}, "state['model'] is a Linear"),
    ({"opt": {"groups": [object()]}}, "state['opt']['groups'][0] is a object"),
    ({("a", 1): 2}, "has a key of type tuple"),
])
def test_a_state_that_would_not_load_back_is_refused_before_writing(script_env, state, words):
    tmp, _ = script_env
    with pytest.raises(TypeError, match=words.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        kubetrain.save(state, 1)
    assert not list((tmp / "ckpt").glob("ckpt-*.pt"))


def test_reports_become_metrics_and_events(script_env):
    tmp, port = script_env
    for step in range(1, 6):
        kubetrain.report(step, total_steps=5, loss=1.0 / step, accuracy=torch.tensor(0.1 * step), lr=0.01)
    text = scrape(f"127.0.0.1:{port}", timeout=5)
    assert 'kubetrain_training_step{job="s",namespace="default",replica="single-0",role="single"} 5.0' in text
    assert 'kubetrain_total_steps{job="s",namespace="default",replica="single-0",role="single"} 5.0' in text
    assert 'kubetrain_loss{job="s",namespace="default",replica="single-0",role="single"} 0.2' in text
    assert 'name="accuracy"' in text and 'name="lr"' in text
    assert "kubetrain_steps_per_second{" in text
    assert 'name="loss"' not in text  # loss has a gauge of its own
    userapi._session.close()
    trains = [e for e in read_events(tmp / "metrics" / "single-0.jsonl") if e["event"] == "train"]
    assert trains[-1]["step"] == 5 and trains[-1]["accuracy"] == pytest.approx(0.5)


def test_reported_names_past_the_limit_stay_out_of_metrics(script_env, caplog):
    tmp, port = script_env
    values = {f"m{i}": float(i) for i in range(MAX_REPORTED_METRICS + 3)}
    kubetrain.report(1, total_steps=1, **values)
    text = scrape(f"127.0.0.1:{port}", timeout=5)
    assert text.count("kubetrain_reported_metric{") == MAX_REPORTED_METRICS
    assert f'name="m{MAX_REPORTED_METRICS}"' not in text
    assert "go to the event log only" in caplog.text
    userapi._session.close()
    [train] = [e for e in read_events(tmp / "metrics" / "single-0.jsonl") if e["event"] == "train"]
    assert train[f"m{MAX_REPORTED_METRICS + 2}"] == MAX_REPORTED_METRICS + 2  # kept in the event log


@pytest.mark.parametrize("call,words", [
    (lambda: kubetrain.report(-1), "step must be a non-negative integer"),
    (lambda: kubetrain.report(1.5), "step must be a non-negative integer"),
    (lambda: kubetrain.report(1, loss="low"), "loss must be a number"),
    (lambda: kubetrain.report(1, flag=True), "flag=True is a bool"),
    (lambda: kubetrain.report(1, loss=torch.ones(3)), "loss must be a number or a one-element tensor"),
    (lambda: kubetrain.save({}, -3), "step must be a non-negative integer"),
])
def test_bad_arguments_are_named(script_env, call, words):
    with pytest.raises(TypeError, match=words):
        call()


def test_checkpoint_dir_is_the_jobs_durable_directory(script_env):
    tmp, _ = script_env
    assert kubetrain.checkpoint_dir() == tmp / "ckpt"
    assert (tmp / "ckpt").is_dir()


def test_outside_kubetrain_the_calls_say_how_to_run_the_script(monkeypatch):
    monkeypatch.delenv("KUBETRAIN_JOB_FILE", raising=False)
    monkeypatch.delenv("KUBETRAIN_CHECKPOINT_DIR", raising=False)
    monkeypatch.setattr(userapi, "_session", None)
    with pytest.raises(userapi.NotUnderKubetrain, match="kubetrain run job.yaml"):
        kubetrain.restore()
    with pytest.raises(userapi.NotUnderKubetrain, match="KUBETRAIN_CHECKPOINT_DIR is not set"):
        kubetrain.checkpoint_dir()


def test_the_public_api_is_the_calls_of_a_script_and_the_client():
    assert kubetrain.__all__ == ["restore", "save", "report", "checkpoint_dir", "fault_tolerant", "Client"]
    assert json.dumps(sorted(n for n in vars(kubetrain) if not n.startswith("_") and callable(getattr(kubetrain, n))
                             and getattr(kubetrain, n).__module__ == "kubetrain"))  == json.dumps(
        sorted(["restore", "save", "report", "checkpoint_dir", "fault_tolerant"]))
    # The client is loaded on first use: a training script's `import kubetrain` never loads Kubernetes' client.
    code = ("import sys, kubetrain; assert 'kubernetes' not in sys.modules and 'kubetrain.client' not in "
            "sys.modules; c = kubetrain.Client; assert c.__module__ == 'kubetrain.client'; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "PYTHONSAFEPATH": "1"})
    assert done.stdout.strip() == "ok", done.stderr


def test_a_save_returns_before_the_write_and_is_reported_only_once_durable(script_env, monkeypatch):
    tmp, port = script_env
    release = threading.Event()
    real = checkpoint._verify_written

    def held(path, *args):
        assert release.wait(60)
        real(path, *args)

    monkeypatch.setattr(checkpoint, "_verify_written", held)
    weights = torch.zeros(8)
    kubetrain.save({"w": weights, "names": ["a"]}, 3)  # returns with the write held
    weights += 1  # in place, as an optimizer step would
    gauge = 'kubetrain_last_checkpoint_step{job="s",namespace="default",replica="single-0",role="single"}'
    text = scrape(f"127.0.0.1:{port}", timeout=5)
    assert f"{gauge} 0.0" in text and not (tmp / "ckpt" / "latest").exists()
    assert not [e for e in read_events(tmp / "metrics" / "single-0.jsonl") if e["event"] == "checkpoint"]
    release.set()
    userapi.session().checkpoints.wait()
    assert f"{gauge} 3.0" in scrape(f"127.0.0.1:{port}", timeout=5)
    userapi.session().close()
    [event] = [e for e in read_events(tmp / "metrics" / "single-0.jsonl") if e["event"] == "checkpoint"]
    assert event["step"] == 3
    userapi._session = None
    restored, step = kubetrain.restore()
    assert step == 3 and torch.equal(restored["w"], torch.zeros(8)) and restored["names"] == ["a"]


SCRIPT_WHOSE_LAST_SAVE_FAILS = """
import shutil, torch, kubetrain
kubetrain.restore()
shutil.rmtree(kubetrain.checkpoint_dir())  # the volume goes away under the writer
kubetrain.save({"w": torch.ones(4)}, 1)
print("script done")
"""


def test_a_script_whose_last_background_save_failed_exits_75_to_be_retried(script_env):
    tmp, _ = script_env
    env = {**os.environ, "KUBETRAIN_METRICS_PORT": "0"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT_WHOSE_LAST_SAVE_FAILS], env=env, capture_output=True,
                          text=True, timeout=120)
    assert "script done" in proc.stdout
    assert proc.returncode == 75, proc.stderr
    assert "could not be written" in proc.stderr and "exiting with 75" in proc.stderr
