"""On the real node, parameter servers and workers speak mutual TLS with the job's own certificates, and nothing else gets in.

The job trains to Succeeded over TLS: its workers dial `<job>-ps-0:50051` (gRPC)
and `<job>-ps-0:50052` (the data plane), a name the job's certificate carries.
Meanwhile a probe pod dials the same name, at both ports.
It wears the job's label, as any pod a tenant creates in the namespace can, so
the job's NetworkPolicy lets it through: what stops it is TLS. It runs the
trainer image (Python, grpcio, the job's certificate code) and has the job's
Secret mounted, so it can also show that the job's own certificate gets as far
as the token check, and with the token, an answer.
"""

from __future__ import annotations

import json

import pytest
from e2elib import (
    REAL_NODE_SELECTOR, RESTRICTED_CONTAINER, RESTRICTED_POD, apply, example, figure, logs, succeeded,
)

from kubetrain.engine.plan import DATA_PORT, GRPC_PORT
from kubetrain.shared import __version__

pytestmark = pytest.mark.e2e

JOB = "tls-ps"
PROBE = "tls-probe"
TRAINER_IMAGE = f"kubetrain/trainer:{__version__}"  # the chart's trainer image in hack/values-e2e.yaml

# Runs in the probe pod. Waits until the shard answers the job's own certificate and token
# (the shard is up), then tries every other way in; prints the gRPC code of each, as JSON.
PROBE_SCRIPT = """
import json, os, pathlib, sys, tempfile, time
from datetime import datetime, timezone
import grpc
from kubetrain.engine.certificates import job_certificates
from kubetrain.trainer.ps import ps_pb2 as pb, ps_pb2_grpc
from kubetrain.trainer.ps.dataplane import DataClient
from kubetrain.trainer.ps.credentials import TlsFiles
from kubetrain.trainer.ps.transport import ByteCounter

target, job, namespace, data_target = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
read = lambda name: open("/secret/" + name, "rb").read()
ca, crt, key, token = read("ca.crt"), read("tls.crt"), read("tls.key"), read("token").decode()
other = job_certificates(job, namespace, [target.split(":")[0]], datetime.now(timezone.utc))
with_token = (("x-kubetrain-token", token),)

def status(credentials, metadata=()):
    channel = grpc.insecure_channel(target) if credentials is None else grpc.secure_channel(target, credentials)
    with channel:
        try:
            ps_pb2_grpc.ParameterShardStub(channel).Status(pb.StatusRequest(), metadata=metadata, timeout=10)
            return "OK"
        except grpc.RpcError as err:
            return err.code().name

def files_of(ca, crt, key):
    folder = pathlib.Path(tempfile.mkdtemp())
    for name, pem in (("ca.crt", ca), ("tls.crt", crt), ("tls.key", key)):
        (folder / name).write_bytes(pem)
    return TlsFiles.load(folder)

def pull(files, token):
    # A Pull on the shard's data plane, as a worker makes it: the parameters' bytes, or the refusal's code.
    client = DataClient(data_target, token, files, ByteCounter())
    try:
        got = 0
        for frame in client.pull_frames(pb.PullRequest(worker=0), 10):
            for piece in frame.header.pieces:
                frame.read_into(memoryview(bytearray(piece.length)))
                got += piece.length
        return "OK" if got else "EMPTY"
    except grpc.RpcError as err:
        return err.code().name
    finally:
        client.close()

own = grpc.ssl_channel_credentials(ca, key, crt)
deadline = time.monotonic() + 180
while status(own, with_token) != "OK" and time.monotonic() < deadline:
    time.sleep(1)
job_files = files_of(ca, crt, key)
print(json.dumps({
    "data plane, plaintext": pull(None, token),
    "data plane, another CA's certificate": pull(files_of(ca, other["tls.crt"].encode(), other["tls.key"].encode()),
                                                 token),
    "data plane, the job's certificate, a wrong token": pull(job_files, "wrong"),
    "data plane, the job's certificate and token": pull(job_files, token),
    "plaintext": status(None, with_token),
    "no certificate": status(grpc.ssl_channel_credentials(ca), with_token),
    "another CA's certificate": status(
        grpc.ssl_channel_credentials(ca, other["tls.key"].encode(), other["tls.crt"].encode()), with_token),
    "the job's certificate, no token": status(own),
    "the job's certificate and token": status(own, with_token),
}))
"""


def probe_pod(secret: str) -> dict:
    return {
        "apiVersion": "v1", "kind": "Pod",
        # The job's label (the NetworkPolicy's selector) but no replica label: the operator ignores it.
        "metadata": {"name": PROBE, "labels": {"kubetrain.dev/job-name": JOB}},
        "spec": {
            "nodeSelector": dict(REAL_NODE_SELECTOR), "restartPolicy": "Never", "securityContext": RESTRICTED_POD,
            "automountServiceAccountToken": False,
            "containers": [{
                "name": "probe", "image": TRAINER_IMAGE, "imagePullPolicy": "IfNotPresent",
                "securityContext": RESTRICTED_CONTAINER,
                "command": ["python", "-c", PROBE_SCRIPT, f"{JOB}-ps-0:{GRPC_PORT}", JOB, "e2e", f"{JOB}-ps-0:{DATA_PORT}"],
                "volumeMounts": [{"name": "secret", "mountPath": "/secret", "readOnly": True}],
            }],
            "volumes": [{"name": "secret", "secret": {"secretName": secret}}],
        },
    }


def test_parameter_servers_on_the_real_node_accept_only_the_jobs_certificate(e2e):
    doc = example("parameter-server.yaml", 200)  # a minute or two of training: the probe runs meanwhile
    doc["metadata"]["name"] = JOB
    apply(e2e, doc)
    e2e.wait(f"{JOB}'s token Secret", lambda: json.loads(e2e.kubectl(
        "get", "secrets", "-l", f"kubetrain.dev/job-name={JOB}", "-o", "json"))["items"], timeout=120)
    [secret] = json.loads(e2e.kubectl("get", "secrets", "-l", f"kubetrain.dev/job-name={JOB}", "-o", "json"))["items"]
    assert set(secret["data"]) == {"token", "ca.crt", "tls.crt", "tls.key"}
    e2e.kube.apply(probe_pod(secret["metadata"]["name"]))
    e2e.wait(f"{PROBE} to finish", lambda: e2e.get("pod", PROBE)["status"].get("phase") in ("Succeeded", "Failed"),
             timeout=300, every=2)
    out = e2e.kubectl("logs", PROBE)
    e2e.kubectl("delete", "pod", PROBE, "--wait=false")
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen == {
        "plaintext": "UNAVAILABLE",  # the handshake fails: no call is read, let alone its token
        "no certificate": "UNAVAILABLE",
        "another CA's certificate": "UNAVAILABLE",
        "the job's certificate, no token": "UNAUTHENTICATED",  # the token check stays behind TLS
        "the job's certificate and token": "OK",
        # The data plane (Pull and Push): the same certificates checked by Python's ssl, the token after them.
        "data plane, plaintext": "UNAVAILABLE",
        "data plane, another CA's certificate": "UNAVAILABLE",
        "data plane, the job's certificate, a wrong token": "UNAUTHENTICATED",
        "data plane, the job's certificate and token": "OK",
    }, out

    status = succeeded(e2e, JOB)
    progress = status["progress"]
    assert progress["step"] == progress["totalSteps"] > 0 and progress["evalAccuracy"] >= 0.9, status
    assert "(mutual TLS)" in logs(e2e, f"{JOB}-ps-0")
    figure(f"{JOB}: trained over mutual TLS on the real node, {progress['totalSteps']} steps, accuracy "
           f"{progress['evalAccuracy']:.4f}; a pod with the job's label: "
           + ", ".join(f"{k} -> {v}" for k, v in seen.items()))
