"""kubetrain from Python: one `Client` over a cluster and over this machine (`kubetrain.Client`).

    import kubetrain
    client = kubetrain.Client()                            # the cluster of the current kubeconfig
    client = kubetrain.Client(local=True, runs_dir="runs")  # this machine: `kubetrain run` in the background
    job = client.create("examples/quickstart.yaml")
    client.wait(job.name)                                  # a progress bar: step, loss, ETA
    for line in client.logs(job.name, follow=True): ...
    client.export(job.name, "model.pt")

The facade holds no logic of its own beyond checking its arguments and the
wait loop: each call goes to one backend (`cluster_backend.ClusterBackend`,
`rundir_backend.RunDirBackend`), as kubeflow's SDK puts each way of running a job behind
one small backend. docs/client.md is the guide.
"""

from __future__ import annotations

import builtins  # the classes below have a method named list
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubetrain.api import InvalidSpec, TrainingJob, from_object
from kubetrain.api.load import MAX_MANIFEST_BYTES, documents
from kubetrain.engine.conditions import STATES
from .api import (
    TERMINAL, Backend, ClientError, Event, Forbidden, InvalidManifest, Job, JobEnded, JobExists, JobNotFound,
    WaitTimeout,
)
from .progressbar import ProgressBar, wanted

EXPORT_FORMATS = ("torch", "safetensors", "huggingface")

__all__ = ["Client", "ClientError", "Event", "Forbidden", "InvalidManifest", "Job", "JobEnded", "JobExists",
           "JobHandle", "JobNotFound", "WaitTimeout"]


class Client:
    """TrainingJobs from Python: `Client(namespace=None)` for the cluster of the current kubeconfig (or the
    pod this runs in; the context's namespace unless given), `Client(local=True, runs_dir=PATH)` for this
    machine (each job a background `kubetrain run` with its run directory under `runs_dir`).

    Every method raises a `ClientError` (JobNotFound, JobExists, InvalidManifest, Forbidden, WaitTimeout,
    JobEnded) whose message names the job and the field, never an API error's dump.
    """

    def __init__(self, namespace: str | None = None, *, local: bool = False, runs_dir: str | Path = "runs",
                 api_client: Any = None):
        """`api_client`: a kubernetes.client.ApiClient to use instead of the kubeconfig's (cluster only)."""
        if local:
            if namespace is not None or api_client is not None:
                raise ClientError("Client(local=True) runs jobs on this machine: it takes runs_dir, not a "
                                  "namespace or an api_client")
            from .rundir_backend import RunDirBackend

            self.backend: Backend = RunDirBackend(runs_dir)
        else:
            from .cluster_backend import ClusterBackend

            self.backend = ClusterBackend(namespace, api_client)
        self.local = local

    def __repr__(self) -> str:
        return f"kubetrain.Client({self.backend.where})"

    # -- jobs ---------------------------------------------------------------------------------

    def create(self, manifest: str | Path | dict[str, Any], code_dir: str | Path | None = None) -> "JobHandle":
        """Validate and start a TrainingJob: `manifest` is a path, YAML text or a dict holding one job.

        Invalid manifests raise InvalidManifest with the lines `kubetrain validate` prints. Locally the job's
        own code (spec.script, entry points) is found in `code_dir`: by default the manifest's directory, or
        the working directory for YAML text and dicts."""
        job, doc, found_in = parse_manifest(manifest)
        name = self.backend.create(job, doc, Path(code_dir) if code_dir is not None else found_in)
        return JobHandle(self, name)

    def get(self, name: str) -> Job:
        """The job now: its typed status (`.state`, `.progress.step`, `.restarts`, `.conditions`,
        `.last_checkpoint`, `.progress.eta_seconds`)."""
        return self.backend.get(name)

    def list(self) -> list[Job]:
        """Every job of the namespace (or of the runs directory)."""
        return self.backend.list()

    def wait(self, name: str, until: str | Sequence[str] = ("Succeeded", "Failed"), timeout: float | None = None,
             progress: bool | None = None) -> Job:
        """Block until the job's state is one of `until`; return the job then.

        Watches (no polling of the API). A job that ends in a state not in `until` raises JobEnded;
        `timeout` seconds without reaching it raise WaitTimeout (both carry the job as `.job`).
        `progress`: a tqdm bar of step, loss and ETA; by default in a notebook or when stderr is a terminal.
        """
        states = (until,) if isinstance(until, str) else tuple(until)
        unknown = [s for s in states if s not in STATES]
        if not states or unknown:
            raise ClientError(f"wait(until=...): {', '.join(map(repr, unknown)) or 'nothing'} is no job state; "
                              f"the states are {', '.join(STATES)}")
        bar = ProgressBar(name) if wanted(progress) else None
        last: Job | None = None
        try:
            for job in self.backend.watch(name, timeout):
                last = job
                if bar is not None:
                    bar.update(job)
                if job.state in states:
                    return job
                if job.state in TERMINAL:
                    cond = job.condition
                    why = f" ({cond.reason}: {cond.message})" if cond is not None else ""
                    raise JobEnded(f"{name}: ended {job.state}{why} while waiting for {' or '.join(states)}", job)
        finally:
            if bar is not None:
                bar.close()
        assert last is not None
        step = last.progress.step if last.progress is not None else 0
        raise WaitTimeout(f"{name}: still {last.state} at step {step} after {timeout} s, waiting for "
                          f"{' or '.join(states)}", last)

    def logs(self, name: str, replica: str | None = None, follow: bool = False) -> Iterator[str]:
        """The log lines of one replica (`worker-1`, `ddp-0`) or of all (each `[replica] line`).

        In a cluster: from the pods; `follow=True` streams as the replicas write and goes on with a replica's
        replacement after a restart, until the job has ended. Locally: logs/<replica>.log of the run."""
        return self.backend.logs(name, replica, follow)

    def events(self, name: str) -> builtins.list[Event]:
        """What happened to the job (Created, Restarted, Suspended, Succeeded, ...), oldest first."""
        return self.backend.events(name)

    def scale(self, name: str, replicas: int) -> None:
        """Resize the job (ParameterServer workers, DDP nodes), as `kubectl scale tj NAME --replicas N`."""
        if isinstance(replicas, bool) or not isinstance(replicas, int):
            raise ClientError(f"{name}: scale: replicas must be a whole number, got {replicas!r}")
        self.backend.scale(name, replicas)

    def suspend(self, name: str) -> None:
        """Stop the job's replicas after a checkpoint (spec.runPolicy.suspend); `resume` continues it."""
        self.backend.suspend(name)

    def resume(self, name: str) -> None:
        """Continue a suspended job from its newest checkpoint."""
        self.backend.resume(name)

    def delete(self, name: str) -> None:
        """Delete the job: its replicas stop; its checkpoints go (in a cluster unless whenDeleted: Retain)."""
        self.backend.delete(name)

    def export(self, name: str, path: str | Path, format: str = "torch",  # noqa: A002 - the CLI's name
               merge_lora: bool = False) -> Path | str:
        """The trained weights of the job's newest valid checkpoint as a plain `torch.save` state_dict file
        (`format="safetensors"`: a .safetensors file of its tensors; `format="huggingface"`, a causal-lm job: a
        Hugging Face model directory, `path` a new directory or s3://BUCKET/PREFIX/, a LoRA job's adapter or with
        `merge_lora` the merged model; docs/fine-tuning.md#the-hugging-face-export).

        In a cluster a short-lived read-only pod mounts the job's checkpoint claims (or, with checkpoints in
        object storage, reads its URI with the job's credentials), exports there and the file (a directory: as
        one tar stream) is copied out (docs/client.md#permissions: pods create/delete and pods/exec); an s3://
        `path` is written by the pod itself, with the job's credentials."""
        if format not in EXPORT_FORMATS:
            raise ClientError(f"{name}: export: format must be {', '.join(EXPORT_FORMATS)}, got {format!r}")
        if merge_lora and format != "huggingface":
            raise ClientError(f"{name}: export: merge_lora applies to format huggingface")
        if str(path).startswith("s3://"):
            if format != "huggingface":
                raise ClientError(f"{name}: export: an s3:// path takes format huggingface (a directory)")
            return self.backend.export(name, str(path), format, merge_lora)
        path = Path(path)
        if not path.parent.is_dir():
            raise ClientError(f"{name}: export: {path.parent} is no directory")
        if format == "huggingface" and path.exists() and (not path.is_dir() or any(path.iterdir())):
            raise ClientError(f"{name}: export: {path} exists and is not an empty directory")
        return self.backend.export(name, path, format, merge_lora)

    def report(self, names: Sequence[str], out: str | Path, prometheus: str | None = None) -> Path:
        """A comparison report (docs/reports.md) of these jobs in `out`: report.md, report.json and its plots.

        Locally from their run directories; in a cluster from the jobs' status and their series in the
        Prometheus at `prometheus` (its URL)."""
        from kubetrain.reports import build_report

        if self.local:
            from .rundir_backend import RunDirBackend

            assert isinstance(self.backend, RunDirBackend)
            for name in names:
                self.backend.run_dir(name)  # JobNotFound
            return build_report([self.backend.runs_dir / n for n in names], Path(out))
        if not prometheus:
            raise ClientError("report: the jobs of a cluster are read from Prometheus: give prometheus=URL")
        from kubetrain.reports.from_cluster import cluster_run

        return build_report([cluster_run(self.backend, n, prometheus) for n in names], Path(out))


@dataclass(frozen=True)
class JobHandle:
    """A job the client created: its name, and the client's calls for it."""

    client: Client
    name: str

    def get(self) -> Job:
        return self.client.get(self.name)

    def wait(self, until: str | Sequence[str] = ("Succeeded", "Failed"), timeout: float | None = None,
             progress: bool | None = None) -> Job:
        return self.client.wait(self.name, until, timeout, progress)

    def logs(self, replica: str | None = None, follow: bool = False) -> Iterator[str]:
        return self.client.logs(self.name, replica, follow)

    def events(self) -> list[Event]:
        return self.client.events(self.name)

    def export(self, path: str | Path, format: str = "torch", merge_lora: bool = False) -> Path | str:  # noqa: A002
        return self.client.export(self.name, path, format, merge_lora)

    def delete(self) -> None:
        self.client.delete(self.name)

    def __repr__(self) -> str:
        return f"JobHandle({self.name!r}, {self.client.backend.where})"


def parse_manifest(manifest: str | Path | dict[str, Any]) -> tuple[TrainingJob, dict[str, Any], Path | None]:
    """(the validated job, its document, the directory it came from) of a path, YAML text or a dict."""
    if isinstance(manifest, dict):
        docs, source, where = [manifest], "(manifest)", None
    elif isinstance(manifest, Path) or (isinstance(manifest, str) and "\n" not in manifest
                                        and not manifest.lstrip().startswith(("{", "apiVersion:", "kind:"))):
        path = Path(manifest)
        try:
            raw = path.read_bytes()[:MAX_MANIFEST_BYTES + 1]
            text = raw.decode("utf-8")
        except FileNotFoundError:
            raise InvalidManifest("(file): no such file", str(path)) from None
        except (OSError, UnicodeDecodeError) as err:
            raise InvalidManifest(f"(file): cannot be read: {err}", str(path)) from None
        if len(raw) > MAX_MANIFEST_BYTES:
            raise InvalidManifest(f"(file): is larger than {MAX_MANIFEST_BYTES} bytes", str(path))
        source, where = str(path), path.resolve().parent
        try:
            docs = documents(text, source)
        except InvalidSpec as err:
            raise InvalidManifest(err) from None
    elif isinstance(manifest, str):
        source, where = "(manifest)", None
        try:
            docs = documents(manifest, source)
        except InvalidSpec as err:
            raise InvalidManifest(err) from None
    else:
        raise ClientError(f"create: a manifest is a path, YAML text or a dict, got {type(manifest).__name__}")
    if len(docs) != 1:
        raise InvalidManifest(f"(file): must hold exactly one TrainingJob, found {len(docs)}", source)
    try:
        return from_object(docs[0], source), docs[0], where
    except InvalidSpec as err:
        raise InvalidManifest(err) from None
