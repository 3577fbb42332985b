"""A real Prometheus on loopback for the tests that query one: started from a config, ready, stopped.

Two binaries serve: Debian's (on PATH, for the local runs' file_sd targets)
and the one `hack/cluster build` makes (it has kubernetes_sd_configs, which
Debian's build leaves out).
"""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from helpers.net import free_port
from helpers.process import stop_process
from helpers.wait import wait_for


@dataclass
class Prometheus:
    url: str
    popen: subprocess.Popen
    log: Path

    def api(self, path: str, **params: str) -> dict:
        query = urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as reply:
            body = json.load(reply)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        try:
            return self.api("query", query=expr)["result"]
        except urllib.error.HTTPError as err:
            raise AssertionError(f"Prometheus refused {expr!r}: {err.read().decode()}") from None

    def firing(self, alert: str) -> list[dict]:
        return [a for a in self.api("alerts")["alerts"] if a["labels"]["alertname"] == alert and a["state"] == "firing"]

    def targets(self) -> str:
        """Each scrape target's health and last error, one line each (why a series is missing)."""
        active = self.api("targets").get("activeTargets", [])
        return "\n".join(f"{t.get('scrapeUrl')}: {t.get('health')} {t.get('lastError', '')!r} "
                         f"({t.get('lastScrapeDuration')} s)" for t in active) or "no targets"

    def log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])

    def ready(self) -> bool:
        """Whether /-/ready says so; fails with the log's tail when the process has exited."""
        assert self.popen.poll() is None, f"prometheus exited:\n{self.log_tail()}"
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, ConnectionError):
            return False

    def stop(self) -> None:
        stop_process(self.popen)


def start_prometheus(binary: str | Path, config: Path, root: Path, timeout: float = 60) -> Prometheus:
    """Prometheus serving on a free loopback port with `config`, its TSDB and log (prometheus.log) under
    `root`, once it is ready; stopped again if it does not get ready within `timeout` s."""
    port, log = free_port(), root / "prometheus.log"
    with open(log, "w") as out:
        popen = subprocess.Popen(
            [str(binary), f"--config.file={config}", f"--storage.tsdb.path={root / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", "--storage.tsdb.retention.time=1h"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
    prometheus = Prometheus(f"http://127.0.0.1:{port}", popen, log)
    try:
        wait_for("Prometheus to be ready", prometheus.ready, timeout=timeout)
    except BaseException:
        prometheus.stop()
        raise
    return prometheus
