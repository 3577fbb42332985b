"""The `kubetrain` command line's parser: one function per group of commands."""

from __future__ import annotations

import argparse

from kubetrain.shared import __version__
from kubetrain.api.podtemplate import ALLOWANCES

from .commands import (
    allowances_arg,
    queue_names_arg,
    secret_names_arg,
    cmd_bench,
    cmd_checkpoints,
    cmd_compare,
    cmd_export,
    cmd_logs,
    cmd_operator,
    cmd_report,
    cmd_run,
    cmd_scale,
    cmd_validate,
    cmd_version,
    cmd_wait,
)

Subparsers = argparse._SubParsersAction  # what add_subparsers returns


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kubetrain",
        description="Distributed PyTorch training from one TrainingJob manifest, locally or on Kubernetes.",
    )
    parser.add_argument("--version", action="version", version=f"kubetrain {__version__}")
    sub = subcommands(parser, "command", "COMMAND")
    add_local_commands(sub)
    add_job_commands(sub)
    add_checkpoints_command(sub)
    add_operator_command(sub)
    add_version_command(sub)
    add_bench_command(sub)
    return parser


def subcommands(parser: argparse.ArgumentParser, dest: str, metavar: str) -> Subparsers:
    """The commands under `parser`, one of which must be given (stored as `dest`)."""
    sub = parser.add_subparsers(dest=dest, metavar=metavar)
    sub.required = True
    return sub


def add_local_commands(sub: Subparsers) -> None:
    """validate, run, scale: a manifest and a run on this machine."""
    p = sub.add_parser("validate", help="check TrainingJob manifests; prints every problem with its field path")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--no-code-check", action="store_true",
                   help="do not look for the entry points' modules (code that exists only in the job's image)")
    p.add_argument("--allow", type=allowances_arg, default=frozenset(), metavar="NAME,...",
                   help="check for a cluster whose kubetrain installation allows these in spec.podTemplate "
                        f"(its chart's podSecurity.allow): {', '.join(ALLOWANCES)}")
    p.add_argument("--object-store-secrets", type=secret_names_arg, default=frozenset(), metavar="NAME,...",
                   help="check for a cluster whose kubetrain installation lets jobs name these Secrets as "
                        "object-storage credentials (its chart's objectStorage.secrets)")
    p.add_argument("--volcano-queues", type=queue_names_arg, default=frozenset(), metavar="NAME,...",
                   help="check for a cluster whose kubetrain installation lets jobs name these Volcano queues "
                        "(its chart's gangScheduling.volcano.queues)")
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


def job_args(p: argparse.ArgumentParser) -> None:
    """The arguments naming one job: a cluster's (NAME, -n) or a local run's (--local, --runs-dir)."""
    p.add_argument("job", metavar="JOB", help="the TrainingJob's name")
    p.add_argument("-n", "--namespace", default="", help="its namespace (default: the kubeconfig context's)")
    p.add_argument("--local", action="store_true", help="a local run: RUNS_DIR/JOB, not a cluster job")
    p.add_argument("--runs-dir", default="runs", help="with --local: where the runs are (default: runs)")


def add_job_commands(sub: Subparsers) -> None:
    """report, logs, wait, export, compare: what became of jobs, on a cluster or locally."""
    p = sub.add_parser("report", help="a Markdown report with plots comparing finished runs: run directories, "
                                      "or cluster jobs (tj/NAME, their series from --prometheus)")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR|tj/NAME")
    p.add_argument("--out", default="reports/latest", help="output directory (default: reports/latest)")
    p.add_argument("--prometheus", metavar="URL", help="the Prometheus that scrapes the cluster jobs' pods")
    p.add_argument("-n", "--namespace", default="", help="the cluster jobs' namespace (default: the context's)")
    p.set_defaults(func=cmd_report)

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
                                      "(a short-lived pod on its checkpoint claims or its checkpoint URI) or a "
                                      "local run")
    job_args(p)
    p.add_argument("--out", required=True, metavar="FILE",
                   help="the file to write (replaced atomically); huggingface: a new directory, or s3://BUCKET/PREFIX/ "
                        "(written by the export pod with the job's credentials)")
    p.add_argument("--format", choices=("torch", "safetensors", "huggingface"), default="torch",
                   help="torch (default), safetensors (the tensors only) or huggingface (a causal-lm job's model as "
                        "a Hugging Face directory; docs/fine-tuning.md)")
    p.add_argument("--merge-lora", action="store_true",
                   help="huggingface, a LoRA job: the pretrained model with the adapter merged in")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("compare", help="run variants of one manifest locally (modes, compression) and report")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--modes", default="Single,ParameterServer,DDP", help="comma-separated modes")
    p.add_argument("--compression", help="comma-separated compression algorithms for the ParameterServer runs")
    p.add_argument("--out", default="reports/compare", help="output directory (runs, manifests, report)")
    p.set_defaults(func=cmd_compare)


def add_checkpoints_command(sub: Subparsers) -> None:
    """checkpoints verify|compare|recovery|export."""
    p = sub.add_parser("checkpoints", help="validate, compare and export checkpoints")
    csub = subcommands(p, "action", "ACTION")
    c = csub.add_parser("verify", help="check every checkpoint of a directory, load it, evaluate the newest")
    c.add_argument("dirs", nargs=1, metavar="DIR", help="a run directory, a checkpoint directory, or s3://BUCKET/PREFIX/")
    c.add_argument("--job", help="the job's manifest (default: job.yaml of the run directory)")
    c.add_argument("--no-eval", action="store_true", help="skip evaluating the model on the eval split")
    c.add_argument("--json", action="store_true")
    c = csub.add_parser("compare", help="compare the final checkpoints of several runs")
    c.add_argument("dirs", nargs="+", metavar="DIR", help="run directories or s3://BUCKET/PREFIX/ URIs")
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
        "directories (ps-0/, ps-1/ ...), several shard directories of a ParameterServer job, or a job's "
        "checkpoint URI in object storage (s3://BUCKET/PREFIX/, its committed checkpoints). Exit 2: bad "
        "input; 3: no usable checkpoint.",
    )
    c.add_argument("dirs", nargs="+", metavar="SOURCE")
    c.add_argument("--out", required=True, metavar="FILE",
                   help="the file to write (replaced atomically), or s3://BUCKET/KEY (uploaded once whole)")
    c.add_argument("--format", choices=("torch", "safetensors", "huggingface"), default="torch",
                   help="torch: a torch.save state_dict (default); safetensors: the tensors as a .safetensors "
                        "file (non-tensor values of a script's state are left out); huggingface: a causal-lm "
                        "job's model as a Hugging Face directory (--out a new directory or s3://BUCKET/PREFIX/) "
                        "that AutoModelForCausalLM.from_pretrained loads; a LoRA job's adapter for peft")
    c.add_argument("--merge-lora", action="store_true",
                   help="huggingface, a LoRA job: the pretrained model with the adapter merged in, not the adapter")
    c.add_argument("--max-shard-size", default="5Gi", metavar="QUANTITY",
                   help="huggingface: the most bytes of weights per safetensors file (default 5Gi); the export "
                        "holds about twice that in memory at once")
    c.add_argument("--job", metavar="FILE", help="the job's manifest (default: job.yaml of the run directory)")
    p.set_defaults(func=cmd_checkpoints)


def add_operator_command(sub: Subparsers) -> None:
    """operator: the controller, with its settings."""
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
    p.add_argument("--object-store-secrets", default="", metavar="NAMES",
                   help="comma-separated Secret names jobs may give as object-storage credentials (secretRef of "
                        "spec.dataset, spec.checkpoint.storage); default: none, a job naming one fails with "
                        "PodSecurity (the allowance secrets lets them name any)")
    p.add_argument("--no-network-policy", action="store_true",
                   help="do not give each job a NetworkPolicy (by default its pods accept connections only from "
                        "the job's own pods, and on the metrics port from --metrics-from-json)")
    p.add_argument("--kueue", action="store_true",
                   help="queue jobs labelled kueue.x-k8s.io/queue-name through Kueue: each gets a Workload and "
                        "stays suspended until Kueue admits it (docs/scheduling.md)")
    p.add_argument("--kueue-workload-slices", action="store_true",
                   help="with --kueue: resize a queued fault-tolerant DDP job live by Kueue workload slices (needs "
                        "Kueue's ElasticJobsViaWorkloadSlices feature gate, alpha in v0.17); without it such a "
                        "job stops and starts again at the new size (docs/scheduling.md#elastic-jobs)")
    p.add_argument("--metrics-from-json", default="[]", metavar="JSON",
                   help="JSON list of NetworkPolicyPeers (podSelector, namespaceSelector, ipBlock) that may reach "
                        "the trainers' metrics port: the operator's own pods, Prometheus; default: none")
    p.add_argument("--gang-scheduler", action="append", default=[], metavar="KIND[=SCHEDULER_NAME]",
                   help="make PodGroups for jobs with spec.runPolicy.schedulingPolicy: volcano or scheduler-plugins "
                        "(repeatable; the first is the default), optionally with the pods' schedulerName "
                        "(volcano, scheduler-plugins-scheduler); default: none, such a job fails with "
                        "GangSchedulingDisabled")
    p.add_argument("--volcano-queues", default="", metavar="NAMES",
                   help="comma-separated Volcano queues jobs may name in spec.runPolicy.schedulingPolicy.queue; "
                        "default: none, a job naming one fails with PodSecurity (unset, its PodGroup goes to "
                        "Volcano's default queue)")
    p.set_defaults(func=cmd_operator)


def add_version_command(sub: Subparsers) -> None:
    """version: the client's, the cluster's operator and CRD, a job's trainer (docs/operating.md#upgrades)."""
    p = sub.add_parser("version", help="print the client's version, the cluster's operator and CRD versions and, "
                                       "with --job, a job's trainer version; warns of a skew the policy does not "
                                       "support")
    p.add_argument("--client", action="store_true", help="only the client's version (no cluster is asked)")
    p.add_argument("--job", metavar="NAME", help="also the trainer version the TrainingJob NAME runs (its status.trainer)")
    p.add_argument("-n", "--namespace", default="", help="the job's namespace (default: the kubeconfig context's)")
    p.add_argument("--operator-namespace", default=None, metavar="NS",
                   help="look for the operator only in NS (default: every namespace the credentials may list, else "
                        "the context's)")
    p.add_argument("-o", "--output", choices=("text", "json"), default="text")
    p.set_defaults(func=cmd_version)


def add_bench_command(sub: Subparsers) -> None:
    """bench BENCH: the benchmarks (kubetrain.bench), each printing JSON."""
    p = sub.add_parser("bench", help="benchmarks that print JSON")
    bsub = subcommands(p, "bench", "BENCH")
    b = bsub.add_parser("transport", help="PS transport throughput vs a raw loopback socket, in one run")
    b.add_argument("--bytes", default="64MiB", help="tensor size, e.g. 64MiB")
    add_bench_modes(bsub)
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
    add_bench_ft(bsub)
    add_bench_checkpoint(bsub)
    add_bench_data(bsub)
    add_bench_finetune(bsub)
    add_bench_soak(bsub)
    p.set_defaults(func=cmd_bench)


def add_bench_soak(bsub: Subparsers) -> None:
    b = bsub.add_parser("soak", help="jobs of every mode on the e2e test cluster under every fault class at once, "
                        "from a seeded schedule, with the invariants checked at the end (docs/benchmarks.md#soak-every-mode-under-every-fault-at-once)")
    b.add_argument("--minutes", type=float, default=20.0, help="how long faults fall (the jobs then get time to end)")
    b.add_argument("--seed", type=int, help="the schedule's seed (default: a random one, printed); give a failed "
                   "soak's seed to replay it")
    b.add_argument("--keep", action="store_true", help="leave the e2e cluster up afterwards (KUBETRAIN_E2E_KEEP)")
    b.add_argument("--out", help="also write the JSON here")


def add_bench_modes(bsub: Subparsers) -> None:
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


def add_bench_ft(bsub: Subparsers) -> None:
    b = bsub.add_parser("ft", help="a fault-tolerant DDP job, with and without a spare group, with a node killed "
                        "every 30 s against no kill, beside plain DDP restarted from its checkpoint under the same "
                        "kills, in one run")
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


def add_bench_checkpoint(bsub: Subparsers) -> None:
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
    b.add_argument("--to", metavar="s3://BUCKET/PREFIX",
                   help="checkpoints in object storage (the store of the AWS_* variables; locally: eval $(hack/objstore "
                        "up)): the background save against a synchronous upload, and the upload against one plain PUT")
    b.add_argument("--out", help="also write the JSON here")


def add_bench_data(bsub: Subparsers) -> None:
    b = bsub.add_parser("data", help="the data loader on s3:// shards against the same shards on local disk")
    b.add_argument("--from", dest="source", required=True, metavar="s3://BUCKET/PREFIX/",
                   help="a prefix of .npz shards (the store of the AWS_* variables)")
    b.add_argument("--make", type=int, default=0, metavar="N", help="first put N shards of random rows there")
    b.add_argument("--rows", type=int, default=20000, help="--make: rows per shard")
    b.add_argument("--features", type=int, default=256, help="--make: float32 features per row")
    b.add_argument("--batch", type=int, default=256, help="samples per batch")
    b.add_argument("--cache", default="10Gi", help="the shard cache's size (spec.dataset.cacheSize)")
    b.add_argument("--out", help="also write the JSON here")


def add_bench_finetune(bsub: Subparsers) -> None:
    b = bsub.add_parser("finetune", help="causal-LM fine-tuning: tokens/s of the built-in FSDP loop against a "
                        "hand-written FSDP2 loop, each rank's memory while loading the pretrained model, and the "
                        "Hugging Face export, in one run")
    b.add_argument("--steps", type=int, default=24, help="training steps of each loop per round")
    b.add_argument("--rounds", type=int, default=2, help="rounds of the two loops, in alternating order (medians "
                   "are compared)")
    b.add_argument("--seq", type=int, default=128, help="tokens per sample (spec.dataset.sequenceLength)")
    b.add_argument("--batch", type=int, default=8, help="samples per step and rank (spec.training.batchSize)")
    b.add_argument("--hidden", type=int, default=256, help="the speed model's width (4 heads, vocabulary 2048)")
    b.add_argument("--layers", type=int, default=4, help="the speed model's decoder layers")
    b.add_argument("--load-hidden", type=int, default=1024,
                   help="the width of the model loaded and exported (8 heads, vocabulary 8192)")
    b.add_argument("--load-layers", type=int, default=4, help="its decoder layers (4: 84M parameters)")
    b.add_argument("--keep", help="keep the models, runs and exports here (default: a temporary directory)")
    b.add_argument("--out", help="also write the JSON here")
