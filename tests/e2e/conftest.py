"""The end-to-end cluster: the test cluster with its real node, our images in it, the chart installed.

One session fixture, `e2e`, runs `hack/cluster up --real-node` for a cluster
of its own name (kt-e2e, or KUBETRAIN_E2E_CLUSTER; never the `cluster`
fixture's), loads the images into the real node's containerd (`hack/images
build --load`), and installs the chart with hack/values-e2e.yaml; it takes
it all down at the end. With KUBETRAIN_E2E_KEEP=1 it leaves the cluster up
and reuses it next time (for working on one test by hand). It
builds nothing that takes long: the tools (`hack/cluster build`) and images
(`hack/images build`) must be built first, or it fails saying so.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2elib import CACHE, CUSTOM_IMAGE, E2E, E2E_CLUSTER, FIGURES, KEEP, NAMESPACE, NODE_CGROUP, S3_SECRET, leftovers

from helpers import cpu
from helpers.kube import ROOT, connect, hack_cluster, require_tools
from helpers.process import run

# The observability tests' catalogue (docs/metrics.md, the dashboards) serves test_e2e_prometheus.py too.
sys.path.insert(0, str(Path(__file__).parents[1] / "observability"))


def pytest_configure(config):
    config.addinivalue_line("markers", "e2e: needs the test cluster with its real node (hack/cluster up --real-node)")


def pytest_terminal_summary(terminalreporter):
    """The figures the e2e tests measured (timings, accuracies), in one place at the end of the run."""
    if FIGURES:
        terminalreporter.section("end-to-end figures")
        for line in FIGURES:
            terminalreporter.write_line(line)


# The cheap tier first, with -x semantics: test_real_node.py checks what every later e2e test needs (the
# node Ready, pods with volumes, logs, exec, DNS, Services) in about a minute. When one of its tests fails,
# the session stops there, failed and saying why, instead of every later test timing out against the same
# broken node for half an hour (a lane of the suite waits for the slowest).
CHEAP_TIER = Path(__file__).parent / "test_real_node.py"


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.path != CHEAP_TIER)  # stable: the rest keep their order


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.failed and item.path == CHEAP_TIER:
        item.session.shouldstop = (f"{item.nodeid} failed: the real node does not work, so the later e2e tests "
                                   f"are not run (their failures would say nothing more)")


@pytest.fixture(scope="session")
def e2e() -> Iterator[E2E]:
    if os.environ.get("KUBETRAIN_CLUSTER") == E2E_CLUSTER:
        pytest.fail(f"KUBETRAIN_CLUSTER={E2E_CLUSTER} is the e2e fixture's own name: the `cluster` fixture "
                    "would share (and take down) its cluster; use another name", pytrace=False)
    env = dict(os.environ, KUBETRAIN_CLUSTER=E2E_CLUSTER)
    require_tools(env)
    images = run(str(ROOT / "hack" / "images"), "check", env=env, timeout=120, check=False)
    if images.returncode != 0:
        pytest.fail(f"the images are not built from the current sources: run `hack/images build` first. "
                    f"{images.stderr.strip()}", pytrace=False)

    started = time.monotonic()
    up = hack_cluster("up", "--nodes", "1", "--real-node", env=env, timeout=900)
    up_seconds = time.monotonic() - started
    reused = KEEP and up.returncode == 1 and "is already up" in up.stderr
    if up.returncode != 0 and not reused:
        pytest.fail(f"hack/cluster up --real-node failed ({up.returncode}):\n{up.stderr[-6000:]}", pytrace=False)
    # The pods' CPU in the suite's report (tests/conftest.py): the kubelet's, not any test's children.
    cpu.charge("the real node's pods", NODE_CGROUP)
    try:
        cluster = connect(E2E_CLUSTER, 1, env)
        env = cluster.env
        net = dict(line.split("=", 1) for line in
                   (CACHE / "realnode" / E2E_CLUSTER / "net.env").read_text().split())
        containerd = f"/run/kubetrain/{E2E_CLUSTER}/containerd.sock"

        started = time.monotonic()
        load = run(str(ROOT / "hack" / "images"), "build", "--load", env=env | {"CONTAINERD_ADDRESS": containerd},
                   timeout=900, check=False)
        assert load.returncode == 0, f"hack/images build --load failed:\n{load.stderr[-4000:]}"
        load_seconds = time.monotonic() - started

        if reused:  # a kept cluster: last run's jobs go (their names are reused), the operator restarts on new images
            cluster.run("kubectl", "-n", NAMESPACE, "delete", "trainingjobs", "--all", "--wait=true", timeout=300)
            cluster.run("kubectl", "-n", NAMESPACE, "delete", "pods", "--all", "--wait=true", timeout=300)
        # Pod Security `restricted` enforced, as docs/operating.md recommends: the operator's and every
        # trainer's pod must pass it (the label is kept on a reused cluster, set on a new one).
        cluster.run("kubectl", "apply", "-f", "-", input=f"apiVersion: v1\nkind: Namespace\nmetadata:\n"
                    f"  name: {NAMESPACE}\n  labels: {{pod-security.kubernetes.io/enforce: restricted}}\n")
        installed = run("helm", "upgrade", "--install", "kubetrain", str(ROOT / "charts" / "kubetrain"),
                        "--namespace", NAMESPACE, "--create-namespace",
                        "-f", str(ROOT / "hack" / "values-e2e.yaml"),
                        "--set", f"operator.scrapeNetworks={{{net['pod_cidr']}}}",
                        "--wait", "--timeout", "5m", env=env, timeout=400, check=False)
        if installed.returncode != 0:  # why the operator did not come up, before the cluster goes
            stuck = E2E(cluster=cluster, pod_cidr=net["pod_cidr"], containerd=containerd)
            pytest.fail(f"helm install of the chart exited {installed.returncode}: {installed.stderr.strip()}\n"
                        f"{stuck.diagnostics(describe=True)}", pytrace=False)
        if reused:
            cluster.run("kubectl", "-n", NAMESPACE, "rollout", "restart", "deploy/kubetrain")
            cluster.run("kubectl", "-n", NAMESPACE, "rollout", "status", "deploy/kubetrain", "--timeout=300s",
                        timeout=320)
        FIGURES.append(f"fixture: hack/cluster up --real-node {up_seconds:.0f} s{' (reused)' if reused else ''}; "
                       f"hack/images build --load {load_seconds:.0f} s; chart installed {time.monotonic() - started - load_seconds:.0f} s")
        yield E2E(cluster=cluster, pod_cidr=net["pod_cidr"], containerd=containerd, host_ip=net["host_ip"])
    finally:
        if not KEEP:
            started = time.monotonic()
            down = hack_cluster("down", env=env, timeout=300)
            print(f"hack/cluster down: {time.monotonic() - started:.0f} s")
            assert down.returncode == 0, f"hack/cluster down failed: {down.stderr}"
            assert not leftovers(), f"hack/cluster down left the real node's pieces behind: {leftovers()}"


@pytest.fixture(scope="session")
def custom_image(e2e: E2E) -> str:
    """The example user image (examples/custom/Dockerfile, FROM the trainer image) in the real node's
    containerd, once per session: `hack/images build --load --examples` builds it unless its inputs are
    unchanged (seconds: one COPY on the trainer) and imports only the layers the trainer's import did not
    bring (a few KB), so the tests that need it pay little and the others nothing."""
    started = time.monotonic()
    load = run(str(ROOT / "hack" / "images"), "build", "--load", "--examples",
               env=e2e.cluster.env | {"CONTAINERD_ADDRESS": e2e.containerd}, timeout=900, check=False)
    assert load.returncode == 0, f"hack/images build --load --examples failed:\n{load.stderr[-4000:]}"
    # hack/images' own lines say what it did (a trainer rebuilt after a source change costs its reload).
    done = [line.removeprefix("hack/images: ") for line in load.stderr.splitlines()
            if re.search(r" (built|loaded) in \d+ s", line)]
    FIGURES.append(f"fixture: example user image {CUSTOM_IMAGE}: hack/images build --load --examples "
                   f"{time.monotonic() - started:.1f} s ({'; '.join(done) or 'nothing to build or load'})")
    return CUSTOM_IMAGE



@pytest.fixture(scope="session")
def e2e_s3(e2e: E2E):
    """A real S3 server (hack/objstore) that the real node's pods reach at the host end of its veth, and the
    Secret `kubetrain-s3` in the e2e namespace holding its AWS_* keys (the endpoint as the pods reach it).
    Yields the server as tests/objstorelib.py's S3 (its env: the endpoint on loopback, for the test itself)."""
    from objstorelib import S3, objstore, parse_exports

    name = f"kt-s3-e2e-{os.getpid()}"
    up = objstore("up", "--bind", e2e.host_ip, name=name)
    if up.returncode != 0:
        objstore("down", name=name)
        pytest.fail(f"hack/objstore up --bind {e2e.host_ip} failed ({up.returncode}):\n{up.stderr}", pytrace=False)
    try:
        server = S3(name, parse_exports(up.stdout))
        port = server.endpoint.rsplit(":", 1)[1]
        keys = {**server.env, "AWS_ENDPOINT_URL": f"http://{e2e.host_ip}:{port}"}
        e2e.kube.run("delete", "secret", S3_SECRET, "--ignore-not-found", timeout=60)
        e2e.kube.run("create", "secret", "generic", S3_SECRET, *[f"--from-literal={k}={v}" for k, v in keys.items()],
                     timeout=60)
        yield server
    finally:
        e2e.kube.run("delete", "secret", S3_SECRET, "--ignore-not-found", timeout=60, check=False)
        down = objstore("down", name=name)
        assert down.returncode == 0, f"hack/objstore down failed: {down.stderr}"
