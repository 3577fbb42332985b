"""A job's ETA: the steps left at the recent steps per second. Pure; the engine's, for both drivers.

The engine keeps the rate in the job's memory (`JobMemory.steps_per_second`) and
writes `status.progress.etaSeconds`; `kubectl get tj` shows it as a column and
the local progress line prints it, so a cluster and this machine give the same
estimate from the same readings.
"""

from __future__ import annotations

import math

RATE_SECONDS = 60.0
"""Time constant of the rate's moving average. A reading's weight is 1 - exp(-dt / RATE_SECONDS): steps
read 5 s apart (a cluster's scrape) move the rate by 8 % of the difference, so one slow scrape, a
checkpoint's pause or a worker's hiccup does not swing the ETA, while a lasting change of pace (a resize,
a restart that lost steps) shows in it within a few minutes. Shorter made the ETA of a parameter-server
job jump with every Sync step; longer kept a restarted job's old pace for many minutes."""


def steps_per_second(rate: float | None, steps: int, seconds: float) -> float | None:
    """The moving average after `steps` more steps in `seconds`; the first reading sets it."""
    if steps <= 0 or seconds <= 0:
        return rate
    now = steps / seconds
    if rate is None or not math.isfinite(rate):
        return now
    weight = 1.0 - math.exp(-seconds / RATE_SECONDS)
    return rate + weight * (now - rate)


def eta_seconds(step: int, total_steps: int | None, rate: float | None) -> int | None:
    """Whole seconds until `total_steps` at `rate` steps per second; None while either is unknown."""
    if not total_steps or rate is None or not math.isfinite(rate) or rate <= 0:
        return None
    return max(0, round((total_steps - step) / rate))


def format_eta(seconds: float | None) -> str:
    """`MM:SS` or `H:MM:SS`; `--:--` when unknown."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "--:--"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"
