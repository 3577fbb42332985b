"""A worker's channel dials a shard that is away (restarting) at least twice a second, not after
gRPC's default backoff (1 s growing to 120 s), so it reaches the shard soon after it is back."""

from __future__ import annotations

import socket
import threading
import time

import grpc

from kubetrain.trainer.ps.transport import RECONNECT_BACKOFF_MAX_MS, open_channel

WINDOW_SECONDS = 4.0


def test_a_channel_to_an_absent_shard_dials_again_at_least_twice_a_second():
    """A listener that accepts and closes at once: each connection is one dial by the channel.
    With the default backoff 4 s hold 3 dials (at 0, 1, 2.6 s); at most 500 ms apart (and 100 ms
    first), at least 6."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.2)
    dials: list[float] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            dials.append(time.monotonic())
            conn.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    channel = open_channel(f"127.0.0.1:{listener.getsockname()[1]}", None)
    try:
        channel.subscribe(lambda state: None, try_to_connect=True)
        time.sleep(WINDOW_SECONDS)
    finally:
        channel.close()
        stop.set()
        thread.join()
        listener.close()
    gaps = [b - a for a, b in zip(dials, dials[1:])]
    assert len(dials) >= 6, (len(dials), gaps)
    # Jitter is ±20%; a loaded machine only stretches a gap (the accepting thread waits for a core), so
    # the bound has 0.5 s of slack above it: still under the 1.6 s gap gRPC's default backoff makes
    # between its second and third dial.
    assert max(gaps) <= 2 * RECONNECT_BACKOFF_MAX_MS / 1000 + 0.5, gaps
