"""Tensors over gRPC without protobuf copies: frames, chunking, assembly, channels, token, retries.

A tensor stream (Pull replies, Push requests) is a sequence of `Frame`
messages. The sender serialises a frame's header fields with protobuf and
appends the `data` field (number 15) itself: tag, length, then the tensors'
own memory, joined once into the message gRPC sends. The receiver slices
field 15 out of the received buffer as a memoryview, parses only the small
header with protobuf, and copies each piece straight into its destination
tensor (a parameter, or a gradient buffer reused across steps). The bytes on
the wire are still plain protobuf: a generated stub can send and read them.

Large payloads are cut into pieces of at most `chunk_bytes`; small ones share
a frame (bucketing), so a model of many small tensors costs a few messages,
not one per tensor.
"""

from __future__ import annotations

import hmac
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import torch

from .. import compression
from ..compression import CompressionError
from . import ps_pb2 as pb
from .credentials import TlsFiles

log = logging.getLogger(__name__)

TOKEN_KEY = "x-kubetrain-token"
DEFAULT_CHUNK_BYTES = 1 << 20
MAX_CHUNK_BYTES = 4 << 20
# A frame is at most one chunk of data plus the headers of its pieces; the
# slack covers a bucket of thousands of small tensors' headers. A larger
# message is refused by gRPC itself with RESOURCE_EXHAUSTED.
MAX_MESSAGE_BYTES = MAX_CHUNK_BYTES + (1 << 20)
DATA_FIELD_TAG = (15 << 3) | 2

RECONNECT_BACKOFF_INITIAL_MS = 100
RECONNECT_BACKOFF_MAX_MS = 500
MIN_CONNECT_TIMEOUT_MS = 3000
"""How long one dial may take before gRPC gives up on it, re-resolves the name and dials again.
gRPC's default is 20 s: a restarted shard's old pod IP is gone without a reset (its network
namespace is deleted), so a dial to it hangs the whole 20 s before the name is resolved to the new
pod (the e2e shard recovery spent 15.9 s there). A dial on loopback or a pod network, TLS
handshake included, takes milliseconds, and a few hundred on a loaded 2-core node; a dial cut
short is simply tried again after the reconnect backoff, so 3 s costs nothing but a retry."""
KEEPALIVE_MS = 10_000
"""How often each end of a connection pings the other, and how long it waits for the answer: a peer gone
without a reset (its node lost) is noticed within twice this. The answer comes from gRPC's core, without
the interpreter, so a loaded process does not miss it."""
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Our own retries (call_with_retry) know which calls are safe to repeat.
    ("grpc.enable_retries", 0),
    # Read the socket in MiB-sized slices: gRPC Python turns every slice of a
    # message into bytes separately, and the default (8 KiB, growing slowly)
    # costs the receiver about 15% more CPU per tensor (measured, 64 MiB).
    ("grpc.experimental.tcp_read_chunk_size", 4 << 20),
    ("grpc.experimental.tcp_min_read_chunk_size", 1 << 20),
    ("grpc.experimental.tcp_max_read_chunk_size", 8 << 20),
    # A restarted shard's pod comes back at a new IP. A shard's Service now has
    # a virtual address that does not change (kubetrain/engine/children.py); a job
    # made by an older operator keeps its headless Service, whose name follows
    # the pod's IP, and gRPC re-resolves a name at most every 30 s by default,
    # which kept workers dialling the dead address for 27 s in the e2e test.
    ("grpc.dns_min_time_between_resolutions_ms", 1000),
    # A shard away for seconds (restarting) is dialled again after gRPC's
    # reconnect backoff: 1 s growing by 1.6x to 120 s by default, so a shard
    # back after 6 s was reached 1.4-5 s later (measured on loopback); at most
    # RECONNECT_BACKOFF_MAX_MS between dials it is 0.4-2 s (at 1 s). Beyond it a
    # dial costs little: a refused TCP connection, twice a second per shard. At
    # 500 ms rather than 1 s, with the worker's retries capped alike
    # (Backoff.cap), a restarted shard was answered 1.6-2.6 s after it
    # listened in real pods before, and 0.4-0.7 s after (docs/benchmarks-history.md, Recovery).
    ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_INITIAL_MS),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MAX_MS),
    # gRPC core reads its minimum connect timeout from this (misleadingly named) argument.
    ("grpc.min_reconnect_backoff_ms", MIN_CONNECT_TIMEOUT_MS),
    # Both ends ping a connection every KEEPALIVE_MS and drop it when a ping goes unanswered as long: a
    # peer whose node vanished sends no reset, and a Stand call (coordinator.py) is silent for the whole
    # job, so without pings ps-0 would keep a dead worker's place held, and a standby would wait on a
    # shard that is gone. Pings go on however long no data flows, and each end accepts the other's.
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_MS),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
]

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Trailing metadata of a refused push: why, as one word a client can act on
# without parsing the message (a worker skips a step refused as non_finite).
REFUSAL_KEY = "x-kubetrain-refusal"
NON_FINITE = "non_finite"
# A call of a worker of another set of workers than the shard's (an elastic job resized): it registers again.
MEMBERSHIP = "membership"


class WireError(Exception):
    """Bad input on the wire: answered with `code` and the message, the server's state untouched.

    `reason`, when set, travels as the call's trailing metadata (REFUSAL_KEY).
    """

    def __init__(self, code: grpc.StatusCode, message: str, reason: str = ""):
        super().__init__(message)
        self.code = code
        self.reason = reason


def invalid(message: str, reason: str = "") -> WireError:
    return WireError(grpc.StatusCode.INVALID_ARGUMENT, message, reason)


def refusal_reason(err: grpc.RpcError) -> str:
    """The REFUSAL_KEY a server sent with an error status ('' when none)."""
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    return dict(trailing or ()).get(REFUSAL_KEY, "")


def first_non_finite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The name of the first tensor holding a NaN or an Inf; None when all are finite.

    One pass of torch.aminmax per tensor: a NaN anywhere makes both NaN, a
    +Inf the max, a -Inf the min, and finite values cannot overflow a min or
    a max (a sum can: float16 beyond 65504). It reads memory once and writes
    nothing: 5 ms per 64 MiB here, against 200 ms for isfinite().all(), which
    writes a bool per element first. `kubetrain bench transport` prints what
    it costs a push (finite_check_ratio).
    """
    for name, tensor in tensors.items():
        if not tensor.is_floating_point() or tensor.numel() == 0:
            continue
        low, high = torch.aminmax(tensor)
        if not (torch.isfinite(low) and torch.isfinite(high)):
            return name
    return None


class ByteCounter:
    """Bytes this process sent and received in tensor streams (thread-safe), mirrored to its metrics."""

    def __init__(self, metrics: Any = None) -> None:
        self.sent = 0
        self.received = 0
        self.metrics = metrics
        self._lock = threading.Lock()

    def add(self, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self.sent += sent
            self.received += received
        if self.metrics is not None:
            if sent:
                self.metrics.network_bytes_total.labels(direction="sent").inc(sent)
            if received:
                self.metrics.network_bytes_total.labels(direction="received").inc(received)


# --- frames ------------------------------------------------------------------


@dataclass
class WireFrame:
    """A Frame: header fields as a protobuf message, the data as buffers kept outside it."""

    header: pb.Frame
    data: list[Any] = field(default_factory=list)
    """Sender: buffers joined once on serialisation. Receiver: one memoryview into the message."""
    read_into: Callable[[memoryview], None] | None = None
    """Receiver on the data plane (dataplane.py): the data is still on the connection; each call
    reads the next len(destination) bytes of it straight into the destination (no copy of its own)."""
    size: int = 0
    """Receiver: the bytes this frame took on the wire (counted as received)."""


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode_frame(frame: WireFrame) -> bytes:
    """Serialise: protobuf for the header, then field 15 appended by hand over the raw buffers."""
    length = sum(memoryview(b).nbytes for b in frame.data)
    return b"".join([frame.header.SerializeToString(), bytes([DATA_FIELD_TAG]), _varint(length), *frame.data])


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise invalid("malformed frame: truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def decode_frame(message: bytes) -> WireFrame:
    """Parse a received Frame; field 15 stays a memoryview into `message` (no copy).

    Any valid protobuf encoding is accepted (fields in any order, data absent);
    a malformed one raises WireError(INVALID_ARGUMENT).
    """
    buf = memoryview(message)
    header_spans: list[memoryview] = []
    data = buf[0:0]
    pos = 0
    while pos < len(buf):
        start = pos
        key, pos = _read_varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            _, pos = _read_varint(buf, pos)
        elif wire_type == 1:
            pos += 8
        elif wire_type == 5:
            pos += 4
        elif wire_type == 2:
            length, pos = _read_varint(buf, pos)
            if number == 15:
                data = buf[pos : pos + length]
            pos += length
        else:
            raise invalid(f"malformed frame: field {number} has unsupported wire type {wire_type}")
        if pos > len(buf):
            raise invalid(f"malformed frame: field {number} runs past the end of the {len(buf)}-byte message")
        if number != 15:
            header_spans.append(buf[start:pos])
    return WireFrame(parse_header(b"".join(header_spans)), [data], size=len(buf))


def parse_header(raw: bytes) -> pb.Frame:
    """A Frame's header fields (everything but the data); malformed ones raise WireError(INVALID_ARGUMENT)."""
    try:
        return pb.Frame.FromString(raw)
    except Exception as err:  # google.protobuf.message.DecodeError
        raise invalid(f"malformed frame header: {err}") from None


# --- chunking --------------------------------------------------------------------


@dataclass
class OutTensor:
    """A tensor to send: its identity and its encoded payload (a flat uint8 tensor)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    codec: str
    payload: torch.Tensor


def frames_for(tensors: Iterable[OutTensor], chunk_bytes: int, first: pb.Frame | None = None) -> Iterator[WireFrame]:
    """Frames carrying every tensor: pieces of at most chunk_bytes, small tensors bucketed together.

    `first` holds header fields (push or pull) for the first frame. Always
    yields at least one frame, so a header reaches the receiver even with no
    tensors.
    """
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be in (0, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
    frame = WireFrame(first if first is not None else pb.Frame())
    room = chunk_bytes
    for tensor in tensors:
        raw = tensor.payload.numpy()
        total = raw.nbytes
        offset, index = 0, 0
        while offset < total or (total == 0 and index == 0):
            if room == 0:
                yield frame
                frame, room = WireFrame(pb.Frame()), chunk_bytes
            length = min(room, total - offset)
            frame.header.pieces.add(
                name=tensor.name, dtype=tensor.dtype, shape=tensor.shape, codec=tensor.codec,
                total_bytes=total, offset=offset, length=length, chunk_index=index,
            )
            frame.data.append(memoryview(raw[offset : offset + length]))  # type: ignore[arg-type]  # an ndarray is a buffer
            offset += length
            room -= length
            index += 1
    yield frame


@dataclass
class Expected:
    """What the receiver holds under a name: the tensor a payload must decode to."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "Expected":
        return cls(tensor.dtype, tuple(tensor.shape))

    @property
    def nbytes(self) -> int:
        # On every piece of every push: no numpy reduction, no tensor made to learn an element's size.
        return math.prod(self.shape) * self.dtype.itemsize


class Assembler:
    """Collects the pieces of a tensor stream into tensors, checking each against what is expected.

    Payloads land in a scratch buffer kept per name across streams (reused, not
    reallocated, every step), or, for raw payloads of a name in `direct`,
    straight in that tensor's memory (a worker's model parameters: one copy
    from the message into the parameter). Nothing but scratch and `direct`
    changes before `finish()` returns, so a stream rejected halfway leaves a
    server's parameters as they were.
    """

    def __init__(self, expected: dict[str, Expected], scratch: dict[str, torch.Tensor], direct: dict[str, torch.Tensor] | None = None,
                 changes: bool = False):
        """`changes`: a lossy payload is a change added to its `direct` tensor, not its value (compressed pulls)."""
        self.expected = expected
        self.scratch = scratch
        self.direct = direct or {}
        self.changes = changes
        self._received: dict[str, int] = {}
        self._total: dict[str, int] = {}
        self._codec: dict[str, str] = {}
        self._landing: dict[str, torch.Tensor] = {}

    def add(self, frame: WireFrame) -> None:
        if frame.read_into is not None:  # the data plane: each piece read from the connection into its place
            for piece in frame.header.pieces:
                frame.read_into(self._destination(piece))
            return
        data = frame.data[0] if frame.data else memoryview(b"")
        declared = sum(p.length for p in frame.header.pieces)
        if declared != data.nbytes:
            raise invalid(f"truncated frame: its pieces declare {declared} bytes but the frame carries {data.nbytes}")
        pos = 0
        for piece in frame.header.pieces:
            self._destination(piece)[:] = data[pos : pos + piece.length]
            pos += piece.length

    def _destination(self, piece: pb.TensorPiece) -> memoryview:
        """Where a piece's bytes go, once it is checked against what is expected: the next
        `piece.length` bytes of its tensor's landing buffer (counted as received)."""
        name = piece.name
        want = self.expected.get(name)
        if want is None:
            known = ", ".join(list(self.expected)[:8])
            raise invalid(f"unknown tensor {name!r}; this shard holds {len(self.expected)} tensors: {known}")
        if piece.dtype != dtype_name(want.dtype):
            raise invalid(f"tensor {name!r}: dtype {piece.dtype!r} does not match the parameter's {dtype_name(want.dtype)!r}")
        if tuple(piece.shape) != want.shape:
            raise invalid(f"tensor {name!r}: shape {list(piece.shape)} does not match the parameter's {list(want.shape)}")
        if piece.codec not in compression.ALGORITHMS:
            raise invalid(f"tensor {name!r}: unknown codec {piece.codec!r}; expected one of {', '.join(compression.ALGORITHMS)}")
        raw_bytes = want.nbytes
        # No codec makes a payload larger than the tensor plus a scale; anything bigger is hostile.
        if piece.total_bytes > raw_bytes + 64:
            raise invalid(f"tensor {name!r}: payload of {piece.total_bytes} bytes is oversized for {raw_bytes} raw bytes")
        if name not in self._received:
            if piece.offset != 0:
                raise invalid(f"tensor {name!r}: first piece starts at offset {piece.offset}, expected 0")
            self._received[name] = 0
            self._total[name] = piece.total_bytes
            self._codec[name] = piece.codec
            self._landing[name] = self._land(name, piece.codec, piece.total_bytes)
        elif (piece.total_bytes, piece.codec) != (self._total[name], self._codec[name]):
            raise invalid(f"tensor {name!r}: piece {piece.chunk_index} changes total_bytes or codec mid-tensor")
        received = self._received[name]
        if piece.offset != received:
            raise invalid(
                f"tensor {name!r}: piece {piece.chunk_index} at offset {piece.offset}, expected {received} "
                "(a chunk missing, repeated or out of order)"
            )
        end = received + piece.length
        if end > self._total[name]:
            raise invalid(f"tensor {name!r}: piece {piece.chunk_index} ends at byte {end}, past the declared total {self._total[name]}")
        self._received[name] = end
        return memoryview(self._landing[name].numpy()[received:end])  # type: ignore[arg-type]  # an ndarray is a buffer

    def _land(self, name: str, codec: str, total: int) -> torch.Tensor:
        target = self.direct.get(name)
        if target is not None and codec == compression.NoCompression.name:
            return target.detach().view(-1).view(torch.uint8)
        buffer = self.scratch.get(name)
        if buffer is None or buffer.numel() < total:
            buffer = torch.empty(total, dtype=torch.uint8)
            self.scratch[name] = buffer
        return buffer[:total]

    @property
    def payload_bytes(self) -> int:
        """Encoded bytes of the tensors received so far (what travelled, before decoding)."""
        return sum(self._total.values())

    def finish(self) -> dict[str, torch.Tensor]:
        """Every expected tensor, decoded; each must have arrived whole.

        A decoded tensor may share memory with the scratch buffers: use it
        before the next stream on this assembler's scratch.
        """
        missing = [n for n in self.expected if n not in self._received]
        if missing:
            raise invalid(f"stream lacks {len(missing)} of the shard's {len(self.expected)} tensors, e.g. {missing[:4]}")
        decoded: dict[str, torch.Tensor] = {}
        for name, received in self._received.items():
            if received != self._total[name]:
                raise invalid(f"tensor {name!r} truncated: got {received} of {self._total[name]} bytes")
            want = self.expected[name]
            try:
                decoded[name] = compression.decode(self._codec[name], self._landing[name], want.shape, want.dtype)
            except CompressionError as err:
                raise invalid(f"tensor {name!r}: {err}") from None
            target = self.direct.get(name)
            if target is not None and decoded[name].data_ptr() != target.data_ptr():
                with torch.no_grad():
                    if self.changes and self._codec[name] != compression.NoCompression.name:
                        target.add_(decoded[name])
                    else:
                        target.copy_(decoded[name])
        return decoded


# --- channels, token, retries ---------------------------------------------------------


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call whose `x-kubetrain-token` metadata is missing or wrong: UNAUTHENTICATED."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("the job token must not be empty")
        self._token = token.encode()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        sent = dict(handler_call_details.invocation_metadata or ()).get(TOKEN_KEY)
        if sent is not None and hmac.compare_digest(sent.encode(), self._token):
            return handler
        message = f"missing {TOKEN_KEY} metadata" if sent is None else f"wrong {TOKEN_KEY}"

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        factory = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(handler.request_streaming, handler.response_streaming)]
        return factory(deny, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


def open_channel(address: str, tls: TlsFiles | None = None) -> grpc.Channel:
    """A channel to a shard: mutual TLS with the job's certificates when given (credentials.py), else plaintext."""
    if tls is None:
        return grpc.insecure_channel(address, options=GRPC_OPTIONS)
    return grpc.secure_channel(address, tls.channel_credentials(), options=GRPC_OPTIONS)


PEER_AWAY_WARN_SECONDS = 30.0
"""A peer unanswered this long is a WARNING, before it an INFO line: the workers of a job start beside their
parameter servers and ask for them until they listen (1.7-1.9 s in the quickstart here), and a restarted
shard is back within its restore (seconds); 30 s is past both on a loaded machine and far inside the retry
budget (Backoff.budget, 600 s)."""
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})
"""CANCELLED too: a shard cancels the calls still in flight when it stops (SIGTERM, then its restart)
and a stream it takes for stalled; for an honest worker both are transient, and repeating is safe."""

T = TypeVar("T")


@dataclass
class Backoff:
    """Exponential backoff with full jitter (AWS architecture blog, 2015): sleep U(0, min(cap, base * 2^n))."""

    base: float = 0.05
    cap: float = 0.5
    """The longest sleep between two tries: a shard back from a restart is tried again within it
    (together with the channel's own RECONNECT_BACKOFF_MAX_MS)."""
    budget: float = 600.0
    """Seconds of consecutive failures after which the call gives up."""
    give_up: Callable[[], bool] = lambda: False
    """Asked before each retry: True stops retrying (the process was told to stop: SIGTERM)."""

    def delay(self, attempt: int) -> float:
        return random.uniform(0.0, min(self.cap, self.base * 2 ** min(attempt, 32)))  # no overflow


def call_with_retry(
    call: Callable[[], T],
    what: str,
    backoff: Backoff,
    on_retry: Callable[[grpc.RpcError, int], None] | None = None,
) -> T:
    """Run `call` until it succeeds, retrying RETRYABLE statuses within the budget.

    Only calls that are safe to repeat come here: pulls, and pushes (the server
    applies a push at most once per (worker, worker_step)). Any other status is
    raised at once; the last retryable one is raised when the budget is spent.
    """
    started = time.monotonic()
    attempt = 0
    while True:
        try:
            result = call()
            if attempt:  # how long a peer was away (a shard restarting): tests/e2e time recoveries by it
                log.info("%s: answered after %d retries, %.2f s", what, attempt, time.monotonic() - started)
            return result
        except grpc.RpcError as err:
            code = err.code()
            if code not in RETRYABLE and attempt:  # the peer is back, and refuses this call (a restarted shard)
                log.info("%s: answered after %d retries, %.2f s (%s)", what, attempt, time.monotonic() - started,
                         code.name)
            if code not in RETRYABLE or time.monotonic() - started > backoff.budget or backoff.give_up():
                raise
            if on_retry is not None:
                on_retry(err, attempt)
            # Quiet for the first attempts, then a line every 20: a peer still starting up is normal (an INFO
            # line); one away past PEER_AWAY_WARN_SECONDS is worth a WARNING.
            if attempt == 3 or attempt % 20 == 3:
                away = time.monotonic() - started
                log.log(logging.WARNING if away > PEER_AWAY_WARN_SECONDS else logging.INFO,
                        "%s: %s (%s) for %.1f s; retrying", what, code.name, err.details(), away)
            time.sleep(backoff.delay(attempt))
            attempt += 1
