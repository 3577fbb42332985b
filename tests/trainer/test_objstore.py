"""kubetrain's S3 client against a real S3 server (SeaweedFS): objects whole and in parts, the multipart
uploads a kill leaves, errors that name the URI and never a secret, and retries bounded by ATTEMPTS."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
from dataclasses import dataclass

import pytest

from objstorelib import secret_free
from kubetrain.trainer import objstore
from kubetrain.trainer.errors import ConfigError, LoadError, TransientError
from kubetrain.trainer.objstore import (ATTEMPTS, MULTIPART_BYTES, PART_BYTES, CorruptObject, Credentials, ObjectStore,
                                        ObjectURI, parse_uri)


@dataclass
class UriCase:
    name: str
    text: str
    bucket: str = ""
    key: str = ""
    error: str = ""


URI_CASES = [
    UriCase("object", "s3://my-bucket/data/x.npz", "my-bucket", "data/x.npz"),
    UriCase("prefix", "s3://my-bucket/data/", "my-bucket", "data/"),
    UriCase("bucket only", "s3://my.bucket", "my.bucket", ""),
    UriCase("other scheme", "gs://b/x", error="expected s3://BUCKET/KEY"),
    UriCase("bucket too short", "s3://ab/x", error="no valid bucket name"),
    UriCase("upper-case bucket", "s3://MyBucket/x", error="no valid bucket name"),
    UriCase("dot-dot key", "s3://bkt/a/../b", error="'.' or '..'"),
    UriCase("empty part", "s3://bkt/a//b", error="empty"),
]


@pytest.mark.parametrize("case", URI_CASES, ids=[c.name for c in URI_CASES])
def test_uris_are_parsed_or_refused_naming_the_field(case):
    if case.error:
        with pytest.raises(ConfigError, match=case.error) as err:
            parse_uri(case.text, "spec.dataset.uri")
        assert str(err.value).startswith("spec.dataset.uri: ")
    else:
        uri = parse_uri(case.text)
        assert (uri.bucket, uri.key) == (case.bucket, case.key)
        assert str(uri) == case.text if case.key else str(uri) == case.text + "/"


def test_small_and_multipart_objects_round_trip_with_their_sha256(s3, bucket, tmp_path):
    store = s3.store()
    root = ObjectURI(bucket, "round/")
    store.put_bytes(root.child("small.txt"), b"hello world")
    assert store.get_bytes(root.child("small.txt")) == b"hello world"
    assert store.get_range(root.child("small.txt"), 6, 5) == b"world"
    assert store.head(root.child("small.txt")).size == 11
    assert store.head(root.child("missing")) is None
    # Past MULTIPART_BYTES: parts of PART_BYTES, the last one short.
    big = tmp_path / "big.bin"
    payload = os.urandom(2 * PART_BYTES + 12345)
    big.write_bytes(payload)
    assert big.stat().st_size >= MULTIPART_BYTES
    digest = store.upload(big, root.child("big.bin"))
    assert digest == (len(payload), hashlib.sha256(payload).hexdigest())
    requests_before = store.stats.requests
    got = store.download(root.child("big.bin"), tmp_path / "back.bin", expect=digest)
    assert got == digest and (tmp_path / "back.bin").read_bytes() == payload
    assert store.stats.requests - requests_before >= 3  # a HEAD and one ranged GET per part at least
    assert [i.uri.key for i in store.list(root)] == ["round/big.bin", "round/small.txt"]
    store.delete([root.child("small.txt"), root.child("never-was")])
    assert [i.uri.key for i in store.list(root)] == ["round/big.bin"]


def test_a_download_that_differs_from_its_commit_leaves_nothing(s3, bucket, tmp_path):
    store = s3.store()
    uri = ObjectURI(bucket, "x.bin")
    store.put_bytes(uri, b"the bytes written")
    target = tmp_path / "x.bin"
    target.write_bytes(b"what was here")
    with pytest.raises(CorruptObject, match="its commit records"):
        store.download(uri, target, expect=(17, "0" * 64))
    assert target.read_bytes() == b"what was here"
    assert [p.name for p in tmp_path.iterdir()] == ["x.bin"]  # no temporary file left


def test_a_multipart_upload_cut_short_is_invisible_until_aborted(s3, bucket):
    store = s3.store()
    uri = ObjectURI(bucket, "run/ckpt-00000010-ab.pt")
    # What a writer killed between two parts leaves: an upload begun, a part sent, never completed.
    answer = store.request("POST", uri, {"uploads": ""})
    upload_id = objstore._xml_text(objstore.ET.fromstring(answer.body), "UploadId")
    store.request("PUT", uri, {"partNumber": "1", "uploadId": upload_id}, body=os.urandom(PART_BYTES))
    assert store.list(ObjectURI(bucket, "run/")) == []
    assert store.abort_incomplete(ObjectURI(bucket, "run/")) == 1
    assert store.abort_incomplete(ObjectURI(bucket, "run/")) == 0
    assert store.list(ObjectURI(bucket, "run/")) == []


@dataclass
class ErrorCase:
    name: str
    uri: str
    overrides: dict
    words: str


ERROR_CASES = [
    ErrorCase("missing bucket", "s3://no-such-bucket-kt/x.npz", {}, "no such bucket 'no-such-bucket-kt'"),
    ErrorCase("missing object", "s3://{bucket}/nothing-here.npz", {}, "no such object"),
    ErrorCase("wrong secret", "s3://{bucket}/x.npz", {"AWS_SECRET_ACCESS_KEY": "not-the-secret-at-all"},
              "access denied"),
    ErrorCase("unknown key id", "s3://{bucket}/x.npz", {"AWS_ACCESS_KEY_ID": "AKIDNOBODYHAS"}, "access denied"),
    ErrorCase("no credentials", "s3://{bucket}/x.npz", {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""},
              "no credentials"),
]


@pytest.mark.parametrize("case", ERROR_CASES, ids=[c.name for c in ERROR_CASES])
def test_errors_are_permanent_name_the_uri_and_never_the_secret(s3, bucket, case):
    s3.store().put_bytes(ObjectURI(bucket, "x.npz"), b"x")
    uri = parse_uri(case.uri.format(bucket=bucket))
    store = s3.store(**case.overrides)
    with pytest.raises(LoadError) as err:
        store.get_bytes(uri)
    message = str(err.value)
    assert message.startswith(str(uri)) and case.words in message, message
    assert err.value.exit_code == 3
    secret_free(message, s3)
    for value in case.overrides.values():
        assert not value or value not in message or value == "AKIDNOBODYHAS" and "AKID" not in message


def test_a_store_that_never_answers_fails_transient_after_ATTEMPTS_tries():
    with socket.socket() as s:  # a port nothing listens on: every connection is refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = ObjectStore(credentials=Credentials("k", "s", "", "us-east-1", f"http://127.0.0.1:{port}"))
    retried = []
    store.on_retry = lambda: retried.append(1)
    started = time.monotonic()
    with pytest.raises(TransientError, match=f"did not answer after {ATTEMPTS} attempts") as err:
        store.get_bytes(ObjectURI("bkt", "x"))
    assert err.value.exit_code == 75
    assert store.stats.retries == len(retried) == ATTEMPTS - 1
    # The backoff's windows bound the wait: 0.5 + 1 + 2 + 4 s at most for ATTEMPTS 5.
    assert time.monotonic() - started < sum(min(objstore.BACKOFF_MAX_SECONDS, objstore.BACKOFF_BASE_SECONDS * 2 ** i)
                                            for i in range(ATTEMPTS - 1)) + 5


class FlakyProxy:
    """A TCP proxy in front of the real server that answers the first `failures` connections with
    503 Service Unavailable (a store that is restarting), then forwards."""

    def __init__(self, target: str, failures: int):
        host, port = target.removeprefix("http://").split(":")
        self.target = (host, int(port))
        self.failures = failures
        self.served = 0
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(16)
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.served += 1
            if self.served <= self.failures:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                conn.close()
                continue
            upstream = socket.create_connection(self.target)
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.server.close()


@pytest.mark.parametrize("failures", [ATTEMPTS - 1, ATTEMPTS], ids=["ridden out", "past the edge"])
def test_a_store_busy_for_a_moment_is_retried_with_backoff(s3, bucket, failures):
    s3.store().put_bytes(ObjectURI(bucket, "x"), b"payload")
    proxy = FlakyProxy(s3.endpoint, failures)
    try:
        store = s3.store(AWS_ENDPOINT_URL=f"http://127.0.0.1:{proxy.port}")
        if failures < ATTEMPTS:
            assert store.get_bytes(ObjectURI(bucket, "x")) == b"payload"
        else:
            with pytest.raises(TransientError, match=f"answered 503 after {ATTEMPTS} attempts"):
                store.get_bytes(ObjectURI(bucket, "x"))
        assert store.stats.retries == min(failures, ATTEMPTS - 1)
    finally:
        proxy.close()


def test_credentials_never_show_in_their_repr():
    creds = Credentials("AKIDEXAMPLE", "wJalrXUtnFEMI-secret", "token-secret", "eu-west-1", "http://127.0.0.1:1")
    assert "secret" not in repr(creds) and "AKID" not in repr(creds)


def test_a_long_transfer_logs_its_bytes_share_and_rate(s3, bucket, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(objstore, "PROGRESS_SECONDS", 0.0)  # every piece is "due": the lines a long one logs
    path = tmp_path / "x.bin"
    path.write_bytes(os.urandom(MULTIPART_BYTES + 1000))
    with caplog.at_level("INFO", logger="kubetrain.trainer.objstore"):
        s3.store().upload(path, ObjectURI(bucket, "x.bin"))
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith(f"upload s3://{bucket}/x.bin: ") and "MiB of 16.0 MiB (" in line and "/s" in line
               for line in lines), lines
    assert lines[-1].endswith(": done") and "(100%)" in lines[-1]
