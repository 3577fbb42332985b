"""ISO 8601 timestamps in UTC, formatted and read in one place.

The format is Kubernetes' (metav1.Time: RFC 3339, UTC, whole seconds, `Z`): a job's status, its
Events, the local run's files and the client's output all write it, so a time from any of them
reads the same and compares as text. `micro=True` gives metav1.MicroTime (six fractional digits,
as a Lease's renewTime needs).
"""

from __future__ import annotations

import time
from datetime import datetime, timezone

FORMAT = "%Y-%m-%dT%H:%M:%SZ"
MICRO_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"


def iso(when: float | datetime | None = None, *, micro: bool = False) -> str:
    """`when` (seconds since the epoch, or an aware datetime; now by default) as 2026-12-03T07:29:01Z."""
    if when is None:
        when = time.time()
    moment = when.astimezone(timezone.utc) if isinstance(when, datetime) else datetime.fromtimestamp(when, timezone.utc)
    return moment.strftime(MICRO_FORMAT if micro else FORMAT)


def parse_iso(text: str | None) -> float | None:
    """Seconds since the epoch of a timestamp `iso` wrote; None for none or one in another format."""
    if not text:
        return None
    try:
        return datetime.strptime(text, FORMAT).replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return None
