"""The operator reads tenants' /metrics: a hostile or broken answer costs it a bounded time and memory."""

from __future__ import annotations

import itertools
import selectors
import socket
import threading
import time

import pytest

from helpers.net import free_port
from helpers.wait import wait_for
from kubetrain.api import from_object
from kubetrain.drivers.cluster import kube, rounds, scrapes
from kubetrain.drivers.cluster.state import Controller
from kubetrain.engine.engine import PROGRESS_UNKNOWN, ReplicaObservation
from kubetrain.drivers.cluster.observe import parse_metrics, progress_from

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


@pytest.mark.parametrize("head", [
    pytest.param(b"HTTP/1.1 2\xb20 OK\r\nContent-Length: %d\r\n\r\n" % len(GOOD), id="status-superscript"),
    pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: 1\xb2\r\n\r\n", id="length-superscript"),
    pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: \xb9\r\n\r\n", id="length-superscript-one"),
    pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: +%d\r\n\r\n" % len(GOOD), id="length-signed"),
])
def test_an_answer_whose_numbers_are_not_ascii_digits_is_a_failed_scrape(serve, head):
    """The head is read as latin-1, where `str.isdigit` holds for \xb2 (superscript two) but `int` refuses
    it: such a status line or Content-Length raised ValueError out of `scrape`, with a traceback in the
    operator's log at every scrape of that chief. A number of ASCII digits only; anything else is a failed
    scrape (None), as any other bad answer is."""
    assert kube.scrape("127.0.0.1", serve(lambda c: c.sendall(head + GOOD))) is None


# --- scrapes apart from the reconcile workers, SCRAPE_WORKERS at once ---------------------------

class StalledReads:
    """Reads that stall until `gate` is set (at most DRIP_SECONDS), counting how many run at once (`running`,
    its `peak`) and which ended (`done`)."""

    def __init__(self):
        self.gate = threading.Event()
        self.lock = threading.Lock()
        self.running = self.peak = 0
        self.done: list[str] = []

    def read(self, job: str, result: str):
        def read():
            with self.lock:
                self.running += 1
                self.peak = max(self.peak, self.running)
            self.gate.wait(DRIP_SECONDS)
            with self.lock:
                self.running -= 1
                self.done.append(job)
            return result
        return read


def test_scrapes_run_in_their_own_bounded_pool_and_never_hold_the_caller():
    """More jobs than SCRAPE_WORKERS whose chiefs stall: `latest` returns at once every time,
    at most SCRAPE_WORKERS scrapes run together, and every job's scrape still runs in its turn."""
    reads = StalledReads()

    def stalled(job):
        return reads.read(job, f"progress of {job}")

    changed = []
    pool = scrapes.Scrapes(on_change=changed.append, min_interval=0.0)
    jobs = [f"job-{i}" for i in range(scrapes.SCRAPE_WORKERS + 3)]
    try:
        for job in jobs:
            assert pool.latest(job, stalled(job)) is PROGRESS_UNKNOWN  # no result yet, and no wait for one
        wait_for("SCRAPE_WORKERS stalled scrapes", lambda: reads.running == scrapes.SCRAPE_WORKERS, timeout=30)
        for job in jobs:  # asked again while theirs is queued or running: no second scrape
            assert pool.latest(job, stalled(job)) is PROGRESS_UNKNOWN
        assert reads.peak == scrapes.SCRAPE_WORKERS and not reads.done
        reads.gate.set()
        wait_for("every job's scrape", lambda: sorted(reads.done) == sorted(jobs), timeout=30)
        assert reads.peak == scrapes.SCRAPE_WORKERS
        wait_for("every job queued again for its new progress", lambda: sorted(changed) == sorted(jobs), timeout=30)
        assert pool.latest("job-0", stalled("job-0")) == "progress of job-0"
    finally:
        reads.gate.set()
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



def test_a_result_older_than_stale_seconds_is_unknown_and_the_read_that_ends_the_wait_queues_the_job():
    """A job whose reads wait their turn: its last step is no longer what the job is at, and a round
    must not take it for a job that stands still (engine.ProgressUnknown)."""
    now = [100.0]
    changed = []
    pool = scrapes.Scrapes(on_change=changed.append, min_interval=1e9, clock=lambda: now[0], tick=None)
    try:
        assert pool.latest("j", lambda: 7) is PROGRESS_UNKNOWN  # never read yet
        wait_for("the first read", lambda: pool._entries["j"].result == 7 and not pool._entries["j"].running,
                 timeout=30)
        assert changed == ["j"]
        now[0] += scrapes.STALE_SECONDS
        assert pool.latest("j", lambda: 7) == 7  # the edge: still what the job is at
        now[0] += 0.01
        assert pool.latest("j", lambda: 7) is PROGRESS_UNKNOWN  # past it: unknown, no read started (min_interval)
        assert pool.tick() == 1  # the read that was waiting its turn
        wait_for("the job queued for its read, though its step did not change", lambda: changed == ["j", "j"],
                 timeout=30)
        assert pool.latest("j", lambda: 7) == 7
    finally:
        pool.close()


@pytest.mark.parametrize("until, took, finished, expected", [
    (None, scrapes.SLOW_READ_SECONDS - 0.01, 100.0, None),
    (None, scrapes.SLOW_READ_SECONDS, 100.0, 100.0 + scrapes.SLOW_LANE_SECONDS),
    (400.0, 0.01, 399.99, 400.0),
    (400.0, 0.01, 400.0, None),
    (400.0, scrapes.SLOW_READ_SECONDS, 450.0, 450.0 + scrapes.SLOW_LANE_SECONDS),
], ids=["a quick read keeps a job in the main lane", "a read of SLOW_READ_SECONDS moves it to the slow lane",
        "a quick read before SLOW_LANE_SECONDS keeps it there", "a quick read from then on brings it back",
        "a slow read in the slow lane starts its time again"])
def test_a_slow_read_moves_its_job_to_the_slow_lane_until_a_quick_one_after_slow_lane_seconds(
        until, took, finished, expected):
    assert scrapes.slow_lane_until(until, took, finished) == expected


def test_jobs_whose_reads_were_slow_hold_only_the_slow_lanes_workers():
    """More slow jobs than the slow lane has workers read at once, stalled: at most SLOW_SCRAPE_WORKERS
    of them run, and a quick job's read runs all the while in the main lane."""
    now = [100.0]
    reads = StalledReads()

    def slow_first(job):
        def read():  # took SLOW_READ_SECONDS by the pool's clock
            with reads.lock:
                now[0] += scrapes.SLOW_READ_SECONDS
            return "stalled"
        return read

    pool = scrapes.Scrapes(on_change=lambda key: None, min_interval=0.0, clock=lambda: now[0], tick=None)
    jobs = [f"slow-{i}" for i in range(scrapes.SLOW_SCRAPE_WORKERS + 2)]
    try:
        for job in jobs:
            pool.latest(job, slow_first(job))
        wait_for("every job's first, slow, read", lambda: all(
            pool._entries[j].result == "stalled" and not pool._entries[j].running for j in jobs), timeout=30)
        assert all(pool._entries[j].slow_until is not None for j in jobs)
        for job in jobs:
            pool.latest(job, reads.read(job, "stalled"))
        wait_for("the slow lane full", lambda: reads.running == scrapes.SLOW_SCRAPE_WORKERS, timeout=30)
        pool.latest("quick", lambda: "progress")
        wait_for("the quick job read while the slow lane is full",
                 lambda: pool._entries["quick"].result == "progress", timeout=30)
        assert reads.running == reads.peak == scrapes.SLOW_SCRAPE_WORKERS and not reads.done
        reads.gate.set()
        wait_for("every slow job's read, in its turn", lambda: sorted(reads.done) == sorted(jobs), timeout=30)
        assert reads.peak == scrapes.SLOW_SCRAPE_WORKERS
    finally:
        reads.gate.set()
        pool.close()


# --- one deadline per job's read, and a lane for jobs that stall (the tenants' third pass) -------
#
# The deadline was per pod: a fault-tolerant job reads its chief, then every other group in turn
# until one answers, so a job of 1,024 nodes whose pods accept and never answer held a scrape
# worker for 1,024 x 2 s, about 34 minutes; four such jobs held the pool, and every other job's
# progress went stale until the engine restarted it as Hung. The servers below are real listeners
# on loopback addresses (127.0.0.0/8 is all loopback on Linux), one per pod, that accept and never
# answer: what a job's read costs is counted by which pods it asked, not by a stopwatch.

class Silent:
    """Listeners on `addresses`, all on one port, that accept every connection and never answer;
    `asked` lists the address of each connection, in order (which pod a read asked)."""

    def __init__(self, addresses: list[str]):
        self.listeners: list[socket.socket] = []
        self.held: list[socket.socket] = []
        self.asked: list[str] = []
        self.lock = threading.Lock()
        for _ in range(5):  # the port taken on the first address may be another's on a later one (rarely)
            try:
                self._listen(addresses)
                break
            except OSError:
                self._close_listeners()
        else:
            raise RuntimeError(f"no port free on all of {addresses[0]}..{addresses[-1]}")
        self.selector = selectors.DefaultSelector()
        for listener in self.listeners:
            listener.setblocking(False)
            self.selector.register(listener, selectors.EVENT_READ)
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _listen(self, addresses: list[str]) -> None:
        port = 0
        for address in addresses:
            listener = socket.socket()
            self.listeners.append(listener)
            listener.bind((address, port))
            listener.listen(64)
            port = listener.getsockname()[1]
        self.port = port

    def _accept(self) -> None:
        while not self.closed:
            for key, _ in self.selector.select(timeout=0.2):
                try:
                    conn, _ = key.fileobj.accept()
                except OSError:
                    continue
                with self.lock:
                    self.held.append(conn)  # held open, never answered
                    self.asked.append(conn.getsockname()[0])

    def count(self, address: str) -> int:
        with self.lock:
            return self.asked.count(address)

    def _close_listeners(self) -> None:
        for listener in self.listeners:
            listener.close()
        self.listeners = []

    def close(self) -> None:
        self.closed = True
        self._close_listeners()
        with self.lock:
            for conn in self.held:
                conn.close()


@pytest.fixture
def silent():
    made = []

    def start(addresses):
        made.append(Silent(addresses))
        return made[-1]

    yield start
    for s in made:
        s.close()


@pytest.fixture
def ctl():
    """A controller of this process (no cluster): rounds._progress asks its scrape pool, which each test
    replaces with one whose ticker runs fast."""
    c = Controller(scrape_tick=None)
    yield c
    c.close()


def fast_pool(ctl: Controller, changed: list | None = None) -> scrapes.Scrapes:
    """The controller's scrape pool, with its ticker reading each followed job again every 0.2 s
    (the real one: 10 s) and the pool's other limits as they are."""
    ctl.scrapes.close()
    ctl.scrapes = scrapes.Scrapes(on_change=(changed.append if changed is not None else lambda key: None),
                                  min_interval=0.0, interval=0.2, tick=0.1)
    return ctl.scrapes


def ft_job(name: str, nodes: int, port: int):
    return from_object({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob",
                        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"},
                        "spec": {"mode": "DDP", "ddp": {"nodes": nodes, "faultTolerance": {}},
                                 "metrics": {"port": port}}})


def running_at(addresses: list[str]) -> dict[str, ReplicaObservation]:
    return {f"ddp-{i}": ReplicaObservation(f"ddp-{i}", "Running", ip=ip) for i, ip in enumerate(addresses)}


def test_a_job_whose_pods_never_answer_holds_a_scrape_worker_for_one_deadline_per_read(ctl, silent):
    """Each read asks the chief first and then the other groups in turn: a read that asked every pod
    at 2 s each held its worker for nodes x 2 s. Now a read asks only the pods that fit in one
    deadline, JOB_READ_SECONDS, and the next read starts again at the chief."""
    nodes = 64
    addresses = [f"127.3.0.{i + 1}" for i in range(nodes)]
    server = silent(addresses)
    fast_pool(ctl)
    rounds._progress(ctl, ft_job("many", nodes, server.port), running_at(addresses))
    # Three reads (the chief asked three times): before, the first read alone took 128 s.
    wait_for("three reads of the job", lambda: server.count(addresses[0]) >= 3, timeout=90)
    # Each read asked at most the pods that fit in its one deadline: a silent pod costs it a whole
    # scrape (SCRAPE_SECONDS), and one more may be asked with the deadline's last moments.
    fit = int(scrapes.JOB_READ_SECONDS / kube.SCRAPE_SECONDS)
    with server.lock:
        asked = list(server.asked)
    assert set(asked) <= set(addresses[:fit + 1]), asked
    assert len(asked) <= (fit + 1) * (asked.count(addresses[0]) + 1)


def test_jobs_whose_pods_never_answer_never_starve_another_jobs_progress(ctl, silent, serve):
    """More stalling jobs than the whole pool has workers: the victim's progress keeps reaching its
    rounds (each new step queues it), many times over while the stalling jobs are read in their turn."""
    stalling, nodes = scrapes.SCRAPE_WORKERS + 4, 16
    addresses = {j: [f"127.4.{j}.{i + 1}" for i in range(nodes)] for j in range(stalling)}
    server = silent([a for pods in addresses.values() for a in pods])
    steps = itertools.count(1)
    victim_port = serve(lambda c: c.sendall(http("200 OK", f"kubetrain_training_step {next(steps)}\n".encode())))
    changed: list = []
    fast_pool(ctl, changed)
    for j, pods in addresses.items():  # asked first: their reads are queued ahead of the victim's
        rounds._progress(ctl, ft_job(f"stalling-{j}", nodes, server.port), running_at(pods))
    victim = from_object({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob",
                          "metadata": {"name": "victim", "namespace": "ns", "uid": "uid-victim"},
                          "spec": {"mode": "Single", "metrics": {"port": victim_port}}})
    rounds._progress(ctl, victim, {"single-0": ReplicaObservation("single-0", "Running", ip="127.0.0.1")})
    # Every read of the victim finds a new step, and each queues a round.
    wait_for("20 rounds of the victim for its new progress", lambda: changed.count(("ns", "victim")) >= 20,
             timeout=90)
    assert ctl.scrapes._entries[("ns", "victim")].result.step >= 20
    # The stalling jobs are read all the same, each in its turn (their chiefs asked again).
    wait_for("a second read of every stalling job",
             lambda: all(server.count(pods[0]) >= 2 for pods in addresses.values()), timeout=120)


def test_a_chief_that_accepts_and_never_answers_is_no_progress_not_unknown(silent):
    """The job's own chief stalled past the read's deadline (a deadlocked process still accepts, in the
    kernel): that is a reading of no step, on which the hang clock runs, as on a refused one. Only a
    result made old by other jobs' reads is unknown (`latest`)."""
    server = silent(["127.5.0.1"])
    reading = scrapes.read_progress({"single-0": "127.5.0.1"}, server.port, ["single-0"], None)
    assert reading is None and server.count("127.5.0.1") == 1
