"""The test cluster runs only the cached binaries, listens only on loopback, and refuses a second start."""

import ipaddress
import os
import socket
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from helpers.kube import HACK_CLUSTER, hack_cluster
from helpers.process import run

pytestmark = pytest.mark.cluster

COMPONENTS = {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"}


def _cluster_processes(cluster) -> dict[int, str]:
    """The pids of the cluster's components (our binaries, started for this cluster), with their names."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            exe = Path(os.readlink(proc / "exe"))
            cmdline = (proc / "cmdline").read_bytes().decode()
        except (OSError, ValueError):  # not a pid, gone, or not ours to read
            continue
        if exe.parent == cluster.bin_dir and str(cluster.directory) in cmdline:
            found[int(proc.name)] = exe.name
    return found


def _listening_addresses(pids) -> set[str]:
    """The local addresses of the TCP sockets these pids listen on, read from /proc."""
    return {address for address, _ in _listening(pids)}


def _listening_ports(pids) -> set[int]:
    """The ports of the TCP sockets these pids listen on."""
    return {port for _, port in _listening(pids)}


def _listening(pids) -> set[tuple[str, int]]:
    """(address, port) of each TCP socket these pids listen on, read from /proc."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:  # closed since the listing (the listing's own fd, for one)
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    addresses = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                raw = bytes.fromhex(local.split(":")[0])
                # The kernel prints the address as 32-bit words in host (little-endian) order.
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                addresses.add((socket.inet_ntop(family, words), int(local.split(":")[1], 16)))
    return addresses


def test_components_are_the_cached_binaries_listening_on_loopback_only(cluster):
    processes = _cluster_processes(cluster)
    addresses = _listening_addresses(processes)

    assert set(processes.values()) == COMPONENTS
    assert addresses, "found no listening sockets of the cluster's components"
    assert all(ipaddress.ip_address(a).is_loopback for a in addresses), addresses


def test_kwokctl_downloaded_nothing(cluster):
    # Where kwokctl itself says it would put what it downloads (its config's cacheDir), for this cluster.
    workdir = cluster.directory.parent.parent  # KWOK_WORKDIR: clusters/<name> lives under it
    view = run(str(cluster.bin_dir / "kwokctl"), "--name", cluster.name, "config", "view",
               env={**cluster.env, "KWOK_WORKDIR": str(workdir)}, timeout=60).stdout
    [cache] = [Path(line.split(":", 1)[1].strip()) for line in view.splitlines() if line.strip().startswith("cacheDir:")]
    # The path is the cluster's own KWOK_WORKDIR's (a wrong guess of it would make the check below vacuous).
    assert cache.parent == workdir and (workdir / "clusters" / cluster.name).is_dir(), (cache, workdir)
    assert not cache.exists() or not any(cache.iterdir()), sorted(cache.rglob("*"))


def test_second_up_is_refused_while_the_cluster_runs(cluster):
    second = cluster.hack_cluster("up", timeout=60)

    assert second.returncode != 0
    assert f"cluster {cluster.name} is already up" in second.stderr


def test_two_clusters_brought_up_at_once_both_come_up_on_ports_of_their_own(cluster):
    """hack/test's lanes bring their clusters up at the same moment. kwokctl picks each component's port as
    one free when it looks, and two creates at once once took the same ones: the second's kwok controller
    could not listen and its nodes never became Ready. hack/cluster now creates one cluster at a time."""
    names = [f"{cluster.name}-twin{n}" for n in range(2)]
    envs = [{**cluster.env, "KUBETRAIN_CLUSTER": name} for name in names]
    ups = [subprocess.Popen([str(HACK_CLUSTER), "up", "--nodes", "1"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True) for env in envs]
    try:
        outputs = [up.communicate(timeout=300)[0] for up in ups]
        for up, out in zip(ups, outputs):
            assert up.returncode == 0, out[-3000:]
        twins = [replace(cluster, name=name, kubeconfig=cluster.kubeconfig.parent.parent / name / "kubeconfig.yaml")
                 for name in names]
        ports = [_listening_ports(_cluster_processes(twin)) for twin in twins]
        assert all(ports) and not ports[0] & ports[1], ports
        for twin, env in zip(twins, envs):
            nodes = run("kubectl", "--kubeconfig", str(twin.kubeconfig), "get", "nodes", "-o", "name", env=env).stdout
            assert nodes.split() == ["node/node-000000"], nodes
    finally:
        for up in ups:
            if up.poll() is None:
                up.kill()
        for env in envs:
            hack_cluster("down", env=env, timeout=120)
