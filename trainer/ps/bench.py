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

from kubetrain_contract.tls_files import TLS_DIR_VAR

from ..compression import as_bytes
from . import ps_pb2 as pb
from .client import PSClient
from .job import chunk_bytes as configured_chunk_bytes
from .credentials import TlsFiles
from .credentials import from_env as tls_from_env
from .dataplane import DataServer
from .transport import (
    GRPC_OPTIONS,
    Assembler,
    Backoff,
    ByteCounter,
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
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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


def _ready(*ports: int) -> None:
    print(*ports, flush=True)


class _BenchShard:
    """The shard's Push and Pull paths without the optimizer: what gRPC and the data plane both serve."""

    def __init__(self, nbytes: int, chunk: int, check_finite: bool):
        self.tensor = _tensor(nbytes)
        self.expected = {"t": Expected.of(self.tensor)}
        self.scratch: dict = {}
        self.chunk, self.check_finite = chunk, check_finite
        self.counter = ByteCounter()

    def push_frames(self, frames, context):
        try:
            assembler = Assembler(self.expected, self.scratch)
            for frame in frames:
                assembler.add(frame)
            grads = assembler.finish()
            if self.check_finite and first_non_finite(grads) is not None:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "not finite")
        except WireError as err:
            context.abort(err.code, str(err))
        return pb.PushReply(outcome=pb.PushReply.APPLIED)

    def Pull(self, request, context):
        out = [OutTensor("t", "float32", tuple(self.tensor.shape), "None", as_bytes(self.tensor))]
        yield from frames_for(out, self.chunk, pb.Frame(pull=pb.PullHeader(step=0)))


def _transport_sink(nbytes: int, chunk: int, check_finite: bool = False) -> None:
    """A gRPC server and a data-plane server (dataplane.py) with the shard's Push and Pull paths."""
    shard = _BenchShard(nbytes, chunk, check_finite)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=[TokenInterceptor(TOKEN)],
                         options=GRPC_OPTIONS)
    handlers = {
        "Push": grpc.stream_unary_rpc_method_handler(
            lambda messages, context: shard.push_frames((decode_frame(m) for m in messages), context),
            response_serializer=pb.PushReply.SerializeToString),
        "Pull": grpc.unary_stream_rpc_method_handler(shard.Pull, request_deserializer=pb.PullRequest.FromString,
                                                     response_serializer=encode_frame),
    }
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("kubetrain.ps.v1.ParameterShard", handlers)])
    tls = tls_from_env()  # the transport-tls sink: started with the job's certificates (bench_transport)
    port = server.add_insecure_port("127.0.0.1:0") if tls is None else \
        server.add_secure_port("127.0.0.1:0", tls.server_credentials())
    server.start()
    data = DataServer(shard, TOKEN, tls, max_connections=16, drain_bytes=nbytes + (1 << 20))
    _ready(port, data.start("127.0.0.1", 0))
    server.wait_for_termination()


SINKS = {
    "socket": _socket_sink,
    "transport": _transport_sink,
    "transport-checked": lambda nbytes, chunk: _transport_sink(nbytes, chunk, check_finite=True),
    "transport-tls": _transport_sink,  # with TLS_DIR_VAR in its environment
}


def _with_sink(kind: str, nbytes: int, chunk: int, tls_dir: Path | None = None) -> tuple[subprocess.Popen, list[int]]:
    """Start a receiver process; it prints its ports once it listens (a transport sink: gRPC's, the data plane's)."""
    env = {k: v for k, v in os.environ.items() if k != TLS_DIR_VAR}
    if tls_dir is not None:
        env[TLS_DIR_VAR] = str(tls_dir)
    process = subprocess.Popen(
        [sys.executable, "-m", "kubetrain_trainer.ps.bench", "--sink", kind, str(nbytes), str(chunk)],
        stdout=subprocess.PIPE, text=True, env=env,
    )
    line = process.stdout.readline().split()
    if not line or not all(p.isdigit() for p in line):
        process.kill()
        raise RuntimeError(f"bench sink {kind!r} did not start (exit {process.wait()})")
    return process, [int(p) for p in line]


def bench_transport(
    nbytes: int = 64 << 20, chunk_bytes: int | None = None, rounds: int = ROUNDS, tls_dir: Path | None = None,
) -> dict[str, Any]:
    """Throughput of the PS transport (push and pull) and of a raw loopback socket, and their ratios;
    with `tls_dir` (a job's certificates, kubetrain_contract.tls_files.FILES) also over mutual TLS, and its ratio to plaintext.

    The three are measured in turns, round after round, so a busy machine
    slows them alike; the ratios are of the best rounds, and the median of
    each round's own ratio is reported beside them.
    """
    chunk = chunk_bytes or configured_chunk_bytes()
    nbytes -= nbytes % 4
    tensor = _tensor(nbytes)
    payload = memoryview(as_bytes(tensor).numpy())
    sinks = [_with_sink(kind, nbytes, chunk) for kind in ("socket", "transport", "transport-checked")]
    (_, [socket_port]), (_, [grpc_port, data_port]), (_, [checked_grpc, checked_data]) = sinks
    grpc_addrs = [f"127.0.0.1:{grpc_port}", f"127.0.0.1:{checked_grpc}"]
    # What a worker uses (the data plane), and gRPC's own Push and Pull beside it.
    client = PSClient(grpc_addrs, TOKEN, chunk, Backoff(budget=30.0),
                      data_addrs=[f"127.0.0.1:{data_port}", f"127.0.0.1:{checked_data}"])
    grpc_client = PSClient(grpc_addrs, TOKEN, chunk, Backoff(budget=30.0))
    tls_client = grpc_tls_client = None
    if tls_dir is not None:
        sinks.append(_with_sink("transport-tls", nbytes, chunk, tls_dir))
        tls_grpc, tls_data = sinks[-1][1]
        tls_client = PSClient([f"127.0.0.1:{tls_grpc}"], TOKEN, chunk, Backoff(budget=30.0),
                              tls=TlsFiles.load(tls_dir), data_addrs=[f"127.0.0.1:{tls_data}"])
        grpc_tls_client = PSClient([f"127.0.0.1:{tls_grpc}"], TOKEN, chunk, Backoff(budget=30.0),
                                   tls=TlsFiles.load(tls_dir))
    targets: dict[str, torch.Tensor] = {}
    try:
        conn = socket.create_connection(("127.0.0.1", socket_port))
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out = [OutTensor("t", "float32", tuple(tensor.shape), "None", as_bytes(tensor))]
        header = pb.PushHeader(worker=0, worker_step=1)
        expected = {"t": Expected.of(tensor)}
        scratch: dict = {}

        def raw() -> None:
            # In pieces of the chunk size, as the transport sends: one sendall of 64 MiB reached 2.5 GB/s
            # on loopback where 1 MiB pieces reached 4.3 (the copies stay in the caches), and the
            # socket is the best a transport could do, not a handicapped one.
            for offset in range(0, nbytes, chunk):
                conn.sendall(payload[offset : offset + chunk])
            conn.recv(1)

        def pull(way: str, via: PSClient) -> Callable[[], Any]:
            target = targets.setdefault(way, torch.empty_like(tensor))
            return lambda: via.pull(0, pb.PullRequest(worker=0), lambda: Assembler(expected, scratch, {"t": target}))

        ways: dict[str, Callable[[], Any]] = {
            "raw_socket": raw,
            "ps_push": lambda: client.push(0, header, out),
            "ps_pull": pull("ps_pull", client),
            "grpc_push": lambda: grpc_client.push(0, header, out),
            "grpc_pull": pull("grpc_pull", grpc_client),
            "ps_push_checked": lambda: client.push(1, header, out),
        }
        if tls_client is not None:
            ways["ps_push_tls"] = lambda: tls_client.push(0, header, out)
            ways["ps_pull_tls"] = pull("ps_pull_tls", tls_client)
            ways["grpc_push_tls"] = lambda: grpc_tls_client.push(0, header, out)
            ways["grpc_pull_tls"] = pull("grpc_pull_tls", grpc_tls_client)
        # Who receives: a sink process for the socket and pushes, this process for pulls.
        receiver = {"raw_socket": sinks[0][0].pid, "ps_push": sinks[1][0].pid, "grpc_push": sinks[1][0].pid,
                    "ps_push_checked": sinks[2][0].pid, "ps_pull": os.getpid(), "grpc_pull": os.getpid(),
                    "ps_pull_tls": os.getpid(), "grpc_pull_tls": os.getpid()}
        if tls_client is not None:
            receiver["ps_push_tls"] = receiver["grpc_push_tls"] = sinks[3][0].pid
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
        for way, target in targets.items():
            if not torch.equal(target, tensor):
                raise RuntimeError(f"{way}: the pulled tensor differs from the one the sink served")
    finally:
        for each in (client, grpc_client, tls_client, grpc_tls_client):
            if each is not None:
                each.close()
        for process, _ in sinks:
            process.kill()
            process.wait()

    best = {name: max(r) for name, r in rates.items()}
    paired = {
        way: statistics.median(p / s for p, s in zip(rates[way], rates["raw_socket"]))
        for way in ("ps_push", "ps_pull", "grpc_push", "grpc_pull")
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
        # gRPC's own Push and Pull (what carried tensors before the data plane; every other call still).
        "grpc_push_ratio": round(best["grpc_push"] / best["raw_socket"], 3),
        "grpc_pull_ratio": round(best["grpc_pull"] / best["raw_socket"], 3),
        "grpc_push_ratio_median_of_rounds": round(paired["grpc_push"], 3),
        "grpc_pull_ratio_median_of_rounds": round(paired["grpc_pull"], 3),
        # The receiving process's CPU time per transfer (user + system, all its threads; /proc's
        # 10 ms ticks, averaged over the rounds): less disturbed by a loaded machine than throughput.
        **{f"{name}_receiver_cpu_ms": round(1000 * seconds / rounds, 1) for name, seconds in cpu.items()},
        "finite_check_ratio": round(best["ps_push_checked"] / best["ps_push"], 3),
        "finite_check_ratio_median_of_rounds": round(checked, 3),
        "finite_check_gb_per_s": round(nbytes / check_seconds / 1e9, 2),
        **(_tls_ratios(rates, best) if tls_client is not None else {}),
    }


def _tls_ratios(rates: dict[str, list[float]], best: dict[str, float]) -> dict[str, float]:
    """Mutual TLS over plaintext, push and pull: of the best rounds, and the median of each round's own
    ratio; and the data plane over gRPC, both over mutual TLS (what a kubetrain job's shards serve)."""
    out = {}
    for way in ("push", "pull"):
        for name, tls, other in (("tls", f"ps_{way}_tls", f"ps_{way}"),
                                 ("tls_over_grpc_tls", f"ps_{way}_tls", f"grpc_{way}_tls")):
            out[f"{name}_{way}_ratio"] = round(best[tls] / best[other], 3)
            out[f"{name}_{way}_ratio_median_of_rounds"] = round(
                statistics.median(t / p for t, p in zip(rates[tls], rates[other])), 3)
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
