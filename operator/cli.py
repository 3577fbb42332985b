"""The `kubetrain` command: thin argument handling over the API model and the backends.

Errors the user can fix are printed as one line each (file, field path,
message) with exit code 2, never as a traceback.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any


from . import __version__
from .api import InvalidSpec, TrainingJob, load_file, load_one
from .api.schema import MAX_SHOWN_PROBLEMS
from .api.spec import DNS1123_PATTERN
from .api.podtemplate import ALLOWANCES, parse_allowances
from .client.api import ClientError
from .core import podsecurity as pod_security
from .core.children import Settings

EXIT_USAGE = 2
EXIT_LOAD = 3


class UsageError(Exception):
    """A bad command line or input file; the message says which."""


def _print_invalid(err: InvalidSpec) -> None:
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


def _allowances(value: str) -> frozenset[str]:
    try:
        return parse_allowances([value])
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def cmd_validate(args: argparse.Namespace) -> int:
    failed = False
    for path in args.files:
        try:
            jobs = load_file(path)
        except InvalidSpec as err:
            _print_invalid(err)
            failed = True
            continue
        # Entry points' modules must be importable by the trainers: locally from the
        # manifest's directory (kubetrain run's code directory), else as installed packages.
        code_dir = Path(path).resolve().parent
        # What the template asks of the node, judged as the cluster's policy and operator judge it.
        settings = Settings(pod_security_allow=frozenset(args.allow))
        missing = [f"{path}: {p}" for job in jobs for p in pod_security.problems(job, settings)]
        if len(missing) > MAX_SHOWN_PROBLEMS:
            missing[MAX_SHOWN_PROBLEMS:] = [f"{path}: ... and {len(missing) - MAX_SHOWN_PROBLEMS} more problems"]
        if missing:
            missing.append(f"{path}: checked for an installation whose podSecurity.allow is "
                           f"[{', '.join(sorted(args.allow))}]; --allow NAME,... checks for one that allows more")
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
    from .core.plan import replica_names
    from .local.backend import LocalBackend
    from .local.rundir import RunDir, RunDirError

    job = load_one(args.file)
    path = job.spec.dataset.path if job.spec.dataset is not None else None
    if path is not None and not Path(path).is_file():
        print(f"{args.file}: spec.dataset.path: {path}: no such file", file=sys.stderr)
        return EXIT_LOAD
    replicas = [f"{role}-{i}" for role, i in replica_names(job)]
    if job.spec.mode == "DDP":  # a fault names a rank, and there are nodes x procsPerNode of them
        replicas = [f"ddp-{rank}" for rank in range(job.spec.world_size)]
    faults = parse_faults(args.fault, replicas, fault_tolerant=job.spec.fault_tolerant)
    run_dir = run_dir_of(job, args.run_dir)
    try:
        # User code (a script, entry points) is found next to the manifest.
        code_dir = Path(args.code_dir).resolve() if args.code_dir else Path(args.file).resolve().parent
        return LocalBackend(job, RunDir(run_dir), faults, echo_logs=not args.quiet, code_dir=code_dir).run_job()
    except RunDirError as err:
        raise UsageError(str(err)) from None


def cmd_scale(args: argparse.Namespace) -> int:
    """Set a local run's size (spec.replicas in its run directory's job.yaml), as `kubectl scale` does a
    TrainingJob's: a `kubetrain run` in progress resizes the job within a second (a ParameterServer job
    live, a DDP job after a checkpoint); otherwise the next run starts at that size."""
    from .local.rundir import RunDirError, scale_run

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
    from .core.gang import SCHEDULERS

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


def cmd_operator(args: argparse.Namespace) -> int:
    from .api.podtemplate import parse_allowances
    from .controller.run import run

    try:
        allowed = parse_allowances([args.pod_security_allow])
    except ValueError as err:
        raise UsageError(f"--pod-security-allow: {err}") from None
    from .controller.handlers import MAX_WORKERS, WORKERS

    workers = WORKERS if args.workers is None else args.workers
    if not 1 <= workers <= MAX_WORKERS:
        raise UsageError(f"--workers: expected 1 to {MAX_WORKERS}, got {workers}")
    return run(
        workers=workers,
        gang_schedulers=parse_gang_schedulers(args.gang_scheduler),
        network_policy=not args.no_network_policy,
        kueue=args.kueue,
        metrics_from=parse_metrics_from(args.metrics_from_json),
        pod_security_allow=allowed,
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


def cmd_report(args: argparse.Namespace) -> int:
    from .report import ReportError, build_report

    sources: list[Any] = []
    try:
        for source in args.run_dirs:
            kind, _, name = source.partition("/")
            if kind.lower() in ("tj", "trainingjob", "trainingjobs") and name:
                if not args.prometheus:
                    raise UsageError(f"{source}: a cluster job's series come from Prometheus: give --prometheus URL")
                from .report.cluster import cluster_run

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
    from .client import Client

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
    from .client import JobEnded, WaitTimeout

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
    path = _client(args).export(args.job, args.out)
    print(path)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from .report import ReportError, compare

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
        from kubetrain_trainer import verify
    except ImportError as err:
        raise UsageError(f"kubetrain checkpoints needs the trainer's dependencies (torch): {err}") from None
    if args.action == "verify":
        return verify.main_verify(args.dirs[0], job_file=args.job, as_json=args.json, run_eval=not args.no_eval)
    if args.action == "compare":
        return verify.main_compare(args.dirs, tolerance=args.tolerance, as_json=args.json)
    if args.action == "export":
        from kubetrain_trainer import export

        return export.main_export(args.dirs, args.out, job_file=args.job)
    job, faults = recovery_inputs(args.dirs[0], args.fault)
    return verify.main_recovery(job, args.fault, faults, args.run_root, run_locally, as_json=args.json)


def recovery_inputs(manifest: str | Path, fault: str) -> tuple[Any, dict[str, int]]:
    """The job of `kubetrain checkpoints recovery` and its parsed fault (UsageError names a bad one)."""
    from .core.plan import replica_names

    job = load_one(manifest)
    return job, parse_faults([fault], [f"{role}-{i}" for role, i in replica_names(job)])


def run_locally(job: Any, run_dir: Path, faults: dict[str, str], stream: Any) -> int:
    """Run a job to its end with the local backend (the recovery check's runs); its exit code."""
    from .local.backend import LocalBackend
    from .local.rundir import RunDir, RunDirError

    try:
        return LocalBackend(job, RunDir(run_dir), faults, out=stream, echo_logs=False).run_job()
    except RunDirError as err:
        raise UsageError(str(err)) from None


def recovery_check(manifest: str | Path, fault: str, run_root: str | Path, stream: Any = sys.stderr) -> dict:
    """The recovery check of a manifest (kubetrain_trainer.verify.recovery_check, run locally)."""
    from kubetrain_trainer import verify

    job, faults = recovery_inputs(manifest, fault)
    return verify.recovery_check(job, fault, faults, run_root, run_locally, stream=stream)


def cmd_bench(args: argparse.Namespace) -> int:
    from .benchcli import run_bench

    try:
        result = run_bench(args)
    except ValueError as err:
        raise UsageError(str(err)) from None
    text = json.dumps(result, indent=2)
    print(text)
    if getattr(args, "out", None):
        Path(args.out).write_text(text + "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kubetrain",
        description="Distributed PyTorch training from one TrainingJob manifest, locally or on Kubernetes.",
    )
    parser.add_argument("--version", action="version", version=f"kubetrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("validate", help="check TrainingJob manifests; prints every problem with its field path")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--no-code-check", action="store_true",
                   help="do not look for the entry points' modules (code that exists only in the job's image)")
    p.add_argument("--allow", type=_allowances, default=frozenset(), metavar="NAME,...",
                   help="check for a cluster whose kubetrain installation allows these in spec.podTemplate "
                        f"(its chart's podSecurity.allow): {', '.join(ALLOWANCES)}")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("run", help="run a TrainingJob on this machine as local processes (resumes an unfinished run)")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--run-dir", help="run directory (default: runs/<name>)")
    p.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="REPLICA:kill@step=N|kill@save=N",
        help="SIGKILL a replica right after step N (kill@step=N), or while it writes the checkpoint of step N, "
             "its files written and not yet committed (kill@save=N); first attempt only; repeatable",
    )
    p.add_argument("--quiet", action="store_true", help="do not echo the replicas' log lines")
    p.add_argument("--code-dir", metavar="DIR",
                   help="where the job's own code is found (spec.script, entry points); default: FILE's directory")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("scale", help="change a local run's size (ParameterServer workers, DDP nodes), as kubectl "
                                     "scale does a TrainingJob's")
    p.add_argument("target", metavar="RUN_DIR_OR_FILE", help="the run directory, or the manifest it was run from")
    p.add_argument("--replicas", type=int, required=True, help="the new size")
    p.add_argument("--run-dir", help="run directory of FILE (default: runs/<name>)")
    p.set_defaults(func=cmd_scale)

    p = sub.add_parser("report", help="a Markdown report with plots comparing finished runs: run directories, "
                                      "or cluster jobs (tj/NAME, their series from --prometheus)")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR|tj/NAME")
    p.add_argument("--out", default="reports/latest", help="output directory (default: reports/latest)")
    p.add_argument("--prometheus", metavar="URL", help="the Prometheus that scrapes the cluster jobs' pods")
    p.add_argument("-n", "--namespace", default="", help="the cluster jobs' namespace (default: the context's)")
    p.set_defaults(func=cmd_report)

    def job_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("job", metavar="JOB", help="the TrainingJob's name")
        p.add_argument("-n", "--namespace", default="", help="its namespace (default: the kubeconfig context's)")
        p.add_argument("--local", action="store_true", help="a local run: RUNS_DIR/JOB, not a cluster job")
        p.add_argument("--runs-dir", default="runs", help="with --local: where the runs are (default: runs)")

    p = sub.add_parser("logs", help="a job's log lines: one replica's or every replica's, [replica]-prefixed")
    job_args(p)
    p.add_argument("-f", "--follow", action="store_true",
                   help="stream new lines until the job ends, across a replica's restarts")
    p.add_argument("--replica", help="only this replica (worker-1, ddp-0, ...)")
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("wait", help="wait for a job to end (or reach --until), with a progress bar; exit 0 "
                                    "succeeded or reached, 1 failed, 124 timed out")
    job_args(p)
    p.add_argument("--until", default="Succeeded,Failed", help="comma-separated states (default: Succeeded,Failed)")
    p.add_argument("--timeout", type=float, help="seconds (default: no limit)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_wait)

    p = sub.add_parser("export", help="a job's trained weights as a plain torch.save state_dict, from a cluster "
                                      "(a short-lived pod on its checkpoint claims) or a local run")
    job_args(p)
    p.add_argument("--out", required=True, metavar="FILE", help="the file to write (replaced atomically)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("compare", help="run variants of one manifest locally (modes, compression) and report")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--modes", default="Single,ParameterServer,DDP", help="comma-separated modes")
    p.add_argument("--compression", help="comma-separated compression algorithms for the ParameterServer runs")
    p.add_argument("--out", default="reports/compare", help="output directory (runs, manifests, report)")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("checkpoints", help="validate, compare and export checkpoints")
    csub = p.add_subparsers(dest="action", metavar="ACTION")
    csub.required = True
    c = csub.add_parser("verify", help="check every checkpoint of a directory, load it, evaluate the newest")
    c.add_argument("dirs", nargs=1, metavar="DIR")
    c.add_argument("--job", help="the job's manifest (default: job.yaml of the run directory)")
    c.add_argument("--no-eval", action="store_true", help="skip evaluating the model on the eval split")
    c.add_argument("--json", action="store_true")
    c = csub.add_parser("compare", help="compare the final checkpoints of several runs")
    c.add_argument("dirs", nargs="+", metavar="DIR")
    c.add_argument("--tolerance", type=float, default=1e-6)
    c.add_argument("--json", action="store_true")
    c = csub.add_parser("recovery", help="run a job with a fault and without, and compare their final checkpoints")
    c.add_argument("dirs", nargs=1, metavar="FILE")
    c.add_argument("--fault", required=True, metavar="REPLICA:kill@step=N|kill@save=N")
    c.add_argument("--run-root", default="runs/recovery-check")
    c.add_argument("--json", action="store_true")
    c = csub.add_parser(
        "export",
        help="write the model's weights of the newest usable checkpoint as a plain torch.save state_dict",
        description="SOURCE: a run directory, one replica's checkpoint directory, a directory holding replica "
        "directories (ps-0/, ps-1/ ...), or several shard directories of a ParameterServer job. Exit 2: bad "
        "input; 3: no usable checkpoint.",
    )
    c.add_argument("dirs", nargs="+", metavar="SOURCE")
    c.add_argument("--out", required=True, metavar="FILE", help="the file to write (replaced atomically)")
    c.add_argument("--job", metavar="FILE", help="the job's manifest (default: job.yaml of the run directory)")
    p.set_defaults(func=cmd_checkpoints)

    p = sub.add_parser("operator", help="run the TrainingJob operator against the current kubeconfig")
    p.add_argument("--namespace", action="append", default=[], help="watch only this namespace (repeatable); default: all")
    p.add_argument("--metrics-port", type=int, default=8080, help="port of the operator's /metrics (0: off)")
    p.add_argument("--liveness-port", type=int, default=8081, help="port of /healthz for the liveness probe (0: off)")
    p.add_argument("--trainer-image", default=f"kubetrain/trainer:{__version__}", help="image of jobs without spec.image")
    p.add_argument("--pull-policy", default="IfNotPresent", choices=["Always", "IfNotPresent", "Never"])
    p.add_argument(
        "--scrape-networks",
        default="",
        help="comma-separated CIDRs of pod IPs the operator may read /metrics from (default: any)",
    )
    p.add_argument("--no-scrape", action="store_true", help="never read the trainers' /metrics (no progress, no hang detection)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="reconcile workers that take any job (1 to 64; default 8), beside one that only replaces "
                        "replicas that died")
    p.add_argument("--leader-elect", action="store_true",
                   help="act only while holding a coordination.k8s.io Lease, so replicas make one leader and standbys")
    p.add_argument("--lease-name", default="kubetrain-operator", help="name of the leader-election Lease")
    p.add_argument("--lease-namespace", default="",
                   help="namespace of the Lease (default: env POD_NAMESPACE, else default)")
    p.add_argument("--pod-security-allow", default="", metavar="NAMES",
                   help="comma-separated podTemplate allowances (privileged, hostNamespaces, hostPath, capabilities, "
                        "root, serviceAccount); default: none, a job asking for one fails with PodSecurity")
    p.add_argument("--no-network-policy", action="store_true",
                   help="do not give each job a NetworkPolicy (by default its pods accept connections only from "
                        "the job's own pods, and on the metrics port from --metrics-from-json)")
    p.add_argument("--kueue", action="store_true",
                   help="queue jobs labelled kueue.x-k8s.io/queue-name through Kueue: each gets a Workload and "
                        "stays suspended until Kueue admits it (docs/scheduling.md)")
    p.add_argument("--metrics-from-json", default="[]", metavar="JSON",
                   help="JSON list of NetworkPolicyPeers (podSelector, namespaceSelector, ipBlock) that may reach "
                        "the trainers' metrics port: the operator's own pods, Prometheus; default: none")
    p.add_argument("--gang-scheduler", action="append", default=[], metavar="KIND[=SCHEDULER_NAME]",
                   help="make PodGroups for jobs with spec.runPolicy.schedulingPolicy: volcano or scheduler-plugins "
                        "(repeatable; the first is the default), optionally with the pods' schedulerName "
                        "(volcano, scheduler-plugins-scheduler); default: none, such a job fails with "
                        "GangSchedulingDisabled")
    p.set_defaults(func=cmd_operator)

    p = sub.add_parser("version", help="print the version")
    p.set_defaults(func=lambda a: print(f"kubetrain {__version__}") or 0)

    p = sub.add_parser("bench", help="benchmarks that print JSON")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH")
    bsub.required = True
    b = bsub.add_parser("transport", help="PS transport throughput vs a raw loopback socket, in one run")
    b.add_argument("--bytes", default="64MiB", help="tensor size, e.g. 64MiB")
    b = bsub.add_parser("modes", help="samples/s and time to an accuracy of Single, PS Sync, PS Async and DDP "
                        "on the same work, in one run")
    b.add_argument("--case", choices=("small", "cnn", "straggler", "all"), default="all",
                   help="small: the MLP; cnn: the built-in CNN; straggler: the CNN with one PS worker or DDP rank slowed")
    b.add_argument("--epochs", type=int, default=5, help="epochs of digits per mode (the same samples for every mode)")
    b.add_argument("--batch", type=int, default=64, help="global batch; 2-replica modes use half per replica")
    b.add_argument("--model-hidden", type=int, default=128, help="the small case's MLP width")
    b.add_argument("--slow-factor", type=float, default=3.0, help="straggler: how many times slower worker-1 / ddp-1 is")
    b.add_argument("--target", type=float, default=0.9, help="eval accuracy the time to target is measured to")
    b.add_argument("--rounds", type=int, default=1, help="rounds of every mode, in alternating order (medians)")
    b.add_argument("--modes", help="comma-separated subset of Single,PS-Sync,PS-Async,DDP")
    b.add_argument("--out", help="also write the JSON here")
    b = bsub.add_parser("contract", help="what kubetrain.report and kubetrain.save cost a script, in one run")
    b.add_argument("--rounds", type=int, default=3, help="alternating rounds of each variant (medians are compared)")
    b.add_argument("--steps", type=int, default=400, help="timed steps of the DDP script per round")
    b.add_argument("--save-mib", type=int, default=100, help="size of the state kubetrain.save writes")
    b.add_argument("--out", help="also write the JSON here")
    b = bsub.add_parser("compression", help="push and pull bytes per step and accuracy of every compression algorithm")
    b.add_argument("--manifest", default="examples/quickstart.yaml", help="a ParameterServer TrainingJob")
    b.add_argument("--algorithms", default="None,FP16,Int8,TopK,PowerSGD", help="comma-separated")
    b.add_argument("--ratio", type=float, default=0.01, help="TopK's fraction of elements")
    b.add_argument("--rank", type=int, default=2, help="PowerSGD's rank")
    b.add_argument("--min-tensor-bytes", type=int, default=0, help="tensors below this travel uncompressed")
    b.add_argument("--out", help="also write the JSON here")
    b = bsub.add_parser("ft", help="a fault-tolerant DDP job with a node killed every 30 s against no kill, beside "
                        "plain DDP restarted from its checkpoint under the same kills, in one run")
    b.add_argument("--steps", type=int, default=5000, help="maxSteps of every variant (1-4 minutes each here)")
    b.add_argument("--rounds", type=int, default=2, help="rounds of each job's two variants, in alternating order "
                   "(medians are compared)")
    b.add_argument("--groups", type=int, default=3, help="DDP nodes: the replica groups of the fault-tolerant job")
    b.add_argument("--kill-every", type=float, default=30.0, help="seconds between two SIGKILLs of a node")
    b.add_argument("--model-hidden", type=int, default=128, help="width of the MLP")
    b.add_argument("--heartbeat", type=float, default=1.0, help="faultTolerance.heartbeatTimeoutSeconds")
    b.add_argument("--slowdown", type=float, default=4.0,
                   help="every rank's step lasts this many times its compute (a sleep): nodes with CPUs of their own")
    b.add_argument("--keep", help="keep the run directories here (default: a temporary directory)")
    b.add_argument("--out", help="also write the JSON here")
    b = bsub.add_parser("checkpoint", help="what a checkpoint costs the training loop, background against synchronous")
    b.add_argument("--model-mb", type=int, default=100, help="parameter megabytes of the model (at least 100)")
    b.add_argument("--steps", type=int, default=60, help="timed training steps per round and variant")
    b.add_argument("--every", type=int, default=20, help="a checkpoint every this many steps")
    b.add_argument("--rounds", type=int, default=2, help="alternating rounds (none, checkpoints) and synchronous saves")
    b.add_argument("--dir", help="write the checkpoints under this directory (default: a temporary one under /tmp)")
    b.add_argument("--sharded", action="store_true",
                   help="a sharded checkpoint instead: FSDP2 over 2 ranks, every rank writing its shards, against "
                        "its synchronous save and against rank 0's torch.save of the gathered state")
    b.add_argument("--gib", type=float, default=1.0, help="--sharded: GiB of state in all (parameters and AdamW's)")
    b.add_argument("--out", help="also write the JSON here")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except InvalidSpec as err:
        _print_invalid(err)
        return EXIT_USAGE
    except UsageError as err:
        print(f"kubetrain: {err}", file=sys.stderr)
        return EXIT_USAGE
    except ClientError as err:  # logs, wait, export, report of cluster jobs: the message names the job
        print(f"kubetrain: {err}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
