"""Comparison reports: `build_report` (Markdown + PNG plots) and `compare` (run variants, then report).

Pure control-plane code (matplotlib, no torch): it reads run directories
written by `kubetrain run`, and cluster jobs through their status and
Prometheus (`cluster.cluster_run`), and drives the local backend.
"""

from .compare import compare
from .report import build_report
from .runs import ReportError

__all__ = ["ReportError", "build_report", "compare"]
