"""kubetrain.Client against the real API server of the test cluster, with the real operator (kwok's nodes).

Pods on fake nodes run nothing: a replica's end is what a kubelet would report, written through the pod's
status subresource. Logs and export need real pods: tests/e2e/test_e2e_client.py.
"""

from __future__ import annotations

import sys
import threading
import time
import uuid

import pytest
import yaml
from kubernetes import config

import kubetrain
from helpers.process import run
from kubetrain.client import ClientError, Forbidden, InvalidManifest, JobExists, JobNotFound
from support import EXAMPLES

pytestmark = pytest.mark.cluster


class Counting:
    """The API requests one ApiClient makes: each call_api is one HTTP request (a watch or a log stream is one
    for as long as it lasts)."""

    def __init__(self, api):
        self.calls: list[tuple[float, str, str]] = []
        real = api.call_api

        def call_api(method, url, *args, **kwargs):
            self.calls.append((time.monotonic(), method, url))
            return real(method, url, *args, **kwargs)

        api.call_api = call_api


def api_client(cluster):
    return config.new_client_from_config(config_file=str(cluster.kubeconfig))


@pytest.fixture
def client(operator, cluster):
    return kubetrain.Client(namespace=operator.namespace, api_client=api_client(cluster))


def manifest(mode: str = "Single", name: str | None = None) -> dict:
    doc = yaml.safe_load((EXAMPLES / {"ParameterServer": "parameter-server.yaml", "Single": "single.yaml"}[mode])
                         .read_text())
    doc["metadata"]["name"] = name or f"cl-{uuid.uuid4().hex[:6]}"
    return doc


def test_the_kubeconfig_and_its_contexts_namespace_are_the_defaults(cluster, operator, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    client = kubetrain.Client()
    assert client.backend.namespace == "default"
    assert kubetrain.Client(namespace=operator.namespace).backend.namespace == operator.namespace


def test_create_get_list_and_wait_follow_the_job_through_the_operator(client, operator):
    handle = client.create(manifest())
    name = handle.name
    job = client.get(name)
    assert (job.name, job.namespace, job.mode) == (name, operator.namespace, "Single")
    assert name in [j.name for j in client.list()]
    running = client.wait(name, until="Running", timeout=60, progress=False)
    assert running.state == "Running" and running.conditions[-1].type == "Running"
    # The watch sees the replica's end, reported while wait() blocks.
    threading.Timer(1.0, operator.set_pod_status, (f"{name}-single-0", "Succeeded", 0)).start()
    counting = Counting(client.backend.api)
    done = handle.wait(timeout=60, progress=False)
    assert done.state == "Succeeded" and done.completion_time
    assert [m for _, m, _ in counting.calls] == ["GET", "GET"], counting.calls  # one list, one watch: no polling
    assert "watch=true" in counting.calls[1][2] and "watch" not in counting.calls[0][2]
    assert {"Completed"} <= {e.reason for e in client.events(name)}


def test_suspend_and_resume_go_through_the_spec(client, operator):
    name = client.create(manifest()).name
    client.wait(name, until="Running", timeout=60, progress=False)
    client.suspend(name)
    assert client.wait(name, until="Suspended", timeout=60, progress=False).state == "Suspended"
    assert operator.get("trainingjob", name)["spec"]["runPolicy"]["suspend"] is True
    client.resume(name)
    assert client.wait(name, until="Running", timeout=60, progress=False).state == "Running"
    assert {"Suspended", "Resumed"} <= {e.reason for e in client.events(name)}


def test_scale_goes_through_the_scale_subresource_and_refuses_a_size_the_job_cannot_take(client, operator):
    name = client.create(manifest("ParameterServer")).name
    client.wait(name, until="Running", timeout=60, progress=False)
    client.scale(name, 3)
    assert operator.get("trainingjob", name)["spec"]["replicas"] == 3
    operator.wait("3 workers", lambda: client.get(name).replicas == 3)
    with pytest.raises(InvalidManifest, match=f"trainingjob {name}: spec.replicas"):
        client.scale(name, 0)


def test_delete_removes_the_job_and_a_wait_on_it_says_so(client, operator):
    name = client.create(manifest()).name
    client.wait(name, until="Running", timeout=60, progress=False)
    errors: list[Exception] = []

    def waiting():
        try:
            client.wait(name, timeout=60, progress=False)
        except ClientError as err:
            errors.append(err)

    t = threading.Thread(target=waiting)
    t.start()
    time.sleep(1)
    client.delete(name)
    t.join(60)
    assert len(errors) == 1 and isinstance(errors[0], JobNotFound), errors
    assert str(errors[0]) == f"trainingjob {name}: deleted from namespace {operator.namespace}"
    with pytest.raises(JobNotFound, match=f"trainingjob {name}: not found in namespace {operator.namespace}"):
        client.get(name)


def test_bad_input_gives_clear_errors(client, operator):
    bad = manifest()
    bad["spec"]["training"]["batchSize"] = -1
    with pytest.raises(InvalidManifest, match=r"\(manifest\): spec.training.batchSize"):
        client.create(bad)
    for call in (client.get, client.events, client.suspend, client.delete, lambda n: client.wait(n, progress=False),
                 lambda n: list(client.logs(n))):
        with pytest.raises(JobNotFound, match=f"trainingjob nope: not found in namespace {operator.namespace}"):
            call("nope")
    taken = client.create(manifest()).name
    with pytest.raises(JobExists, match=f"trainingjob {taken}: exists already in namespace {operator.namespace}"):
        client.create(manifest(name=taken))


def test_no_permission_is_a_forbidden_error_naming_the_call(cluster, operator):
    api = api_client(cluster)
    api.set_default_header("Impersonate-User", "someone-without-rbac")
    client = kubetrain.Client(namespace=operator.namespace, api_client=api)
    with pytest.raises(Forbidden) as err:
        client.list()
    text = str(err.value)
    assert text.startswith(f"list trainingjobs in namespace {operator.namespace}: forbidden: ")
    assert "someone-without-rbac" in text and "docs/client.md#permissions" in text
    assert "HTTP response headers" not in text and "{" not in text  # no API dump
    with pytest.raises(Forbidden, match="create trainingjob"):
        client.create(manifest())


def test_kubetrain_wait_and_logs_against_the_cluster(cluster, operator):
    """The command line's client: the kubeconfig's cluster, `-n` the namespace, one line on an error."""
    client = kubetrain.Client(namespace=operator.namespace, api_client=api_client(cluster))
    name = client.create(manifest()).name
    env = {**cluster.env, "PYTHONSAFEPATH": "1"}
    kubetrain_cli = (sys.executable, "-m", "kubetrain.cli")
    waited = run(*kubetrain_cli, "wait", name, "-n", operator.namespace, "--until", "Running", "--timeout", "60",
                 env=env, timeout=120, check=False)
    assert (waited.returncode, waited.stdout.strip()) == (0, f"{name}: Running"), waited.stderr
    timed_out = run(*kubetrain_cli, "wait", name, "-n", operator.namespace, "--timeout", "2", "--quiet",
                    env=env, timeout=60, check=False)
    assert timed_out.returncode == 124 and f"{name}: still Running" in timed_out.stderr, timed_out.stderr
    missing = run(*kubetrain_cli, "logs", "nope", "-n", operator.namespace, env=env, timeout=60, check=False)
    assert missing.returncode == 2 and missing.stderr.strip() == \
        f"kubetrain: trainingjob nope: not found in namespace {operator.namespace}"
