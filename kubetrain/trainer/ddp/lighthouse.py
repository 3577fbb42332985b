"""`python -m kubetrain.trainer lighthouse`: a fault-tolerant DDP job's Lighthouse (torchft's quorum server).

One per job (spec.ddp.faultTolerance): the replica groups heartbeat it and ask it, before every step,
which groups take part (ft.py). It runs torchft's own server (`LighthouseServer`, the Rust code behind
the wheel's `torchft_lighthouse` binary) with the job's timings, on the replica's listen address, and
serves the replica's /metrics beside it. It keeps no state worth a checkpoint: a replacement learns
the groups again from their next heartbeats and quorum requests.

torchft's extension module is loaded without the `torchft` package, whose import pulls in torch
(3.9 s on this machine, against 1.3 ms for the module alone): a lost Lighthouse is back in well under
a heartbeat timeout once its process starts.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
import time
from pathlib import Path
from typing import Any

from kubetrain.shared.launch import FT_LIGHTHOUSE_PORT_VAR

from ..context import ReplicaContext
from ..errors import EXIT_TERMINATED, ConfigError
from ..events import EventLog, startup
from ..metrics import TrainerMetrics

log = logging.getLogger(__name__)

QUORUM_TICK_MS = 100
"""How often the Lighthouse looks again at a quorum it waits for (torchft's default): a group that joins
waits at most this long past the moment the quorum could form."""
STOP_POLL_SECONDS = 0.2
"""How often the process looks at its SIGTERM flag: the stop takes at most this long."""


def lighthouse_module() -> Any:
    """torchft's extension module (`torchft._torchft`), loaded from the installed wheel without torch."""
    spec = importlib.util.find_spec("torchft")
    if spec is None or spec.origin is None:
        raise ConfigError("spec.ddp.faultTolerance needs torchft (the trainer image has it); it is not installed")
    found = sorted(Path(spec.origin).parent.glob("_torchft*.so"))
    if not found:
        raise ConfigError(f"torchft at {Path(spec.origin).parent} has no _torchft extension module")
    os.environ.setdefault("RUST_LOG", "warn")  # not a line per quorum request (ft.quiet_torchft)
    loader = importlib.machinery.ExtensionFileLoader("torchft._torchft", str(found[0]))
    module_spec = importlib.util.spec_from_file_location("torchft._torchft", found[0], loader=loader)
    assert module_spec is not None
    module = importlib.util.module_from_spec(module_spec)
    loader.exec_module(module)
    return module


def run_lighthouse(ctx: ReplicaContext) -> int:
    """Serve the quorum until SIGTERM; exits 143 then (the job's end, a suspend, a deletion)."""
    ddp = ctx.spec.ddp
    if ddp is None or ddp.fault_tolerance is None:
        raise ConfigError("spec.ddp.faultTolerance: a Lighthouse serves fault-tolerant DDP jobs only")
    ft = ddp.fault_tolerance
    raw = os.environ.get(FT_LIGHTHOUSE_PORT_VAR, "")
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise ConfigError(f"{FT_LIGHTHOUSE_PORT_VAR}: expected a port, got {raw!r}")
    metrics = TrainerMetrics(ctx)
    metrics.process_starts_total.inc()
    metrics.serve(ctx.metrics_port, ctx.listen_address)
    events = EventLog(ctx.run_dir, ctx.replica)
    bind = f"{ctx.listen_address}:{raw}" if ":" not in ctx.listen_address else f"[{ctx.listen_address}]:{raw}"
    server = lighthouse_module().LighthouseServer(
        bind=bind,
        min_replicas=ft.min_replicas,
        join_timeout_ms=int(ft.join_timeout_seconds * 1000),
        quorum_tick_ms=QUORUM_TICK_MS,
        heartbeat_timeout_ms=int(ft.heartbeat_timeout_seconds * 1000),
    )
    startup("serving", role="lighthouse")
    events.write("start", step=0, pid=os.getpid(), bind=bind, min_replicas=ft.min_replicas,
                 heartbeat_timeout_seconds=ft.heartbeat_timeout_seconds)
    log.info("%s: Lighthouse on %s (minReplicas %d, heartbeat timeout %.2f s)", ctx.replica, bind,
             ft.min_replicas, ft.heartbeat_timeout_seconds)
    try:
        while not ctx.stop_requested:
            time.sleep(STOP_POLL_SECONDS)
    finally:
        server.shutdown()
        events.write("stop", step=0)
        metrics.close()
        events.close()
    return EXIT_TERMINATED
