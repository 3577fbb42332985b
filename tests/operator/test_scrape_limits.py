"""The operator reads tenants' /metrics: a hostile or broken answer costs it a bounded time and memory."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from helpers.net import free_port
from kubetrain_operator.controller import kube
from kubetrain_operator.controller.observe import parse_metrics, progress_from

GOOD = b"kubetrain_training_step{job=\"j\"} 7.0\nkubetrain_loss{job=\"j\"} +Inf\n"


class Server:
    """One loopback HTTP server that answers every connection with `answer(conn)`."""

    def __init__(self, answer):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.answer = answer
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(4096)
                try:
                    self.answer(conn)
                except OSError:
                    pass  # the operator hung up: that is the point

    def close(self):
        self.sock.close()


@pytest.fixture
def serve():
    servers = []

    def start(answer):
        servers.append(Server(answer))
        return servers[-1].port

    yield start
    for s in servers:
        s.close()


def http(status: str, body: bytes, headers: str = "") -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n{headers}\r\n".encode() + body


def test_a_plain_answer_is_read_and_an_infinite_loss_stays_out_of_the_status(serve):
    port = serve(lambda c: c.sendall(http("200 OK", GOOD)))
    text = kube.scrape("127.0.0.1", port)
    assert text == GOOD.decode()
    progress = progress_from(parse_metrics(text))
    assert progress.step == 7 and progress.loss is None


def test_an_answer_past_the_limit_is_not_held_in_memory(serve):
    body = b"#" * (kube.MAX_SCRAPE_BYTES + 1)
    announced = serve(lambda c: c.sendall(http("200 OK", body)))
    assert kube.scrape("127.0.0.1", announced) is None

    def unannounced(conn):  # no Content-Length: read until the limit, then stop
        conn.sendall(b"HTTP/1.0 200 OK\r\n\r\n")
        for _ in range(kube.MAX_SCRAPE_BYTES // (64 << 10) + 4):
            conn.sendall(b"#" * (64 << 10))

    assert kube.scrape("127.0.0.1", serve(unannounced)) is None
    # The edge itself is read.
    edge = GOOD + b"#" * (kube.MAX_SCRAPE_BYTES - len(GOOD))
    assert kube.scrape("127.0.0.1", serve(lambda c: c.sendall(http("200 OK", edge)))) is not None


def test_a_redirect_is_not_followed(serve):
    target = serve(lambda c: c.sendall(http("200 OK", GOOD)))
    port = serve(lambda c: c.sendall(http("302 Found", b"", f"Location: http://127.0.0.1:{target}/metrics\r\n")))
    assert kube.scrape("127.0.0.1", port) is None


def test_a_dripped_answer_is_cut_off_at_the_timeout(serve):
    def drip(conn):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
        for _ in range(1000):
            conn.sendall(b"#")
            time.sleep(0.1)  # each byte well within the socket timeout

    started = time.monotonic()
    assert kube.scrape("127.0.0.1", serve(drip), timeout=1.0) is None
    assert time.monotonic() - started < 3.0  # bounded by the timeout, not by the 100 s drip


def test_a_silent_or_absent_server_is_none(serve):
    assert kube.scrape("127.0.0.1", serve(lambda c: time.sleep(5)), timeout=0.5) is None
    assert kube.scrape("127.0.0.1", free_port()) is None  # nothing listens there
