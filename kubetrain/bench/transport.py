"""`kubetrain bench transport`: the parameter-server transport's throughput against a raw socket, in one run.

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

from kubetrain.shared.tls_files import TLS_DIR_VAR

from kubetrain.trainer.compression import as_bytes
from kubetrain.trainer.ps import ps_pb2 as pb
from kubetrain.trainer.ps.psclient import PSClient
from kubetrain.trainer.ps.job import chunk_bytes as configured_chunk_bytes
from kubetrain.trainer.ps.credentials import TlsFiles
from kubetrain.trainer.ps.credentials import from_env as tls_from_env
from kubetrain.trainer.ps.dataplane import DataServer
from kubetrain.trainer.ps.transport import (
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
        [sys.executable, "-m", "kubetrain.bench.transport", "--sink", kind, str(nbytes), str(chunk)],
        stdout=subprocess.PIPE, text=True, env=env,
    )
    assert process.stdout is not None  # stdout=PIPE
    line = process.stdout.readline().split()
    if not line or not all(p.isdigit() for p in line):
        process.kill()
        raise RuntimeError(f"bench sink {kind!r} did not start (exit {process.wait()})")
    return process, [int(p) for p in line]


def _start_sinks(nbytes: int, chunk: int, tls_dir: Path | None) -> list[tuple[subprocess.Popen, list[int]]]:
    """The receivers, in this order: the raw socket's, the transport's, the transport's that checks that
    gradients are finite, and with `tls_dir` the transport's over mutual TLS."""
    kinds = ["socket", "transport", "transport-checked"]
    sinks = [_with_sink(kind, nbytes, chunk) for kind in kinds]
    if tls_dir is not None:
        sinks.append(_with_sink("transport-tls", nbytes, chunk, tls_dir))
    return sinks


def _clients(sinks: list[tuple[subprocess.Popen, list[int]]], chunk: int, tls_dir: Path | None) -> dict[str, PSClient]:
    """What a worker uses (the data plane: "ps"), and gRPC's own Push and Pull beside it ("grpc"); with
    `tls_dir` both again over mutual TLS ("ps_tls", "grpc_tls")."""
    (_, [grpc_port, data_port]), (_, [checked_grpc, checked_data]) = sinks[1], sinks[2]
    grpc_addrs = [f"127.0.0.1:{grpc_port}", f"127.0.0.1:{checked_grpc}"]
    clients = {
        "ps": PSClient(grpc_addrs, TOKEN, chunk, Backoff(budget=30.0),
                       data_addrs=[f"127.0.0.1:{data_port}", f"127.0.0.1:{checked_data}"]),
        "grpc": PSClient(grpc_addrs, TOKEN, chunk, Backoff(budget=30.0)),
    }
    if tls_dir is not None:
        tls_grpc, tls_data = sinks[3][1]
        clients["ps_tls"] = PSClient([f"127.0.0.1:{tls_grpc}"], TOKEN, chunk, Backoff(budget=30.0),
                                     tls=TlsFiles.load(tls_dir), data_addrs=[f"127.0.0.1:{tls_data}"])
        clients["grpc_tls"] = PSClient([f"127.0.0.1:{tls_grpc}"], TOKEN, chunk, Backoff(budget=30.0),
                                       tls=TlsFiles.load(tls_dir))
    return clients


def _ways(clients: dict[str, PSClient], sinks: list[tuple[subprocess.Popen, list[int]]], tensor: torch.Tensor,
          conn: socket.socket, chunk: int, targets: dict[str, torch.Tensor],
          ) -> tuple[dict[str, Callable[[], Any]], dict[str, int]]:
    """Each way of moving `tensor` once (name -> call), and who receives it (name -> pid): a sink
    process for the socket and pushes, this process for pulls (into `targets`, checked afterwards)."""
    nbytes = tensor.numel() * 4
    payload = memoryview(as_bytes(tensor).numpy())  # type: ignore[arg-type]  # an ndarray is a buffer
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

    def push(via: PSClient, shard: int = 0) -> Callable[[], Any]:
        return lambda: via.push(shard, header, out)

    def pull(way: str, via: PSClient) -> Callable[[], Any]:
        target = targets.setdefault(way, torch.empty_like(tensor))
        return lambda: via.pull(0, pb.PullRequest(worker=0), lambda: Assembler(expected, scratch, {"t": target}))

    ways = {"raw_socket": raw, "ps_push": push(clients["ps"]), "ps_pull": pull("ps_pull", clients["ps"]),
            "grpc_push": push(clients["grpc"]), "grpc_pull": pull("grpc_pull", clients["grpc"]),
            "ps_push_checked": push(clients["ps"], 1)}
    receiver = {"raw_socket": sinks[0][0].pid, "ps_push": sinks[1][0].pid, "grpc_push": sinks[1][0].pid,
                "ps_push_checked": sinks[2][0].pid, "ps_pull": os.getpid(), "grpc_pull": os.getpid()}
    if "ps_tls" in clients:
        for way in ("ps", "grpc"):
            ways[f"{way}_push_tls"] = push(clients[f"{way}_tls"])
            ways[f"{way}_pull_tls"] = pull(f"{way}_pull_tls", clients[f"{way}_tls"])
            receiver[f"{way}_push_tls"], receiver[f"{way}_pull_tls"] = sinks[3][0].pid, os.getpid()
    return ways, receiver


def _measure(ways: dict[str, Callable[[], Any]], receiver: dict[str, int], rounds: int, nbytes: int,
             ) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Every way in turn, round after round: (bytes per second of each round, the receiver's CPU seconds in all)."""
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
    return rates, cpu


def bench_transport(
    nbytes: int = 64 << 20, chunk_bytes: int | None = None, rounds: int = ROUNDS, tls_dir: Path | None = None,
) -> dict[str, Any]:
    """Throughput of the PS transport (push and pull) and of a raw loopback socket, and their ratios;
    with `tls_dir` (a job's certificates, kubetrain.shared.tls_files.FILES) also over mutual TLS, and its ratio to plaintext.

    The three are measured in turns, round after round, so a busy machine
    slows them alike; the ratios are of the best rounds, and the median of
    each round's own ratio is reported beside them.
    """
    chunk = chunk_bytes or configured_chunk_bytes()
    nbytes -= nbytes % 4
    tensor = _tensor(nbytes)
    sinks = _start_sinks(nbytes, chunk, tls_dir)
    clients: dict[str, PSClient] = {}
    targets: dict[str, torch.Tensor] = {}
    try:
        clients = _clients(sinks, chunk, tls_dir)
        with socket.create_connection(("127.0.0.1", sinks[0][1][0])) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ways, receiver = _ways(clients, sinks, tensor, conn, chunk, targets)
            rates, cpu = _measure(ways, receiver, rounds, nbytes)
        for way, target in targets.items():
            if not torch.equal(target, tensor):
                raise RuntimeError(f"{way}: the pulled tensor differs from the one the sink served")
    finally:
        for each in clients.values():
            each.close()
        for process, _ in sinks:
            process.kill()
            process.wait()
    return _figures(rates, cpu, tensor, chunk, rounds)


def _figures(rates: dict[str, list[float]], cpu: dict[str, float], tensor: torch.Tensor, chunk: int,
             rounds: int) -> dict[str, Any]:
    """bench_transport's JSON from the measured rates: the best rounds' throughput and ratios, and more."""
    nbytes = tensor.numel() * 4
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
        **(_tls_ratios(rates, best) if "ps_push_tls" in rates else {}),
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
    """`python -m kubetrain.bench.transport [NBYTES]` prints bench_transport's JSON."""
    if argv[:1] == ["--sink"]:
        kind, nbytes, chunk = argv[1], int(argv[2]), int(argv[3])
        SINKS[kind](nbytes, chunk)
        return
    print(json.dumps(bench_transport(int(argv[0]) if argv else 64 << 20), indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
