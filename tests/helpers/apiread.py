"""Plain reads of the API server from the test process, without a kubectl process.

Most of the tests' kubectl calls are polls: a job's status every 0.5-1 s, the pods of a job, the
static volumes' recycler (tests/operator/conftest.py). A CI run started about 3,000 kubectl processes,
each about 45 ms of CPU (a Go binary's start, the kubeconfig, a TLS handshake): some 150 CPU s of the
2-core machine's run. The same GET from this process, over a connection kept open per thread, costs a
few milliseconds. `helpers.kube.Kubectl` sends here what is a plain read (`get KIND [NAME]`, with `-l`
and `--field-selector`) of a kind the API server's discovery names; anything else (other flags, other
output, writes, a kubeconfig of another shape) stays kubectl's. What comes back is what `kubectl get -o
json` prints: the object, or a List whose items carry their kind and apiVersion.
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
import threading
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

NOT_FOUND = None


class Unsupported(Exception):
    """Not a read this module does: the caller runs kubectl instead."""


@dataclass(frozen=True)
class Resource:
    prefix: str  # /api/v1 or /apis/GROUP/VERSION
    plural: str
    kind: str
    api_version: str
    namespaced: bool


def read_args(args: tuple[str, ...]) -> tuple[str, str | None, dict[str, str]]:
    """`get KIND [NAME] [-l SEL] [--field-selector SEL]` as (kind, name, query); Unsupported otherwise."""
    if not args or args[0] != "get":
        raise Unsupported(args)
    positional, query, rest = [], {}, list(args[1:])
    while rest:
        arg = rest.pop(0)
        flag, eq, value = arg.partition("=")
        if flag in ("-l", "--selector", "--field-selector"):
            if not eq:
                if not rest:
                    raise Unsupported(args)
                value = rest.pop(0)
            query["fieldSelector" if flag == "--field-selector" else "labelSelector"] = value
        elif arg.startswith("-"):
            raise Unsupported(args)
        else:
            positional.append(arg)
    if not 1 <= len(positional) <= 2 or "," in positional[0] or "/" in positional[0]:
        raise Unsupported(args)
    return positional[0], positional[1] if len(positional) == 2 else None, query


class Reader:
    """GETs against the cluster of one kubeconfig (client certificate files, as kwokctl writes them)."""

    def __init__(self, kubeconfig: Path):
        try:
            config = yaml.safe_load(kubeconfig.read_text())
            context = next(c["context"] for c in config["contexts"] if c["name"] == config["current-context"])
            cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == context["cluster"])
            user = next(u["user"] for u in config["users"] if u["name"] == context["user"])
            server = urllib.parse.urlsplit(cluster["server"])
            tls = ssl.create_default_context(cafile=cluster["certificate-authority"])
            tls.load_cert_chain(user["client-certificate"], user["client-key"])
        except (OSError, KeyError, StopIteration, TypeError, ValueError, ssl.SSLError) as err:
            raise Unsupported(f"{kubeconfig}: {err}") from None
        if server.scheme != "https" or not server.hostname:
            raise Unsupported(cluster["server"])
        self.host, self.port, self.tls = server.hostname, server.port or 443, tls
        self.namespace = context.get("namespace") or "default"
        self._local = threading.local()
        self._resources: dict[str, Resource] | None = None
        self._lock = threading.Lock()

    def _request(self, path: str, timeout: float) -> tuple[int, bytes]:
        """One GET on this thread's connection; a connection the server closed is opened again once."""
        for attempt in (1, 2):
            conn = getattr(self._local, "conn", None)
            if conn is None:
                conn = self._local.conn = http.client.HTTPSConnection(self.host, self.port, context=self.tls,
                                                                      timeout=timeout)
            conn.timeout = timeout
            if conn.sock is not None:
                conn.sock.settimeout(timeout)
            try:
                conn.request("GET", path, headers={"Accept": "application/json"})
                response = conn.getresponse()
                return response.status, response.read()
            except (http.client.HTTPException, OSError) as err:
                conn.close()
                self._local.conn = None
                if attempt == 2:
                    raise OSError(f"GET {path}: {err!r}") from err  # what Kubectl turns into kubectl's failure
        raise AssertionError("unreachable")

    def _get_json(self, path: str, timeout: float, missing: Any = AssertionError) -> Any:
        """The answer, parsed; a 404 gives `missing` where one is given, and fails like any other error else."""
        status, body = self._request(path, timeout)
        if status == 404 and missing is not AssertionError:
            return missing
        if status != 200:
            raise AssertionError(f"GET {path}: {status} {body[:500].decode(errors='replace')}")
        return json.loads(body)

    def _discover(self, timeout: float) -> dict[str, Resource]:
        """Every name kubectl accepts for a kind (plural, singular, short names, plural.group), core first."""
        table: dict[str, Resource] = {}
        versions = [("/api/v1", "v1", "")]
        for group in self._get_json("/apis", timeout)["groups"]:
            preferred = group["preferredVersion"]["groupVersion"]
            versions.append((f"/apis/{preferred}", preferred, group["name"]))
        for prefix, api_version, group in versions:
            for r in self._get_json(prefix, timeout)["resources"]:
                if "/" in r["name"] or "get" not in r.get("verbs", ()):
                    continue
                resource = Resource(prefix, r["name"], r["kind"], api_version, r["namespaced"])
                names = {r["name"], r.get("singularName") or r["kind"].lower(), *r.get("shortNames", ())}
                if group:
                    names |= {f"{n}.{group}" for n in list(names)}
                for name in names:
                    table.setdefault(name, resource)
        return table

    def resource(self, kind: str, timeout: float) -> Resource:
        with self._lock:
            if self._resources is None or kind not in self._resources:  # a CRD installed since: look again
                self._resources = self._discover(timeout)
            found = self._resources.get(kind)
        if found is None:
            raise Unsupported(kind)  # kubectl says what is wrong with the name
        return found

    def get(self, kind: str, name: str | None, namespace: str | None, query: dict[str, str],
            timeout: float) -> Any:
        """`kubectl get -o json` of one object (None when not found) or of a List."""
        r = self.resource(kind, timeout)
        path = r.prefix
        if r.namespaced:
            path += f"/namespaces/{urllib.parse.quote(namespace or self.namespace)}"
        path += f"/{r.plural}"
        if name is not None:
            if query:
                raise Unsupported("a name with a selector")
            found = self._get_json(f"{path}/{urllib.parse.quote(name)}", timeout, missing=NOT_FOUND)
            return NOT_FOUND if found is NOT_FOUND else as_kubectl_prints(found)
        listed = self._get_json(f"{path}?{urllib.parse.urlencode(query)}" if query else path, timeout)
        for item in listed["items"]:
            item.setdefault("kind", r.kind)
            item.setdefault("apiVersion", r.api_version)
            as_kubectl_prints(item)
        return {"apiVersion": "v1", "kind": "List", "items": listed["items"],
                "metadata": {"resourceVersion": ""}}


def as_kubectl_prints(obj: dict) -> dict:
    """kubectl leaves out metadata.managedFields unless asked (--show-managed-fields)."""
    (obj.get("metadata") or {}).pop("managedFields", None)
    return obj


_readers: dict[tuple[str, int, int], Reader | None] = {}
_readers_lock = threading.Lock()


def reader(env: dict[str, str] | Any) -> Reader:
    """The Reader of env's KUBECONFIG, one per version of that file (a cluster made again under the same
    name writes a new one, with new certificates); Unsupported where there is none to use."""
    path = env.get("KUBECONFIG") if hasattr(env, "get") else None
    if not path or os.pathsep in path:
        raise Unsupported("KUBECONFIG")
    try:
        stat = Path(path).stat()
    except OSError:
        raise Unsupported(path) from None
    key = (path, stat.st_mtime_ns, stat.st_ino)
    with _readers_lock:
        if key not in _readers:
            try:
                _readers[key] = Reader(Path(path))
            except Unsupported:
                _readers[key] = None
        found = _readers[key]
    if found is None:
        raise Unsupported(path)
    return found
