"""kubetrain.Client where it needs real pods: logs that follow a replica across its restart, export from the
job's claim through a short-lived pod, the report of a cluster job from Prometheus, the Hugging Face example
killed and resumed in a pod, the notebook against the cluster; and what `wait` and `logs(follow=True)` cost
in API requests per second on one real job."""

from __future__ import annotations

import json
import re
import sys
import threading
import time

import pytest
import torch
import yaml
from e2elib import NAMESPACE, REAL_NODE_SELECTOR, example, figure, first_checkpoint, on_real_node, sigkill_process
from kubernetes import config
from test_e2e_prometheus import prometheus  # noqa: F401  (the fixture: Prometheus scraping the e2e namespace)

import kubetrain
from kubetrain.api.podtemplate import CONTAINER
from helpers.process import run
from support import EXAMPLES, ROOT

pytestmark = pytest.mark.e2e

class Counting:
    """The HTTP requests one ApiClient makes (a watch or a log stream is one for as long as it lasts)."""

    def __init__(self, api):
        self.calls: list[tuple[float, str]] = []
        real = api.call_api

        def call_api(method, url, *args, **kwargs):
            self.calls.append((time.monotonic(), url))
            return real(method, url, *args, **kwargs)

        api.call_api = call_api


def new_client(e2e):
    api = config.new_client_from_config(config_file=str(e2e.cluster.kubeconfig))
    return kubetrain.Client(namespace=NAMESPACE, api_client=api), api


def test_logs_follow_a_replica_across_its_restart_export_and_report(e2e, prometheus, tmp_path):  # noqa: F811
    client, api = new_client(e2e)
    # 900 epochs: it must still train once the status shows a checkpoint (the operator's scrape reads it
    # every 10 s; at 300 epochs the job was over first on a loaded machine).
    doc = example("single.yaml", 900)
    doc["metadata"]["name"] = name = "client-single"
    client.create(doc)
    # wait() on its own client, beside the follow, to count what each costs.
    waiter, waiter_api = new_client(e2e)
    waited = Counting(waiter_api)
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(job=waiter.wait(name, timeout=900, progress=False)))
    t.start()
    probe, _ = new_client(e2e)  # the test's own reads, counted nowhere
    follow = Counting(api)
    started = time.monotonic()
    lines: list[str] = []
    killed_at = None
    for line in client.logs(name, replica="single-0", follow=True):
        lines.append(line)
        if killed_at is None and re.search(r"single-0: step \d+: eval accuracy", line) and \
                (probe.get(name).last_checkpoint or None) is not None:
            sigkill_process(e2e, f"{name}-single-0", "kubetrain.trainer")
            killed_at = len(lines)
    follow_seconds = time.monotonic() - started
    t.join(900)
    job = result["job"]
    assert killed_at is not None, lines[-30:]
    assert (job.state, job.restarts) == ("Succeeded", 1), (job, client.events(name))
    # Two incarnations of single-0, one stream each: the second one's lines came through the same iterator.
    # killed_at counts the lines through the one that triggered the kill: the next line's index. The first
    # incarnation may print nothing more before it dies (a CI run: the new process's first line came next).
    starts = [i for i, line in enumerate(lines) if '"milestone": "process"' in line]
    assert len(starts) == 2 and starts[1] >= killed_at, (starts, killed_at)
    assert any(re.search(r"single-0: step \d+", line) for line in lines[starts[1]:])
    logs_rate = len(follow.calls) / follow_seconds
    wait_rate = len(waited.calls) / follow_seconds
    figure(f"client: logs(follow=True) of one replica across 1 restart: {len(follow.calls)} API requests in "
           f"{follow_seconds:.0f} s ({logs_rate:.3f}/s); wait(): {len(waited.calls)} ({wait_rate:.3f}/s)")
    # A list and a watch of the job and of its pods, a log stream per incarnation (2), a few retries at most
    # while the new pod starts: a count set by events, not by time.
    assert len(follow.calls) <= 10, follow.calls
    assert len(waited.calls) <= 3, waited.calls

    # The model out of the job's claim.
    exported = client.export(name, tmp_path / "model.pt")
    weights = torch.load(exported, weights_only=True)
    assert weights and all(isinstance(v, torch.Tensor) for v in weights.values())
    assert not e2e.kube.items("pods", "-l", f"kubetrain.dev/export-of={name}")  # the export pod is gone
    cli = run(str(ROOT / ".venv" / "bin" / "kubetrain"), "export", name, "-n", NAMESPACE, "--out",
              str(tmp_path / "cli.pt"), env=e2e.cluster.env, timeout=600, check=False)
    assert cli.returncode == 0, cli.stderr
    assert torch.load(tmp_path / "cli.pt", weights_only=True).keys() == weights.keys()

    # Its report, from its status and from Prometheus.
    report = client.report([name], tmp_path / "report", prometheus=prometheus.url)
    summary = json.loads((report.parent / "report.json").read_text())["runs"][0]["summary"]
    assert summary["steps"] == job.progress.step and summary["final_train_loss"] == job.progress.loss
    assert summary["eval_accuracy"] == job.progress.eval_accuracy and summary["restarts"] == job.restarts == 1
    assert (report.parent / "loss.png").is_file() and "## Restarts and recovery" in report.read_text()
    cli = run(str(ROOT / ".venv" / "bin" / "kubetrain"), "report", f"tj/{name}", "-n", NAMESPACE, "--prometheus",
              prometheus.url, "--out", str(tmp_path / "cli-report"), env=e2e.cluster.env, timeout=300, check=False)
    assert cli.returncode == 0, cli.stderr
    figure(f"client: report of tj/{name} from Prometheus: steps {summary['steps']}, loss "
           f"{summary['final_train_loss']:.4f}, restarts {summary['restarts']} (the job's status)")


HF_STEPS = 400  # killed once the first save (step 20) shows: it resumed from step 20 (this machine, alone)


def test_the_hugging_face_example_killed_in_its_pod_resumes_from_kubetrains_checkpoint(e2e, custom_image, tmp_path):
    # The data: the script's own source, the same bytes here and in the image (the default, the standard
    # library's ast.py, differs between this machine's Python and the image's).
    doc = on_real_node(yaml.safe_load((EXAMPLES / "hf" / "job.yaml").read_text()))
    doc["spec"]["script"]["args"] += ["--data", "train.py"]
    # Long enough to be killed while it trains (the example's 60 steps take 1 s here), and killed once
    # the pod's own metrics show a checkpoint (the job's status learns of it up to a scrape later).
    args = doc["spec"]["script"]["args"]
    args[args.index("--steps") + 1] = str(HF_STEPS)
    manifest = tmp_path / "hf.yaml"
    manifest.write_text(yaml.safe_dump(doc))
    local = run(str(ROOT / ".venv" / "bin" / "kubetrain"), "run", str(manifest), "--run-dir", str(tmp_path / "local"),
                "--code-dir", str(EXAMPLES / "hf"), "--quiet", timeout=600)
    fault_free = json.loads((tmp_path / "local" / "summary.json").read_text())["final_train_loss"]
    client, _ = new_client(e2e)
    name = doc["metadata"]["name"]
    client.create(doc)
    first_checkpoint(e2e, f"{name}-single-0", timeout=600)
    sigkill_process(e2e, f"{name}-single-0", "train.py")
    job = client.wait(name, timeout=900, progress=False)
    assert (job.state, job.restarts) == ("Succeeded", 1), client.events(name)
    text = "\n".join(client.logs(name))
    resumed = re.search(r"resuming the Trainer from kubetrain's checkpoint of step (\d+)", text)
    assert resumed and int(resumed.group(1)) % 20 == 0 and 0 < int(resumed.group(1)) < HF_STEPS, text[-3000:]
    assert job.progress.loss == fault_free, (job.progress, fault_free, local.stderr[-500:])
    figure(f"client: examples/hf killed in its pod and resumed from step {resumed.group(1)} of {HF_STEPS}: "
           f"final loss {job.progress.loss:.4f} = the local fault-free run's")


def test_the_quickstart_notebook_runs_against_the_cluster(e2e, prometheus, tmp_path):  # noqa: F811
    sys.path.insert(0, str(ROOT / "tests" / "client"))  # the notebook runner of tests/client/test_notebook.py
    from nbrun import outputs, run_notebook

    nb = run_notebook(tmp_path, {
        "KUBECONFIG": str(e2e.cluster.kubeconfig),
        "KUBETRAIN_NOTEBOOK_NAMESPACE": NAMESPACE,
        "KUBETRAIN_NOTEBOOK_PROMETHEUS": prometheus.url,
        # A quarter of a core each (the node's cgroups enforce it): the 1,840 steps take some tens of seconds
        # instead of a few, for no more CPU, so that Prometheus (2 s scrapes) finds and scrapes both pods
        # (at full speed nb-slow once ended before it was scraped at all).
        "KUBETRAIN_NOTEBOOK_POD_TEMPLATE": json.dumps({"spec": {
            "nodeSelector": REAL_NODE_SELECTOR,
            "containers": [{"name": CONTAINER, "resources": {"limits": {"cpu": "250m"}}}]}}),
    })
    text = outputs(nb)
    assert "state: Succeeded" in text and "spec.training.batchSize" in text and "eval accuracy" in text
    assert (tmp_path / "report" / "report.md").is_file()
    assert torch.load(tmp_path / "model.pt", weights_only=True)
    e2e.wait("the notebook's jobs to be deleted", lambda: not {"nb-fast", "nb-slow"} & {
        j["metadata"]["name"] for j in e2e.kube.items("trainingjobs")}, timeout=120)
