"""kubetrain.shared.exitcodes and .timestamps: one table, one signal rule, one time format."""

import signal
import subprocess
import sys
from datetime import datetime, timezone

import pytest

from kubetrain.shared.exitcodes import (EXIT_CONFIG, EXIT_LOAD, EXIT_TERMINATED, PERMANENT_CODES, PERMANENT_REASONS,
                                          killed_by, shell_code, signal_name, signaled)
from kubetrain.shared.timestamps import iso, parse_iso


def test_the_permanent_codes_and_their_reasons_map_both_ways():
    assert PERMANENT_REASONS == {EXIT_CONFIG: "InvalidConfiguration", EXIT_LOAD: "LoadFailed"}
    assert {code: reason for reason, code in PERMANENT_CODES.items()} == PERMANENT_REASONS


def test_a_process_killed_by_a_signal_exits_128_plus_n_as_the_shell_says():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    child.send_signal(signal.SIGTERM)
    returncode = child.wait()
    assert returncode == -signal.SIGTERM  # Popen's convention
    # The shell (and a container's runtime) reports the same death as 128+N.
    shell = subprocess.run(["sh", "-c", f"{sys.executable} -c 'import os; os.kill(os.getpid(), 15)'; exit $?"])
    assert shell.returncode == shell_code(returncode) == signaled(signal.SIGTERM) == EXIT_TERMINATED == 143


@pytest.mark.parametrize("code,signum", [(0, None), (2, None), (75, None), (128, None), (137, 9), (143, 15), (-9, 9)])
def test_killed_by_reads_the_signal_back(code, signum):
    assert killed_by(code) == signum


def test_signal_names():
    assert (signal_name(9), signal_name(15), signal_name(99)) == ("SIGKILL", "SIGTERM", "signal 99")


def test_timestamps_are_utc_whole_seconds_and_read_back():
    t = datetime(2026, 12, 3, 7, 29, 1, 250_000, tzinfo=timezone.utc).timestamp()
    assert iso(t) == "2026-12-03T07:29:01Z"
    assert iso(datetime.fromtimestamp(t, timezone.utc), micro=True) == "2026-12-03T07:29:01.250000Z"
    assert parse_iso(iso(t)) == int(t)
    assert parse_iso("2026-12-03 07:29:01") is None and parse_iso(None) is None
    assert parse_iso(iso()) is not None
