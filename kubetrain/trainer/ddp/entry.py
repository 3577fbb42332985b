"""What every DDP rank runs (`python -m kubetrain.trainer ddp`): one rank of a torchrun group
(`runtime.run_group_rank`), or, for a job with spec.ddp.faultTolerance, one rank of a replica group of its
own (`ft.run_replica_group`, torchft). Each is imported only when chosen."""

from __future__ import annotations

from ..context import ReplicaContext


def run_ddp(ctx: ReplicaContext) -> int:
    """Train as one DDP rank; returns the exit code (each runner's docstring says which)."""
    if ctx.spec.fault_tolerant:
        from .ft import run_replica_group

        return run_replica_group(ctx)
    from .runtime import run_group_rank

    return run_group_rank(ctx)
