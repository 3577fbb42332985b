"""Polling until a condition holds: one loop for every test that waits on something outside itself."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(what: str, check: Callable[[], Any], timeout: float, every: float = 0.5,
             explain: Callable[[], str] | None = None) -> Any:
    """Poll check() until it returns something truthy and return that; on timeout fail naming `what`,
    the last value, and what explain() says (a log tail, the cluster's state)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every)
    detail = f"\n{explain()}" if explain is not None else ""
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; last: {last!r}{detail}")
