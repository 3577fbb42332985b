"""A job's certificates: a CA of its own and the one certificate every replica of the job presents.

Pure but for randomness: names and the time in, PEM text out (the keys of the
job's Secret, `kubetrain.shared.tls_files.FILES`). No I/O; the operator puts the result in the
job's token Secret, the local backend writes it into the run directory.

Why one leaf for every replica: the replicas of a job share one Secret (the
operator never reads Secrets, so it cannot hand each pod its own), so ps-0,
ps-1 and every worker present the same certificate, as server and as client.
What it proves is "a replica of this job", the same claim the token makes;
what TLS adds is encryption, and that a peer without the job's key cannot
talk to a parameter server at all, token or not.

Why a CA per job, whose key is thrown away: a parameter server trusts this
CA only, so a certificate of another job (or of anything else in the
cluster) is refused at the handshake, and once the leaf is signed nobody,
the operator included, can mint another certificate the job's replicas
accept. A job that needs new certificates is a new job (a new uid, a new
Secret).
"""

from __future__ import annotations

import functools
import ipaddress
import secrets
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kubetrain.shared.tls_files import CA_FILE, CERT_FILE, KEY_FILE

from kubetrain.api import TrainingJob

CURVE = ec.SECP256R1()
"""P-256: what every TLS stack speaks, and its keys and signatures are cheap (a job's CA and leaf: about 3 ms here)."""
VALIDITY = timedelta(days=365)
"""How long the CA and the leaf are valid. A job is not expected to outlive it; one that does
fails its handshakes after a year (`CERTIFICATE_VERIFY_FAILED`, expired), and a new job gets new ones."""
CLOCK_SKEW = timedelta(minutes=5)
"""notBefore is set this far back: a node whose clock is a little behind the operator's would
otherwise refuse a certificate that is not valid yet, in the first minutes of the job."""
LOOPBACK_NAMES = ("localhost",)
LOOPBACK_IPS = ("127.0.0.1", "::1")
"""A local run's workers dial 127.0.0.1:<port>; the same certificate serves a cluster and a local run."""
CACHED_JOBS = 4096
"""Jobs whose Secret's certificates `secret_certificates` remembers (about 2 KB each). The
reconciler renders every child every round and creates only the missing ones; without the
cache each round of a ParameterServer job would make a CA again for nothing. A job beyond
the bound only costs a regeneration, never a different Secret: the Secret is created once."""


def uses_tls(job: TrainingJob) -> bool:
    """Parameter servers and workers speak mutual TLS; a Single or DDP job has no PS traffic
    (DDP's gloo and NCCL traffic is not covered: see docs/parameter-server.md#encryption)."""
    return job.spec.mode == "ParameterServer"


def ps_dns_names(namespace: str, ps_hosts: Sequence[str]) -> list[str]:
    """Every name a worker may dial a shard by: the Service's short name (what the plan uses),
    and its namespaced forms, for clients in other namespaces and tools."""
    names = []
    for host in ps_hosts:
        names += [host, f"{host}.{namespace}", f"{host}.{namespace}.svc"]
    return names


def ps_hosts_of(job_name: str, ps_replicas: int) -> list[str]:
    """The shards' Service names, `<job>-ps-<i>` (children.ps_services)."""
    return [f"{job_name}-ps-{i}" for i in range(ps_replicas)]


def job_certificates(job_name: str, namespace: str, ps_hosts: Sequence[str], now: datetime) -> dict[str, str]:
    """A new CA and leaf for the job: `{ca.crt, tls.crt, tls.key}` as PEM text.

    The CA's private key is not returned and not kept: it signs the leaf and is
    gone when this function returns. The leaf's SANs are `ps_dns_names` and
    loopback; its extended key usage allows server and client auth.
    """
    if now.tzinfo is None:
        raise ValueError("now must carry a time zone (UTC)")
    not_before, not_after = now - CLOCK_SKEW, now + VALIDITY
    ca_key = ec.generate_private_key(CURVE)
    ca_name = x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kubetrain"),
        x509.NameAttribute(NameOID.COMMON_NAME, f"kubetrain job CA {namespace}/{job_name}"[:64]),
    ])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(_serial())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        # path_length 0: the CA signs leaves only, never another CA.
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    leaf_key = ec.generate_private_key(CURVE)
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in [*ps_dns_names(namespace, ps_hosts), *LOOPBACK_NAMES]]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in LOOPBACK_IPS]
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kubetrain"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"{job_name}.{namespace} replica"[:64]),
        ]))
        .issuer_name(ca_name)
        .public_key(leaf_key.public_key())
        .serial_number(_serial())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(leaf_key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    return {
        CA_FILE: ca_cert.public_bytes(pem).decode(),
        CERT_FILE: leaf.public_bytes(pem).decode(),
        KEY_FILE: leaf_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode(),
    }


@functools.lru_cache(maxsize=CACHED_JOBS)
def secret_certificates(job_name: str, namespace: str, uid: str, ps_hosts: tuple[str, ...]) -> dict[str, str]:
    """`job_certificates` for the job's Secret, made once per job (name, namespace, uid) in this
    process, at the time of its first rendering (see CACHED_JOBS)."""
    return job_certificates(job_name, namespace, ps_hosts, datetime.now(timezone.utc))


def _serial() -> int:
    # RFC 5280: positive, at most 20 octets; 159 random bits (CA/Browser Forum asks for 64 or more).
    return secrets.randbits(159) | 1


def _key_usage(cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign,  # the leaf signs its TLS handshakes (ECDHE-ECDSA)
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )
