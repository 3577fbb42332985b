"""The transport-security contract: where a replica finds its job's certificates, and what the files are.

Both sides read it: the operator puts the files in the job's Secret and projects
them into the pods (under SUBDIR of its config volume), the local backend writes them into the run
directory, and the trainer's parameter-server code (`kubetrain.trainer.ps.credentials`) loads them.
No `cryptography` here: the trainer only reads PEM files, and the control plane's
generator is `kubetrain.engine.certificates`.

A replica whose environment has `KUBETRAIN_TLS_DIR` serves and dials the
parameter servers over mutual TLS with the three files in that directory;
every kubetrain job with parameter servers gets it, in a pod and locally.
"""

from __future__ import annotations

TLS_DIR_VAR = "KUBETRAIN_TLS_DIR"
"""The directory holding CA_FILE, CERT_FILE and KEY_FILE."""

CA_FILE = "ca.crt"
"""The job's own CA (PEM): the one issuer a replica trusts, as server and as client."""
CERT_FILE = "tls.crt"
"""The job's replica certificate (PEM), signed by the job's CA: server and client auth."""
KEY_FILE = "tls.key"
"""Its private key (PKCS#8 PEM, unencrypted)."""

FILES = (CA_FILE, CERT_FILE, KEY_FILE)
"""The Secret's keys and the files' names: the same, so a Secret volume projects them as they are."""

SUBDIR = "tls"
"""The folder of the files in a pod's read-only `config` volume (the operator's children.TLS_MOUNT)."""
