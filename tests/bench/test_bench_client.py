"""hack/bench-client: both paths of a pod create run and are reported, and a bad count is refused."""

from __future__ import annotations

import re
from pathlib import Path

from helpers.process import run

ROOT = Path(__file__).resolve().parents[2]


def test_it_reports_both_paths_and_their_ratio():
    out = run(str(ROOT / "hack/bench-client"), "--creates", "20").stdout
    generated = float(re.search(r"generated method +(\d+) us", out).group(1))
    plain = float(re.search(r"kube\._send +(\d+) us", out).group(1))
    ratio = float(re.search(r"ratio +([\d.]+)", out).group(1))
    assert generated > 0 and plain > 0 and abs(ratio - plain / generated) < 0.01, out


def test_a_count_below_one_is_refused_naming_the_option():
    done = run(str(ROOT / "hack/bench-client"), "--creates", "0", check=False)
    assert done.returncode == 2 and "--creates: expected 1 or more" in done.stderr and "Traceback" not in done.stderr
