"""CPU that no test process reaps but that a test causes, charged to the test all the same.

tests/conftest.py counts each test's CPU with getrusage: its pytest process and the processes it
started and waited for. The real node's pods (tests/e2e) are nobody's child: the kubelet starts them
under the node's cgroup root. A fixture that starts such processes registers the cgroup they live
under (cgroup v1's cpuacct hierarchy, which this project's machines mount), and the report adds what
that cgroup used during each test.
"""

from __future__ import annotations

from pathlib import Path

CPUACCT = Path("/sys/fs/cgroup/cpuacct")

_charged: dict[str, Path] = {}


def charge(name: str, group: str) -> bool:
    """Charge the CPU of cgroup `group` (a path under the cpuacct hierarchy, e.g. `kt-kt-e2e`) to the
    tests that run while it exists, under `name` in the report. False where it cannot be read (cgroup
    v2, or no such group): its CPU is then nobody's, as before."""
    usage = CPUACCT / group / "cpuacct.usage"
    if not usage.is_file():
        return False
    _charged[name] = usage
    return True


def charged_names() -> list[str]:
    return sorted(_charged)


def usage() -> dict[str, float]:
    """The CPU seconds each registered cgroup has used so far; one that cannot be read (its cluster is
    down) is left out."""
    out = {}
    for name, path in list(_charged.items()):
        try:
            out[name] = int(path.read_text()) / 1e9
        except (OSError, ValueError):
            continue
    return out


def used_between(before: dict[str, float], after: dict[str, float]) -> float:
    """What the groups used between two `usage()` readings. A group registered in between counts from
    its start (the fixture that made it ran in that test's setup), and so does one made again (its
    counter began again); one gone in between counts nothing."""
    used = 0.0
    for name, seconds in after.items():
        earlier = before.get(name, 0.0)
        used += seconds - earlier if seconds >= earlier else seconds
    return used
