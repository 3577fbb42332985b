"""Benchmarks of the parameter-server runtime: transport throughput against a raw socket, training modes.

`bench_transport(nbytes)` sends one float32 tensor of `nbytes` to a server
process on loopback through the PS transport (Push: frames, chunking, the
token check, assembly into reused buffers) and receives it back (Pull), and
sends the same bytes through a plain TCP socket, in the same run, so the
ratio holds however loaded the machine is. Every receiver is a separate
process: in one process client and server would share the GIL. A second
transport receiver also checks the received gradient for NaN and Inf, as a
shard does before it applies one: `finite_check_ratio` is the cost of that
check, as push throughput with it over push throughput without. Given the
job's certificates (`tls_dir`), a third one serves over mutual TLS, as a shard
of a kubetrain job does: `tls_push_ratio` and `tls_pull_ratio` are TLS
throughput over plaintext throughput, measured in the same rounds.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import torch

from kubetrain_operator.api.tls import TLS_DIR_VAR

from ..compression import as_bytes
from . import ps_pb2 as pb
from .client import PSClient
from .job import chunk_bytes as configured_chunk_bytes
from .tls import TlsFiles
from .tls import from_env as tls_from_env
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
    first_non_finite,
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


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) a process has used so far, from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        # Fields after the parenthesised command name; utime and stime are the 12th and 13th.
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _ready(port: int) -> None:
    print(port, flush=True)


def _transport_sink(nbytes: int, chunk: int, check_finite: bool = False) -> None:
    """A gRPC server with the shard's Push and Pull paths, without the optimizer."""
    tensor = _tensor(nbytes)
    expected = {"t": Expected.of(tensor)}
    scratch: dict = {}

    def push(messages, context):
        try:
            assembler = Assembler(expected, scratch)
            for message in messages:
                assembler.add(decode_frame(message))
            grads = assembler.finish()
            if check_finite and first_non_finite(grads) is not None:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "not finite")
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
    tls = tls_from_env()  # the transport-tls sink: started with the job's certificates (bench_transport)
    port = server.add_insecure_port("127.0.0.1:0") if tls is None else \
        server.add_secure_port("127.0.0.1:0", tls.server_credentials())
    server.start()
    _ready(port)
    server.wait_for_termination()


SINKS = {
    "socket": _socket_sink,
    "transport": _transport_sink,
    "transport-checked": lambda nbytes, chunk: _transport_sink(nbytes, chunk, check_finite=True),
    "transport-tls": _transport_sink,  # with TLS_DIR_VAR in its environment
}


def _with_sink(kind: str, nbytes: int, chunk: int, tls_dir: Path | None = None) -> tuple[subprocess.Popen, int]:
    """Start a receiver process; it prints its port once it listens."""
    env = {k: v for k, v in os.environ.items() if k != TLS_DIR_VAR}
    if tls_dir is not None:
        env[TLS_DIR_VAR] = str(tls_dir)
    process = subprocess.Popen(
        [sys.executable, "-m", "kubetrain_trainer.ps.bench", "--sink", kind, str(nbytes), str(chunk)],
        stdout=subprocess.PIPE, text=True, env=env,
    )
    line = process.stdout.readline()
    if not line.strip().isdigit():
        process.kill()
        raise RuntimeError(f"bench sink {kind!r} did not start (exit {process.wait()})")
    return process, int(line)


def bench_transport(
    nbytes: int = 64 << 20, chunk_bytes: int | None = None, rounds: int = ROUNDS, tls_dir: Path | None = None,
) -> dict[str, Any]:
    """Throughput of the PS transport (push and pull) and of a raw loopback socket, and their ratios;
    with `tls_dir` (a job's certificates, api.tls.FILES) also over mutual TLS, and its ratio to plaintext.

    The three are measured in turns, round after round, so a busy machine
    slows them alike; the ratios are of the best rounds, and the median of
    each round's own ratio is reported beside them.
    """
    chunk = chunk_bytes or configured_chunk_bytes()
    nbytes -= nbytes % 4
    tensor = _tensor(nbytes)
    payload = memoryview(as_bytes(tensor).numpy())
    sinks = [_with_sink(kind, nbytes, chunk) for kind in ("socket", "transport", "transport-checked")]
    (_, socket_port), (_, transport_port), (_, checked_port) = sinks
    client = PSClient([f"127.0.0.1:{transport_port}", f"127.0.0.1:{checked_port}"], TOKEN, chunk,
                      Backoff(budget=30.0))
    tls_client = None
    if tls_dir is not None:
        sinks.append(_with_sink("transport-tls", nbytes, chunk, tls_dir))
        tls_client = PSClient([f"127.0.0.1:{sinks[-1][1]}"], TOKEN, chunk, Backoff(budget=30.0),
                              tls=TlsFiles.load(tls_dir))
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
            "ps_push_checked": lambda: client.push(1, header, out),
            "ps_pull": lambda: client.pull(0, pb.PullRequest(worker=0), lambda: Assembler(expected, scratch, {"t": target})),
        }
        if tls_client is not None:
            ways["ps_push_tls"] = lambda: tls_client.push(0, header, out)
            ways["ps_pull_tls"] = lambda: tls_client.pull(
                0, pb.PullRequest(worker=0), lambda: Assembler(expected, scratch, {"t": target}))
        # Who receives: a sink process for the socket and pushes, this process for pulls.
        receiver = {"raw_socket": sinks[0][0].pid, "ps_push": sinks[1][0].pid, "ps_push_checked": sinks[2][0].pid,
                    "ps_pull": os.getpid(), "ps_pull_tls": os.getpid()}
        if tls_client is not None:
            receiver["ps_push_tls"] = sinks[3][0].pid
        rates: dict[str, list[float]] = {name: [] for name in ways}
        cpu: dict[str, float] = {name: 0.0 for name in ways}
        for round_ in range(rounds + 1):
            for name, once in ways.items():
                cpu_before = _cpu_seconds(receiver[name])
                started = time.perf_counter()
                once()
                if round_:  # the first round warms up connections and buffers
                    rates[name].append(nbytes / (time.perf_counter() - started))
                    cpu[name] += _cpu_seconds(receiver[name]) - cpu_before
        conn.close()
        if not torch.equal(target, tensor):
            raise RuntimeError("the pulled tensor differs from the one the sink served")
    finally:
        client.close()
        if tls_client is not None:
            tls_client.close()
        for process, _ in sinks:
            process.kill()
            process.wait()

    best = {name: max(r) for name, r in rates.items()}
    paired = {
        way: statistics.median(p / s for p, s in zip(rates[way], rates["raw_socket"])) for way in ("ps_push", "ps_pull")
    }
    checked = statistics.median(c / p for c, p in zip(rates["ps_push_checked"], rates["ps_push"]))
    check_seconds = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        first_non_finite({"t": tensor})
        check_seconds = min(check_seconds, time.perf_counter() - started)
    return {
        "bytes": nbytes,
        "chunk_bytes": chunk,
        "rounds": rounds,
        **{f"{name}_gb_per_s": round(rate / 1e9, 3) for name, rate in best.items()},
        "push_ratio": round(best["ps_push"] / best["raw_socket"], 3),
        "pull_ratio": round(best["ps_pull"] / best["raw_socket"], 3),
        "push_ratio_median_of_rounds": round(paired["ps_push"], 3),
        "pull_ratio_median_of_rounds": round(paired["ps_pull"], 3),
        # The receiving process's CPU time per transfer (user + system, all its threads; /proc's
        # 10 ms ticks, averaged over the rounds): less disturbed by a loaded machine than throughput.
        **{f"{name}_receiver_cpu_ms": round(1000 * seconds / rounds, 1) for name, seconds in cpu.items()},
        "finite_check_ratio": round(best["ps_push_checked"] / best["ps_push"], 3),
        "finite_check_ratio_median_of_rounds": round(checked, 3),
        "finite_check_gb_per_s": round(nbytes / check_seconds / 1e9, 2),
        **(_tls_ratios(rates, best) if tls_client is not None else {}),
    }


def _tls_ratios(rates: dict[str, list[float]], best: dict[str, float]) -> dict[str, float]:
    """Mutual TLS over plaintext, push and pull: of the best rounds, and the median of each round's own ratio."""
    out = {}
    for way in ("push", "pull"):
        tls, plain = f"ps_{way}_tls", f"ps_{way}"
        out[f"tls_{way}_ratio"] = round(best[tls] / best[plain], 3)
        out[f"tls_{way}_ratio_median_of_rounds"] = round(
            statistics.median(t / p for t, p in zip(rates[tls], rates[plain])), 3)
    return out


def main(argv: list[str]) -> None:
    """`python -m kubetrain_trainer.ps.bench [NBYTES]` prints bench_transport's JSON."""
    if argv[:1] == ["--sink"]:
        kind, nbytes, chunk = argv[1], int(argv[2]), int(argv[3])
        SINKS[kind](nbytes, chunk)
        return
    print(json.dumps(bench_transport(int(argv[0]) if argv else 64 << 20), indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
