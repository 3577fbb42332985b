"""Free TCP ports on loopback, for the servers the tests start (operators, trainers, Prometheus)."""

from __future__ import annotations

import contextlib
import socket


def free_ports(count: int) -> list[int]:
    """`count` different ports that were free a moment ago.

    The sockets are held until all are picked, so the kernel cannot hand out
    the same port twice; two free_port() calls in a row can (rarely), and the
    second server to start would then fail to bind. Between this call and a
    server's bind another process may still take one: the window is short,
    and loopback on a test machine has few other takers.
    """
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def free_port() -> int:
    """A port on loopback that was free a moment ago."""
    return free_ports(1)[0]
