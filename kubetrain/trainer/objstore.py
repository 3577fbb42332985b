"""Object storage: `s3://` URIs, kubetrain's S3 client with its retries and errors, and the transfers on top.

Data is read from, checkpoints are written to and models are exported to S3 or an S3-compatible store
through `ObjectStore`. It speaks S3's REST API itself (Signature Version 4 over urllib3's connection
pools, ~500 lines): the libraries were weighed and none fits this project's one environment and its
guarantees. boto3 (and s3fs, through aiobotocore) pins python-dateutil below 3, which kubernetes 37
(the operator's client) requires; obstore (Rust, fast) can neither list nor abort the multipart uploads
a killed writer leaves, and its retries are invisible to kubetrain's metrics. What is needed here is
small and fixed: objects put whole or in parallel parts, ranged reads, listings, batched deletes and the
multipart bookkeeping. docs/object-storage.md has the measured throughput against a single plain PUT.

Credentials come the way every S3 tool takes them, from the environment: `AWS_ACCESS_KEY_ID`,
`AWS_SECRET_ACCESS_KEY` (and `AWS_SESSION_TOKEN`), `AWS_REGION` (or `AWS_DEFAULT_REGION`; us-east-1
when unset), and `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL` for a store that is not AWS (path-style
requests; AWS itself gets virtual-hosted ones); `AWS_CA_BUNDLE` names extra CA certificates. In a pod
they come from the job's `secretRef`. Profiles, instance metadata and web identity (IRSA) are not read.
No message of this module carries a key: errors name the URI, the endpoint and the store's error code.

Errors become the trainer's: a bad URI, a missing bucket or object, refused credentials are permanent
(`LoadError`, exit 3, the URI named); a store that does not answer after `ATTEMPTS` tries is transient
(`TransientError`, exit 75: the replica is restarted and resumes).
"""

from __future__ import annotations

import base64
import builtins  # the classes below have a method named list
import concurrent.futures
import datetime
import hashlib
import hmac
import io
import logging
import os
import random
import re
import threading
import time
import urllib.parse
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from kubetrain.shared.files import atomic_write

from .errors import ConfigError, LoadError, TransientError

log = logging.getLogger(__name__)

SCHEME = "s3://"
# A bucket name as S3 allows it (3-63 lower-case letters, digits, dots and hyphens); the API model holds
# the same rule for the manifest's URIs (kubetrain/api/spec.py OBJECT_URI_PATTERN).
BUCKET_PATTERN = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")

# Attempts per request, the first included, with BACKOFF_* between them: a store that is busy or
# fails for a moment (an answer of 5xx, 429 or SlowDown, a connection refused or reset, a timeout) is
# ridden out; past that the operation fails with TransientError and the replica is restarted, resuming
# from its checkpoint (tests/trainer/test_objstore.py goes past it). Answers that will not change (403,
# 404, another 4xx) are not retried.
ATTEMPTS = 5
# How long a connection may take to open, and a read to wait for bytes, before the attempt fails (and
# is retried): long enough for a loaded store, short enough that a dead one is noticed within a minute.
CONNECT_SECONDS = 10
READ_SECONDS = 60
# Multipart: objects from MULTIPART_BYTES up are sent in parts of PART_BYTES, TRANSFER_THREADS at a
# time; a download of that size is read in ranges the same way. 16 MiB parts keep a 1 GiB checkpoint at
# 64 parts (S3 allows 10,000, so objects up to 156 GiB) and each request long enough that its fixed cost
# is small. Four threads fill loopback and a pod's network; each holds one part in memory.
MULTIPART_BYTES = 16 << 20
PART_BYTES = 16 << 20
TRANSFER_THREADS = 4
# HTTP connections one process keeps to the store: the transfer threads of two transfers at once (a
# checkpoint upload while the data loader prefetches) and a few small requests beside them.
MAX_CONNECTIONS = 2 * TRANSFER_THREADS + 4
# A transfer that lasts longer than this logs its progress (bytes, rate) every this many seconds.
PROGRESS_SECONDS = 10.0
# Reads of small objects (commits, indexes): anything larger is not one kubetrain wrote.
SMALL_OBJECT_BYTES = 16 << 20
# How many keys one DeleteObjects request takes (S3's own limit).
DELETE_BATCH = 1000

# The store's error codes that mean "no such thing" and "not allowed", as S3 and compatible stores send them.
MISSING_BUCKET = {"NoSuchBucket"}
MISSING_KEY = {"NoSuchKey", "404", "NotFound", "NoSuchUpload"}
DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "InvalidToken", "ExpiredToken",
          "AllAccessDisabled", "AccountProblem", "InvalidSecurity"}


@dataclass(frozen=True)
class ObjectURI:
    """`s3://BUCKET/KEY`: one object, or with a KEY that ends in `/` (or is empty) a prefix of objects."""

    bucket: str
    key: str = ""

    def __str__(self) -> str:
        return f"{SCHEME}{self.bucket}/{self.key}"

    @property
    def is_prefix(self) -> bool:
        return self.key == "" or self.key.endswith("/")

    def child(self, name: str) -> "ObjectURI":
        """The object or prefix `name` under this prefix."""
        base = self.key if self.is_prefix else self.key + "/"
        return ObjectURI(self.bucket, base + name)

    def prefix(self) -> "ObjectURI":
        """This URI as a prefix (a trailing `/`)."""
        return self if self.is_prefix else ObjectURI(self.bucket, self.key + "/")

    @property
    def name(self) -> str:
        """The last part of the key (`ckpt-00000050.pt` of `s3://b/run/ckpt-00000050.pt`)."""
        return self.key.rstrip("/").rsplit("/", 1)[-1]


def is_uri(text: str | os.PathLike[str] | None) -> bool:
    """Whether `text` is an object-storage URI (s3://...) rather than a path."""
    return isinstance(text, str) and text.startswith(SCHEME)


def parse_uri(text: str, where: str = "URI") -> ObjectURI:
    """`s3://BUCKET[/KEY]` as an ObjectURI; ConfigError naming `where` (a field path, an argument) if not one."""
    if not isinstance(text, str) or not text.startswith(SCHEME):
        raise ConfigError(f"{where}: expected s3://BUCKET/KEY, got {text!r}")
    bucket, _, key = text[len(SCHEME):].partition("/")
    if not BUCKET_PATTERN.fullmatch(bucket) or ".." in bucket:
        raise ConfigError(f"{where}: {text!r} has no valid bucket name (3-63 lower-case letters, digits, dots "
                          "and hyphens, as S3 allows)")
    if "//" in key or any(part in (".", "..") for part in key.split("/")):
        raise ConfigError(f"{where}: {text!r} has an empty, '.' or '..' part in its key")
    if "\x00" in key or len(key.encode()) > 1024:
        raise ConfigError(f"{where}: {text!r}: a key is at most 1,024 bytes with no NUL")
    return ObjectURI(bucket, key)


@dataclass(frozen=True)
class ObjectInfo:
    """One object of a listing: its URI, size in bytes and last-modified time (Unix seconds)."""

    uri: ObjectURI
    size: int
    modified: float


@dataclass
class TransferStats:
    """What one process moved to and from the store; read by the metrics and the benchmarks."""

    uploaded_bytes: int = 0
    downloaded_bytes: int = 0
    retries: int = 0
    requests: int = 0


class Progress:
    """A transfer's progress, logged every PROGRESS_SECONDS once it lasts that long: bytes, share, rate.

    The transfers call it from their threads with each piece's byte count.
    """

    def __init__(self, what: str, total: int | None, on_bytes: Callable[[int], None] | None = None):
        self.what, self.total, self.on_bytes = what, total, on_bytes
        self.done = 0
        self.started = time.monotonic()
        self._next = self.started + PROGRESS_SECONDS
        self._lock = threading.Lock()

    def __call__(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            due = now >= self._next
            if due:
                self._next = now + PROGRESS_SECONDS
        if self.on_bytes is not None:
            self.on_bytes(n)
        if due:
            log.info("%s", self.line(now))

    def line(self, now: float | None = None) -> str:
        seconds = max((now or time.monotonic()) - self.started, 1e-9)
        share = f" of {human_bytes(self.total)} ({100 * self.done / self.total:.0f}%)" if self.total else ""
        return f"{self.what}: {human_bytes(self.done)}{share}, {human_bytes(self.done / seconds)}/s"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class StoreError(Exception):
    """A request the store answered with an error (`code`: S3's error code, else the HTTP status), or that
    never got an answer (`code` empty, `status` 0)."""

    def __init__(self, code: str, message: str, status: int = 0):
        super().__init__(f"{code or 'no answer'}: {message}" if message else (code or "no answer"))
        self.code, self.message, self.status = code, message, status


# Answers worth another attempt: the store is busy, restarting or failing for a moment.
RETRIED_STATUS = {500, 502, 503, 504, 429}
RETRIED_CODES = {"RequestTimeout", "SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeTooSkewed"}
# Backoff between attempts: full jitter over an exponentially growing window, as AWS's own SDKs do
# (0.5, 1, 2, 4 s windows for the four retries of ATTEMPTS 5: at most 7.5 s in all, plus the timeouts).
BACKOFF_BASE_SECONDS = 0.5
BACKOFF_MAX_SECONDS = 8.0
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def translate(err: BaseException, uri: ObjectURI | str, action: str, endpoint: str) -> Exception:
    """A StoreError as the trainer's own error, naming the URI and never a credential.

    Permanent (LoadError, exit 3): no such bucket or object, credentials missing or refused, a request
    the store refuses. Anything else reached here after ATTEMPTS tries: TransientError (exit 75).
    """
    where = f"{uri}: {action}"
    if isinstance(err, (LoadError, TransientError, ConfigError)):
        return err
    if not isinstance(err, StoreError):
        return TransientError(f"{where}: {type(err).__name__}: {str(err)[:300]}")
    code, message = err.code, err.message[:300]
    if code in MISSING_BUCKET:
        bucket = uri.bucket if isinstance(uri, ObjectURI) else str(uri)
        return LoadError(f"{where}: no such bucket {bucket!r} at {endpoint}")
    if code in MISSING_KEY:
        return LoadError(f"{where}: no such object at {endpoint}")
    if code in DENIED:
        return LoadError(f"{where}: access denied by {endpoint} ({code}): the credentials (AWS_ACCESS_KEY_ID, "
                         "AWS_SECRET_ACCESS_KEY) were refused or may not do this")
    if err.status and 400 <= err.status < 500 and code not in RETRIED_CODES:
        return LoadError(f"{where}: refused by {endpoint} ({code}{': ' + message if message else ''})")
    if not err.status:
        return TransientError(f"{where}: {endpoint} did not answer after {ATTEMPTS} attempts: {message}")
    return TransientError(f"{where}: {endpoint} answered {code} after {ATTEMPTS} attempts"
                          f"{': ' + message if message else ''}")


def endpoint_url() -> str:
    """The store's address: AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL; empty for AWS itself."""
    return (os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "").rstrip("/")


def _quote(text: str, safe: str = "-_.~") -> str:
    return urllib.parse.quote(text, safe=safe)


def _xml_text(node: ET.Element, name: str) -> str:
    """The text of the first child element `name` (any namespace), "" when there is none."""
    for child in node.iter():
        if child.tag.rsplit("}", 1)[-1] == name:
            return child.text or ""
    return ""


def _xml_children(node: ET.Element, name: str) -> list[ET.Element]:
    return [child for child in node if child.tag.rsplit("}", 1)[-1] == name]


@dataclass(frozen=True)
class Credentials:
    """The store's address and keys, read from the environment once per client."""

    access_key: str
    secret_key: str
    session_token: str
    region: str
    endpoint: str
    """Scheme, host and port of a store that is not AWS; empty for AWS (virtual-hosted requests)."""

    @classmethod
    def from_env(cls) -> "Credentials":
        env = os.environ
        return cls(env.get("AWS_ACCESS_KEY_ID", ""), env.get("AWS_SECRET_ACCESS_KEY", ""),
                   env.get("AWS_SESSION_TOKEN", ""),
                   env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1", endpoint_url())

    def __repr__(self) -> str:  # never the keys, in a traceback or a log
        return f"Credentials(endpoint={self.endpoint or 'AWS'!r}, region={self.region!r})"


class Signer:
    """AWS Signature Version 4 for S3 requests: the canonical request, the string to sign, the header."""

    def __init__(self, credentials: Credentials):
        self.credentials = credentials

    def _key(self, day: str) -> bytes:
        key = ("AWS4" + self.credentials.secret_key).encode()
        for part in (day, self.credentials.region, "s3", "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        return key

    def sign(self, method: str, host: str, path: str, query: dict[str, str], headers: dict[str, str],
             payload_sha256: str, now: datetime.datetime | None = None) -> dict[str, str]:
        """`headers` with x-amz-date, x-amz-content-sha256, the session token and Authorization added."""
        now = now or datetime.datetime.now(datetime.timezone.utc)
        stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
        out = dict(headers)
        out["host"] = host
        out["x-amz-date"] = stamp
        out["x-amz-content-sha256"] = payload_sha256
        if self.credentials.session_token:
            out["x-amz-security-token"] = self.credentials.session_token
        signed = {k.lower(): " ".join(str(v).split()) for k, v in out.items()}
        names = ";".join(sorted(signed))
        canonical_query = "&".join(f"{_quote(k)}={_quote(v)}" for k, v in sorted(query.items()))
        canonical = "\n".join([method, _quote(path, safe="/-_.~"), canonical_query,
                               "".join(f"{k}:{signed[k]}\n" for k in sorted(signed)), names, payload_sha256])
        scope = f"{day}/{self.credentials.region}/s3/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()])
        signature = hmac.new(self._key(day), to_sign.encode(), hashlib.sha256).hexdigest()
        out["Authorization"] = (f"AWS4-HMAC-SHA256 Credential={self.credentials.access_key}/{scope}, "
                                f"SignedHeaders={names}, Signature={signature}")
        del out["host"]  # urllib3 sends the Host header of the URL itself
        return out


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: Any
    """bytes, or with stream=True urllib3's response to read from (and release)."""


class ObjectStore:
    """One process's client of the store named by its environment, with kubetrain's retries and errors.

    Thread-safe (urllib3's pool is; each transfer's parts run in threads of their own). `on_upload(n)`
    and `on_download(n)` are told every piece's byte count, `on_retry()` every retried request (the
    metrics' hooks); `stats` counts the same for benchmarks and tests.
    """

    def __init__(self, on_upload: Callable[[int], None] | None = None,
                 on_download: Callable[[int], None] | None = None,
                 on_retry: Callable[[], None] | None = None, credentials: Credentials | None = None):
        self.on_upload, self.on_download, self.on_retry = on_upload, on_download, on_retry
        self.stats = TransferStats()
        self.credentials = credentials or Credentials.from_env()
        self.endpoint = self.credentials.endpoint or f"AWS S3 ({self.credentials.region})"
        self._signer = Signer(self.credentials)
        self._pool: Any = None
        self._lock = threading.Lock()
        self._stats_lock = threading.Lock()

    # --- requests ---------------------------------------------------------------------------------

    @property
    def pool(self) -> Any:
        with self._lock:
            if self._pool is None:
                import urllib3

                ca = os.environ.get("AWS_CA_BUNDLE") or None
                self._pool = urllib3.PoolManager(
                    maxsize=MAX_CONNECTIONS, block=True, ca_certs=ca, retries=False,
                    timeout=urllib3.Timeout(connect=CONNECT_SECONDS, read=READ_SECONDS))
            return self._pool

    def _address(self, bucket: str, key: str) -> tuple[str, str, str]:
        """(base URL, host, path) of an object: path-style at an endpoint, virtual-hosted at AWS."""
        if self.credentials.endpoint:
            parsed = urllib.parse.urlsplit(self.credentials.endpoint)
            if parsed.scheme not in ("http", "https") or not parsed.netloc:
                raise ConfigError(f"AWS_ENDPOINT_URL: expected http(s)://host[:port], got {self.credentials.endpoint!r}")
            base_path = parsed.path.rstrip("/")
            return f"{parsed.scheme}://{parsed.netloc}", parsed.netloc, f"{base_path}/{bucket}/{key}" if bucket else "/"
        region = self.credentials.region
        host = f"{bucket}.s3.{region}.amazonaws.com" if bucket and "." not in bucket else f"s3.{region}.amazonaws.com"
        path = f"/{key}" if bucket and "." not in bucket else f"/{bucket}/{key}"
        return f"https://{host}", host, path

    def request(self, method: str, uri: ObjectURI, query: dict[str, str] | None = None, body: bytes = b"",
                headers: dict[str, str] | None = None, stream: bool = False, ok: tuple[int, ...] = (200,),
                bucket_only: bool = False) -> Response:
        """One S3 request, signed, tried up to ATTEMPTS times; StoreError for an answer outside `ok`."""
        if not self.credentials.access_key or not self.credentials.secret_key:
            raise LoadError(f"{uri}: no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (in a cluster: "
                            "the field's secretRef names a Secret holding them)")
        query = query or {}
        base, host, path = self._address(uri.bucket, "" if bucket_only else uri.key)
        url = base + _quote(path, safe="/-_.~") + ("?" + "&".join(
            f"{_quote(k)}={_quote(v)}" if v != "" else _quote(k) for k, v in sorted(query.items())) if query else "")
        payload = hashlib.sha256(body).hexdigest() if body else EMPTY_SHA256
        last: StoreError | None = None
        for attempt in range(ATTEMPTS):
            if attempt:
                self._count(retries=1)
                if self.on_retry is not None:
                    self.on_retry()
                time.sleep(random.uniform(0, min(BACKOFF_MAX_SECONDS, BACKOFF_BASE_SECONDS * 2 ** (attempt - 1))))
            signed = self._signer.sign(method, host, path, query, headers or {}, payload)
            try:
                answer = self.pool.request(method, url, body=body or None, headers=signed, preload_content=not stream,
                                           redirect=False)
            except Exception as err:  # noqa: BLE001 - urllib3's connection, timeout and protocol errors
                last = StoreError("", f"{type(err).__name__}: {str(err)[:200]}")
                continue
            self._count(requests=1)
            if answer.status in ok:
                return Response(answer.status, dict(answer.headers), answer if stream else answer.data)
            data = answer.data if not stream else answer.read(64 << 10)
            if stream:
                answer.release_conn()
            last = self._error(answer.status, data, method)
            if answer.status not in RETRIED_STATUS and last.code not in RETRIED_CODES:
                raise last
        assert last is not None
        raise last

    @staticmethod
    def _error(status: int, data: bytes, method: str) -> StoreError:
        code = message = ""
        if data:
            try:
                root = ET.fromstring(data)
                code, message = _xml_text(root, "Code"), _xml_text(root, "Message")
            except ET.ParseError:
                message = data[:200].decode(errors="replace")
        if not code:  # a HEAD has no body
            code = {404: "NotFound", 403: "AccessDenied", 400: "BadRequest"}.get(status, str(status))
        return StoreError(code, message, status)

    def _call(self, uri: ObjectURI, action: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (StoreError, OSError) as err:
            raise translate(err, uri, action, self.endpoint) from None

    def _count(self, requests: int = 0, retries: int = 0, up: int = 0, down: int = 0) -> None:
        with self._stats_lock:
            self.stats.requests += requests
            self.stats.retries += retries
            self.stats.uploaded_bytes += up
            self.stats.downloaded_bytes += down

    def _uploaded(self, n: int) -> None:
        self._count(up=n)
        if self.on_upload is not None:
            self.on_upload(n)

    def _downloaded(self, n: int) -> None:
        self._count(down=n)
        if self.on_download is not None:
            self.on_download(n)

    # --- reading ----------------------------------------------------------------------------------

    def head(self, uri: ObjectURI) -> ObjectInfo | None:
        """The object's size and time; None when there is no such object."""
        try:
            answer = self.request("HEAD", uri)
        except StoreError as err:
            if err.code in MISSING_KEY:
                return None
            raise translate(err, uri, "read", self.endpoint) from None
        modified = answer.headers.get("Last-Modified", "")
        try:
            when = datetime.datetime.strptime(modified, "%a, %d %b %Y %H:%M:%S %Z").replace(
                tzinfo=datetime.timezone.utc).timestamp() if modified else 0.0
        except ValueError:
            when = 0.0
        return ObjectInfo(uri, int(answer.headers.get("Content-Length", "0")), when)

    def list(self, prefix: ObjectURI) -> list[ObjectInfo]:
        """Every object under `prefix` (all levels), in key order (ListObjectsV2, a page of 1,000 at a time)."""
        found: list[ObjectInfo] = []
        token = ""
        while True:
            query = {"list-type": "2", "prefix": prefix.key}
            if token:
                query["continuation-token"] = token
            answer = self._call(prefix, "list", self.request, "GET", prefix, query, bucket_only=True)
            root = self._parse(answer.body, prefix, "list")
            for item in _xml_children(root, "Contents"):
                when = _xml_text(item, "LastModified")
                try:
                    stamp = datetime.datetime.fromisoformat(when.replace("Z", "+00:00")).timestamp()
                except ValueError:
                    stamp = 0.0
                found.append(ObjectInfo(ObjectURI(prefix.bucket, _xml_text(item, "Key")),
                                        int(_xml_text(item, "Size") or 0), stamp))
            token = _xml_text(root, "NextContinuationToken")
            if _xml_text(root, "IsTruncated") != "true" or not token:
                break
        return sorted(found, key=lambda info: info.uri.key)

    def _parse(self, body: bytes, uri: ObjectURI, action: str) -> ET.Element:
        try:
            return ET.fromstring(body)
        except ET.ParseError as err:
            raise TransientError(f"{uri}: {action}: {self.endpoint} answered something that is not S3's XML: "
                                 f"{err}") from None

    def get_bytes(self, uri: ObjectURI, max_bytes: int = SMALL_OBJECT_BYTES) -> bytes:
        """A small object's bytes (a commit, an index); LoadError when it is larger than `max_bytes`."""
        answer = self._call(uri, "read", self.request, "GET", uri, stream=True)
        try:
            data = answer.body.read(max_bytes + 1)
        except Exception as err:  # noqa: BLE001 - the connection broke mid-read
            raise TransientError(f"{uri}: read: {type(err).__name__}: {err}") from None
        finally:
            answer.body.release_conn()
        if len(data) > max_bytes:
            raise LoadError(f"{uri}: larger than {max_bytes} bytes, not an object kubetrain wrote")
        self._downloaded(len(data))
        return data

    def get_range(self, uri: ObjectURI, start: int, length: int) -> bytes:
        """`length` bytes of the object from byte `start` (a ranged GET), whole or TransientError."""
        if length <= 0:
            return b""
        for attempt in range(ATTEMPTS):
            answer = self._call(uri, "read", self.request, "GET", uri,
                                headers={"Range": f"bytes={start}-{start + length - 1}"}, ok=(206, 200))
            data = answer.body if answer.status == 206 else answer.body[start:start + length]
            if len(data) == length:
                self._downloaded(len(data))
                return data
        raise TransientError(f"{uri}: read: asked for {length} bytes at {start}, got {len(data)}")

    def download(self, uri: ObjectURI, path: Path, expect: tuple[int, str] | None = None,
                 size: int | None = None) -> tuple[int, str]:
        """Download the object to `path` whole or not at all (atomic_write); its (length, sha256).

        `expect`: the (length, sha256) a commit recorded; a different object raises CorruptObject and
        leaves `path` as it was. An object of MULTIPART_BYTES or more is read in ranges of PART_BYTES,
        TRANSFER_THREADS at a time, each written at its offset; the file is hashed once whole.
        """
        if size is None:
            info = self.head(uri)
            if info is None:
                raise LoadError(f"{uri}: download: no such object at {self.endpoint}")
            size = info.size
        progress = Progress(f"download {uri}", size, self._downloaded)
        result: dict[str, Any] = {}

        def write(f: BinaryIO) -> None:
            if size < MULTIPART_BYTES:
                for chunk in self._chunks(uri, progress):
                    f.write(chunk)
                return
            f.truncate(size)
            f.flush()
            fd = f.fileno()

            def part(offset: int) -> None:
                data = self._ranged(uri, offset, min(PART_BYTES, size - offset))
                os.pwrite(fd, data, offset)
                progress(len(data))

            with concurrent.futures.ThreadPoolExecutor(TRANSFER_THREADS, thread_name_prefix="download") as pool:
                for future in [pool.submit(part, offset) for offset in range(0, size, PART_BYTES)]:
                    future.result()

        def verify(tmp: Path) -> None:
            result["digest"] = file_digest(tmp)
            if expect is not None and result["digest"] != expect:
                raise CorruptObject(f"{uri}: downloaded {result['digest'][0]} bytes with sha256 "
                                    f"{result['digest'][1][:12]}..., its commit records {expect[0]} bytes, "
                                    f"{expect[1][:12]}...")

        atomic_write(path, write, verify)
        if time.monotonic() - progress.started >= PROGRESS_SECONDS:
            log.info("%s: done", progress.line())
        return result["digest"]

    def _ranged(self, uri: ObjectURI, start: int, length: int) -> bytes:
        """get_range without counting (the caller's Progress counts)."""
        answer = self._call(uri, "read", self.request, "GET", uri,
                            headers={"Range": f"bytes={start}-{start + length - 1}"}, ok=(206,))
        if len(answer.body) != length:
            raise TransientError(f"{uri}: read: asked for {length} bytes at {start}, got {len(answer.body)}")
        return answer.body

    def _chunks(self, uri: ObjectURI, progress: Callable[[int], None] | None = None) -> Iterator[bytes]:
        answer = self._call(uri, "read", self.request, "GET", uri, stream=True)
        try:
            while chunk := answer.body.read(1 << 20):
                if progress is not None:
                    progress(len(chunk))
                else:
                    self._downloaded(len(chunk))
                yield chunk
        except Exception as err:  # noqa: BLE001 - the connection broke mid-read
            raise TransientError(f"{uri}: read: {type(err).__name__}: {err}") from None
        finally:
            answer.body.release_conn()

    def stream(self, uri: ObjectURI) -> Iterator[bytes]:
        """The object's bytes in chunks, in order (for hashing an object without keeping it)."""
        return self._chunks(uri)

    def digest(self, uri: ObjectURI) -> tuple[int, str]:
        """(length, sha256) of the object as the store serves it."""
        sha, length = hashlib.sha256(), 0
        for chunk in self.stream(uri):
            sha.update(chunk)
            length += len(chunk)
        return length, sha.hexdigest()

    # --- writing ----------------------------------------------------------------------------------

    def upload(self, path: Path, uri: ObjectURI, digest: tuple[int, str] | None = None,
               midway: Callable[[], None] | None = None) -> tuple[int, str]:
        """Upload the file at `path` as `uri`; its (length, sha256), hashed as it is read.

        Under MULTIPART_BYTES: one PUT. From there: a multipart upload, parts of PART_BYTES read in order
        and sent TRANSFER_THREADS at a time, completed in one request, so the object appears whole or not
        at all; one cut short by a kill stays an incomplete upload, invisible to readers, until
        `abort_incomplete` (a failure short of a kill aborts it at once). Every part's sha256 is signed,
        so the store refuses a part that arrives damaged. `midway()` runs once when half the bytes are
        sent (the `kill@save` fault of a checkpoint in object storage).
        """
        size = path.stat().st_size
        sha = hashlib.sha256()
        fired = threading.Event()

        def sent(n: int) -> None:
            progress(n)
            if midway is not None and progress.done >= size // 2 and not fired.is_set():
                fired.set()
                midway()

        progress = Progress(f"upload {uri}", size, self._uploaded)
        with open(path, "rb") as f:
            if size < MULTIPART_BYTES:
                data = f.read()
                sha.update(data)
                self._call(uri, "upload", self.request, "PUT", uri, body=data)
                sent(len(data))
            else:
                self._multipart(uri, f, size, sha, sent)
        result = (size, sha.hexdigest())
        if digest is not None and digest != result:
            raise TransientError(f"{path}: changed while it was uploaded to {uri}")
        info = self.head(uri)
        if info is None or info.size != size:
            raise TransientError(f"{uri}: uploaded {size} bytes, the store holds "
                                 f"{'nothing' if info is None else f'{info.size} bytes'}")
        if time.monotonic() - progress.started >= PROGRESS_SECONDS:
            log.info("%s: done", progress.line())
        return result

    def _multipart(self, uri: ObjectURI, f: BinaryIO, size: int, sha: Any, sent: Callable[[int], None]) -> None:
        answer = self._call(uri, "upload", self.request, "POST", uri, {"uploads": ""})
        upload_id = _xml_text(self._parse(answer.body, uri, "upload"), "UploadId")
        if not upload_id:
            raise TransientError(f"{uri}: upload: {self.endpoint} gave no UploadId")
        etags: dict[int, str] = {}

        def part(number: int, data: bytes) -> None:
            reply = self._call(uri, "upload", self.request, "PUT", uri,
                               {"partNumber": str(number), "uploadId": upload_id}, body=data)
            etags[number] = reply.headers.get("ETag", "")
            sent(len(data))

        try:
            # Parts are read here, in order (the sha256 of the whole needs them in order), and at most
            # TRANSFER_THREADS are in flight: the memory an upload holds is that many parts.
            slots = threading.BoundedSemaphore(TRANSFER_THREADS)
            with concurrent.futures.ThreadPoolExecutor(TRANSFER_THREADS, thread_name_prefix="upload") as pool:
                futures = []
                for number in range(1, (size + PART_BYTES - 1) // PART_BYTES + 1):
                    data = f.read(PART_BYTES)
                    sha.update(data)
                    slots.acquire()
                    future = pool.submit(part, number, data)
                    future.add_done_callback(lambda _: slots.release())
                    futures.append(future)
                    if any(fu.done() and fu.exception() for fu in futures):
                        break
                for future in futures:
                    future.result()
            body = ("<CompleteMultipartUpload>" + "".join(
                f"<Part><PartNumber>{n}</PartNumber><ETag>{etags[n]}</ETag></Part>" for n in sorted(etags))
                + "</CompleteMultipartUpload>").encode()
            reply = self._call(uri, "upload", self.request, "POST", uri, {"uploadId": upload_id}, body=body)
            # CompleteMultipartUpload may answer 200 with an error inside (S3's documented quirk).
            if b"<Error>" in reply.body[:512]:
                err = self._error(500, reply.body, "POST")
                raise translate(err, uri, "upload", self.endpoint)
        except BaseException:
            try:
                self.request("DELETE", uri, {"uploadId": upload_id}, ok=(204, 200, 404))
            except Exception as err:  # noqa: BLE001 - the next writer's start aborts it
                log.warning("%s: the failed upload could not be aborted now (%s)", uri, err)
            raise

    def put_bytes(self, uri: ObjectURI, data: bytes, if_absent: bool = False) -> bool:
        """A small object (a commit, an index, a manifest) in one request; True once written. `if_absent`: only
        when no object has the key (a conditional write, `If-None-Match: *`): False when one has."""
        headers = {"If-None-Match": "*"} if if_absent else None
        try:
            self.request("PUT", uri, body=data, headers=headers)
        except StoreError as err:
            if if_absent and (err.status == 412 or err.code == "PreconditionFailed"):
                return False
            raise translate(err, uri, "write", self.endpoint) from None
        except OSError as err:
            raise translate(err, uri, "write", self.endpoint) from None
        self._uploaded(len(data))
        return True

    def delete(self, uris: builtins.list[ObjectURI]) -> None:
        """Delete objects (DELETE_BATCH a request); a key already gone is no error."""
        by_bucket: dict[str, list[str]] = {}
        for uri in uris:
            by_bucket.setdefault(uri.bucket, []).append(uri.key)
        for bucket, keys in by_bucket.items():
            for i in range(0, len(keys), DELETE_BATCH):
                batch = keys[i:i + DELETE_BATCH]
                body = ("<Delete><Quiet>true</Quiet>" + "".join(
                    f"<Object><Key>{_xml_escape(k)}</Key></Object>" for k in batch) + "</Delete>").encode()
                md5 = base64.b64encode(hashlib.md5(body, usedforsecurity=False).digest()).decode()
                where = ObjectURI(bucket, batch[0])
                answer = self._call(where, "delete", self.request, "POST", where, {"delete": ""}, body=body,
                                    headers={"Content-MD5": md5, "Content-Type": "application/xml"}, bucket_only=True)
                errors = [e for e in _xml_children(self._parse(answer.body, where, "delete"), "Error")
                          if _xml_text(e, "Code") not in MISSING_KEY]
                if errors:
                    raise TransientError(f"{SCHEME}{bucket}/{_xml_text(errors[0], 'Key')}: delete refused by "
                                         f"{self.endpoint} ({_xml_text(errors[0], 'Code')}), and {len(errors) - 1} more")

    def abort_incomplete(self, prefix: ObjectURI) -> int:
        """Abort every multipart upload under `prefix` that was never completed (a writer killed mid-upload:
        its parts take room and cost money until aborted); how many. Only a prefix's one writer calls it,
        and only when none of its own uploads is in flight."""
        uploads: list[tuple[str, str]] = []
        markers: dict[str, str] = {}
        while True:
            answer = self._call(prefix, "list uploads", self.request, "GET", prefix,
                                {"uploads": "", "prefix": prefix.key, **markers}, bucket_only=True)
            root = self._parse(answer.body, prefix, "list uploads")
            uploads += [(_xml_text(u, "Key"), _xml_text(u, "UploadId")) for u in _xml_children(root, "Upload")]
            if _xml_text(root, "IsTruncated") != "true":
                break
            markers = {"key-marker": _xml_text(root, "NextKeyMarker"),
                       "upload-id-marker": _xml_text(root, "NextUploadIdMarker")}
            if not markers["key-marker"]:
                break
        aborted = 0
        for key, upload_id in uploads:
            if not key.startswith(prefix.key):
                continue
            uri = ObjectURI(prefix.bucket, key)
            try:
                self.request("DELETE", uri, {"uploadId": upload_id}, ok=(204, 200, 404))
                aborted += 1
            except StoreError as err:  # one that cannot go now goes at the next start
                log.warning("%s: an incomplete upload could not be aborted: %s", uri,
                            translate(err, uri, "abort", self.endpoint))
        if aborted:
            log.warning("%s: aborted %d incomplete upload(s) left by a writer that stopped mid-upload", prefix,
                        aborted)
        return aborted

    def check_bucket(self, uri: ObjectURI, action: str = "read") -> None:
        """LoadError naming the URI when its bucket does not exist or may not be read: checked once before a
        job uses a store (a PUT to a missing bucket is an error on AWS, and some compatible stores make the
        bucket instead: a typo in a URI would then put a job's checkpoints in a bucket nobody meant)."""
        try:
            self.request("HEAD", uri, bucket_only=True)
        except StoreError as err:
            code = "NoSuchBucket" if err.code in {"NotFound", "404"} else err.code
            raise translate(StoreError(code, err.message, err.status), uri, action, self.endpoint) from None

    def ensure_bucket(self, uri: ObjectURI) -> None:
        """Create the bucket if it does not exist (tests, benchmarks); a job never creates one."""
        try:
            self.request("HEAD", uri, bucket_only=True)
            return
        except StoreError as err:
            if err.code not in {"NotFound", "NoSuchBucket", "404"}:
                raise translate(err, uri, "read", self.endpoint) from None
        body = b""
        if self.credentials.region != "us-east-1":
            body = (f"<CreateBucketConfiguration><LocationConstraint>{self.credentials.region}"
                    "</LocationConstraint></CreateBucketConfiguration>").encode()
        self._call(uri, "create bucket", self.request, "PUT", uri, body=body, bucket_only=True)


def _xml_escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


class CorruptObject(Exception):
    """An object whose bytes differ from what its commit recorded."""


def file_digest(path: str | Path) -> tuple[int, str]:
    """(length, sha256) of a local file."""
    sha, length = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(PART_BYTES):
            sha.update(chunk)  # hashlib releases the GIL for large buffers
            length += len(chunk)
    return length, sha.hexdigest()


class RangeReader(io.RawIOBase):
    """A read-only, seekable file over ranged reads (`read_range(start, n)`, clamped to `size`): an object of
    the store read piece by piece. torch.distributed.checkpoint's reader loads a rank's pieces of a sharded
    checkpoint through it (one ranged GET each), pyarrow a Parquet shard's footer and columns."""

    def __init__(self, read_range: Callable[[int, int], bytes], size: int):
        super().__init__()
        self.read_range, self.size = read_range, size
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), max(0, self.size - self._pos))
        data = self.read_range(self._pos, n) if n else b""
        memoryview(buffer)[: len(data)] = data
        self._pos += len(data)
        return len(data)


_shared: ObjectStore | None = None
_shared_lock = threading.Lock()


def shared_store() -> ObjectStore:
    """The process's one ObjectStore (one connection pool for data, checkpoints and exports), for the
    credentials and address the environment names now: a change of them (a process that sets AWS_* after
    its first use) gets a new one, with the old one's metrics hooks."""
    global _shared
    with _shared_lock:
        credentials = Credentials.from_env()
        if _shared is None or _shared.credentials != credentials:
            old = _shared
            _shared = ObjectStore(credentials=credentials)
            if old is not None:
                _shared.on_upload, _shared.on_download, _shared.on_retry = old.on_upload, old.on_download, old.on_retry
        return _shared
