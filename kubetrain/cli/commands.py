"""The commands of `kubetrain` (parser.py gives them their arguments), thin over the API model and the backends.

Errors the user can fix raise UsageError (or InvalidSpec): `main` prints
them as one line each (file, field path, message) with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from kubetrain.api import InvalidSpec, TrainingJob, load_file, load_one
from kubetrain.api.schema import MAX_SHOWN_PROBLEMS
from kubetrain.api.spec import DNS1123_PATTERN
from kubetrain.api.podtemplate import parse_allowances
from kubetrain.engine import podsecurity as pod_security
from kubetrain.engine.children import Settings
from kubetrain.engine.gang import policy_problems

EXIT_USAGE = 2
EXIT_LOAD = 3


class UsageError(Exception):
    """A bad command line or input file; the message says which."""


def print_invalid(err: InvalidSpec) -> None:
    source = f"{err.source}: " if err.source else ""
    for line in err.shown():
        print(f"{source}{line}", file=sys.stderr)


def _module_found(name: str, code_dir: Path) -> bool:
    """Whether module `name` can be imported from `code_dir` (first, as trainers do) or the installed packages.

    Found, never imported: importlib.util.find_spec("a.b") would import (run)
    package `a`, so walk the packages' search locations instead; this process
    runs none of the user's code, and never imports torch.
    """
    from importlib.machinery import PathFinder
    from importlib.util import find_spec

    top, *rest = name.split(".")
    try:
        spec = PathFinder.find_spec(top, [str(code_dir)]) or find_spec(top)
    except (ImportError, ValueError):  # ValueError: a module in sys.modules without __spec__
        spec = None
    prefix = top
    for part in rest:
        if spec is None or spec.submodule_search_locations is None:
            break
        prefix = f"{prefix}.{part}"
        spec = PathFinder.find_spec(prefix, list(spec.submodule_search_locations))
    else:
        return spec is not None
    # Not a package on disk (os.path, a module its parent sets up at import): ask
    # importlib only when the parent is imported already, so asking runs nothing new.
    parent = name.rpartition(".")[0]
    if parent in sys.modules:
        try:
            return find_spec(name) is not None
        except (ImportError, ValueError):
            return False
    return False


def allowances_arg(value: str) -> frozenset[str]:
    try:
        return parse_allowances([value])
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def secret_names_arg(value: str) -> frozenset[str]:
    try:
        return parse_secret_names(value, "--object-store-secrets")
    except UsageError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--object-store-secrets: ")) from None


def queue_names_arg(value: str) -> frozenset[str]:
    try:
        return parse_secret_names(value, "--volcano-queues", "a Volcano queue name")
    except UsageError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--volcano-queues: ")) from None


def cmd_validate(args: argparse.Namespace) -> int:
    failed = False
    for path in args.files:
        try:
            jobs = load_file(path)
        except InvalidSpec as err:
            print_invalid(err)
            failed = True
            continue
        # Entry points' modules must be importable by the trainers: locally from the
        # manifest's directory (kubetrain run's code directory), else as installed packages.
        code_dir = Path(path).resolve().parent
        # What the template asks of the node, judged as the cluster's policy and operator judge it.
        settings = Settings(pod_security_allow=frozenset(args.allow), object_store_secrets=args.object_store_secrets,
                            volcano_queues=args.volcano_queues)
        # An existingClaim named as another job's checkpoint claim, as the operator refuses it (a label it
        # would also judge is the cluster's to read).
        missing = [f"{path}: {p}" for job in jobs
                   for p in pod_security.problems(job, settings)
                   + pod_security.existing_claim_problems(job, settings.pod_security_allow, None)
                   + policy_problems(job, settings.pod_security_allow, settings.volcano_queues)]
        if len(missing) > MAX_SHOWN_PROBLEMS:
            missing[MAX_SHOWN_PROBLEMS:] = [f"{path}: ... and {len(missing) - MAX_SHOWN_PROBLEMS} more problems"]
        if missing:
            missing.append(f"{path}: checked for an installation whose podSecurity.allow is "
                           f"[{', '.join(sorted(args.allow))}]; --allow NAME,... checks for one that allows more")
            if any(".schedulingPolicy.queue: " in m for m in missing):
                missing.append(f"{path}: checked for an installation whose gangScheduling.volcano.queues is "
                               f"[{', '.join(sorted(args.volcano_queues))}]; --volcano-queues NAME,... names others")
        for job in jobs if not args.no_code_check else []:
            spec = job.spec
            refs = [
                ("spec.model.entrypoint", spec.model.entrypoint if spec.model is not None else None),
                ("spec.dataset.entrypoint", spec.dataset.entrypoint if spec.dataset is not None else None),
                ("spec.training.loss", spec.training.loss if spec.training is not None else None),
            ]
            for field_path, ref in refs:
                module = ref.partition(":")[0] if ref and ":" in ref else None
                if module is not None and not _module_found(module, code_dir):
                    missing.append(f"{path}: {field_path}: {ref}: cannot find module {module!r} "
                                   f"in {code_dir} or the installed packages")
        if missing:
            print("\n".join(missing), file=sys.stderr)
            failed = True
            continue
        names = ", ".join(f"{j.name} ({j.spec.mode})" for j in jobs)
        print(f"{path}: ok: {names}")
    if failed:
        return EXIT_USAGE
    print("ok")
    return 0


FAULT = re.compile(r"(?P<replica>[a-z]+-\d+):kill@(?P<when>step|save|allreduce)=(?P<step>\d+)")


def parse_faults(values: list[str], replicas: list[str], fault_tolerant: bool = False) -> dict[str, str]:
    """`REPLICA:kill@step=N` (SIGKILL right after step N), `REPLICA:kill@save=N` (SIGKILL in the middle of
    writing the checkpoint of step N: its files written, not yet committed) or `ddp-R:kill@allreduce=N`
    (SIGKILL in the middle of step N's gradient average across replica groups: fault-tolerant DDP)
    -> {replica: "kill@...=N"}."""
    faults: dict[str, str] = {}
    for value in values:
        m = FAULT.fullmatch(value)
        if not m:
            raise UsageError(f"--fault {value!r}: expected REPLICA:kill@step=N or REPLICA:kill@save=N, for example "
                             "worker-1:kill@step=40 (or ddp-R:kill@allreduce=N in a fault-tolerant DDP job)")
        replica, step = m["replica"], int(m["step"])
        if m["when"] == "allreduce" and not fault_tolerant:
            raise UsageError(f"--fault {value!r}: kill@allreduce applies to the ranks of a fault-tolerant DDP job "
                             "(spec.ddp.faultTolerance), whose steps average gradients through torchft")
        if replica not in replicas:
            raise UsageError(f"--fault {value!r}: this job has no replica {replica!r} (it has {', '.join(replicas)})")
        if step < 1:
            raise UsageError(f"--fault {value!r}: the step must be at least 1")
        if replica in faults:
            raise UsageError(f"--fault {value!r}: a fault for {replica} is given twice")
        if replica.startswith("ddp-") and any(r.startswith("ddp-") for r in faults):
            raise UsageError(f"--fault {value!r}: a DDP group takes one fault per run")
        faults[replica] = f"kill@{m['when']}={step}"
    return faults


def run_dir_of(job: TrainingJob, run_dir: str | None) -> Path:
    """Where `kubetrain run` keeps a job's run: --run-dir, or runs/<name>."""
    return Path(run_dir) if run_dir else Path("runs") / job.name


def cmd_run(args: argparse.Namespace) -> int:
    from kubetrain.engine.plan import replica_names
    from kubetrain.drivers.local.runner import LocalRunner
    from kubetrain.drivers.local.rundir import RunDir, RunDirError

    job = load_one(args.file)
    path = job.spec.dataset.path if job.spec.dataset is not None else None
    if path is not None and not Path(path).exists():  # a file, or a directory of shards or text files
        print(f"{args.file}: spec.dataset.path: {path}: no such file or directory", file=sys.stderr)
        return EXIT_LOAD
    replicas = [f"{role}-{i}" for role, i in replica_names(job)]
    if job.spec.mode == "DDP":  # a fault names a rank, and there are nodes x procsPerNode of them
        replicas = [f"ddp-{rank}" for rank in range(job.spec.world_size)]
    faults = parse_faults(args.fault, replicas, fault_tolerant=job.spec.fault_tolerant)
    run_dir = run_dir_of(job, args.run_dir)
    try:
        # User code (a script, entry points) is found next to the manifest.
        code_dir = Path(args.code_dir).resolve() if args.code_dir else Path(args.file).resolve().parent
        return LocalRunner(job, RunDir(run_dir), faults, echo_logs=not args.quiet, code_dir=code_dir).run_job()
    except RunDirError as err:
        raise UsageError(str(err)) from None


def cmd_scale(args: argparse.Namespace) -> int:
    """Set a local run's size (spec.replicas in its run directory's job.yaml), as `kubectl scale` does a
    TrainingJob's: a `kubetrain run` in progress resizes the job within a second (a ParameterServer job
    live, a DDP job after a checkpoint); otherwise the next run starts at that size."""
    from kubetrain.drivers.local.rundir import RunDirError, scale_run

    target = Path(args.target)
    if target.is_dir():
        run_dir = target
    else:
        job = load_one(target)
        run_dir = run_dir_of(job, args.run_dir)
    try:
        job = scale_run(run_dir, args.replicas)  # refuses a size the job cannot take, naming spec.replicas
    except RunDirError as err:
        raise UsageError(str(err)) from None
    unit = {"ParameterServer": "worker", "DDP": "node", "Single": "replica"}[job.spec.mode] + ("s" if job.spec.size != 1 else "")
    how = "at once (live)" if job.spec.mode == "ParameterServer" or job.spec.fault_tolerant else "after a checkpoint"
    print(f"{run_dir}: {job.name} scaled to {job.spec.size} {unit}; a `kubetrain run` in progress resizes it "
          f"{how}, otherwise the next run starts at that size")
    return 0


PEER_KEYS = frozenset({"podSelector", "namespaceSelector", "ipBlock"})


def parse_metrics_from(value: str) -> tuple[dict[str, Any], ...]:
    """`--metrics-from-json`: a JSON list of NetworkPolicyPeers. A peer that is not one is refused
    here, at start: the API server would refuse every job's policy, and no job would start."""
    try:
        peers = json.loads(value or "[]")
    except ValueError as err:
        raise UsageError(f"--metrics-from-json: not JSON ({err})") from None
    if not isinstance(peers, list):
        raise UsageError(f"--metrics-from-json: expected a list of NetworkPolicyPeers, got {value!r}")
    for i, peer in enumerate(peers):
        if not isinstance(peer, dict) or not peer or set(peer) - PEER_KEYS:
            raise UsageError(f"--metrics-from-json[{i}]: expected an object with some of "
                             f"{', '.join(sorted(PEER_KEYS))}, got {json.dumps(peer)}")
    return tuple(peers)


def parse_gang_schedulers(values: list[str]) -> tuple[tuple[str, str], ...]:
    """`--gang-scheduler KIND[=SCHEDULER_NAME]` (repeatable) as (kind, the pods' schedulerName) pairs,
    the first the default; an unknown kind is refused here, at start, naming the ones there are."""
    from kubetrain.engine.gang import SCHEDULERS

    out: list[tuple[str, str]] = []
    for value in values:
        kind, _, name = value.partition("=")
        if kind not in SCHEDULERS:
            raise UsageError(f"--gang-scheduler: expected {' or '.join(SCHEDULERS)}[=SCHEDULER_NAME], got {value!r}")
        if kind in dict(out):
            raise UsageError(f"--gang-scheduler: {kind} given twice")
        if "=" in value and not re.fullmatch(DNS1123_PATTERN, name):
            raise UsageError(f"--gang-scheduler: the scheduler name must be a DNS-1123 name, got {name!r}")
        out.append((kind, name or SCHEDULERS[kind].default_scheduler_name))
    return tuple(out)


def parse_secret_names(text: str | frozenset[str], flag: str, what: str = "a Secret name") -> frozenset[str]:
    """Comma-separated object names (DNS-1123: Secrets, Volcano queues); UsageError naming the flag and the
    bad name."""
    if isinstance(text, frozenset):
        return text
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    for name in sorted(names):
        if not re.fullmatch(DNS1123_PATTERN, name) or len(name) > 253:
            raise UsageError(f"{flag}: {name!r} is not {what} (a DNS-1123 name)")
    return names


def cmd_operator(args: argparse.Namespace) -> int:
    from kubetrain.api.podtemplate import parse_allowances
    from kubetrain.drivers.cluster.run import run

    try:
        allowed = parse_allowances([args.pod_security_allow])
    except ValueError as err:
        raise UsageError(f"--pod-security-allow: {err}") from None
    from kubetrain.drivers.cluster.state import MAX_WORKERS, WORKERS

    workers = WORKERS if args.workers is None else args.workers
    if not 1 <= workers <= MAX_WORKERS:
        raise UsageError(f"--workers: expected 1 to {MAX_WORKERS}, got {workers}")
    return run(
        workers=workers,
        gang_schedulers=parse_gang_schedulers(args.gang_scheduler),
        network_policy=not args.no_network_policy,
        kueue=args.kueue,
        kueue_slices=args.kueue_workload_slices,
        metrics_from=parse_metrics_from(args.metrics_from_json),
        pod_security_allow=allowed,
        object_store_secrets=parse_secret_names(args.object_store_secrets, "--object-store-secrets"),
        volcano_queues=parse_secret_names(args.volcano_queues, "--volcano-queues", "a Volcano queue name"),
        namespaces=args.namespace,
        metrics_port=args.metrics_port,
        liveness_port=args.liveness_port,
        trainer_image=args.trainer_image,
        pull_policy=args.pull_policy,
        scrape_networks=[n for n in args.scrape_networks.split(",") if n],
        scrape=not args.no_scrape,
        leader_elect=args.leader_elect,
        lease_name=args.lease_name,
        lease_namespace=args.lease_namespace,
    )


def cmd_version(args: argparse.Namespace) -> int:
    """The client's version and, unless --client, what the cluster runs (kubetrain.client.versions): exit 0,
    warnings included; 1 when the cluster cannot be asked or the job is not there."""
    from kubetrain.shared import __version__

    client_only = json.dumps({"client": __version__}, indent=2) if args.output == "json" else \
        f"client:   kubetrain {__version__}"
    if args.client:
        print(client_only)
        return 0
    try:  # the Kubernetes client: not in the trainer's image, whose `kubetrain version --client` still answers
        from kubetrain.client import versions
        from kubetrain.client.api import ClientError
    except ImportError as err:
        print(client_only)
        print(f"kubetrain version: asking the cluster needs the client's dependencies (pip install "
              f"'kubetrain[client]'): {err}", file=sys.stderr)
        return 1
    try:
        found = versions.read(args.namespace or None, args.job, args.operator_namespace)
    except ClientError as err:
        print(client_only)
        print(f"kubetrain version: {err}", file=sys.stderr)
        return 1
    print(found.to_json() if args.output == "json" else "\n".join(versions.lines(found)))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from kubetrain.reports import ReportError, build_report

    sources: list[Any] = []
    try:
        for source in args.run_dirs:
            kind, _, name = source.partition("/")
            if kind.lower() in ("tj", "trainingjob", "trainingjobs") and name:
                if not args.prometheus:
                    raise UsageError(f"{source}: a cluster job's series come from Prometheus: give --prometheus URL")
                from kubetrain.reports.from_cluster import cluster_run

                sources.append(cluster_run(_client(args).backend, name, args.prometheus))
            else:
                sources.append(Path(source))
        path = build_report(sources, Path(args.out))
    except ReportError as err:
        raise UsageError(str(err)) from None
    print(path)
    return 0


def _client(args: argparse.Namespace) -> Any:
    """The Python client for `kubetrain logs|wait|export|report`: the cluster, or this machine with --local."""
    from kubetrain.client import Client

    if getattr(args, "local", False):
        return Client(local=True, runs_dir=args.runs_dir)
    return Client(namespace=args.namespace or None)


EXIT_TIMEOUT = 124  # as timeout(1)


def cmd_logs(args: argparse.Namespace) -> int:
    try:
        for line in _client(args).logs(args.job, replica=args.replica, follow=args.follow):
            print(line, flush=args.follow)
    except KeyboardInterrupt:
        return 130
    return 0


def cmd_wait(args: argparse.Namespace) -> int:
    from kubetrain.client import JobEnded, WaitTimeout

    until = [s for s in args.until.split(",") if s]
    try:
        job = _client(args).wait(args.job, until=until, timeout=args.timeout,
                                 progress=None if not args.quiet else False)
    except WaitTimeout as err:
        print(f"kubetrain: {err}", file=sys.stderr)
        return EXIT_TIMEOUT
    except JobEnded as err:
        print(f"kubetrain: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print(f"{job.name}: {job.state}")
    return 1 if job.state == "Failed" else 0


def cmd_export(args: argparse.Namespace) -> int:
    path = _client(args).export(args.job, args.out, args.format, merge_lora=args.merge_lora)
    print(path)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from kubetrain.reports import ReportError, compare

    modes = [m for m in args.modes.split(",") if m]
    compression = [c for c in args.compression.split(",") if c] if args.compression else None
    try:
        path = compare(Path(args.file), modes, compression, Path(args.out))
    except (ReportError, ValueError) as err:
        raise UsageError(str(err)) from None
    except KeyboardInterrupt:
        return 130
    print(path)
    return 0


def cmd_checkpoints(args: argparse.Namespace) -> int:
    try:
        from kubetrain.trainer import verify
    except ImportError as err:
        raise UsageError(f"kubetrain checkpoints needs the trainer's dependencies (torch): {err}") from None
    if args.action in ("verify", "compare", "export"):
        import tempfile

        with tempfile.TemporaryDirectory(prefix="kubetrain-checkpoints-") as staging:
            sources = staged_sources(args.action, args.dirs, Path(staging))
            if sources is None:
                return EXIT_LOAD
            if args.action == "verify":
                return verify.main_verify(sources[0], job_file=args.job, as_json=args.json,
                                          run_eval=not args.no_eval)
            if args.action == "compare":
                return verify.main_compare(sources, tolerance=args.tolerance, as_json=args.json)
            from kubetrain.trainer import export

            return export.main_export(sources, args.out, job_file=args.job, fmt=args.format,
                                      hf_options=hf_options(args))
    job, faults = recovery_inputs(args.dirs[0], args.fault)
    return verify.main_recovery(job, args.fault, faults, args.run_root, run_locally, as_json=args.json)


def hf_options(args: argparse.Namespace) -> dict[str, Any] | None:
    """--merge-lora and --max-shard-size of `checkpoints export --format huggingface` (UsageError otherwise)."""
    from kubetrain.trainer.errors import ConfigError
    from kubetrain.trainer.shards import parse_quantity

    if args.format != "huggingface":
        if args.merge_lora:
            raise UsageError("--merge-lora: applies to --format huggingface")
        return None
    try:
        size = parse_quantity(args.max_shard_size, "--max-shard-size")
    except ConfigError as err:
        raise UsageError(str(err)) from None
    if size < 1:
        raise UsageError(f"--max-shard-size: must be at least 1 byte, got {args.max_shard_size}")
    return {"merge_lora": args.merge_lora, "max_shard_bytes": size}


def staged_sources(action: str, sources: list[str], staging: Path) -> list[str] | None:
    """SOURCEs with object storage copied here (kubetrain.trainer.object_checkpoints.stage_sources); None after
    printing why when the store refused (a missing bucket, denied credentials: the URI named)."""
    from kubetrain.trainer.errors import ConfigError, TrainerError
    from kubetrain.trainer.object_checkpoints import stage_sources

    try:
        return stage_sources(sources, staging)
    except ConfigError as err:
        raise UsageError(str(err)) from None
    except TrainerError as err:
        print(f"kubetrain checkpoints {action}: error: {err}", file=sys.stderr)
        return None


def recovery_inputs(manifest: str | Path, fault: str) -> tuple[Any, dict[str, str]]:
    """The job of `kubetrain checkpoints recovery` and its parsed fault (UsageError names a bad one)."""
    from kubetrain.engine.plan import replica_names

    job = load_one(manifest)
    return job, parse_faults([fault], [f"{role}-{i}" for role, i in replica_names(job)])


def run_locally(job: Any, run_dir: Path, faults: dict[str, str], stream: Any) -> int:
    """Run a job to its end with the local backend (the recovery check's runs); its exit code."""
    from kubetrain.drivers.local.runner import LocalRunner
    from kubetrain.drivers.local.rundir import RunDir, RunDirError

    try:
        return LocalRunner(job, RunDir(run_dir), faults, out=stream, echo_logs=False).run_job()
    except RunDirError as err:
        raise UsageError(str(err)) from None


def recovery_check(manifest: str | Path, fault: str, run_root: str | Path, stream: Any = sys.stderr) -> dict:
    """The recovery check of a manifest (kubetrain.trainer.verify.recovery_check, run locally)."""
    from kubetrain.trainer import verify

    job, faults = recovery_inputs(manifest, fault)
    return verify.recovery_check(job, fault, faults, run_root, run_locally, stream=stream)


def cmd_bench(args: argparse.Namespace) -> int:
    try:
        from kubetrain.bench import run_bench
    except ImportError as err:  # the images leave the benchmarks out: they run from a checkout
        raise UsageError(f"kubetrain bench runs from a checkout of kubetrain (its bench/ package): {err}") from None

    try:
        result = run_bench(args)
    except ValueError as err:
        raise UsageError(str(err)) from None
    text = json.dumps(result, indent=2)
    print(text)
    if getattr(args, "out", None):
        Path(args.out).write_text(text + "\n")
    return 0
