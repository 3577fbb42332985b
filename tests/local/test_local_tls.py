"""`kubetrain run` of a parameter-server job: its shards and workers speak mutual TLS with certificates made for the run."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import time

import grpc
import pytest
from cryptography import x509

from support import job_doc
from kubetrain.shared.tls_files import CA_FILE, CERT_FILE, FILES, KEY_FILE
from kubetrain.trainer.ps import ps_pb2 as pb
from kubetrain.trainer.ps import ps_pb2_grpc
from kubetrain.trainer.ps.credentials import TlsFiles
from kubetrain.trainer.ps.transport import open_channel

STARTUP_SECONDS = 120  # the shards import torch and load the data first; a loaded 2-core machine is slow


def status(channel) -> grpc.RpcError | None:
    """The shard's answer to a Status call without the token: the error it raised, None if it answered."""
    with channel:
        try:
            ps_pb2_grpc.ParameterShardStub(channel).Status(pb.StatusRequest(), timeout=5)
        except grpc.RpcError as err:
            return err
    return None


def wait_for_line(path, text, process, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        assert process.poll() is None, f"kubetrain run exited {process.returncode} before {path.name} said {text!r}"
        time.sleep(0.2)
    pytest.fail(f"{path} did not say {text!r} within {timeout} s")


@pytest.mark.slow
def test_a_local_parameter_server_job_trains_over_mutual_tls(tmp_path, write_job):
    # Long enough (about 20 s of steps) for the probes below to find the shards serving.
    doc = job_doc("tls", "ParameterServer", dataset={"name": "digits"},
                  training={"epochs": 12, "batchSize": 32, "seed": 0},
                  parameterServer={"replicas": 2, "workers": 2, "aggregation": "Sync"})
    run = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "kubetrain.cli", "run", str(write_job(doc)), "--run-dir", str(run), "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        for shard in ("ps-0", "ps-1"):
            wait_for_line(run / "logs" / f"{shard}.log", "(mutual TLS)", process, STARTUP_SECONDS)
        folder = run / "tls"
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert sorted(p.name for p in folder.iterdir()) == sorted(FILES)
        assert all(stat.S_IMODE((folder / name).stat().st_mode) == 0o600 for name in FILES)
        plan = {r["replica"]: r for r in json.loads((run / "plan.json").read_text())}
        for shard in ("ps-0", "ps-1"):
            address = f"127.0.0.1:{plan[shard]['ports']['grpc']}"
            # Plaintext gets no further than the handshake.
            plain = status(grpc.insecure_channel(address))
            assert plain is not None and plain.code() == grpc.StatusCode.UNAVAILABLE, plain
            # The run's own certificates get through the handshake, to the token check.
            with_certificates = status(open_channel(address, TlsFiles.load(folder)))
            assert with_certificates is not None and with_certificates.code() == grpc.StatusCode.UNAUTHENTICATED
        out, err = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["state"] == "Succeeded"
    assert summary["eval_accuracy"] >= 0.9
    leaf = x509.load_pem_x509_certificate((folder / CERT_FILE).read_bytes())
    leaf.verify_directly_issued_by(x509.load_pem_x509_certificate((folder / CA_FILE).read_bytes()))
    assert b"PRIVATE KEY" in (folder / KEY_FILE).read_bytes()
    assert "(plaintext)" not in (run / "logs" / "ps-0.log").read_text()
