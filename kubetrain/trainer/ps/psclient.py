"""A worker's calls to the parameter servers: one reused channel per shard, token, deadlines, retries.

Every call has a deadline, so a shard that hangs (or a network that drops
packets without a reset) costs a worker at most that long per attempt:
CALL_TIMEOUT_SECONDS for calls a live shard answers at once,
wait_timeout(syncTimeoutSeconds) for the calls that may wait (a Sync pull
waits for the step, a push waits for the shard's lock), and
HEARTBEAT_TIMEOUT_SECONDS for heartbeats. The shard bounds the other side:
it cancels streams older than the longest of these (server.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc

from . import ps_pb2 as pb
from . import ps_pb2_grpc
from .dataplane import DataClient
from .transport import (
    TOKEN_KEY,
    Assembler,
    Backoff,
    ByteCounter,
    OutTensor,
    WireFrame,
    call_with_retry,
    decode_frame,
    encode_frame,
    frames_for,
    invalid,
    open_channel,
)
from .credentials import TlsFiles

PULL = "/kubetrain.ps.v1.ParameterShard/Pull"
PUSH = "/kubetrain.ps.v1.ParameterShard/Push"

# Register, Finish, Status: answered at once by a live shard; Finish first
# makes a checkpoint durable (seconds at most), hence the margin.
CALL_TIMEOUT_SECONDS = 30.0
# One try, short: a missed heartbeat is harmless, the next follows in a second.
HEARTBEAT_TIMEOUT_SECONDS = 2.0
# The least a Pull or Push is given, however short syncTimeoutSeconds is: a
# push of a large shard over a busy link takes seconds.
MIN_WAIT_TIMEOUT_SECONDS = 30.0


def wait_timeout(sync_timeout_seconds: float) -> float:
    """Deadline of a call that may wait: a Sync pull waits up to syncTimeoutSeconds for the step to
    complete (dropping the silent), and once more when the step it joined was itself late; 10 s for
    the transfer on top."""
    return max(MIN_WAIT_TIMEOUT_SECONDS, 2 * sync_timeout_seconds + 10)


class PSClient:
    """Calls to every shard of a job. `call_timeout` bounds a call; `wait_timeout` a call that may wait."""

    def __init__(
        self,
        addrs: list[str],
        token: str,
        chunk_bytes: int,
        backoff: Backoff,
        call_timeout: float = CALL_TIMEOUT_SECONDS,
        wait_timeout: float = 2 * MIN_WAIT_TIMEOUT_SECONDS,
        metrics: Any = None,
        tls: TlsFiles | None = None,
        data_addrs: list[str] | None = None,
    ):
        """`tls`: the job's certificates (mutual TLS to every shard); None: plaintext. `data_addrs`: each
        shard's data plane (dataplane.py), which then carries Pull and Push; None or empty: gRPC does."""
        self.addrs, self.chunk_bytes, self.backoff = addrs, chunk_bytes, backoff
        self.call_timeout, self.wait_timeout = call_timeout, wait_timeout
        self.metrics = metrics
        self.counter = ByteCounter(metrics)
        self.metadata = ((TOKEN_KEY, token),)
        self.channels = [open_channel(a, tls) for a in addrs]
        self._pull = [
            ch.unary_stream(PULL, request_serializer=pb.PullRequest.SerializeToString, response_deserializer=self._decode)
            for ch in self.channels
        ]
        self._push = [
            ch.stream_unary(PUSH, request_serializer=self._encode, response_deserializer=pb.PushReply.FromString)
            for ch in self.channels
        ]
        self.shards = [ps_pb2_grpc.ParameterShardStub(ch) for ch in self.channels]
        if data_addrs and len(data_addrs) != len(addrs):
            raise ValueError(f"{len(data_addrs)} data-plane addresses for {len(addrs)} shards")
        self.data = [DataClient(a, token, tls, self.counter) for a in data_addrs or []]
        self.coordinator = ps_pb2_grpc.CoordinatorStub(self.channels[0])

    def _encode(self, frame: WireFrame) -> bytes:
        message = encode_frame(frame)
        self.counter.add(sent=len(message))
        return message

    def _decode(self, message: bytes) -> WireFrame:
        self.counter.add(received=len(message))
        return decode_frame(message)

    def _call(self, method: str, shard: int, call: Callable[[], Any]) -> Any:
        def on_retry(err: grpc.RpcError, attempt: int) -> None:
            if self.metrics:
                self.metrics.rpc_retries_total.labels(method=method).inc()

        started = time.perf_counter()
        try:
            return call_with_retry(call, f"{method} to {self.addrs[shard]}", self.backoff, on_retry)
        finally:
            if self.metrics:
                self.metrics.rpc_duration_seconds.labels(method=method).observe(time.perf_counter() - started)

    def register(self, worker: int, incarnation: int, membership: int = 0, world_size: int = 0) -> pb.RegisterReply:
        """Register with ps-0's coordinator; retried while it is away, or while a resize to a size that
        takes this worker is still to be made (UNAVAILABLE)."""
        request = pb.RegisterRequest(worker=worker, incarnation=incarnation, membership=membership,
                                     world_size=world_size)
        return self._call("Register", 0, lambda: self.coordinator.Register(
            request, timeout=self.call_timeout, metadata=self.metadata))

    def heartbeat(self, worker: int, incarnation: int, worker_step: int) -> pb.HeartbeatReply:
        """One try, short deadline: a missed heartbeat is harmless, the next one follows."""
        request = pb.HeartbeatRequest(worker=worker, incarnation=incarnation, worker_step=worker_step)
        return self.coordinator.Heartbeat(request, timeout=HEARTBEAT_TIMEOUT_SECONDS, metadata=self.metadata)

    def pull(self, shard: int, request: pb.PullRequest, assembler: Callable[[], Assembler]) -> tuple[pb.PullHeader, dict]:
        """The shard's parameters into a fresh assembler per attempt; returns the header and the tensors."""

        def attempt() -> tuple[pb.PullHeader, dict]:
            collector = assembler()
            header = None
            frames = (self.data[shard].pull_frames(request, self.wait_timeout) if self.data else
                      self._pull[shard](request, timeout=self.wait_timeout, metadata=self.metadata))
            for frame in frames:
                if header is None:
                    if not frame.header.HasField("pull"):
                        raise invalid(f"{self.addrs[shard]}: pull reply without a PullHeader")
                    header = frame.header.pull
                collector.add(frame)
            if header is None:
                raise invalid(f"{self.addrs[shard]}: empty pull reply")
            return header, collector.finish()

        return self._call("Pull", shard, attempt)

    def push(self, shard: int, header: pb.PushHeader, tensors: list[OutTensor]) -> pb.PushReply:
        """Push one gradient; a retry re-sends the same (incarnation, worker_step), applied once."""
        if self.data:
            return self._call("Push", shard, lambda: self.data[shard].push(
                frames_for(tensors, self.chunk_bytes, pb.Frame(push=header)), self.wait_timeout))
        return self._call("Push", shard, lambda: self._push[shard](
            frames_for(tensors, self.chunk_bytes, pb.Frame(push=header)),
            timeout=self.wait_timeout, metadata=self.metadata))

    def report_progress(self, shard: int, header: pb.PushHeader) -> pb.PushReply:
        """A push without a gradient: the step counts for the worker (Sync stops waiting for it), nothing is applied."""
        marked = pb.PushHeader()
        marked.CopyFrom(header)
        marked.no_gradient = True
        return self.push(shard, marked, [])

    def finish(self, shard: int, worker: int, incarnation: int, cursor_json: str) -> pb.FinishReply:
        request = pb.FinishRequest(worker=worker, incarnation=incarnation, cursor_json=cursor_json)
        return self._call("Finish", shard, lambda: self.shards[shard].Finish(
            request, timeout=self.call_timeout, metadata=self.metadata))

    def status(self, shard: int) -> pb.StatusReply:
        return self.shards[shard].Status(pb.StatusRequest(), timeout=self.call_timeout, metadata=self.metadata)

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
        for data in self.data:
            data.close()
