"""The `s3` fixture: one real S3 server (SeaweedFS, hack/objstore) per test session, and a fresh bucket per test.

The server must be built before the session starts (`hack/objstore build`, about 10 CPU minutes cold;
hack/test builds it beside the cluster's tools): a cold build inside a fixture would run into pytest's
per-test timeout, so the fixture fails at once under CI, saying what to run, and skips elsewhere. Each
pytest process (each lane of hack/test) starts its own server under a name of its own, with its own
ports, keys and data, and takes it down at the end.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from support import ROOT

OBJSTORE = ROOT / "hack" / "objstore"


@dataclass
class S3:
    """A running server: its AWS_* variables, and clients and buckets on it."""

    name: str
    env: dict[str, str]
    """AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION."""

    @property
    def endpoint(self) -> str:
        return self.env["AWS_ENDPOINT_URL"]

    @property
    def secret(self) -> str:
        return self.env["AWS_SECRET_ACCESS_KEY"]

    def environ(self, **extra: str) -> dict[str, str]:
        """This process's environment with the server's variables (for a `kubetrain` command)."""
        return {**os.environ, **self.env, **extra}

    def store(self, **overrides: str):
        """An ObjectStore of this server (overrides: AWS_* values to change, e.g. a wrong secret)."""
        from kubetrain.trainer.objstore import Credentials, ObjectStore

        env = {**self.env, **overrides}
        return ObjectStore(credentials=Credentials(env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"], "",
                                                   env["AWS_REGION"], env["AWS_ENDPOINT_URL"]))

    def bucket(self, prefix: str = "t") -> str:
        """A new, empty bucket's name."""
        from kubetrain.trainer.objstore import ObjectURI

        name = f"{prefix}-{secrets.token_hex(6)}"
        self.store().ensure_bucket(ObjectURI(name))
        return name


def objstore(*args: str, name: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([str(OBJSTORE), *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "KUBETRAIN_OBJSTORE": name})


def parse_exports(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if line.startswith("export ") and "=" in line:
            key, _, value = line[len("export "):].partition("=")
            out[key] = value
    return out


@pytest.fixture(scope="session")
def s3() -> Iterator[S3]:
    name = os.environ.get("KUBETRAIN_OBJSTORE") or f"kt-s3-{os.getpid()}"
    built = objstore("build", "--check", name=name)
    if built.returncode != 0:
        message = f"the S3 server is not built: run hack/objstore build ({built.stderr.strip()})"
        if os.environ.get("CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    up = objstore("up", name=name)
    if up.returncode != 0:
        objstore("down", name=name)
        pytest.fail(f"hack/objstore up failed ({up.returncode}):\n{up.stderr}", pytrace=False)
    try:
        yield S3(name, parse_exports(up.stdout))
    finally:
        down = objstore("down", name=name)
        assert down.returncode == 0, f"hack/objstore down failed: {down.stderr}"


@pytest.fixture
def bucket(s3: S3) -> str:
    """A fresh bucket on the session's server."""
    return s3.bucket()


def secret_free(text: str, s3: S3, where: str = "") -> None:
    """Assert `text` (a log, a status, events) holds no secret key of the server."""
    assert s3.secret not in text, f"the secret key appears in {where or 'the output'}"


def tree(store, uri) -> dict[str, int]:
    """{key relative to `uri`: size} of every object under a prefix."""
    return {i.uri.key[len(uri.key):]: i.size for i in store.list(uri)}


DIGITS_SHARDS = 8


def put_digits(store, bucket: str, prefix: str = "digits/") -> str:
    """scikit-learn's digits as DIGITS_SHARDS .npz shards under s3://bucket/prefix; the prefix's URI."""
    import io

    import numpy as np

    from kubetrain.trainer.data import digits
    from kubetrain.trainer.objstore import ObjectURI

    x, y = digits()
    for i, (xs, ys) in enumerate(zip(np.array_split(x, DIGITS_SHARDS), np.array_split(y, DIGITS_SHARDS))):
        buf = io.BytesIO()
        np.savez(buf, x=xs, y=ys)
        store.put_bytes(ObjectURI(bucket, f"{prefix}part-{i:03d}.npz"), buf.getvalue())
    return f"s3://{bucket}/{prefix}"
