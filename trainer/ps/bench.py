"""Benchmarks of the parameter-server runtime: transport throughput against a raw socket, training modes.

`bench_transport(nbytes)` sends one float32 tensor of `nbytes` to a server
process on loopback through the PS transport (Push: frames, chunking, the
token check, assembly into reused buffers) and receives it back (Pull), and
sends the same bytes through a plain TCP socket, in the same run, so the
ratio holds however loaded the machine is. Every receiver is a separate
process: in one process client and server would share the GIL.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
import torch

from ..compression import as_bytes
from . import ps_pb2 as pb
from .client import PSClient
from .job import chunk_bytes as configured_chunk_bytes
from .transport import (
    GRPC_OPTIONS,
    Assembler,
    Backoff,
    Expected,
    OutTensor,
    TokenInterceptor,
    WireError,
    decode_frame,
    encode_frame,
    frames_for,
)

TOKEN = "bench"
ROUNDS = 8
ACK = b"k"


def _tensor(nbytes: int) -> torch.Tensor:
    return torch.rand(nbytes // 4, generator=torch.Generator().manual_seed(0))


def _socket_sink(nbytes: int, chunk: int) -> None:
    """Receive `nbytes` into one reused buffer per round; acknowledge each round with one byte."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        _ready(server.getsockname()[1])
        conn, _ = server.accept()
        buffer = memoryview(bytearray(nbytes))
        with conn:
            while True:
                got = 0
                while got < nbytes:
                    n = conn.recv_into(buffer[got:])
                    if n == 0:
                        return
                    got += n
                conn.sendall(ACK)


def _ready(port: int) -> None:
    print(port, flush=True)


def _transport_sink(nbytes: int, chunk: int) -> None:
    """A gRPC server with the shard's Push and Pull paths, without the optimizer."""
    tensor = _tensor(nbytes)
    expected = {"t": Expected.of(tensor)}
    scratch: dict = {}

    def push(messages, context):
        try:
            assembler = Assembler(expected, scratch)
            for message in messages:
                assembler.add(decode_frame(message))
            assembler.finish()
        except WireError as err:
            context.abort(err.code, str(err))
        return pb.PushReply(outcome=pb.PushReply.APPLIED)

    def pull(request, context):
        out = [OutTensor("t", "float32", tuple(tensor.shape), "None", as_bytes(tensor))]
        yield from frames_for(out, chunk, pb.Frame(pull=pb.PullHeader(step=0)))

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=[TokenInterceptor(TOKEN)],
                         options=GRPC_OPTIONS)
    handlers = {
        "Push": grpc.stream_unary_rpc_method_handler(push, response_serializer=pb.PushReply.SerializeToString),
        "Pull": grpc.unary_stream_rpc_method_handler(pull, request_deserializer=pb.PullRequest.FromString,
                                                     response_serializer=encode_frame),
    }
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("kubetrain.ps.v1.ParameterShard", handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    _ready(port)
    server.wait_for_termination()


SINKS = {"socket": _socket_sink, "transport": _transport_sink}


def _with_sink(kind: str, nbytes: int, chunk: int) -> tuple[subprocess.Popen, int]:
    """Start a receiver process; it prints its port once it listens."""
    process = subprocess.Popen(
        [sys.executable, "-m", "kubetrain_trainer.ps.bench", "--sink", kind, str(nbytes), str(chunk)],
        stdout=subprocess.PIPE, text=True,
    )
    line = process.stdout.readline()
    if not line.strip().isdigit():
        process.kill()
        raise RuntimeError(f"bench sink {kind!r} did not start (exit {process.wait()})")
    return process, int(line)


def bench_transport(nbytes: int = 64 << 20, chunk_bytes: int | None = None, rounds: int = ROUNDS) -> dict[str, Any]:
    """Throughput of the PS transport (push and pull) and of a raw loopback socket, and their ratios.

    The three are measured in turns, round after round, so a busy machine
    slows them alike; the ratios are of the best rounds, and the median of
    each round's own ratio is reported beside them.
    """
    chunk = chunk_bytes or configured_chunk_bytes()
    nbytes -= nbytes % 4
    tensor = _tensor(nbytes)
    payload = memoryview(as_bytes(tensor).numpy())
    sinks = [_with_sink("socket", nbytes, chunk), _with_sink("transport", nbytes, chunk)]
    (_, socket_port), (_, transport_port) = sinks
    client = PSClient([f"127.0.0.1:{transport_port}"], TOKEN, chunk, Backoff(budget=30.0))
    try:
        conn = socket.create_connection(("127.0.0.1", socket_port))
        out = [OutTensor("t", "float32", tuple(tensor.shape), "None", as_bytes(tensor))]
        header = pb.PushHeader(worker=0, worker_step=1)
        target = torch.empty_like(tensor)
        expected = {"t": Expected.of(tensor)}
        scratch: dict = {}

        def raw() -> None:
            conn.sendall(payload)
            conn.recv(1)

        ways: dict[str, Callable[[], Any]] = {
            "raw_socket": raw,
            "ps_push": lambda: client.push(0, header, out),
            "ps_pull": lambda: client.pull(0, pb.PullRequest(worker=0), lambda: Assembler(expected, scratch, {"t": target})),
        }
        rates: dict[str, list[float]] = {name: [] for name in ways}
        for round_ in range(rounds + 1):
            for name, once in ways.items():
                started = time.perf_counter()
                once()
                if round_:  # the first round warms up connections and buffers
                    rates[name].append(nbytes / (time.perf_counter() - started))
        conn.close()
        if not torch.equal(target, tensor):
            raise RuntimeError("the pulled tensor differs from the one the sink served")
    finally:
        client.close()
        for process, _ in sinks:
            process.kill()
            process.wait()

    best = {name: max(r) for name, r in rates.items()}
    paired = {
        way: statistics.median(p / s for p, s in zip(rates[way], rates["raw_socket"])) for way in ("ps_push", "ps_pull")
    }
    return {
        "bytes": nbytes,
        "chunk_bytes": chunk,
        "rounds": rounds,
        **{f"{name}_gb_per_s": round(rate / 1e9, 3) for name, rate in best.items()},
        "push_ratio": round(best["ps_push"] / best["raw_socket"], 3),
        "pull_ratio": round(best["ps_pull"] / best["raw_socket"], 3),
        "push_ratio_median_of_rounds": round(paired["ps_push"], 3),
        "pull_ratio_median_of_rounds": round(paired["ps_pull"], 3),
    }


def main(argv: list[str]) -> None:
    """`python -m kubetrain_trainer.ps.bench [NBYTES]` prints bench_transport's JSON."""
    if argv[:1] == ["--sink"]:
        kind, nbytes, chunk = argv[1], int(argv[2]), int(argv[3])
        SINKS[kind](nbytes, chunk)
        return
    print(json.dumps(bench_transport(int(argv[0]) if argv else 64 << 20), indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
