"""Mutual TLS between a shard and its workers: the job's certificate gets in, nothing else gets to the token check.

A real shard server on loopback, serving with the job's certificates
(`kubetrain.engine.certificates`, as the operator and `kubetrain run` make them),
against real clients: the worker's own (PSClient), and hand-made channels that
lack a certificate, hold another job's, or speak plaintext.
"""

from __future__ import annotations

from datetime import datetime, timezone

import grpc
import pytest
import torch

from cluster import TOKEN, shard_checkpoints
from helpers.net import free_port
from kubetrain.shared.tls_files import CA_FILE, CERT_FILE, KEY_FILE, TLS_DIR_VAR
from kubetrain.engine.certificates import job_certificates
from kubetrain.trainer.compression import as_bytes
from kubetrain.trainer.errors import ConfigError
from kubetrain.trainer.ps import ps_pb2 as pb
from kubetrain.trainer.ps import ps_pb2_grpc
from kubetrain.trainer.ps.psclient import PSClient
from kubetrain.trainer.ps.server import ParameterShard, ShardConfig, build_server
from kubetrain.trainer.ps.credentials import TlsFiles, from_env
from kubetrain.trainer.ps.transport import TOKEN_KEY, Assembler, Backoff, Expected, OutTensor, open_channel

PARAMS = {"w": torch.arange(12, dtype=torch.float32).reshape(4, 3)}
AUTH = ((TOKEN_KEY, TOKEN),)
REFUSED = 5.0  # seconds a refused client may take to learn it (a handshake on loopback: milliseconds)


def write(folder, files):
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory):
    files = job_certificates("j", "ns", ["j-ps-0"], datetime.now(timezone.utc))
    return write(tmp_path_factory.mktemp("tls") / "job", files)


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    """Another job's CA and certificate: every name the same, every key different."""
    files = job_certificates("j", "ns", ["j-ps-0"], datetime.now(timezone.utc))
    return write(tmp_path_factory.mktemp("tls") / "other", files)


@pytest.fixture
def shard(tmp_path, job_dir):
    config = ShardConfig(replica="ps-0", workers=1, aggregation="Async", sync_timeout=5.0, max_staleness=4,
                         max_steps=None, interval_steps=1000, chunk_bytes=1 << 20)
    shard = ParameterShard(config, {k: v.clone() for k, v in PARAMS.items()}, lambda p: torch.optim.SGD(p, lr=0.5),
                           shard_checkpoints(tmp_path / "ckpt"))
    server = build_server(shard, TOKEN, max_workers=8)
    port = free_port()
    server.add_secure_port(f"127.0.0.1:{port}", TlsFiles.load(job_dir).server_credentials())
    server.start()
    yield shard, f"127.0.0.1:{port}"
    server.stop(None)


def status(channel, metadata=AUTH):
    with channel:
        return ps_pb2_grpc.ParameterShardStub(channel).Status(pb.StatusRequest(), metadata=metadata, timeout=REFUSED)


def refused(channel) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        status(channel)
    return caught.value


def test_a_worker_with_the_jobs_certificate_pushes_and_pulls(shard, job_dir):
    state, address = shard
    client = PSClient([address], TOKEN, 1 << 20, Backoff(budget=5.0), call_timeout=5.0, wait_timeout=5.0,
                      tls=TlsFiles.load(job_dir))
    try:
        grad = [OutTensor("w", "float32", (4, 3), "None", as_bytes(torch.ones(4, 3)))]
        reply = client.push(0, pb.PushHeader(worker=0, incarnation=1, worker_step=1), grad)
        assert reply.outcome == pb.PushReply.APPLIED
        target = torch.empty(4, 3)
        expected = {"w": Expected.of(target)}
        client.pull(0, pb.PullRequest(worker=0), lambda: Assembler(expected, {}, {"w": target}))
        torch.testing.assert_close(target, PARAMS["w"] - 0.5)
    finally:
        client.close()
    assert state.step == 1


def test_the_token_check_stays_behind_tls(shard, job_dir):
    _, address = shard
    with pytest.raises(grpc.RpcError) as caught:
        status(open_channel(address, TlsFiles.load(job_dir)), metadata=((TOKEN_KEY, "wrong"),))
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_client_without_a_certificate_fails_the_handshake(shard, job_dir):
    _, address = shard
    # It trusts the job's CA, so the server is fine by it; the server wants a client certificate.
    credentials = grpc.ssl_channel_credentials(root_certificates=(job_dir / CA_FILE).read_bytes())
    err = refused(grpc.secure_channel(address, credentials))
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err  # no call reached the server, let alone the token check


def test_a_client_with_another_jobs_certificate_fails_the_handshake(shard, job_dir, other_dir):
    _, address = shard
    credentials = grpc.ssl_channel_credentials(root_certificates=(job_dir / CA_FILE).read_bytes(),
                                               private_key=(other_dir / KEY_FILE).read_bytes(),
                                               certificate_chain=(other_dir / CERT_FILE).read_bytes())
    err = refused(grpc.secure_channel(address, credentials))
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err


def test_a_worker_refuses_a_server_its_jobs_ca_did_not_sign(shard, other_dir):
    _, address = shard
    # Another job's worker (or a client of a server that impersonates a shard): its CA did not sign this server.
    err = refused(open_channel(address, TlsFiles.load(other_dir)))
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err


def test_a_plaintext_client_gets_nothing(shard):
    _, address = shard
    err = refused(grpc.insecure_channel(address))
    assert err.code() == grpc.StatusCode.UNAVAILABLE, err


def test_the_certificates_come_from_the_environment(job_dir, tmp_path):
    assert from_env({}) is None  # plaintext: only where nothing asks for TLS
    files = from_env({TLS_DIR_VAR: str(job_dir)})
    assert files is not None and files.ca == (job_dir / CA_FILE).read_bytes()
    with pytest.raises(ConfigError, match=f"{TLS_DIR_VAR}: cannot read"):
        from_env({TLS_DIR_VAR: str(tmp_path / "missing")})
    (tmp_path / "bad").mkdir()
    for name in (CA_FILE, CERT_FILE, KEY_FILE):
        (tmp_path / "bad" / name).write_text("not pem")
    with pytest.raises(ConfigError, match="is not a PEM file"):
        from_env({TLS_DIR_VAR: str(tmp_path / "bad")})


@pytest.mark.slow
def test_the_transport_benchmark_compares_tls_with_plaintext_in_one_run(job_dir):
    from kubetrain.bench.transport import bench_transport

    result = bench_transport(1 << 20, rounds=2, tls_dir=job_dir)
    for key in ("ps_push_tls_gb_per_s", "ps_pull_tls_gb_per_s", "tls_push_ratio", "tls_pull_ratio",
                "tls_push_ratio_median_of_rounds", "tls_pull_ratio_median_of_rounds",
                "grpc_push_ratio", "grpc_pull_ratio", "tls_over_grpc_tls_push_ratio", "tls_over_grpc_tls_pull_ratio"):
        assert result[key] > 0, (key, result)
