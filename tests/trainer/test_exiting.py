"""`exit_now` ends a replica's process without the interpreter's teardown, but only after what a normal
exit would still have finished: threads that are not daemons, and the logs."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import logging, sys, threading, time
    from kubetrain.trainer.exiting import exit_now

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")

    def write():  # as a background checkpoint writer: slower than the main thread's end
        time.sleep(0.5)
        open(sys.argv[1], "w").write("written")

    threading.Thread(target=write, name="writer").start()
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()  # a daemon is not waited for
    logging.getLogger("t").info("logged before the end")
    sys.stdout.write("buffered on stdout")  # no newline, a pipe: block-buffered until flushed
    atexit_marker = __import__("atexit").register(lambda: print("atexit ran", file=sys.stderr))
    exit_now(7)
""")


def test_exit_now_waits_for_non_daemon_threads_flushes_and_keeps_the_code(tmp_path):
    out = tmp_path / "written.txt"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(out)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 7, proc.stderr
    assert out.read_text() == "written"  # the non-daemon thread finished before the process ended
    assert proc.stdout == "buffered on stdout"
    assert "logged before the end" in proc.stderr
    # What is skipped: other libraries' atexit handlers (and the interpreter's teardown).
    assert "atexit ran" not in proc.stderr
