"""The test cluster runs only the cached binaries, listens only on loopback, and refuses a second start."""

import ipaddress
import os
import socket
from pathlib import Path

import pytest

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
                addresses.add(socket.inet_ntop(family, words))
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
