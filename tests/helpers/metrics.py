"""Scraping a Prometheus /metrics endpoint and reading its samples, the way Prometheus would."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Series = tuple[str, frozenset[tuple[str, str]]]
"""A sample's name (counters with `_total`) and its label set."""


def scrape(target: str, timeout: float = 10) -> str:
    """The exposition text of http://<target>/metrics (target: `host:port`); raises when it does not answer."""
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=timeout) as reply:
        return reply.read().decode()


def try_scrape(target: str, timeout: float = 10) -> str | None:
    """scrape(), or None while the target refuses, times out or is not there yet (a replica between
    two attempts, a pod not yet routed)."""
    try:
        return scrape(target, timeout)
    except OSError:  # URLError, ConnectionError and socket timeouts are all OSErrors
        return None


def samples(text: str) -> dict[Series, float]:
    """Every sample of an exposition, keyed by name and label set."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}
