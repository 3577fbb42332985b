"""The data plane: a shard's Pull and Push over a plain TCP (or mutual-TLS) connection, beside gRPC.

Why: gRPC Python turns every received slice into a bytes object and the
transport then copies it into place; its receive path cost 51-58 ms of CPU per
64 MiB against the raw socket's 15 (docs/benchmarks-history.md), and the wire reached
0.56-0.59 of the socket. Here a frame's header is read first, the Assembler
(transport.py) names where each piece goes (a parameter, or a scratch buffer
reused across steps), and the piece is read with `recv_into` straight there:
one copy, the kernel's, as for the raw socket. Sending, a frame's header and
its tensors' own memory go out in one `sendmsg` (plaintext) without joining.

The same frames (transport.frames_for: chunks of at most chunk_bytes, small
tensors bucketed), the same checks (Assembler), the same handlers
(ParameterShard.Pull and push_frames, with CallContext in place of gRPC's),
the same token (compared in constant time) and the same refusals (a status
code, its details and the refusal reason, raised on the worker as a
DataPlaneError, a grpc.RpcError, so call_with_retry and the worker's handling
of each refusal are unchanged). gRPC keeps every other call (Register,
Heartbeat, Stand, Finish, Status): the data plane carries tensors only.

The protocol, integers big-endian. Every record is a kind (1 byte), a length
(4 bytes) and that many bytes:

    client, once per connection: MAGIC, then HELLO with the job's token
    server: OK, or ERROR and the connection closed
    a call:  PULL with a PullRequest   -> FRAME..., END   or ERROR
             PUSH, FRAME..., END       -> REPLY (a PushReply) or ERROR
    FRAME:   a Frame's header fields (protobuf, without the data field),
             then the data: its pieces' lengths summed, outside the record
    ERROR:   JSON {"code": a grpc.StatusCode name, "details", "reason"}

One call at a time per connection; a worker keeps POOL_SIZE idle connections
per shard. The limits below are named and tested past their edge
(tests/ps/test_dataplane.py).
"""

from __future__ import annotations

import hmac
import json
import logging
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc

from . import ps_pb2 as pb
from .credentials import TlsFiles
from .transport import (
    KEEPALIVE_MS,
    MAX_CHUNK_BYTES,
    MAX_MESSAGE_BYTES,
    REFUSAL_KEY,
    ByteCounter,
    WireError,
    WireFrame,
    invalid,
    parse_header,
)

log = logging.getLogger(__name__)

MAGIC = b"KTDP\x01"
"""First bytes a client sends: the protocol and its version. Anything else (a gRPC or HTTP client at
the wrong port) is closed at once."""
HELLO, OK, PULL, PUSH, FRAME, END, REPLY, ERROR = range(1, 9)
RECORD = struct.Struct(">BI")

MAX_HEADER_BYTES = MAX_MESSAGE_BYTES - MAX_CHUNK_BYTES
"""The largest record other than a frame's data (a frame's header, a request, a reply): the same 1 MiB
of slack gRPC's message limit leaves for the headers of a bucket of thousands of small tensors."""
MAX_FRAME_DATA_BYTES = MAX_CHUNK_BYTES
"""The most data one frame may declare (the largest chunk a sender may cut), checked before a byte of
it is read: a frame declaring more is refused with RESOURCE_EXHAUSTED, as gRPC refuses a larger message."""
MAX_TOKEN_BYTES = 4096
"""The longest token a HELLO may carry (the operator's are 43 characters)."""
HELLO_SECONDS = 10.0
"""A new connection must finish its TLS handshake and its HELLO within this, one deadline over both
(each read waits only for what is left of it), or it is closed: a client that connects and says
nothing, or drips a byte at a time (a per-read timeout once kept such a connection 6 s past a 1 s
limit, for as long as it dripped), holds a thread no longer."""
MAX_PENDING_PER_PEER = 32
"""Connections from one address that have not finished their HELLO, at once. An honest worker opens
one or two at a time (its pool, a retry racing a call) and finishes its HELLO in milliseconds; a
local run's workers all connect from 127.0.0.1 and may start together, hence 32. One more is closed
at once (counted, reason `peer`), and an honest worker's call retries it with its backoff; so a
peer without the token cannot take every one of max_connections' slots and keep out the workers
that hold it (it once did), unless it comes from many addresses."""
IDLE_SECONDS = 120.0
"""A connection without a call for this long is closed by the shard (a worker calls every step;
its pool finds the closed connection readable and drops it before using it)."""
IO_SECONDS = 60.0
"""The longest one read or write of a call may block on the shard's side: a backstop only, since the
shard's watchdog (server.py: PUSH_STALL_SECONDS, STREAM_GRACE_SECONDS) cancels stalled calls first."""
DRAIN_SECONDS = 5.0
"""After refusing a push mid-stream the shard reads (and drops) what the client still sends, for
at most this long and `drain_bytes`, so the client finishes sending and reads the refusal rather
than a reset connection."""
CONNECT_SECONDS = 1.0
"""The longest a worker's TCP connect to a shard may wait for the shard's SYN-ACK; the TLS handshake and
HELLO then get the call's own timeout. The kernel answers a SYN on a listening port in milliseconds,
however loaded the node; one unanswered for a second went to an address nobody holds (a dead shard's
pod IP, still in kube-proxy's rules for a moment after the pod went: the connect would hang for the
3 s of MIN_CONNECT_TIMEOUT_MS, then for ARP's own timeout, while the new pod already listened), and a
new dial, to the address kube-proxy holds now, is better than waiting (docs/benchmarks-history.md, Recovery)."""
POOL_SIZE = 2
"""Idle connections a worker keeps per shard: it makes one call per shard at a time."""
IOV_MAX = 512
"""Buffers per sendmsg call (Linux allows 1024)."""


def max_connections(max_workers: int, max_standbys: int) -> int:
    """Connections a shard serves at once, each with its own thread: two per worker (a call and a
    retry racing it), standbys once placed, and some to spare. One more is closed at once, logged."""
    return 2 * (max_workers + max_standbys) + 16


def ensure_descriptors(connections: int) -> int:
    """Raise this process's soft limit on open files to what `connections` need (a descriptor each, and
    as many again for gRPC's and the files'), within the hard limit; returns the soft limit now. Many
    containers start with a soft limit of 1024, below a shard's max_connections."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 2 * connections + 256
    if soft != resource.RLIM_INFINITY and soft < wanted:
        soft = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        if soft < wanted:
            log.warning("data plane: open files limited to %d (the hard limit); %d connections want %d",
                        soft, connections, wanted)
    return soft


# --- errors ---------------------------------------------------------------------------------------


class DataPlaneError(grpc.RpcError):
    """A data-plane call's failure as gRPC would report it: a status code, details, a refusal reason."""

    def __init__(self, code: grpc.StatusCode, details: str, reason: str = ""):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details, self._reason = code, details, reason

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((REFUSAL_KEY, self._reason),) if self._reason else ()


class _Aborted(Exception):
    """A handler ended its call with a status (CallContext.abort)."""

    def __init__(self, code: grpc.StatusCode, details: str, reason: str):
        super().__init__(details)
        self.code, self.details, self.reason = code, details, reason


def _error_record(code: grpc.StatusCode, details: str, reason: str = "") -> bytes:
    body = json.dumps({"code": code.name, "details": details, "reason": reason}).encode()
    return RECORD.pack(ERROR, len(body)) + body


def _parse_error(raw: bytes) -> DataPlaneError:
    try:
        body = json.loads(raw)
        code = grpc.StatusCode[body["code"]]
        return DataPlaneError(code, str(body.get("details", "")), str(body.get("reason", "")))
    except (ValueError, KeyError, TypeError):
        return DataPlaneError(grpc.StatusCode.INTERNAL, f"malformed error record from the shard: {raw[:200]!r}")


# --- reading and writing --------------------------------------------------------------------------


def _before(deadline: float | None, conn: socket.socket) -> None:
    """A read is about to wait: for what is left of `deadline` (monotonic), if there is one."""
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the deadline passed")
        conn.settimeout(left)


def _read_exactly(conn: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill `view` from the connection (its own buffer: recv_into, no copy of ours); each read waits
    at most for what is left of `deadline`, when one is given."""
    while view.nbytes:
        _before(deadline, conn)
        n = conn.recv_into(view)
        if not n:
            raise ConnectionError("the peer closed the connection mid-record")
        view = view[n:]


def _read_record(conn: socket.socket, kinds: tuple[int, ...], limit: int = MAX_HEADER_BYTES,
                 at_boundary: bool = False, deadline: float | None = None) -> tuple[int, bytes]:
    """One record of an expected kind, at most `limit` bytes. `at_boundary`: a close before its first
    byte is the peer's clean end (EOFError), not a broken record. `deadline`: for the whole record."""
    prefix = bytearray(RECORD.size)
    view = memoryview(prefix)
    _before(deadline, conn)
    n = conn.recv_into(view)
    if not n:
        if at_boundary:
            raise EOFError
        raise ConnectionError("the peer closed the connection")
    _read_exactly(conn, view[n:], deadline)
    kind, length = RECORD.unpack(prefix)
    if kind not in kinds:
        raise WireError(grpc.StatusCode.INVALID_ARGUMENT, f"data plane: unexpected record kind {kind} "
                        f"(expected one of {list(kinds)})")
    if length > limit:
        raise WireError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"data plane: a record of {length} bytes exceeds the limit of {limit}")
    body = bytearray(length)
    _read_exactly(conn, memoryview(body), deadline)
    return kind, bytes(body)


def _skip(conn: socket.socket, nbytes: int) -> None:
    scratch = memoryview(bytearray(min(nbytes, 1 << 20)))
    while nbytes:
        _read_exactly(conn, scratch[: min(nbytes, scratch.nbytes)])
        nbytes -= min(nbytes, scratch.nbytes)


class _Frames:
    """The frames of a stream up to its END, as WireFrames whose data the consumer reads
    (Assembler.add through `read_into`); whatever data a consumer leaves is skipped."""

    def __init__(self, conn: socket.socket, errors: bool = False):
        self.conn, self.errors, self.ended = conn, errors, False

    def __iter__(self) -> Iterator[WireFrame]:
        kinds = (FRAME, END, ERROR) if self.errors else (FRAME, END)
        while True:
            kind, raw = _read_record(self.conn, kinds)
            if kind == ERROR:
                raise _parse_error(raw)
            if kind == END:
                self.ended = True
                return
            header = parse_header(raw)
            declared = sum(p.length for p in header.pieces)
            if declared > MAX_FRAME_DATA_BYTES:
                raise WireError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"a frame declares {declared} bytes of data; at most {MAX_FRAME_DATA_BYTES} "
                                "(MAX_CHUNK_BYTES) per frame")
            left = [declared]

            def read_into(dest: memoryview, left: list[int] = left) -> None:
                if dest.nbytes > left[0]:  # an Assembler reads its pieces' lengths: never more
                    raise invalid(f"a read of {dest.nbytes} bytes past the frame's remaining {left[0]}")
                _read_exactly(self.conn, dest)
                left[0] -= dest.nbytes

            yield WireFrame(header, [], read_into=read_into, size=RECORD.size + len(raw) + declared)
            if left[0]:
                _skip(self.conn, left[0])


def _send(conn: socket.socket, buffers: list[Any]) -> int:
    """Send every buffer in order; returns the bytes sent. Plaintext: sendmsg, the tensors' own memory
    without a join. TLS (which has no sendmsg): small buffers joined, large ones sent as they are."""
    views = [memoryview(b).cast("B") for b in buffers]
    views = [v for v in views if v.nbytes]
    total = sum(v.nbytes for v in views)
    if isinstance(conn, ssl.SSLSocket):
        small: list[memoryview] = []
        for view in views:
            if view.nbytes < 64 << 10:
                small.append(view)
                continue
            if small:
                conn.sendall(b"".join(small))
                small = []
            conn.sendall(view)
        if small:
            conn.sendall(b"".join(small))
        return total
    while views:
        sent = conn.sendmsg(views[:IOV_MAX])
        while sent:
            if sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0
    return total


def _frame_buffers(frame: WireFrame) -> list[Any]:
    header = frame.header.SerializeToString()
    return [RECORD.pack(FRAME, len(header)) + header, *frame.data]


def _tune(conn: socket.socket) -> None:
    """No Nagle delay (a small record is a whole call's reply); TCP keepalive as gRPC's (KEEPALIVE_MS):
    a peer lost with its node is noticed within about twice that."""
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    seconds = max(1, KEEPALIVE_MS // 1000)
    for option, value in (("TCP_KEEPIDLE", seconds), ("TCP_KEEPINTVL", seconds), ("TCP_KEEPCNT", 2)):
        if hasattr(socket, option):
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def _readable(conn: socket.socket) -> bool:
    """Whether the peer sent something (or closed): never expected of an idle connection or a waiting call.

    poll(), not select(): select() refuses a descriptor numbered 1024 or more (FD_SETSIZE), and a shard
    serving max_connections has descriptors far past that."""
    poller = select.poll()
    try:
        poller.register(conn, select.POLLIN | select.POLLPRI)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True  # a closed socket (fileno -1): as good as readable, never to be used


# --- the shard's side -----------------------------------------------------------------------------


class CallContext:
    """What a shard's handler asks of its call (the part of grpc.ServicerContext it uses), on a connection."""

    def __init__(self, conn: socket.socket):
        self._conn = conn
        self._cancelled = False
        self._reason = ""

    def is_active(self) -> bool:
        # A client sends nothing while it waits for its reply: anything readable is its end.
        return not self._cancelled and not _readable(self._conn)

    def set_trailing_metadata(self, metadata: Iterable[tuple[str, str]]) -> None:
        self._reason = dict(metadata).get(REFUSAL_KEY, "")

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details, self._reason)

    def cancel(self) -> None:
        """The shard's watchdog: a stalled or overdue call. Its blocked read or write fails at once."""
        self._cancelled = True
        try:
            self._conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class DataServer:
    """A shard's data-plane listener: one thread per connection, at most `max_connections`."""

    def __init__(self, shard: Any, token: str, tls: TlsFiles | None, max_connections: int,
                 drain_bytes: int, hello_seconds: float = HELLO_SECONDS, idle_seconds: float = IDLE_SECONDS,
                 metrics: Any = None, max_pending_per_peer: int = MAX_PENDING_PER_PEER):
        """`shard`: a ParameterShard (Pull, push_frames, counter). `drain_bytes`: the most a refused push
        is read on for (the shard's parameter bytes and a frame of slack). `metrics`: TrainerMetrics
        (ps_data_connections, ps_data_refused_connections_total), or None."""
        if not token:
            raise ValueError("the job token must not be empty")
        self.shard = shard
        self._token = token.encode()
        self._ssl = tls.server_context() if tls is not None else None
        self.max_connections = max_connections
        self.drain_bytes = drain_bytes
        self.hello_seconds = hello_seconds
        self.idle_seconds = idle_seconds
        self.max_pending_per_peer = max_pending_per_peer
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._pending: dict[str, int] = {}  # peer address -> its connections before their HELLO
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self.metrics = metrics
        self.unserved: dict[str, int] = {}
        """Connections closed before any call, by reason: limit, peer, handshake, protocol, deadline."""

    def start(self, host: str, port: int) -> int:
        """Listen on host:port (0: any free port) and serve; returns the port."""
        self._listener = socket.create_server((host, port), backlog=128)
        self._thread = threading.Thread(target=self._accept, name="ps-data-accept", daemon=True)
        self._thread.start()
        return self._listener.getsockname()[1]

    def stop(self) -> None:
        """Stop listening and end every connection, calls in flight included (as gRPC's stop(grace=None))."""
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _unserved(self, reason: str, what: str) -> None:
        """A connection closed before any call: counted by reason, logged the first time and every 100th."""
        with self._lock:
            self.unserved[reason] = seen = self.unserved.get(reason, 0) + 1
        if self.metrics:
            self.metrics.ps_data_refused_connections_total.labels(reason=reason).inc()
        if seen == 1 or seen % 100 == 0:
            log.warning("data plane: %s (%d %s refusals so far)", what, seen, reason)

    def _count_connections(self) -> None:
        if self.metrics:
            with self._lock:
                self.metrics.ps_data_connections.set(len(self._conns))

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                conn, address = self._listener.accept()
            except OSError:
                return  # stop()
            peer = str(address[0])
            with self._lock:
                full = len(self._conns) >= self.max_connections
                crowded = not full and self._pending.get(peer, 0) >= self.max_pending_per_peer
                if not full and not crowded:
                    self._conns.add(conn)
                    self._pending[peer] = self._pending.get(peer, 0) + 1
            self._count_connections()
            if full:
                self._unserved("limit", f"refused a connection: {self.max_connections} connections already "
                                        "served, the limit (max_connections)")
                conn.close()
                continue
            if crowded:
                self._unserved("peer", f"refused a connection from {peer}: {self.max_pending_per_peer} of its "
                                       "connections have not said HELLO yet, the limit (max_pending_per_peer)")
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, peer), name="ps-data", daemon=True).start()

    def _greeted(self, peer: str) -> None:
        """One of `peer`'s connections is past its HELLO (served, or closed)."""
        with self._lock:
            left = self._pending.get(peer, 0) - 1
            if left > 0:
                self._pending[peer] = left
            else:
                self._pending.pop(peer, None)

    def _serve(self, conn: socket.socket, peer: str) -> None:
        raw = conn
        pending = True
        try:
            _tune(conn)
            # One deadline over the handshake and the HELLO. The TLS handshake waits for the socket's
            # timeout as a whole (CPython's do_handshake keeps its own deadline); the HELLO's reads
            # each wait for what is left (_read_record's deadline).
            deadline = time.monotonic() + self.hello_seconds
            conn.settimeout(self.hello_seconds)
            if self._ssl is not None:
                try:
                    conn = self._ssl.wrap_socket(conn, server_side=True)
                except ssl.SSLError as err:  # no certificate, another CA's, plaintext: never gets further
                    self._unserved("handshake", f"TLS handshake failed: {err.reason or err}")
                    return
                except TimeoutError:  # a handshake dripped, or never sent: the same deadline as the HELLO's
                    self._unserved("deadline", f"closed a connection from {peer} that did not finish its handshake "
                                               f"and HELLO within {self.hello_seconds:g} s (hello_seconds)")
                    return
                with self._lock:
                    self._conns.discard(raw)
                    self._conns.add(conn)
            try:
                if not self._hello(conn, deadline):
                    return
            except TimeoutError:
                self._unserved("deadline", f"closed a connection from {peer} that did not finish its handshake "
                                           f"and HELLO within {self.hello_seconds:g} s (hello_seconds)")
                return
            pending = False
            self._greeted(peer)  # before the OK: a peer that read it may open its next connection at once
            conn.sendall(RECORD.pack(OK, 0))
            while True:
                conn.settimeout(self.idle_seconds)
                try:
                    kind, body = _read_record(conn, (PULL, PUSH), at_boundary=True)
                except EOFError:
                    return
                conn.settimeout(IO_SECONDS)
                keep = self._pull(conn, body) if kind == PULL else self._push(conn)
                if not keep:
                    return
        except WireError as err:  # a malformed record between calls: refused, and the connection closed
            self._refuse(conn, err.code, str(err))
        except (OSError, EOFError, ConnectionError):
            pass  # the client went away, a timeout, or stop(): nothing to answer
        except Exception:  # a bug: the client gets INTERNAL, the log the traceback
            log.exception("data plane: a call failed")
            self._refuse(conn, grpc.StatusCode.INTERNAL, "internal error in the shard's data plane")
        finally:
            if pending:
                self._greeted(peer)
            with self._lock:
                self._conns.discard(conn)
                self._conns.discard(raw)
            self._count_connections()
            try:
                conn.close()
            except OSError:
                pass

    def _hello(self, conn: socket.socket, deadline: float) -> bool:
        magic = bytearray(len(MAGIC))
        _read_exactly(conn, memoryview(magic), deadline)
        if bytes(magic) != MAGIC:
            self._unserved("protocol", f"closed a connection that does not speak it (first bytes {bytes(magic)!r})")
            return False
        _, token = _read_record(conn, (HELLO,), limit=MAX_TOKEN_BYTES, deadline=deadline)
        if not hmac.compare_digest(token, self._token):
            self._refuse(conn, grpc.StatusCode.UNAUTHENTICATED, "wrong job token")
            return False
        return True

    def _refuse(self, conn: socket.socket, code: grpc.StatusCode, details: str, reason: str = "",
                drain: int = 1 << 20) -> None:
        """Send a refusal, then read on (dropping it) what the client still sends, within DRAIN_SECONDS
        and `drain` bytes, so that it reads the refusal rather than a reset; the caller closes."""
        try:
            conn.settimeout(DRAIN_SECONDS)
            conn.sendall(_error_record(code, details, reason))
            conn.shutdown(socket.SHUT_WR)  # the client reads the refusal, then the end at once
            deadline = time.monotonic() + DRAIN_SECONDS
            scratch = memoryview(bytearray(1 << 20))
            while drain > 0 and time.monotonic() < deadline:
                n = conn.recv_into(scratch[: min(drain, scratch.nbytes)])
                if not n:
                    return
                drain -= n
        except OSError:
            pass

    def _pull(self, conn: socket.socket, body: bytes) -> bool:
        try:
            request = pb.PullRequest.FromString(body)
        except Exception as err:  # google.protobuf.message.DecodeError
            conn.sendall(_error_record(grpc.StatusCode.INVALID_ARGUMENT, f"malformed PullRequest: {err}"))
            return True
        context = CallContext(conn)
        reply = self.shard.Pull(request, context)
        try:
            for frame in reply:
                self.shard.counter.add(sent=_send(conn, _frame_buffers(frame)))
        except _Aborted as err:
            conn.sendall(_error_record(err.code, err.details, err.reason))
            return True
        finally:
            reply.close()  # a client gone mid-reply: the handler's stream leaves the watchdog's list now
        if context._cancelled or not context.is_active():
            return False  # cancelled, or its client gone: no END, the client sees the connection close
        conn.sendall(RECORD.pack(END, 0))
        return True

    def _push(self, conn: socket.socket) -> bool:
        context = CallContext(conn)
        frames = _Frames(conn)
        try:
            reply = self.shard.push_frames(iter(frames), context)
        except _Aborted as err:
            if frames.ended:  # the whole stream was read: the connection is in step
                conn.sendall(_error_record(err.code, err.details, err.reason))
                return True
            self._refuse(conn, err.code, err.details, err.reason, drain=self.drain_bytes)
            return False
        if not frames.ended:
            return False  # cannot happen with our handler (it reads to the end); never serve out of step
        body = reply.SerializeToString()
        conn.sendall(RECORD.pack(REPLY, len(body)) + body)
        return True


# --- the worker's side ----------------------------------------------------------------------------


@dataclass
class _Conn:
    sock: socket.socket
    greeted: bool = False
    """Whether the shard's answer to this connection's HELLO was read (it is read with the first call's reply)."""
    reusable: bool = False
    """Set by a call that ended in step with the shard: the connection goes back to the pool."""


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected host:port, got {address!r}")
    return host.strip("[]"), int(port)


class DataClient:
    """One shard's data plane, for a worker: pooled connections, one call on each at a time.

    `counter` counts the frames (their records, headers and data) both ways, as the shard counts
    them: a worker's bytes sent are its shards' bytes received, as over gRPC."""

    def __init__(self, address: str, token: str, tls: TlsFiles | None, counter: ByteCounter,
                 pool_size: int = POOL_SIZE):
        self.address = address
        self.host, self.port = split_address(address)
        self._hello = MAGIC + RECORD.pack(HELLO, len(token.encode())) + token.encode()
        self._ssl = tls.client_context() if tls is not None else None
        self.counter = counter
        self.pool_size = pool_size
        self._idle: list[_Conn] = []
        self._lock = threading.Lock()

    def _failed(self, err: BaseException, what: str) -> DataPlaneError:
        if isinstance(err, (socket.timeout, TimeoutError)):
            return DataPlaneError(grpc.StatusCode.DEADLINE_EXCEEDED, f"{what} to {self.address}: deadline exceeded")
        return DataPlaneError(grpc.StatusCode.UNAVAILABLE, f"{what} to {self.address}: {err or type(err).__name__}")

    def _take(self, timeout: float) -> _Conn:
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                if not _readable(conn.sock):  # a closed one (the shard restarted, or closed it idle) is readable
                    conn.sock.settimeout(timeout)
                    return conn
                conn.sock.close()
        try:
            sock = socket.create_connection((self.host, self.port), timeout=min(timeout, CONNECT_SECONDS))
        except (socket.timeout, TimeoutError):
            raise DataPlaneError(grpc.StatusCode.UNAVAILABLE, f"connect to {self.address}: no answer within "
                                 f"{min(timeout, CONNECT_SECONDS):g} s (CONNECT_SECONDS)") from None
        except OSError as err:
            raise self._failed(err, "connect") from None
        try:
            sock.settimeout(timeout)  # the handshake and HELLO: the call's own timeout (the SSLSocket keeps it)
            _tune(sock)
            if self._ssl is not None:
                sock = self._ssl.wrap_socket(sock, server_hostname=self.host)
            sock.sendall(self._hello)  # its answer is read with the first call's reply: no round trip of its own
        except (OSError, ssl.SSLError) as err:
            sock.close()
            raise self._failed(err, "connect") from None
        return _Conn(sock)

    def _give_back(self, conn: _Conn) -> None:
        with self._lock:
            if len(self._idle) < self.pool_size:
                self._idle.append(conn)
                return
        conn.sock.close()

    def _greeted(self, conn: _Conn) -> None:
        if not conn.greeted:
            kind, raw = _read_record(conn.sock, (OK, ERROR))
            if kind == ERROR:
                raise _parse_error(raw)
            conn.greeted = True

    @contextmanager
    def _lease(self, timeout: float, what: str) -> Iterator[_Conn]:
        """A connection for one call: given back to the pool if the call ended in step with the shard
        (`reusable` set by the call), closed otherwise; a broken connection is the call's UNAVAILABLE."""
        conn = self._take(timeout)
        conn.reusable = False
        try:
            yield conn
        except (OSError, EOFError) as err:
            raise self._failed(err, what) from None
        finally:
            if conn.reusable:
                self._give_back(conn)
            else:
                conn.sock.close()

    def pull_frames(self, request: pb.PullRequest, timeout: float) -> Iterator[WireFrame]:
        """A Pull's reply frames, each read by its consumer (Assembler.add) straight into place."""
        with self._lease(timeout, "Pull") as conn:
            body = request.SerializeToString()
            conn.sock.sendall(RECORD.pack(PULL, len(body)) + body)
            self._greeted(conn)
            frames = _Frames(conn.sock, errors=True)
            for frame in frames:
                self.counter.add(received=frame.size)
                yield frame
            conn.reusable = frames.ended

    def push(self, frames: Iterable[WireFrame], timeout: float) -> pb.PushReply:
        with self._lease(timeout, "Push") as conn:
            try:
                conn.sock.sendall(RECORD.pack(PUSH, 0))
                for frame in frames:
                    self.counter.add(sent=_send(conn.sock, _frame_buffers(frame)))
                conn.sock.sendall(RECORD.pack(END, 0))
            except OSError as err:
                # The shard may have refused the push and closed: its refusal can still be read.
                refusal = self._refusal_after(conn)
                raise (refusal or self._failed(err, "Push")) from None
            self._greeted(conn)
            kind, raw = _read_record(conn.sock, (REPLY, ERROR))
            if kind == ERROR:
                raise _parse_error(raw)
            reply = pb.PushReply.FromString(raw)
            conn.reusable = True
            return reply

    def _refusal_after(self, conn: _Conn) -> DataPlaneError | None:
        """The shard's refusal, if it sent one before the connection broke."""
        try:
            conn.sock.settimeout(1.0)
            self._greeted(conn)
            kind, raw = _read_record(conn.sock, (REPLY, ERROR))
            return _parse_error(raw) if kind == ERROR else None
        except DataPlaneError as refusal:  # the HELLO's: a wrong token
            return refusal
        except (OSError, WireError, EOFError):
            return None

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.sock.close()

