"""A job's certificates (engine/certificates.py) and where the cluster and the local run put them."""

from __future__ import annotations

import ipaddress
import stat
from datetime import datetime, timedelta, timezone

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from kubetrain.shared.tls_files import CA_FILE, CERT_FILE, FILES, KEY_FILE, TLS_DIR_VAR
from kubetrain.api import from_object
from kubetrain.api import podtemplate
from kubetrain.engine import certificates as tls
from kubetrain.engine.children import TLS_MOUNT as MOUNT, children, token_name
from kubetrain.drivers.local.runner import write_certificates
from kubetrain.drivers.local.rundir import RunDir

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)


def job(mode, **spec):
    return from_object({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob",
                        "metadata": {"name": "j", "namespace": "ns"}, "spec": {"mode": mode, **spec}})


@pytest.fixture(scope="module")
def made():
    files = tls.job_certificates("j", "ns", ["j-ps-0", "j-ps-1"], NOW)
    ca = x509.load_pem_x509_certificate(files[CA_FILE].encode())
    leaf = x509.load_pem_x509_certificate(files[CERT_FILE].encode())
    key = serialization.load_pem_private_key(files[KEY_FILE].encode(), password=None)
    return files, ca, leaf, key


def test_the_result_is_the_three_pem_files_and_no_ca_key(made):
    files, _, _, _ = made
    assert tuple(files) == FILES == ("ca.crt", "tls.crt", "tls.key")
    assert sum("PRIVATE KEY" in text for text in files.values()) == 1  # the leaf's key only
    assert files[KEY_FILE].startswith("-----BEGIN PRIVATE KEY-----")


def test_the_job_ca_signs_the_leaf_and_the_key_is_the_leafs(made):
    _, ca, leaf, key = made
    leaf.verify_directly_issued_by(ca)
    ca.verify_directly_issued_by(ca)  # self-signed
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1"
    assert key.public_key() == leaf.public_key()
    assert ca.public_key() != leaf.public_key()
    assert leaf.issuer == ca.subject
    aki = leaf.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    assert aki.key_identifier == ski.digest


def test_the_ca_may_sign_leaves_only(made):
    _, ca, _, _ = made
    basic = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert basic.critical and basic.value.ca and basic.value.path_length == 0
    usage = ca.extensions.get_extension_for_class(x509.KeyUsage)
    assert usage.critical and usage.value.key_cert_sign and usage.value.crl_sign
    assert not usage.value.digital_signature


def test_the_leaf_is_for_servers_and_clients_and_no_ca(made):
    _, _, leaf, _ = made
    basic = leaf.extensions.get_extension_for_class(x509.BasicConstraints)
    assert basic.critical and not basic.value.ca
    usage = leaf.extensions.get_extension_for_class(x509.KeyUsage)
    assert usage.critical and usage.value.digital_signature and not usage.value.key_cert_sign
    extended = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(extended) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}


def test_the_leaf_names_every_shard_service_and_loopback(made):
    _, _, leaf, _ = made
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == [
        "j-ps-0", "j-ps-0.ns", "j-ps-0.ns.svc", "j-ps-1", "j-ps-1.ns", "j-ps-1.ns.svc", "localhost"]
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")]


def test_validity_is_a_year_from_a_little_before_now(made):
    _, ca, leaf, _ = made
    for cert in (ca, leaf):
        assert cert.not_valid_before_utc == NOW - tls.CLOCK_SKEW
        assert cert.not_valid_after_utc == NOW + tls.VALIDITY
    assert tls.VALIDITY == timedelta(days=365)
    assert ca.serial_number != leaf.serial_number


def test_every_job_gets_a_ca_of_its_own():
    a = tls.job_certificates("j", "ns", ["j-ps-0"], NOW)
    b = tls.job_certificates("j", "ns", ["j-ps-0"], NOW)
    assert a[CA_FILE] != b[CA_FILE] and a[KEY_FILE] != b[KEY_FILE]
    leaf_b = x509.load_pem_x509_certificate(b[CERT_FILE].encode())
    with pytest.raises(Exception):
        leaf_b.verify_directly_issued_by(x509.load_pem_x509_certificate(a[CA_FILE].encode()))


def test_a_naive_time_is_refused():
    with pytest.raises(ValueError, match="time zone"):
        tls.job_certificates("j", "ns", [], datetime(2026, 12, 1))


# --- in the cluster: the token Secret, the volume, the mount, the variable ----------------------


def test_a_parameter_server_jobs_secret_holds_the_token_and_its_certificates():
    objs = children(job("ParameterServer", parameterServer={"replicas": 2, "workers": 1}), "uid-1", "tok")
    [secret] = [o for o in objs if o["kind"] == "Secret"]
    assert set(secret["stringData"]) == {"token", *FILES}
    leaf = x509.load_pem_x509_certificate(secret["stringData"][CERT_FILE].encode())
    names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert "j-ps-1" in names and "j-ps-1.ns.svc" in names
    # Rendered again (every reconcile round renders every child): the same certificates, made once.
    again = [o for o in children(job("ParameterServer", parameterServer={"replicas": 2, "workers": 1}), "uid-1", "tok")
             if o["kind"] == "Secret"][0]
    assert again["stringData"] == secret["stringData"]
    # Another job (a new uid under the same name) gets a CA of its own.
    other = [o for o in children(job("ParameterServer", parameterServer={"replicas": 2, "workers": 1}), "uid-2", "tok")
             if o["kind"] == "Secret"][0]
    assert other["stringData"][CA_FILE] != secret["stringData"][CA_FILE]


def test_parameter_servers_and_workers_find_the_certificates_in_their_config_volume():
    j = job("ParameterServer", parameterServer={"replicas": 1, "workers": 2})
    pods = [o for o in children(j, "uid-1", "tok") if o["kind"] == "Pod"]
    assert len(pods) == 3
    for pod in pods:
        [volume] = [v for v in pod["spec"]["volumes"] if v["name"] == podtemplate.CONFIG_VOLUME]
        assert volume["projected"]["sources"] == [
            {"configMap": {"name": "j-config"}},
            # The certificate files only (the token is a variable), under tls/, the key's group (fsGroup) may read.
            {"secret": {"name": token_name(j), "items": [{"key": k, "path": f"tls/{k}", "mode": 0o440} for k in FILES]}},
        ]
        container = pod["spec"]["containers"][0]
        assert {"name": podtemplate.CONFIG_VOLUME, "mountPath": podtemplate.CONFIG_MOUNT, "readOnly": True} \
            in container["volumeMounts"]
        assert MOUNT == f"{podtemplate.CONFIG_MOUNT}/tls"
        assert {"name": TLS_DIR_VAR, "value": MOUNT} in container["env"]


@pytest.mark.parametrize("mode,spec", [("Single", {}), ("DDP", {"ddp": {"nodes": 2}})])
def test_jobs_without_parameter_servers_get_no_certificates(mode, spec):
    objs = children(job(mode, **spec), "uid-1", "tok")
    [secret] = [o for o in objs if o["kind"] == "Secret"]
    assert set(secret["stringData"]) == {"token"}
    text = repr(objs)
    assert "projected" not in text and TLS_DIR_VAR not in text


# --- a local run: the run directory ------------------------------------------------------------


def test_a_local_run_writes_the_certificates_for_its_owner_only(tmp_path):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    folder = write_certificates(job("ParameterServer", parameterServer={"replicas": 1, "workers": 1}), run)
    assert folder == run.path / "tls"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for name in FILES:
        assert stat.S_IMODE((folder / name).stat().st_mode) == 0o600
    leaf = x509.load_pem_x509_certificate((folder / CERT_FILE).read_bytes())
    leaf.verify_directly_issued_by(x509.load_pem_x509_certificate((folder / CA_FILE).read_bytes()))
    assert write_certificates(job("Single"), run) is None
