"""`kubetrain run` of script jobs: the user's own command, supervised, restarted and summarised like any job."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import yaml

from kubetrain.trainer.events import read_events
from support import EXAMPLES, job_doc, kubetrain

CUSTOM = EXAMPLES / "custom"


def summary_of(run):
    return json.loads((run / "summary.json").read_text())


def reported_before_the_restart(run, replica):
    """Step of the newest checkpoint `replica` reported durable before its first restart (None: none)."""
    step = None
    for event in read_events(run / "metrics" / f"{replica}.jsonl"):
        if event["event"] == "resume":  # the restarted attempt's: a fresh start resumes nothing
            break
        if event["event"] == "checkpoint":
            step = event["step"]
    return step


def resumed_steps(log):
    return [int(s) for s in re.findall(r"resumed from step (\d+)", log)]


def script_job(name, mode="Single", steps=60, save_every=20, **spec):
    return job_doc(name, mode, script={"command": ["python", "train.py"], "workingDir": str(CUSTOM),
                                       "args": ["--steps", str(steps), "--save-every", str(save_every)]}, **spec)


def test_the_example_script_runs_beside_its_manifest_and_its_reports_make_the_summary(tmp_path):
    run = tmp_path / "run"
    proc = kubetrain("run", str(CUSTOM / "single.yaml"), "--run-dir", str(run), "--quiet", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summary = summary_of(run)
    assert (summary["state"], summary["steps"], summary["restarts"]) == ("Succeeded", 300, 0)
    assert 0 < summary["eval_loss"] < 0.5 and summary["final_train_loss"] > 0
    assert summary["eval_accuracy"] is None  # the script reported none
    assert set(summary["metrics"]) == {"weight_norm"}
    # keepLast 3 of a save every 50 steps: 200, 250, 300.
    ckpts = sorted(p.name for p in (run / "checkpoints" / "single-0").glob("ckpt-*.pt"))
    assert ckpts == ["ckpt-00000200.pt", "ckpt-00000250.pt", "ckpt-00000300.pt"]
    written = yaml.safe_load((run / "job.yaml").read_text())["spec"]
    assert "model" not in written and written["script"]["command"] == ["python", "train.py"]
    results = json.loads((run / "results" / "single-0.json").read_text())
    assert (results["steps"], results["checkpoint_step"]) == (300, 300)
    assert "done: 300 steps" in (run / "logs" / "single-0.log").read_text()


def test_a_killed_script_resumes_from_its_last_save_and_ends_where_a_clean_run_ends(tmp_path, write_job):
    path = write_job(script_job("resume"))
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    assert kubetrain("run", str(path), "--run-dir", str(clean), "--quiet").returncode == 0
    proc = kubetrain("run", str(path), "--run-dir", str(faulty), "--fault", "single-0:kill@step=50", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert "single-0 was killed by SIGKILL; restart 1 of 6." in proc.stderr
    log = (faulty / "logs" / "single-0.log").read_text()
    # Saves are written in the background: the kill at step 50 may land while
    # step 40's is still in flight, and the job then resumes from step 20's.
    # Never from step 0, never from one older than the last reported durable.
    [resumed] = resumed_steps(log)
    reported = reported_before_the_restart(faulty, "single-0")
    assert resumed in (20, 40) and reported is not None and resumed >= reported, (log, reported)
    a, b = summary_of(clean), summary_of(faulty)
    assert b["restarts"] == 1
    # The batches depend on the step alone: the same path, to the last bit.
    assert (a["eval_loss"], a["metrics"]) == (b["eval_loss"], b["metrics"])


def test_a_ddp_script_runs_once_per_rank_and_a_killed_rank_resumes_the_group(tmp_path, write_job):
    path = write_job(script_job("ddp", "DDP", steps=40, save_every=10, ddp={"nodes": 2}))
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    assert kubetrain("run", str(path), "--run-dir", str(clean), "--quiet").returncode == 0
    proc = kubetrain("run", str(path), "--run-dir", str(faulty), "--fault", "ddp-1:kill@step=25", "--quiet")
    assert proc.returncode == 0, proc.stderr
    logs = "".join((faulty / "logs" / f"ddp-{node}.log").read_text() for node in (0, 1))
    # Both ranks restored the same save, the newest durable before the kill (step
    # 20's, or 10's if the kill at 25 landed while 20's was still being written); never step 0.
    first = [resumed_steps((faulty / "logs" / f"ddp-{node}.log").read_text())[:1] for node in (0, 1)]
    reported = reported_before_the_restart(faulty, "ddp-0")
    assert first[0] == first[1] and first[0][0] in (10, 20), logs
    assert reported is not None and first[0][0] >= reported, (logs, reported)
    a, b = summary_of(clean), summary_of(faulty)
    assert (a["state"], b["state"], a["steps"], b["steps"]) == ("Succeeded", "Succeeded", 40, 40)
    assert b["restarts"] >= 1
    assert (a["eval_loss"], a["metrics"]) == (b["eval_loss"], b["metrics"])
    # torchrun's environment reached every rank: each wrote its own results.
    assert {p.name for p in (faulty / "results").iterdir()} == {"ddp-0.json", "ddp-1.json"}


def test_a_relative_working_dir_resolves_against_the_manifest_and_siblings_import(tmp_path, write_job):
    code = tmp_path / "code"
    code.mkdir()
    (code / "helper.py").write_text("STEPS = 7\n")
    (code / "tiny.py").write_text(
        "import helper, kubetrain, sys\n"
        "state, start = kubetrain.restore()\n"
        "for step in range(start + 1, helper.STEPS + 1):\n"
        "    kubetrain.report(step, total_steps=helper.STEPS, loss=1.0 / step)\n"
        "kubetrain.save({'done': True}, helper.STEPS)\n"
        "print('cwd', __import__('os').getcwd(), 'args', sys.argv[1:])\n"
    )
    path = write_job(job_doc("rel", script={"command": ["python", "tiny.py"], "args": ["a b", "--c"],
                                            "workingDir": "code"}))
    run = tmp_path / "run"
    other = tmp_path / "elsewhere"
    other.mkdir()
    proc = kubetrain("run", str(path), "--run-dir", str(run), "--quiet", cwd=other)
    assert proc.returncode == 0, proc.stderr
    assert summary_of(run)["steps"] == 7
    log = (run / "logs" / "single-0.log").read_text()
    assert f"cwd {code} args ['a b', '--c']" in log


def test_a_missing_program_or_working_dir_fails_the_job_with_the_field_named(tmp_path, write_job):
    path = write_job(job_doc("missing", script={"command": ["./no-such-program"]},
                             restartPolicy={"policy": "ExitCode"}))
    proc = kubetrain("run", str(path), "--run-dir", str(tmp_path / "a"), "--quiet")
    assert proc.returncode == 2, proc.stderr
    assert "spec.script.command[0]: './no-such-program' not found" in proc.stderr
    assert "Traceback" not in proc.stderr
    path = write_job(job_doc("nodir", script={"command": ["python", "x.py"], "workingDir": "nope"}), "b.yaml")
    proc = kubetrain("run", str(path), "--run-dir", str(tmp_path / "b"), "--quiet")
    assert proc.returncode == 2, proc.stderr
    assert "spec.script.workingDir:" in proc.stderr and "is not a directory" in proc.stderr


def test_a_scripts_own_exit_code_decides_the_restart(tmp_path, write_job):
    # Exit 3 (data could not be loaded) is permanent under policy ExitCode: no restart.
    shutil.copy(CUSTOM / "train.py", tmp_path / "train.py")
    (tmp_path / "fail.py").write_text("import sys\nprint('no data here')\nsys.exit(3)\n")
    path = write_job(job_doc("fail", script={"command": ["python", "fail.py"]},
                             restartPolicy={"policy": "ExitCode"}))
    proc = kubetrain("run", str(path), "--run-dir", str(tmp_path / "run"), "--quiet")
    assert proc.returncode == 3, proc.stderr
    summary = summary_of(tmp_path / "run")
    assert (summary["state"], summary["restarts"]) == ("Failed", 0)
    assert "no data here" in summary["message"]


def test_bench_contract_measures_both_variants_and_the_save_in_one_run(tmp_path):
    out = tmp_path / "contract.json"
    proc = kubetrain("bench", "contract", "--rounds", "1", "--steps", "20", "--save-mib", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    report, save = result["report"], result["save"]
    assert len(report["samples_per_second"]["with_report"]) == len(report["samples_per_second"]["without_report"]) == 1
    # The ratio is of the unrounded medians; the printed medians are rounded to whole samples/s (0.5218 against 0.5219 seen).
    assert report["ratio_with_to_without"] == pytest.approx(
        report["median_with_report"] / report["median_without_report"], rel=0.001, abs=1e-4)
    assert set(save["seconds"]) == {"torch_save", "torch_save_fsync", "kubetrain_save", "kubetrain_save_background"}
    assert all(s > 0 for s in save["seconds"].values())
    bad = kubetrain("bench", "contract", "--rounds", "0")
    assert bad.returncode == 2 and "--rounds, --steps and --save-mib must be at least 1" in bad.stderr


def test_sigterm_reaches_the_script_and_its_exit_code_comes_back(tmp_path, write_job):
    import os
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "graceful.py").write_text(
        "import signal, sys, time, pathlib\n"
        "def stop(signum, frame):\n"
        "    pathlib.Path('stopped').write_text(str(signum))\n"
        "    sys.exit(143)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "pathlib.Path('ready').write_text('1')\n"
        "time.sleep(60)\n"
    )
    path = write_job(job_doc("term", script={"command": ["python", "graceful.py"]}))
    env = {**os.environ, "KUBETRAIN_JOB_FILE": str(path), "KUBETRAIN_REPLICA": "single-0",
           "KUBETRAIN_RUN_DIR": str(tmp_path / "run"), "KUBETRAIN_CODE_DIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "kubetrain.trainer", "script"], env=env)
    deadline = time.monotonic() + 30
    while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 143
    assert (tmp_path / "stopped").read_text() == str(int(signal.SIGTERM))
    assert not (tmp_path / "run" / "results").exists()  # no results for a run that did not finish
