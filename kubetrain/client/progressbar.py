"""The progress bar of `Client.wait`: tqdm in a terminal (stderr) or a notebook, showing step, loss and ETA."""

from __future__ import annotations

import sys
from typing import Any

from kubetrain.engine.eta import format_eta
from .api import Job


def in_notebook() -> bool:
    """Whether this runs in a Jupyter kernel (IPython's kernel app is there)."""
    shell = sys.modules.get("IPython")
    get = getattr(shell, "get_ipython", None)
    ip = get() if get is not None else None
    return ip is not None and "IPKernelApp" in getattr(ip, "config", {})


def wanted(progress: bool | None) -> bool:
    """`progress` as given, or by default: in a notebook, or when stderr is a terminal."""
    if progress is not None:
        return progress
    return in_notebook() or sys.stderr.isatty()


def _tqdm() -> Any:
    if in_notebook():
        try:
            import ipywidgets  # noqa: F401  (tqdm.notebook draws with it)
            from tqdm.notebook import tqdm

            return tqdm
        except ImportError:
            pass  # a notebook without ipywidgets gets the text bar in its stderr output
    from tqdm.std import tqdm

    return tqdm


class ProgressBar:
    """One bar for one job: n is the step, total the job's totalSteps once known; the postfix its state,
    loss and the engine's ETA (status.progress.etaSeconds, not tqdm's own estimate)."""

    FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"

    def __init__(self, name: str):
        self.bar = _tqdm()(desc=name, unit="step", total=None, bar_format=self.FORMAT, file=sys.stderr,
                           dynamic_ncols=True, leave=True)

    def update(self, job: Job) -> None:
        p = job.progress
        if p is not None:
            if p.total_steps and self.bar.total != p.total_steps:
                self.bar.total = p.total_steps
            self.bar.n = p.step
        parts = [job.state]
        if p is not None and p.loss is not None:
            parts.append(f"loss {p.loss:.4g}")
        parts.append(f"ETA {format_eta(p.eta_seconds if p is not None else None)}")
        self.bar.set_postfix_str(", ".join(parts), refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()
