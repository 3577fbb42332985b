"""The data plane (kubetrain/trainer/ps/dataplane.py): a shard's Pull and Push over its own TCP or mutual-TLS listener.

A real ParameterShard behind a real DataServer on loopback, ticked as serve.py
ticks it, against the worker's own client (PSClient with data addresses) and
hand-made sockets that speak the protocol badly: every refusal arrives as the
status and reason gRPC would give, and every limit holds past its edge.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from types import SimpleNamespace

import grpc
import pytest
import torch

from cluster import TOKEN, shard_checkpoints, ticking
from helpers.wait import wait_for
from kubetrain.engine.certificates import job_certificates
from kubetrain.trainer.compression import as_bytes
from kubetrain.trainer.metrics import TrainerMetrics
from kubetrain.trainer.ps import dataplane
from kubetrain.trainer.ps import ps_pb2 as pb
from kubetrain.trainer.ps.psclient import PSClient
from kubetrain.trainer.ps.dataplane import (
    ERROR,
    FRAME,
    HELLO,
    MAGIC,
    MAX_FRAME_DATA_BYTES,
    MAX_HEADER_BYTES,
    PUSH,
    RECORD,
    DataPlaneError,
    DataServer,
)
from kubetrain.trainer.ps.server import TICK_SECONDS, ParameterShard, ShardConfig, build_server
from kubetrain.trainer.ps.credentials import TlsFiles
from kubetrain.trainer.ps.transport import NON_FINITE, Assembler, Backoff, Expected, OutTensor, refusal_reason

# Two small tensors (bucketed into one frame) and one of 40 KB (cut into pieces at the test's chunk size).
PARAMS = {"w": torch.arange(12, dtype=torch.float32).reshape(4, 3), "b": torch.ones(3),
          "big": torch.linspace(-1, 1, 10_000)}
CHUNK = 4096
LR = 0.5
LABELS = {"namespace": "default", "job": "data", "role": "ps", "replica": "ps-0"}


def sample(ps, name: str, **labels: str) -> float:
    return ps.metrics.registry.get_sample_value(name, {**LABELS, **labels}) or 0.0


@contextmanager
def serving(tmp_path, tls_dir=None, max_connections=16, hello_seconds=5.0, idle_seconds=60.0,
            max_pending_per_peer=dataplane.MAX_PENDING_PER_PEER, **config) -> Iterator[SimpleNamespace]:
    settings = dict(replica="ps-0", workers=2, aggregation="Async", sync_timeout=5.0, max_staleness=100,
                    max_steps=None, interval_steps=1000, chunk_bytes=CHUNK)
    settings.update(config)
    shard = ParameterShard(ShardConfig(**settings), {k: v.clone() for k, v in PARAMS.items()},
                           lambda p: torch.optim.SGD(p, lr=LR), shard_checkpoints(tmp_path))
    tls = TlsFiles.load(tls_dir) if tls_dir else None
    server = build_server(shard, TOKEN, max_workers=8)
    port = server.add_insecure_port("127.0.0.1:0") if tls is None else \
        server.add_secure_port("127.0.0.1:0", tls.server_credentials())
    server.start()
    metrics = TrainerMetrics(LABELS)
    data = DataServer(shard, TOKEN, tls, max_connections=max_connections, drain_bytes=32 << 20,
                      hello_seconds=hello_seconds, idle_seconds=idle_seconds, metrics=metrics,
                      max_pending_per_peer=max_pending_per_peer)
    data_port = data.start("127.0.0.1", 0)
    try:
        with ticking(shard, TICK_SECONDS):
            yield SimpleNamespace(shard=shard, data=data, address=f"127.0.0.1:{port}", metrics=metrics,
                                  data_address=f"127.0.0.1:{data_port}", data_port=data_port, tls=tls)
    finally:
        data.stop()
        server.stop(None)


def client_of(ps, token=TOKEN, budget=5.0, tls="same", **kwargs) -> PSClient:
    return PSClient([ps.address], token, CHUNK, Backoff(budget=budget), call_timeout=5.0, wait_timeout=5.0,
                    tls=ps.tls if tls == "same" else tls, data_addrs=[ps.data_address], **kwargs)


def gradient(value: float = 1.0, **override: torch.Tensor) -> list[OutTensor]:
    grads = {n: torch.full_like(t, value) for n, t in PARAMS.items()}
    grads.update(override)
    return [OutTensor(n, "float32", tuple(g.shape), "None", as_bytes(g)) for n, g in grads.items()]


def pull(client: PSClient, worker: int = 0) -> tuple[pb.PullHeader, dict[str, torch.Tensor]]:
    targets = {n: torch.empty_like(t) for n, t in PARAMS.items()}
    expected = {n: Expected.of(t) for n, t in targets.items()}
    header, _ = client.pull(0, pb.PullRequest(worker=worker), lambda: Assembler(expected, {}, targets))
    return header, targets


def raw_connection(ps, hello=True) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", ps.data_port), timeout=5)
    if hello:
        sock.sendall(MAGIC + RECORD.pack(HELLO, len(TOKEN)) + TOKEN.encode())
    return sock


def read_record(sock: socket.socket) -> tuple[int, bytes]:
    prefix = b""
    while len(prefix) < RECORD.size:
        more = sock.recv(RECORD.size - len(prefix))
        if not more:
            raise ConnectionError("closed")
        prefix += more
    kind, length = RECORD.unpack(prefix)
    body = b""
    while len(body) < length:
        more = sock.recv(length - len(body))
        if not more:
            raise ConnectionError("closed")
        body += more
    return kind, body


def closed(sock: socket.socket, within: float = 5.0) -> bool:
    sock.settimeout(within)
    try:
        while sock.recv(1 << 16):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def certificates(tmp_path_factory, name: str):
    """A job's certificates, as the operator makes them; every call's keys are new (another job's)."""
    folder = tmp_path_factory.mktemp("tls") / name
    folder.mkdir()
    for file, text in job_certificates("j", "ns", ["j-ps-0"], datetime.now(timezone.utc)).items():
        (folder / file).write_text(text)
    return folder


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory):
    return certificates(tmp_path_factory, "job")


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    """Another job's certificates: every name the same, every key different."""
    return certificates(tmp_path_factory, "other")


# --- what a worker does -------------------------------------------------------------------------


@pytest.mark.parametrize("secure", [False, True], ids=["plaintext", "mutual TLS"])
def test_a_worker_pushes_and_pulls_over_the_data_plane(tmp_path, job_dir, secure):
    with serving(tmp_path, tls_dir=job_dir if secure else None) as ps:
        client = client_of(ps)
        try:
            reply = client.push(0, pb.PushHeader(worker=0, incarnation=1, worker_step=1), gradient(1.0))
            assert (reply.outcome, reply.step) == (pb.PushReply.APPLIED, 1)
            # A retry of the same step is a duplicate, on the connection the pool kept.
            reply = client.push(0, pb.PushHeader(worker=0, incarnation=1, worker_step=1), gradient(1.0))
            assert reply.outcome == pb.PushReply.DUPLICATE
            header, pulled = pull(client)
            assert header.step == 1
            for name, value in PARAMS.items():
                torch.testing.assert_close(pulled[name], value - LR, rtol=0, atol=0)
            # gRPC and the data plane serve the same parameters.
            grpc_client = PSClient([ps.address], TOKEN, CHUNK, Backoff(budget=5.0), tls=ps.tls)
            try:
                _, over_grpc = pull(grpc_client)
            finally:
                grpc_client.close()
            assert all(torch.equal(over_grpc[n], pulled[n]) for n in PARAMS)
            # The 40 KB tensor went in 4 KiB pieces, and both sides counted what travelled.
            raw = sum(t.numel() * 4 for t in PARAMS.values())
            assert client.counter.sent > 2 * raw and client.counter.received > raw
            assert ps.shard.counter.received > 2 * raw and ps.shard.counter.sent > raw
            assert len(client.data[0]._idle) == 1  # one connection served every call
        finally:
            client.close()


def test_a_refusal_arrives_with_its_status_and_reason_and_the_connection_serves_on(tmp_path):
    with serving(tmp_path) as ps:
        client = client_of(ps)
        try:
            nan = torch.full((4, 3), float("nan"))
            with pytest.raises(DataPlaneError) as caught:
                client.push(0, pb.PushHeader(worker=0, incarnation=1, worker_step=1), gradient(w=nan))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refusal_reason(caught.value) == NON_FINITE and "'w'" in caught.value.details()
            with pytest.raises(DataPlaneError) as caught:
                client.push(0, pb.PushHeader(worker=5, incarnation=1, worker_step=1), gradient())
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "worker 5 is outside this job's 2 workers" in caught.value.details()
            assert ps.shard.step == 0
            reply = client.push(0, pb.PushHeader(worker=0, incarnation=1, worker_step=1), gradient())
            assert reply.outcome == pb.PushReply.APPLIED and ps.shard.step == 1
        finally:
            client.close()


def test_a_wrong_token_is_refused_at_once_and_not_retried(tmp_path):
    with serving(tmp_path) as ps:
        client = client_of(ps, token="wrong", budget=30.0)
        try:
            started = time.monotonic()
            with pytest.raises(DataPlaneError) as caught:
                pull(client)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert time.monotonic() - started < 5.0  # refused, not retried for the 30 s budget
        finally:
            client.close()


def test_a_push_refused_mid_stream_is_read_to_its_refusal_not_a_reset(tmp_path):
    """The shard refuses at the first bad piece; the client is still sending a large push. The shard
    drains it, so the client reads the refusal (INVALID_ARGUMENT with the tensor's name)."""
    with serving(tmp_path) as ps:
        client = client_of(ps)
        try:
            # 16 MB: more than loopback's socket buffers hold, so the client is still sending when refused.
            wrong = [OutTensor("nope", "float32", (4 << 20,), "None", as_bytes(torch.ones(4 << 20)))] + gradient()
            with pytest.raises(DataPlaneError) as caught:
                client.push(0, pb.PushHeader(worker=0, incarnation=1, worker_step=1), wrong)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "unknown tensor 'nope'" in caught.value.details()
            assert client.push(0, pb.PushHeader(worker=0, incarnation=1, worker_step=1), gradient()).outcome == \
                pb.PushReply.APPLIED
        finally:
            client.close()


# --- hand-made clients and the limits -----------------------------------------------------------


def error_of(body: bytes) -> dict:
    return json.loads(body)


def test_a_frame_declaring_more_data_than_a_chunk_is_refused_before_its_data_is_read(tmp_path):
    with serving(tmp_path) as ps, raw_connection(ps) as sock:
        assert read_record(sock)[0] == dataplane.OK
        piece = pb.TensorPiece(name="big", dtype="float32", shape=[10_000], codec="None",
                               total_bytes=MAX_FRAME_DATA_BYTES + 1, offset=0, length=MAX_FRAME_DATA_BYTES + 1)
        header = pb.Frame(push=pb.PushHeader(worker=0, incarnation=1, worker_step=1), pieces=[piece]).SerializeToString()
        sock.sendall(RECORD.pack(PUSH, 0) + RECORD.pack(FRAME, len(header)) + header)
        kind, body = read_record(sock)
        assert kind == ERROR and error_of(body)["code"] == "RESOURCE_EXHAUSTED"
        assert f"at most {MAX_FRAME_DATA_BYTES}" in error_of(body)["details"]
        assert closed(sock)
        assert ps.shard.step == 0


def test_a_record_past_the_header_limit_is_refused(tmp_path):
    with serving(tmp_path) as ps, raw_connection(ps) as sock:
        assert read_record(sock)[0] == dataplane.OK
        sock.sendall(RECORD.pack(dataplane.PULL, MAX_HEADER_BYTES + 1))
        kind, body = read_record(sock)
        assert kind == ERROR and error_of(body)["code"] == "RESOURCE_EXHAUSTED"
        assert f"limit of {MAX_HEADER_BYTES}" in error_of(body)["details"]
        assert closed(sock)


def test_garbage_and_silence_are_closed(tmp_path):
    with serving(tmp_path, hello_seconds=0.5) as ps:
        with raw_connection(ps, hello=False) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\n\r\n")  # not the protocol: closed without a word
            assert closed(sock)
        assert sample(ps, "kubetrain_ps_data_refused_connections_total", reason="protocol") == 1
        with raw_connection(ps, hello=False) as sock:
            started = time.monotonic()
            assert closed(sock)  # says nothing: closed after hello_seconds
            assert 0.4 <= time.monotonic() - started < 5.0
        with raw_connection(ps, hello=False) as sock:
            sock.sendall(MAGIC + RECORD.pack(HELLO, dataplane.MAX_TOKEN_BYTES + 1))
            kind, body = read_record(sock)
            assert kind == ERROR and error_of(body)["code"] == "RESOURCE_EXHAUSTED"


def test_connections_past_the_limit_are_closed_and_served_again_once_one_ends(tmp_path):
    with serving(tmp_path, max_connections=2) as ps:
        held = [raw_connection(ps) for _ in range(2)]
        for sock in held:
            assert read_record(sock)[0] == dataplane.OK
        with raw_connection(ps) as third:
            assert closed(third)
        assert ps.data.unserved == {"limit": 1}
        assert sample(ps, "kubetrain_ps_data_refused_connections_total", reason="limit") == 1
        assert sample(ps, "kubetrain_ps_data_connections") == 2
        held.pop().close()
        wait_for("the closed connection's thread to end", lambda: len(ps.data._conns) == 1, timeout=5, every=0.05)
        assert sample(ps, "kubetrain_ps_data_connections") == 1
        with raw_connection(ps) as fourth:
            assert read_record(fourth)[0] == dataplane.OK
        for sock in held:
            sock.close()


def test_an_idle_connection_is_closed_and_the_pool_drops_it(tmp_path):
    with serving(tmp_path, idle_seconds=0.3) as ps:
        client = client_of(ps)
        try:
            header = pb.PushHeader(worker=0, incarnation=1, worker_step=1)
            assert client.push(0, header, gradient()).outcome == pb.PushReply.APPLIED
            wait_for("the shard to close the idle connection", lambda: not ps.data._conns, timeout=5, every=0.05)
            header.worker_step = 2
            assert client.push(0, header, gradient()).outcome == pb.PushReply.APPLIED  # on a new connection
            assert ps.shard.step == 2
        finally:
            client.close()


def test_a_stalled_push_is_cancelled_by_the_shards_watchdog(tmp_path):
    with serving(tmp_path, push_stall_seconds=0.5) as ps, raw_connection(ps) as sock:
        assert read_record(sock)[0] == dataplane.OK
        piece = pb.TensorPiece(name="w", dtype="float32", shape=[4, 3], codec="None", total_bytes=48, offset=0,
                               length=48)
        header = pb.Frame(push=pb.PushHeader(worker=0, incarnation=1, worker_step=1), pieces=[piece]).SerializeToString()
        sock.sendall(RECORD.pack(PUSH, 0) + RECORD.pack(FRAME, len(header)) + header + bytes(24))  # half its data
        wait_for("the push to be watched", lambda: len(ps.shard.streams) == 1, timeout=5, every=0.02)
        started = time.monotonic()
        assert closed(sock)
        assert time.monotonic() - started < 5.0
        wait_for("the handler to end", lambda: not ps.shard.streams, timeout=5, every=0.05)
        assert ps.shard.step == 0 and not ps.shard.workers[0].receive_lock.locked()


def test_a_held_pull_whose_client_goes_away_ends(tmp_path):
    with serving(tmp_path, aggregation="Sync") as ps, raw_connection(ps) as sock:
        assert read_record(sock)[0] == dataplane.OK
        request = pb.PullRequest(worker=0, min_step=5).SerializeToString()  # held: the shard is at step 0
        sock.sendall(RECORD.pack(dataplane.PULL, len(request)) + request)
        wait_for("the pull to wait", lambda: ps.shard.waiting.get(0) == 1, timeout=5, every=0.02)
        sock.close()
        wait_for("the held pull to end", lambda: ps.shard.waiting.get(0) == 0 and not ps.shard.streams,
                 timeout=5, every=0.05)


def failed_pull(data_port: int, wait_timeout: float) -> tuple[DataPlaneError, float]:
    """One pull, without retries, from a data plane at `data_port` that never answers: its error, and
    how long it took."""
    client = PSClient(["127.0.0.1:1"], TOKEN, CHUNK, Backoff(budget=0.0), wait_timeout=wait_timeout,
                      data_addrs=[f"127.0.0.1:{data_port}"])
    try:
        started = time.monotonic()
        with pytest.raises(DataPlaneError) as caught:
            pull(client)
        return caught.value, time.monotonic() - started
    finally:
        client.close()


def test_a_shard_that_never_answers_costs_a_call_its_deadline():
    with socket.create_server(("127.0.0.1", 0)) as black_hole:
        error, seconds = failed_pull(black_hole.getsockname()[1], wait_timeout=0.5)
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert 0.4 <= seconds < 3.0


def test_a_connect_nobody_answers_gives_up_after_connect_seconds_not_the_calls_deadline(monkeypatch):
    """CONNECT_SECONDS past its edge: a SYN nobody answers (here a listener whose accept queue is full, so
    the kernel drops it, as a dead shard's pod IP still in kube-proxy's rules drops it) ends the dial
    UNAVAILABLE, retryable, long before the call's own 30 s; the worker dials again, to whatever the
    address holds by then."""
    monkeypatch.setattr(dataplane, "CONNECT_SECONDS", 0.3)
    with socket.socket() as full:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        address = full.getsockname()
        queued = []
        try:
            for _ in range(16):  # fill the accept queue (its size is the kernel's: backlog + 1)
                sock = socket.socket()
                queued.append(sock)
                sock.settimeout(0.3)
                try:
                    sock.connect(address)
                except TimeoutError:
                    break
            else:
                pytest.fail("the listener's accept queue never filled: the kernel answered every SYN")
            error, seconds = failed_pull(address[1], wait_timeout=30.0)
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            assert "no answer within 0.3 s (CONNECT_SECONDS)" in error.details()
            assert seconds < 15.0  # not the call's 30 s
        finally:
            for sock in queued:
                sock.close()


def test_a_restarted_shard_is_reached_again_through_the_pool(tmp_path):
    """Stopped and served again on the same port (a restarted pod behind its Service): the pooled
    connection is dead, the call is retried and answered by the new server."""
    with serving(tmp_path) as ps:
        client = client_of(ps, budget=10.0)
        try:
            header = pb.PushHeader(worker=0, incarnation=1, worker_step=1)
            assert client.push(0, header, gradient()).outcome == pb.PushReply.APPLIED
            ps.data.stop()
            restarted = DataServer(ps.shard, TOKEN, None, max_connections=4, drain_bytes=1 << 20)
            threading.Timer(0.5, lambda: restarted.start("127.0.0.1", ps.data_port)).start()
            header.worker_step = 2
            assert client.push(0, header, gradient()).outcome == pb.PushReply.APPLIED
            assert ps.shard.step == 2
            restarted.stop()
        finally:
            client.close()


# --- mutual TLS ---------------------------------------------------------------------------------


def test_only_the_jobs_certificate_gets_through_tls(tmp_path, job_dir, other_dir):
    with serving(tmp_path, tls_dir=job_dir) as ps:
        for name, files in (("another job's certificate", TlsFiles.load(other_dir)), ("plaintext", None)):
            client = client_of(ps, tls=files, budget=0.0)
            try:
                with pytest.raises(DataPlaneError) as caught:
                    pull(client)
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, name
            finally:
                client.close()
        # Without a client certificate: the handshake fails before any token is seen.
        import ssl

        context = ssl.create_default_context(cadata=(job_dir / "ca.crt").read_text())
        with socket.create_connection(("127.0.0.1", ps.data_port), timeout=5) as raw:
            with pytest.raises((ssl.SSLError, ConnectionError)):
                with context.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
                    sock.sendall(MAGIC + RECORD.pack(HELLO, len(TOKEN)) + TOKEN.encode())
                    read_record(sock)
        assert ps.shard.counter.received == 0
        # Another job's certificate, plaintext, no certificate: each counted (and logged) by the shard.
        wait_for("the three failed handshakes", lambda: ps.data.unserved.get("handshake") == 3, timeout=5,
                 every=0.05)
        assert sample(ps, "kubetrain_ps_data_refused_connections_total", reason="handshake") == 3


def test_a_connection_numbered_past_select_s_limit_is_watched_like_any_other(tmp_path):
    """A shard with max_connections open has descriptors numbered past 1024, where select() fails: a held
    pull must still see its client as there (and gone once it is)."""
    import fcntl

    from kubetrain.trainer.ps.dataplane import CallContext

    ours, theirs = socket.socketpair()
    # The descriptor a thousand-odd connections would give: the lowest free one from 1500 (dup2 onto 1500
    # would close whatever this long-lived test process holds there, under another test's feet).
    high = fcntl.fcntl(ours.fileno(), fcntl.F_DUPFD, 1500)
    assert high >= 1024
    conn = socket.socket(fileno=high)
    ours.close()
    try:
        context = CallContext(conn)
        assert context.is_active()  # an idle client waiting for its reply
        theirs.close()
        assert not context.is_active()  # its end: readable
    finally:
        conn.close()


def test_a_shard_raises_its_open_files_limit_to_what_its_connections_need():
    import resource

    from kubetrain.trainer.ps.dataplane import ensure_descriptors, max_connections

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    connections = max_connections(1024, 8)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))  # many containers' default
        now = ensure_descriptors(connections)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == now
        assert now == (2 * connections + 256 if hard == resource.RLIM_INFINITY else min(2 * connections + 256, hard))
        assert now > 1024 or hard <= 1024
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# --- one deadline over the handshake and HELLO, and a cap per peer address (issue 31) --------------

DRIP_EVERY = 0.25


def drip(sock: socket.socket, data: bytes) -> bool:
    """Send `data` a byte every DRIP_EVERY s; True when the shard closed the connection before the last
    byte went (its end read, or a send refused), False when every byte went."""
    import select

    for i in range(len(data)):
        if select.select([sock], [], [], 0)[0]:
            try:
                if sock.recv(1 << 16) == b"":
                    return True
            except OSError:
                return True
        try:
            sock.sendall(data[i:i + 1])
        except OSError:
            return True
        time.sleep(DRIP_EVERY)
    return False


def client_hello(tls_dir) -> bytes:
    """The first bytes a worker's TLS client sends (its ClientHello), made without a connection."""
    import ssl

    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = TlsFiles.load(tls_dir).client_context().wrap_bio(incoming, outgoing, server_hostname="j-ps-0")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def test_a_hello_dripped_a_byte_at_a_time_is_cut_at_the_deadline(tmp_path):
    hello = MAGIC + RECORD.pack(HELLO, len(TOKEN)) + TOKEN.encode()
    assert len(hello) * DRIP_EVERY > 4 * 1.0  # the drip would last 4 deadlines and more
    with serving(tmp_path, hello_seconds=1.0) as ps:
        with socket.create_connection(("127.0.0.1", ps.data_port), timeout=5) as sock:
            assert drip(sock, hello), "the shard let a dripped HELLO (with the right token) finish"
        wait_for("the refusal counted", lambda: ps.data.unserved == {"deadline": 1}, timeout=10)
        assert sample(ps, "kubetrain_ps_data_refused_connections_total", reason="deadline") == 1


def test_a_tls_handshake_dripped_a_byte_at_a_time_is_cut_at_the_deadline(tmp_path, job_dir):
    hello = client_hello(job_dir)
    assert len(hello) * DRIP_EVERY > 4 * 1.0
    with serving(tmp_path, tls_dir=job_dir, hello_seconds=1.0) as ps:
        with socket.create_connection(("127.0.0.1", ps.data_port), timeout=5) as sock:
            assert drip(sock, hello), "the shard let a dripped TLS handshake go on past its deadline"
        # Counted as the deadline's, as a HELLO dripped after the handshake is (a loaded machine may cut a
        # handshake there too: the next test's must count alike).
        wait_for("the refusal counted", lambda: ps.data.unserved == {"deadline": 1}, timeout=10)


def test_connections_of_one_address_before_hello_are_capped_past_the_edge(tmp_path):
    """A peer without the token holds at most max_pending_per_peer connections, however many it opens:
    a worker from another address is served meanwhile, and the address gets its room back as its
    connections say HELLO."""
    with serving(tmp_path, max_connections=8, max_pending_per_peer=2, hello_seconds=30.0) as ps:
        silent = [socket.create_connection(("127.0.0.1", ps.data_port), timeout=5) for _ in range(2)]
        try:
            wait_for("two connections served", lambda: len(ps.data._conns) == 2, timeout=10)
            with socket.create_connection(("127.0.0.1", ps.data_port), timeout=5) as third:
                assert closed(third), "a third connection of the address was served"
            assert ps.data.unserved == {"peer": 1}
            assert sample(ps, "kubetrain_ps_data_refused_connections_total", reason="peer") == 1
            # Another address (a worker's pod) is served while the first holds its two.
            with socket.create_connection(("127.0.0.1", ps.data_port), timeout=5,
                                          source_address=("127.0.0.2", 0)) as worker:
                worker.sendall(MAGIC + RECORD.pack(HELLO, len(TOKEN)) + TOKEN.encode())
                assert read_record(worker)[0] == dataplane.OK
            # One of the address's connections says HELLO: its room comes back.
            silent[0].sendall(MAGIC + RECORD.pack(HELLO, len(TOKEN)) + TOKEN.encode())
            assert read_record(silent[0])[0] == dataplane.OK
            with raw_connection(ps) as again:
                assert read_record(again)[0] == dataplane.OK
            assert ps.data.unserved == {"peer": 1}
        finally:
            for sock in silent:
                sock.close()


def test_a_hello_dripped_after_a_tls_handshake_is_cut_at_the_same_deadline(tmp_path, job_dir):
    """The handshake and the HELLO share one deadline: a HELLO dripped inside TLS is cut like one in the clear."""
    hello = MAGIC + RECORD.pack(HELLO, len(TOKEN)) + TOKEN.encode()
    with serving(tmp_path, tls_dir=job_dir, hello_seconds=1.0) as ps:
        raw = socket.create_connection(("127.0.0.1", ps.data_port), timeout=5)
        with TlsFiles.load(job_dir).client_context().wrap_socket(raw, server_hostname="j-ps-0") as sock:
            assert drip(sock, hello), "the shard let a HELLO dripped over TLS finish"
        wait_for("the refusal counted", lambda: ps.data.unserved == {"deadline": 1}, timeout=10)
