"""The operator reads tenants' /metrics: a hostile or broken answer costs it a bounded time and memory."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from helpers.net import free_port
from helpers.wait import wait_for
from kubetrain_operator.controller import kube, scrapes
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


# --- one deadline over the whole exchange (issue 31) ---------------------------------------------
#
# http.client read the status line and the headers with a per-read timeout: a chief that sent one
# header byte every 0.5 s held `scrape(timeout=1.0)` for as long as it dripped. Each hostile peer
# below would hold the scrape for DRIP_SECONDS; the scrape must return while it still drips.

DRIP_SECONDS = 30.0
DRIP_EVERY = 0.25


class Drip:
    """Answers every connection by `send(conn)`, a byte every DRIP_EVERY s for up to DRIP_SECONDS;
    `cut` counts connections the scraper closed while this still dripped."""

    def __init__(self, head: bytes, body: bytes = b""):
        self.head, self.body = head, body
        self.cut = 0
        self.lock = threading.Lock()

    def __call__(self, conn):
        conn.sendall(self.head)
        try:
            for i in range(int(DRIP_SECONDS / DRIP_EVERY)):
                conn.sendall(self.body[i:i + 1] or b"x")
                time.sleep(DRIP_EVERY)
        except OSError:
            with self.lock:
                self.cut += 1  # the scraper hung up: a send after its close fails


STATUS_LINE = Drip(b"", b"HTTP/1.1 200 OK\r\n" + b"X" * 400)
HEADERS = Drip(b"HTTP/1.1 200 OK\r\n", b"X-Drip: " + b"x" * 400)


@pytest.mark.parametrize("drip", [STATUS_LINE, HEADERS], ids=["status line", "headers"])
def test_a_dripped_head_is_cut_at_the_deadline(serve, drip):
    port = serve(drip)
    assert kube.scrape("127.0.0.1", port, timeout=1.0) is None
    # Returned while the peer still drips (it would for DRIP_SECONDS): cut at the deadline.
    wait_for("the dripping peer to see the scraper hang up", lambda: drip.cut >= 1, timeout=DRIP_SECONDS / 2)


def test_a_silent_peer_is_cut_at_the_deadline():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        result = []
        scraper = threading.Thread(target=lambda: result.append(kube.scrape("127.0.0.1", port, timeout=1.0)))
        scraper.start()
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(DRIP_SECONDS)
            assert conn.recv(4096).startswith(b"GET /metrics")
            # Never answers: the scraper closes (the read sees its end) within its deadline.
            assert conn.recv(4096) == b""
            scraper.join(DRIP_SECONDS)
            assert result == [None]


def test_a_head_past_its_limit_is_not_read(serve):
    head = b"HTTP/1.1 200 OK\r\n" + b"X-Big: " + b"x" * kube.MAX_SCRAPE_HEAD_BYTES + b"\r\n\r\n"
    assert kube.scrape("127.0.0.1", serve(lambda c: c.sendall(head + GOOD))) is None
    edge = b"HTTP/1.1 200 OK\r\nX-Big: " + b"x" * (kube.MAX_SCRAPE_HEAD_BYTES - 40) + b"\r\n\r\n"
    assert len(edge) <= kube.MAX_SCRAPE_HEAD_BYTES
    assert kube.scrape("127.0.0.1", serve(lambda c: c.sendall(edge + GOOD))) == GOOD.decode()


def test_a_short_or_chunked_body_is_not_taken_for_the_metrics(serve):
    assert kube.scrape("127.0.0.1", serve(lambda c: c.sendall(http("200 OK", GOOD)[:-5]))) is None
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
    assert kube.scrape("127.0.0.1", serve(lambda c: c.sendall(chunked))) is None


# --- scrapes apart from the reconcile workers, SCRAPE_WORKERS at once ---------------------------

def test_scrapes_run_in_their_own_bounded_pool_and_never_hold_the_caller():
    """More jobs than SCRAPE_WORKERS whose chiefs stall: `latest` returns at once every time,
    at most SCRAPE_WORKERS scrapes run together, and every job's scrape still runs in its turn."""
    release = threading.Event()
    lock = threading.Lock()
    running, peak, done = [0], [0], []

    def stalled(job):
        def read():
            with lock:
                running[0] += 1
                peak[0] = max(peak[0], running[0])
            release.wait(DRIP_SECONDS)
            with lock:
                running[0] -= 1
                done.append(job)
            return f"progress of {job}"
        return read

    changed = []
    pool = scrapes.Scrapes(on_change=changed.append, min_interval=0.0)
    jobs = [f"job-{i}" for i in range(scrapes.SCRAPE_WORKERS + 3)]
    try:
        for job in jobs:
            assert pool.latest(job, stalled(job)) is None  # no result yet, and no wait for one
        wait_for("SCRAPE_WORKERS stalled scrapes", lambda: running[0] == scrapes.SCRAPE_WORKERS, timeout=30)
        for job in jobs:  # asked again while theirs is queued or running: no second scrape
            assert pool.latest(job, stalled(job)) is None
        assert peak[0] == scrapes.SCRAPE_WORKERS and not done
        release.set()
        wait_for("every job's scrape", lambda: sorted(done) == sorted(jobs), timeout=30)
        assert peak[0] == scrapes.SCRAPE_WORKERS
        wait_for("every job queued again for its new progress", lambda: sorted(changed) == sorted(jobs), timeout=30)
        assert pool.latest("job-0", stalled("job-0")) == "progress of job-0"
    finally:
        release.set()
        pool.close()


def test_a_job_is_scraped_again_only_after_the_interval():
    now = [100.0]
    reads = []
    pool = scrapes.Scrapes(on_change=lambda key: None, min_interval=5.0, clock=lambda: now[0])
    try:
        pool.latest("j", lambda: reads.append(1) or 7)
        wait_for("the first scrape", lambda: pool.latest("j", lambda: 0) == 7, timeout=30)
        now[0] += 4.9
        assert pool.latest("j", lambda: reads.append(2) or 8) == 7
        now[0] += 0.2
        pool.latest("j", lambda: reads.append(3) or 9)
        wait_for("the second scrape", lambda: pool.latest("j", lambda: 0) == 9, timeout=30)
        assert reads == [1, 3]
    finally:
        pool.close()


def test_a_followed_job_is_scraped_again_by_the_ticker_and_queued_only_when_its_progress_changed():
    now = [100.0]
    changed, values = [], iter([1, 1, 2])
    pool = scrapes.Scrapes(on_change=changed.append, clock=lambda: now[0], tick=None)  # ticks by hand
    try:
        pool.latest("j", lambda: next(values))  # a round asked: the job is followed from now on
        wait_for("the first scrape", lambda: pool._entries["j"].result == 1, timeout=30)
        assert changed == ["j"]
        now[0] += scrapes.INTERVAL_SECONDS - 0.1
        assert pool.tick() == 0  # not yet
        now[0] += 0.2
        assert pool.tick() == 1
        wait_for("the same progress read again", lambda: not pool._entries["j"].running, timeout=30)
        assert changed == ["j"]  # unchanged: no round
        now[0] += scrapes.INTERVAL_SECONDS
        assert pool.tick() == 1
        wait_for("new progress", lambda: changed == ["j", "j"], timeout=30)
        pool.unfollow("j")
        now[0] += scrapes.INTERVAL_SECONDS
        assert pool.tick() == 0 and pool._entries["j"].result == 2  # the last result stays
    finally:
        pool.close()
