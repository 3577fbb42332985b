"""`kubetrain bench`: benchmarks that print JSON with ratios measured in one run.

The benchmarks are development tools, not part of the product: the operator
and the trainer never import them (pyproject.toml's import contracts), and
the images leave this package out. `kubetrain bench BENCH` (kubetrain.cli)
calls `run_bench`, which loads only the benchmark asked for:

- `modes` (modes.py): Single, PS Sync, PS Async and DDP on the same work,
  through the local backend;
- `compression` (compression.py): push and pull bytes per step and accuracy
  of every compression algorithm;
- `ft` (ft.py): fault-tolerant DDP under node kills against plain DDP;
- `transport` (transport.py): the parameter-server transport against a raw
  loopback socket, and over mutual TLS against plaintext;
- `contract` (contract.py, script.py): what kubetrain.report and
  kubetrain.save cost a user's script;
- `checkpoint` (checkpoint.py, sharded.py, objstore.py): what a background checkpoint
  costs the training loop against a synchronous one, or a sharded one, on disk or in
  object storage (`--to s3://...`, with the upload against a plain PUT);
- `data` (objstore.py): the data loader on s3:// shards against the same shards on disk.
- `finetune` (finetune.py): the built-in causal-LM fine-tuning loop against a hand-written FSDP2 loop,
  the memory of loading a pretrained model sharded, and the Hugging Face export.

transport, contract and checkpoint import torch at module level: they are
loaded inside `run_bench`, so that the others run without it.
"""

from __future__ import annotations

import argparse
import re
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]+)\s*([KMG]i?B|B)?\s*", text)
    if not m or int(m[1]) <= 0:
        raise ValueError(f"--bytes {text!r}: expected a size such as 64MiB")
    return int(m[1]) * UNITS[m[2] or ""]


def _bench_transport(args: argparse.Namespace) -> dict[str, Any]:
    from kubetrain.engine.certificates import job_certificates
    from kubetrain.drivers.local.runner import save_certificates

    try:
        from .transport import bench_transport
    except ImportError as err:
        raise SystemExit(f"kubetrain bench transport needs the trainer's dependencies (torch, grpcio): {err}")
    # The same transport over mutual TLS in the same rounds (tls_push_ratio, tls_pull_ratio), with
    # certificates made as for a job; the shards of kubetrain's own jobs always speak it.
    with tempfile.TemporaryDirectory(prefix="kubetrain-bench-tls-") as tmp:
        files = job_certificates("bench", "default", [], datetime.now(timezone.utc))
        return bench_transport(parse_bytes(args.bytes), tls_dir=save_certificates(Path(tmp) / "tls", files))


def _bench_contract(args: argparse.Namespace) -> dict[str, Any]:
    try:
        from .script_calls import bench_report, bench_save
    except ImportError as err:
        raise SystemExit(f"kubetrain bench contract needs the trainer's dependencies (torch): {err}")
    if args.rounds < 1 or args.steps < 1 or args.save_mib < 1:
        raise ValueError("--rounds, --steps and --save-mib must be at least 1")
    return {"benchmark": "contract", "report": bench_report(args.rounds, args.steps),
            "save": bench_save(args.save_mib, args.rounds)}


def _bench_compression(args: argparse.Namespace) -> dict[str, Any]:
    from .compression import bench_compression

    return bench_compression(args.manifest, [a for a in args.algorithms.split(",") if a], args.ratio, args.rank,
                             args.min_tensor_bytes)


def _bench_ft(args: argparse.Namespace) -> dict[str, Any]:
    from .ft import bench_ft

    return bench_ft(args.steps, args.groups, args.kill_every, args.model_hidden, args.heartbeat, args.slowdown,
                    args.rounds, args.keep)


def _bench_checkpoint(args: argparse.Namespace) -> dict[str, Any]:
    try:
        from .checkpoint import bench_checkpoint
        from .sharded import bench_sharded
    except ImportError as err:
        raise SystemExit(f"kubetrain bench checkpoint needs the trainer's dependencies (torch): {err}")
    if args.to:
        from .objstore import bench_checkpoint_to, bench_sharded_to

        return bench_sharded_to(args.to, args.gib) if args.sharded else bench_checkpoint_to(args.to, args.model_mb,
                                                                                           args.rounds)
    if args.sharded:
        return bench_sharded(args.gib, args.dir)
    return bench_checkpoint(args.model_mb, args.steps, args.every, args.rounds, args.dir)


def _bench_data(args: argparse.Namespace) -> dict[str, Any]:
    try:
        from .objstore import bench_data
    except ImportError as err:
        raise SystemExit(f"kubetrain bench data needs the trainer's dependencies (torch): {err}")
    if args.batch < 1 or args.make < 0 or args.rows < 1 or args.features < 1:
        raise ValueError("--batch, --rows and --features must be at least 1, --make at least 0")
    return bench_data(args.source, args.batch, args.cache, args.make, args.rows, args.features)


def _bench_finetune(args: argparse.Namespace) -> dict[str, Any]:
    try:
        from .finetune import bench_finetune
    except ImportError as err:
        raise SystemExit(f"kubetrain bench finetune needs the trainer's dependencies (torch, transformers): {err}")
    return bench_finetune(args.steps, args.rounds, args.seq, args.batch, args.hidden, args.layers, args.load_hidden,
                          args.load_layers, args.keep)


def _bench_modes(args: argparse.Namespace) -> dict[str, Any]:
    from .modes import CASES, bench_modes

    modes = [m for m in args.modes.split(",") if m] if args.modes else None
    cases = list(CASES) if args.case == "all" else [args.case]
    return bench_modes(cases, args.epochs, args.batch, args.model_hidden, args.slow_factor, args.target, modes,
                       args.rounds)


def _bench_soak(args: argparse.Namespace) -> dict[str, Any]:
    from .soak import bench_soak

    return bench_soak(args.minutes, args.seed, args.keep)


BENCHES = {"transport": _bench_transport, "contract": _bench_contract, "compression": _bench_compression,
           "ft": _bench_ft, "checkpoint": _bench_checkpoint, "modes": _bench_modes, "data": _bench_data,
           "finetune": _bench_finetune, "soak": _bench_soak}


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    """The JSON of `kubetrain bench BENCH` (args.bench); ValueError names a bad argument."""
    return BENCHES[args.bench](args)
