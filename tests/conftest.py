"""Fixtures shared by every test area."""

from __future__ import annotations

import os
import resource
import sys
import time
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))  # `import support` and `helpers` from any test area

from helpers import cpu  # noqa: E402


@pytest.fixture
def write_job(tmp_path):
    """Write a manifest (a dict) to tmp_path and return its path."""

    def write(doc: dict, name: str = "job.yaml") -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    return write


# --- where the suite's CPU goes ------------------------------------------------------
#
# The suite is mostly CPU-bound on the 2-core machines (hack/test's lanes keep the cores busy), so its
# wall time is close to its CPU time over 2: the CPU each test costs is what to cut. Each test's is its
# pytest process's own user + system time plus that of the processes it started and reaped (a
# trainer, `kubetrain run` and its replicas, kubectl): getrusage(RUSAGE_CHILDREN) counts a process
# once it and its own children were waited for. The real node's pods are nobody's child: their cgroup's
# use during the test is added (helpers/cpu.py; tests/e2e's fixture registers it). Other daemons of a
# session (the test clusters, the real node's containerd) are nobody's. Printed at the end, beside
# --durations: the 20 heaviest tests and files (a screenful), or as many as KUBETRAIN_CPU_REPORT_TESTS says.
CPU_REPORT_TESTS = int(os.environ.get("KUBETRAIN_CPU_REPORT_TESTS", "20"))
_cpu_seconds: dict[str, float] = {}
_wall_seconds: dict[str, float] = {}  # and the wall time of each test area (tests/<area>/), to split lanes by


def _area(nodeid: str) -> str:
    """`tests/<area>` of a test's node id or file path."""
    return "/".join(nodeid.split("::", 1)[0].split("/")[:2])


def _cpu_now() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before, groups, began = _cpu_now(), cpu.usage(), time.monotonic()
    yield
    _cpu_seconds[item.nodeid] = _cpu_now() - before + cpu.used_between(groups, cpu.usage())
    _wall_seconds[_area(item.nodeid)] = _wall_seconds.get(_area(item.nodeid), 0.0) + time.monotonic() - began


def pytest_terminal_summary(terminalreporter):
    if not _cpu_seconds:
        return
    total = sum(_cpu_seconds.values())
    counted = "".join(f"; {name}" for name in cpu.charged_names())
    terminalreporter.write_sep("=", f"most CPU: {CPU_REPORT_TESTS} tests of {len(_cpu_seconds)}, "
                                    f"{total:.0f} CPU seconds in all (setup, call and teardown; reaped children "
                                    f"included{counted})")
    for nodeid, seconds in sorted(_cpu_seconds.items(), key=lambda kv: -kv[1])[:CPU_REPORT_TESTS]:
        terminalreporter.write_line(f"{seconds:8.1f}s cpu  {nodeid}")
    by_file: dict[str, float] = {}
    for nodeid, seconds in _cpu_seconds.items():
        by_file[nodeid.split("::", 1)[0]] = by_file.get(nodeid.split("::", 1)[0], 0.0) + seconds
    terminalreporter.write_sep("-", "most CPU by file")
    for path, seconds in sorted(by_file.items(), key=lambda kv: -kv[1])[:CPU_REPORT_TESTS]:
        terminalreporter.write_line(f"{seconds:8.1f}s cpu  {path}")
    terminalreporter.write_sep("-", "wall time and CPU by area")
    by_area: dict[str, float] = {}
    for path, seconds in by_file.items():
        by_area[_area(path)] = by_area.get(_area(path), 0.0) + seconds
    for area, seconds in sorted(_wall_seconds.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f}s wall {by_area.get(area, 0.0):8.1f}s cpu  {area}")


from clusterlib import cluster  # noqa: E402,F401  (the session's test cluster, for every area)
from objstorelib import bucket, s3  # noqa: E402,F401  (the session's S3 server and a bucket per test)
from finetunelib import pretrained  # noqa: E402,F401  (a small pretrained Hugging Face model per session)
