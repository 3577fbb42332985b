"""Mutual TLS between parameter servers and workers: the job's PEM files in, gRPC credentials out.

The files are the job's own (`kubetrain.shared.tls_files`): a CA made for the
job, and one certificate and key that every replica presents, as server and
as client. A shard asks every client for a certificate and accepts only one
the job's CA signed (`require_client_auth`); a worker accepts only a shard
whose certificate the job's CA signed, for the name it dials. A peer without
the job's key fails the handshake, before any call or token is seen; the
token check (transport.TokenInterceptor) stays behind it.

Whether a replica speaks TLS is the environment's choice, never a fallback:
with `KUBETRAIN_TLS_DIR` set it does, and unreadable files stop it (exit 2);
without it, plaintext (tests and benchmarks that ask for it; kubetrain's own
jobs always set it).
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kubetrain.shared.tls_files import CA_FILE, CERT_FILE, KEY_FILE, TLS_DIR_VAR

from ..errors import ConfigError


@dataclass(frozen=True)
class TlsFiles:
    """The job's CA certificate, the replica certificate and its key, as PEM bytes."""

    ca: bytes
    cert: bytes
    key: bytes
    directory: Path | None = field(default=None, compare=False)
    """Where they were read from: Python's ssl module (the data plane, dataplane.py) loads a key from a file."""

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> "TlsFiles":
        folder = Path(directory)
        try:
            ca, cert, key = ((folder / name).read_bytes() for name in (CA_FILE, CERT_FILE, KEY_FILE))
        except OSError as err:
            raise ConfigError(f"{TLS_DIR_VAR}: cannot read the job's certificates in {folder}: {err}") from None
        for name, pem in ((CA_FILE, ca), (CERT_FILE, cert), (KEY_FILE, key)):
            if b"-----BEGIN " not in pem:
                raise ConfigError(f"{TLS_DIR_VAR}: {folder / name} is not a PEM file")
        return cls(ca, cert, key, folder)

    def server_credentials(self) -> grpc.ServerCredentials:
        """A shard's side: present the job's certificate, demand one the job's CA signed."""
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """A worker's side: trust the job's CA only (not the system's), present the job's certificate."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert)

    def _chain(self, context: ssl.SSLContext) -> ssl.SSLContext:
        if self.directory is None:
            raise ConfigError("the job's certificates were not loaded from a directory (TlsFiles.load)")
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_verify_locations(cadata=self.ca.decode())  # the job's CA only, not the system's
        context.load_cert_chain(self.directory / CERT_FILE, self.directory / KEY_FILE)
        return context

    def server_context(self) -> ssl.SSLContext:
        """The data plane's shard side, as server_credentials: the job's certificate, a client's demanded."""
        context = self._chain(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))
        context.verify_mode = ssl.CERT_REQUIRED
        return context

    def client_context(self) -> ssl.SSLContext:
        """The data plane's worker side, as channel_credentials: the shard's name checked against the job's CA."""
        return self._chain(ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT))


def from_env(environ: Mapping[str, str] | None = None) -> TlsFiles | None:
    """The job's certificates from `KUBETRAIN_TLS_DIR`; None (plaintext) when it is not set."""
    env = os.environ if environ is None else environ
    directory = env.get(TLS_DIR_VAR, "")
    return TlsFiles.load(directory) if directory else None
