"""Ending a replica's process at once, without the interpreter's teardown.

A process that has imported torch spends 1.3 s (idle, on the 2-core
development machine; several times that under load) after its last line of
Python in the interpreter's finalisation: freeing every module's objects and
running torch's and gloo's destructors, none of which leaves anything behind.
A DDP rank's agent, with torch imported too, spends another 0.9 s. That time
lies on the path of a recovery: a deleted DDP pod is replaced by its
StatefulSet only once its processes are gone, and a surviving node's agent
restarts its group only once its own rank has exited. So every process of a
replica (`python -m kubetrain.trainer ROLE` and the DDP agent) ends through
`exit_now` once its work is done.

What a normal exit would still do, and matters, is done first:

- threads that are not daemons finish (a checkpoint being written in the
  background: its runtime has waited for it already, but a thread that is
  still running is joined here exactly as the interpreter would join it);
- logging's handlers and stdout and stderr are flushed.

What is skipped: `atexit` handlers of other libraries (none that the
trainer's processes rely on: no multiprocessing children, the gRPC server and
the process group are closed by the runtimes' own `close`) and the
finalisation itself. A user's own script is not ended this way: it runs in its
own process (kubetrain/trainer/script.py) and exits as it likes.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Join the remaining non-daemon threads, flush the logs and stdio, and end the process with `code`."""
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon and thread.is_alive():
            thread.join()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe, a closed stream: nothing more can be said there
            pass
    os._exit(code)
