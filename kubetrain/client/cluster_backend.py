"""The client's backend for a cluster: TrainingJobs through the API server, from the current kubeconfig or a pod.

It watches, it does not poll: `wait` is one watch of the one job (a request
every WATCH_SECONDS while nothing changes), `logs(follow=True)` a watch of the
job's pods and of the job plus one log stream per container incarnation (a
replica's replacement after a restart gets its own). Responses are read as raw
JSON (the client's model classes cost more CPU than the rest). Every
ApiException becomes one of the client's errors (`_error`), naming the job.
"""

from __future__ import annotations

import builtins  # the classes below have a method named list
import json
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kubernetes import client, config
from kubernetes.client.rest import ApiException
from kubernetes.watch.watch import iter_resp_lines
from urllib3.exceptions import HTTPError

from kubetrain.shared import __version__
from kubetrain.api import GROUP, PLURAL, VERSION, InvalidSpec, TrainingJob, from_object, to_manifest
from kubetrain.api.podtemplate import CONTAINER
from kubetrain.engine.children import LABEL_JOB
from kubetrain.engine.plan import replica_names
from .api import Backend, ClientError, Event, Forbidden, InvalidManifest, Job, JobExists, JobNotFound, prefixed
from .api import TERMINAL, unknown_replica
from .exportpod import EXPORT_ROOT, claim_problems, export_pod

API_TIMEOUT = (5.0, 30.0)
"""Seconds to connect to and then to hear from the API server on a plain call: a silent server must not hang
a notebook for ever."""
WATCH_SECONDS = 300
"""A watch's timeoutSeconds: the server ends it after this long and the client watches again from the last
resourceVersion, so a quiet job costs one request per 5 minutes. Longer watches save little and are cut by
proxies and load balancers anyway."""
LIST_PAGE = 500
"""Jobs per page of `list()` (the API's limit/continue): 1,000 jobs are 2 requests; a page of 500 jobs of
about 6 KB each is 3 MB of JSON, which the API server assembles without strain."""
FOLLOW_QUEUE_LINES = 10_000
"""Log lines `logs(follow=True)` buffers between its stream threads and the reader: a reader slower than the
replicas' output makes the streams wait (the API server buffers behind them), never memory grow."""
COPY_CHUNK = 1 << 20
"""Bytes per read of the exported file from the exec stream."""
EXPORT_START_SECONDS = 300
"""`export` waits this long for its pod to run: scheduling, attaching the claims and starting the image
(already on the node when the job ran there)."""
EXPORT_SECONDS = 1800
PACK = "import sys, tarfile; t = tarfile.open(sys.argv[2], 'w'); t.add(sys.argv[1], arcname='.'); t.close()"
"""Run in the export pod: a Hugging Face export's directory as one uncompressed tar file (weights do not compress)."""


def unpack(tar: Path, path: Path) -> None:
    """The files of `tar` (a directory packed by PACK) as the new directory `path`: extracted beside it under a
    temporary name with tarfile's `data` filter (no links out, no absolute paths, no devices) and renamed."""
    import shutil
    import tarfile

    staging = path.with_name(f".{path.name}.{uuid.uuid4().hex[:6]}")
    try:
        with tarfile.open(tar) as archive:
            archive.extractall(staging, filter="data")
        if path.exists():
            path.rmdir()  # empty: the client checked
        staging.rename(path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
"""`export` waits this long for the export inside the pod (it reads and verifies every checkpoint file)."""


def connect(namespace: str | None) -> tuple[client.ApiClient, str]:
    """An ApiClient of the current kubeconfig (or this pod's service account) and the namespace to use."""
    try:
        config.load_incluster_config()
        configuration = client.Configuration.get_default_copy()
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
            default = f.read().strip()
    except (config.ConfigException, OSError):
        configuration = client.Configuration()
        try:
            # KUBECONFIG as it is now (the kubernetes package reads it once, at its import).
            path = os.environ.get("KUBECONFIG") or None
            config.load_kube_config(config_file=path, client_configuration=configuration)
            _, active = config.list_kube_config_contexts(config_file=path)
        except (config.ConfigException, OSError, TypeError) as err:
            raise ClientError(f"no cluster to talk to: no kubeconfig ({err}) and not in a pod; "
                              "kubetrain.Client(local=True) runs jobs on this machine") from None
        default = (active or {}).get("context", {}).get("namespace") or "default"
    api = client.ApiClient(configuration)
    api.user_agent = f"kubetrain-client/{__version__}"
    return api, namespace or default


class ClusterBackend(Backend):
    def __init__(self, namespace: str | None = None, api_client: client.ApiClient | None = None):
        if api_client is None:
            api_client, namespace = connect(namespace)
        self.api = api_client
        self.namespace = namespace or "default"
        self.where = f"namespace {self.namespace}"
        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)

    # -- errors --------------------------------------------------------------------------

    def _call(self, verb: str, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("_request_timeout", API_TIMEOUT)
        try:
            return fn(*args, **kwargs)
        except ApiException as err:
            raise self._error(verb, what, err) from None
        except HTTPError as err:
            raise ClientError(f"{verb} {what}: cannot reach the API server at {self.api.configuration.host}: "
                              f"{err}") from None

    def _error(self, verb: str, what: str, err: ApiException) -> ClientError:
        try:
            body = json.loads(err.body or "{}")
        except (ValueError, TypeError):
            body = {}
        message = body.get("message") or err.reason or ""
        details = body.get("details") or {}
        if err.status == 404:
            if details.get("name") or "not found" in message:
                return JobNotFound(f"{what}: not found in {self.where}")
            return ClientError(f"{verb} {what}: the cluster has no TrainingJob API ({message}); install "
                               "kubetrain (helm install kubetrain charts/kubetrain, or kubectl apply -k deploy/)")
        if err.status == 403:
            return Forbidden(f"{verb} {what}: forbidden: {message}. docs/client.md#permissions lists the "
                             "permissions the client needs")
        if err.status == 401:
            return Forbidden(f"{verb} {what}: the API server did not accept the credentials: {message}")
        if err.status == 409:
            return JobExists(f"{what}: exists already in {self.where}: {message}")
        if err.status == 422:
            causes = details.get("causes") or []
            problems = [f"{c.get('field', '')}: {c.get('message', '')}".lstrip(": ") for c in causes] or [message]
            found: list[Any] = [_Problem(p) for p in problems]  # the API server's causes, shaped as Problems
            return InvalidManifest(InvalidSpec(found, what))
        return ClientError(f"{verb} {what}: {err.status} {message}")

    # -- reading -------------------------------------------------------------------------

    def _object(self, name: str) -> dict[str, Any]:
        resp = self._call("get", f"trainingjob {name}", self.custom.get_namespaced_custom_object, GROUP, VERSION,
                          self.namespace, PLURAL, name, _preload_content=False)
        return json.loads(resp.data)

    def _job(self, obj: dict[str, Any]) -> Job:
        meta = obj.get("metadata") or {}
        return Job.of(meta.get("name", ""), meta.get("namespace", self.namespace),
                      (obj.get("spec") or {}).get("mode", ""), obj.get("status"))

    def get(self, name: str) -> Job:
        return self._job(self._object(name))

    def spec(self, name: str) -> TrainingJob:
        obj = self._object(name)
        try:
            return from_object({k: obj[k] for k in ("apiVersion", "kind", "metadata", "spec") if k in obj},
                               f"trainingjob {name}")
        except InvalidSpec as err:
            raise InvalidManifest(err) from None

    def _list(self, **kwargs: Any) -> dict[str, Any]:
        resp = self._call("list", f"trainingjobs in {self.where}", self.custom.list_namespaced_custom_object,
                          GROUP, VERSION, self.namespace, PLURAL, _preload_content=False, **kwargs)
        return json.loads(resp.data)

    def list(self) -> list[Job]:
        jobs: list[Job] = []
        token = None
        while True:
            page = self._list(limit=LIST_PAGE, **({"_continue": token} if token else {}))
            jobs += [self._job(o) for o in page.get("items", [])]
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return jobs

    def watch(self, name: str, timeout: float | None) -> Iterator[Job]:
        deadline = None if timeout is None else time.monotonic() + timeout
        selector = f"metadata.name={name}"
        for obj in self._watch_objects(selector, deadline, what=f"trainingjob {name}"):
            if obj is None:
                raise JobNotFound(f"trainingjob {name}: deleted from {self.where}")
            yield self._job(obj)

    def _watch_objects(self, selector: str, deadline: float | None, what: str) -> Iterator[dict[str, Any] | None]:
        """The one object the field selector names, now and at every change (None when it is deleted), by a
        list and then watches from its resourceVersion, each at most WATCH_SECONDS; until `deadline`."""
        rv = None
        while True:
            if rv is None:
                page = self._list(field_selector=selector)
                items = page.get("items") or []
                if not items:
                    raise JobNotFound(f"{what}: not found in {self.where}")
                rv = page["metadata"]["resourceVersion"]
                yield items[0]
            left = WATCH_SECONDS if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return
            seconds = max(1, min(WATCH_SECONDS, int(left + 0.999)))
            resp = self._call("watch", what, self.custom.list_namespaced_custom_object, GROUP, VERSION,
                              self.namespace, PLURAL, field_selector=selector, watch=True, resource_version=rv,
                              timeout_seconds=seconds, allow_watch_bookmarks=True, _preload_content=False,
                              _request_timeout=(API_TIMEOUT[0], seconds + API_TIMEOUT[1]))
            try:
                for line in iter_resp_lines(resp):
                    event = json.loads(line)
                    kind, obj = event.get("type"), event.get("object") or {}
                    if kind == "ERROR":
                        rv = None  # 410 Gone (the version is too old): list again
                        break
                    rv = (obj.get("metadata") or {}).get("resourceVersion", rv)
                    if kind in ("ADDED", "MODIFIED"):
                        yield obj
                    elif kind == "DELETED":
                        yield None
                        return
            except (HTTPError, OSError) as err:  # the connection dropped: watch again from rv
                if deadline is not None and time.monotonic() >= deadline:
                    return
                del err
            finally:
                resp.release_conn()

    def events(self, name: str) -> builtins.list[Event]:
        self._object(name)  # JobNotFound for a job that does not exist (it would just have no events)
        resp = self._call("list", f"events of trainingjob {name}", self.core.list_namespaced_event, self.namespace,
                          field_selector=f"involvedObject.kind=TrainingJob,involvedObject.name={name}",
                          _preload_content=False)
        out = []
        for e in json.loads(resp.data).get("items", []):
            when = e.get("lastTimestamp") or e.get("eventTime") or e.get("firstTimestamp") or \
                e.get("metadata", {}).get("creationTimestamp") or ""
            out.append(Event(when, e.get("type", ""), e.get("reason", ""), e.get("message", ""),
                             int(e.get("count") or 1)))
        return sorted(out, key=lambda e: e.time)

    # -- logs ------------------------------------------------------------------------------

    def logs(self, name: str, replica: str | None, follow: bool) -> Iterator[str]:
        job = self.spec(name)
        names = [f"{role}-{i}" for role, i in replica_names(job)]
        if replica is not None and replica not in names:
            raise unknown_replica(name, replica, names)
        if follow:
            return _Follow(self, name, replica).lines()
        return self._logs_now(name, replica)

    def _pods(self, name: str) -> dict[str, Any]:
        resp = self._call("list", f"pods of trainingjob {name}", self.core.list_namespaced_pod, self.namespace,
                          label_selector=f"{LABEL_JOB}={name}", _preload_content=False)
        return json.loads(resp.data)

    def _logs_now(self, name: str, replica: str | None) -> Iterator[str]:
        pods = sorted(self._pods(name).get("items", []), key=lambda p: p["metadata"]["name"])
        for pod in pods:
            r = replica_of(name, pod)
            if (replica is not None and r != replica) or incarnation(pod) is None:
                continue
            resp = self._call("read", f"the log of pod {pod['metadata']['name']}",
                              self.core.read_namespaced_pod_log, pod["metadata"]["name"], self.namespace,
                              container=CONTAINER, _preload_content=False)
            for line in resp.data.decode(errors="replace").splitlines():
                yield prefixed(r, line, replica is None)

    # -- acting ------------------------------------------------------------------------------

    def create(self, job: TrainingJob, doc: dict[str, Any], code_dir: Path | None) -> str:
        body = json.loads(json.dumps(doc))
        body.setdefault("metadata", {})["namespace"] = self.namespace
        self._call("create", f"trainingjob {job.name}", self.custom.create_namespaced_custom_object, GROUP, VERSION,
                   self.namespace, PLURAL, body, _preload_content=False)
        return job.name

    def scale(self, name: str, replicas: int) -> None:
        job = self.spec(name)
        try:  # the size the job can take, checked here with the message `kubectl scale`'s refusal would give
            from_object({"apiVersion": f"{GROUP}/{VERSION}", "kind": "TrainingJob",
                         "metadata": {"name": name, "namespace": self.namespace},
                         "spec": {**to_manifest(job)["spec"], "replicas": replicas}}, f"trainingjob {name}")
        except InvalidSpec as err:
            raise InvalidManifest(err) from None
        self._call("scale", f"trainingjob {name}", self.custom.patch_namespaced_custom_object_scale, GROUP, VERSION,
                   self.namespace, PLURAL, name, {"spec": {"replicas": replicas}}, _preload_content=False)

    def _suspend(self, name: str, value: bool) -> None:
        self._call("patch", f"trainingjob {name}", self.custom.patch_namespaced_custom_object, GROUP, VERSION,
                   self.namespace, PLURAL, name, {"spec": {"runPolicy": {"suspend": value}}}, _preload_content=False)

    def suspend(self, name: str) -> None:
        self._suspend(name, True)

    def resume(self, name: str) -> None:
        self._suspend(name, False)

    def delete(self, name: str) -> None:
        self._call("delete", f"trainingjob {name}", self.custom.delete_namespaced_custom_object, GROUP, VERSION,
                   self.namespace, PLURAL, name, body={"propagationPolicy": "Background"}, _preload_content=False)

    # -- export ------------------------------------------------------------------------------

    def export(self, name: str, path: Path | str, fmt: str = "torch", merge_lora: bool = False) -> Path | str:
        job = self.spec(name)
        image = job.spec.image or self._image_of_pods(name)
        if not image:
            raise ClientError(f"{name}: its image is unknown (no spec.image and no pod left to read it from); "
                              "set spec.image")
        claim = job.spec.checkpoint.storage.existing_claim
        refused = claim_problems(job, self._claim_holder(claim) if claim else None)
        if refused:  # the operator's rule, before any pod mounts the claim
            raise ClientError(f"{name}: export: {'; '.join(refused)}")
        pod_name = f"{name}-export-{uuid.uuid4().hex[:6]}"
        pod = export_pod(job, pod_name, image)
        self._call("create", f"export pod {pod_name}", self.core.create_namespaced_pod, self.namespace, pod,
                   _preload_content=False)
        try:
            self._wait_running(pod_name)
            directory = fmt == "huggingface"
            out = str(path) if isinstance(path, str) else "/tmp/model" if directory else "/tmp/model.pt"
            job_file = "/tmp/job.yaml"
            manifest = json.dumps(to_manifest(job))
            code, output = self._exec(pod_name, [
                "python", "-c", "import sys; open(sys.argv[1], 'w').write(sys.argv[2])", job_file, manifest])
            if code != 0:
                raise ClientError(f"{name}: export pod {pod_name}: cannot write the job file: {output.strip()}")
            source = job.spec.checkpoint.storage.uri or EXPORT_ROOT
            code, output = self._exec(pod_name, [
                "python", "-m", "kubetrain.cli", "checkpoints", "export", source, "--job", job_file,
                "--out", out, "--format", fmt, *(["--merge-lora"] if merge_lora else [])], timeout=EXPORT_SECONDS)
            if code != 0:
                raise ClientError(f"{name}: export failed: {output.strip().splitlines()[-1] if output.strip() else code}")
            if isinstance(path, str):
                return path  # written to object storage by the pod
            if directory:
                code, output = self._exec(pod_name, ["python", "-c", PACK, out, "/tmp/model.tar"])
                if code != 0:
                    raise ClientError(f"{name}: export pod {pod_name}: cannot pack {out}: {output.strip()}")
                tar = path.with_name(f".{path.name}.{uuid.uuid4().hex[:6]}.tar")
                try:
                    self._copy_out(pod_name, "/tmp/model.tar", tar)
                    unpack(tar, path)
                finally:
                    tar.unlink(missing_ok=True)
            else:
                self._copy_out(pod_name, out, Path(path))
        finally:
            try:
                self.core.delete_namespaced_pod(pod_name, self.namespace, grace_period_seconds=0,
                                                _preload_content=False, _request_timeout=API_TIMEOUT)
            except (ApiException, HTTPError):
                pass  # its activeDeadlineSeconds ends it
        return Path(path)

    def _claim_holder(self, claim: str) -> str | None:
        """The job a claim of the namespace is labelled as (kubetrain.dev/job-name), as the operator's index sees
        it; None when it has no such label or does not exist."""
        try:
            resp = self._call("read", f"persistentvolumeclaim {claim}",
                              self.core.read_namespaced_persistent_volume_claim, claim, self.namespace,
                              _preload_content=False)
        except JobNotFound:
            return None
        holder = ((json.loads(resp.data).get("metadata") or {}).get("labels") or {}).get(LABEL_JOB)
        return holder if isinstance(holder, str) and holder else None

    def _image_of_pods(self, name: str) -> str | None:
        for pod in self._pods(name).get("items", []):
            for c in pod.get("spec", {}).get("containers", []):
                if c.get("name") == CONTAINER:
                    return c.get("image")
        return None

    def _wait_running(self, pod_name: str) -> None:
        deadline = time.monotonic() + EXPORT_START_SECONDS
        selector = f"metadata.name={pod_name}"
        while True:
            resp = self._call("read", f"pod {pod_name}", self.core.read_namespaced_pod, pod_name, self.namespace,
                              _preload_content=False)
            pod = json.loads(resp.data)
            phase = pod.get("status", {}).get("phase")
            if phase == "Running":
                return
            if phase in ("Succeeded", "Failed") or time.monotonic() > deadline:
                waiting = [s.get("state", {}).get("waiting", {}) for s in pod.get("status", {}).get("containerStatuses", [])]
                why = "; ".join(f"{w.get('reason')}: {w.get('message', '')}" for w in waiting if w) or phase or "Pending"
                raise ClientError(f"export pod {pod_name} did not run within {EXPORT_START_SECONDS} s "
                                  f"(EXPORT_START_SECONDS): {why}")
            # A watch would save a few requests in the few seconds a pod takes to start; not worth a thread.
            resp = self._call("watch", f"pod {pod_name}", self.core.list_namespaced_pod, self.namespace,
                              field_selector=selector, watch=True, timeout_seconds=5, _preload_content=False,
                              _request_timeout=(API_TIMEOUT[0], 5 + API_TIMEOUT[1]))
            for _ in iter_resp_lines(resp):
                break
            resp.release_conn()

    def _exec(self, pod_name: str, command: builtins.list[str], timeout: float = 60) -> tuple[int, str]:
        """Run `command` in the export pod; (exit code, stdout and stderr)."""
        from kubernetes.stream import stream

        try:
            ws = stream(self.core.connect_get_namespaced_pod_exec, pod_name, self.namespace, container=CONTAINER,
                        command=command, stderr=True, stdin=False, stdout=True, tty=False, _preload_content=False)
        except ApiException as err:
            raise self._error("exec in", f"pod {pod_name}", err) from None
        output = []
        deadline = time.monotonic() + timeout
        while ws.is_open() and time.monotonic() < deadline:
            ws.update(timeout=1)
            output.append(ws.read_stdout() + ws.read_stderr())
        code = ws.returncode if not ws.is_open() else None
        output.append(ws.read_stdout() + ws.read_stderr())  # what came with the close
        ws.close()
        if code is None:
            raise ClientError(f"pod {pod_name}: {command[:4]} did not end within {timeout:.0f} s")
        return code, "".join(output)

    def _copy_out(self, pod_name: str, source: str, path: Path) -> None:
        """The file `source` of the pod into `path`, written under a temporary name and renamed."""
        from kubernetes.stream import stream

        code, size_text = self._exec(pod_name, ["wc", "-c", source])
        if code != 0:
            raise ClientError(f"export pod {pod_name}: {source} is missing: {size_text.strip()}")
        size = int(size_text.split()[0])
        try:
            ws = stream(self.core.connect_get_namespaced_pod_exec, pod_name, self.namespace, container=CONTAINER,
                        command=["cat", source], stderr=True, stdin=False, stdout=True, tty=False,
                        _preload_content=False, binary=True)
        except ApiException as err:
            raise self._error("exec in", f"pod {pod_name}", err) from None
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:6]}")
        written = 0
        try:
            with open(tmp, "wb") as f:
                while ws.is_open() or ws.peek_stdout():
                    ws.update(timeout=1)
                    chunk = ws.read_stdout()
                    if chunk:
                        f.write(chunk)
                        written += len(chunk)
                f.flush()
            if written != size:
                raise ClientError(f"export pod {pod_name}: copied {written} of {size} bytes of {source}")
            tmp.replace(path)
        finally:
            ws.close()
            tmp.unlink(missing_ok=True)


class _Problem:
    """An API server's cause, shaped as the validator's Problem for InvalidManifest."""

    def __init__(self, text: str):
        self.text = text

    def __str__(self) -> str:
        return self.text


def replica_of(job: str, pod: dict[str, Any]) -> str:
    """A pod's replica: its name after `<job>-` (`worker-1`, `ddp-0`)."""
    return pod["metadata"]["name"].removeprefix(f"{job}-")


def incarnation(pod: dict[str, Any]) -> tuple[str, int] | None:
    """(pod uid, container restarts) once the trainer container has started (running or ended); None before:
    each incarnation has a log of its own."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") != CONTAINER:
            continue
        state = status.get("state") or {}
        if "running" in state or "terminated" in state:
            return pod["metadata"]["uid"], int(status.get("restartCount") or 0)
    return None


class _Follow:
    """`logs(follow=True)`: the lines of every container incarnation of the job's pods (or one replica's), as
    they come, until the job has ended and every stream has closed."""

    def __init__(self, backend: ClusterBackend, name: str, replica: str | None):
        self.b = backend
        self.name = name
        self.replica = replica
        self.lines_q: queue.Queue[str | None] = queue.Queue(maxsize=FOLLOW_QUEUE_LINES)
        self.lock = threading.Lock()
        self.streamed: set[tuple[str, int]] = set()
        self.open_streams = 0
        self.finished = threading.Event()  # the job is Succeeded or Failed
        self.listed = threading.Event()  # the pods there were at the start have their streams
        self.stop = threading.Event()
        self.responses: list[Any] = []
        self.error: BaseException | None = None

    def lines(self) -> Iterator[str]:
        threads = [threading.Thread(target=self._guard, args=(self._watch_pods,), daemon=True),
                   threading.Thread(target=self._guard, args=(self._watch_job,), daemon=True)]
        for t in threads:
            t.start()
        try:
            while True:
                try:
                    line = self.lines_q.get(timeout=0.5)
                except queue.Empty:
                    line = None
                if line is not None:
                    yield line
                    continue
                if self.error is not None:
                    raise self.error
                with self.lock:  # a job that had ended before: its pods' logs are read first
                    done = self.finished.is_set() and self.listed.is_set() and self.open_streams == 0
                if done and self.lines_q.empty():
                    return
        finally:
            self.stop.set()
            for resp in list(self.responses):
                try:
                    resp.close()
                except Exception:  # noqa: BLE001  (closing what another thread reads: anything may fly)
                    pass

    def _guard(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except ClientError as err:
            if not self.stop.is_set():
                self.error = err
        except Exception as err:  # noqa: BLE001  (a closed connection while stopping)
            if not self.stop.is_set():
                self.error = ClientError(f"following the logs of {self.name}: {err}")

    def _watch_job(self) -> None:
        for obj in self.b._watch_objects(f"metadata.name={self.name}", None, f"trainingjob {self.name}"):
            if self.stop.is_set():
                return
            if obj is None or ((obj.get("status") or {}).get("state") in TERMINAL):
                self.finished.set()
                return

    def _watch_pods(self) -> None:
        selector = f"{LABEL_JOB}={self.name}"
        rv = None
        while not self.stop.is_set():
            if rv is None:
                page = self.b._pods(self.name)
                rv = page["metadata"]["resourceVersion"]
                for pod in page.get("items", []):
                    self._seen(pod)
                self.listed.set()
            resp = self.b._call("watch", f"pods of trainingjob {self.name}", self.b.core.list_namespaced_pod,
                                self.b.namespace, label_selector=selector, watch=True, resource_version=rv,
                                timeout_seconds=WATCH_SECONDS, allow_watch_bookmarks=True, _preload_content=False,
                                _request_timeout=(API_TIMEOUT[0], WATCH_SECONDS + API_TIMEOUT[1]))
            self.responses.append(resp)
            try:
                for line in iter_resp_lines(resp):
                    event = json.loads(line)
                    obj = event.get("object") or {}
                    if event.get("type") == "ERROR":
                        rv = None
                        break
                    rv = (obj.get("metadata") or {}).get("resourceVersion", rv)
                    if event.get("type") in ("ADDED", "MODIFIED"):
                        self._seen(obj)
            except (HTTPError, OSError):
                pass  # dropped: watch again from rv
            finally:
                self.responses.remove(resp)
                resp.release_conn()

    def _seen(self, pod: dict[str, Any]) -> None:
        replica = replica_of(self.name, pod)
        if self.replica is not None and replica != self.replica:
            return
        key = incarnation(pod)
        with self.lock:
            if key is None or key in self.streamed or self.stop.is_set():
                return
            self.streamed.add(key)
            self.open_streams += 1
        threading.Thread(target=self._stream, args=(pod["metadata"]["name"], replica, key), daemon=True).start()

    def _stream(self, pod: str, replica: str, key: tuple[str, int]) -> None:
        """One incarnation's lines. No read timeout: a replica may print nothing for long. Whatever happens, the
        stream is counted closed at the end (a stream counted open for ever would hold `lines` for ever)."""
        resp = None
        try:
            resp = self.b.core.read_namespaced_pod_log(pod, self.b.namespace, container=CONTAINER, follow=True,
                                                       _preload_content=False)
            self.responses.append(resp)
            for line in iter_resp_lines(resp):
                if self.stop.is_set():
                    return
                self.lines_q.put(prefixed(replica, line, self.replica is None))
        except (ApiException, HTTPError) as err:
            if resp is None:
                with self.lock:  # not readable yet (or gone): a later event of the pod tries again
                    self.streamed.discard(key)
            del err  # else the container ended or the connection dropped: the next incarnation has its own
        except (OSError, ValueError):
            pass
        except Exception as err:  # noqa: BLE001  (anything else is a bug here: say so rather than hang)
            if not self.stop.is_set():
                self.error = ClientError(f"following the log of pod {pod}: {err}")
        finally:
            if resp is not None:
                if resp in self.responses:
                    self.responses.remove(resp)
                resp.release_conn()  # type: ignore[attr-defined]  # _preload_content=False: the raw response
            with self.lock:
                self.open_streams -= 1
