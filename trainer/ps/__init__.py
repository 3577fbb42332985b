"""The parameter-server runtime (spec.mode: ParameterServer): shards, workers, coordinator, transport."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..context import ReplicaContext


# Imported on call, so `python -m kubetrain_trainer.ps.codegen` does not load torch.
def run_ps(ctx: ReplicaContext) -> int:
    """The `ps` role: serve one shard until every worker finished (0) or SIGTERM (143)."""
    from .serve import run_ps as run

    return run(ctx)


def run_worker(ctx: ReplicaContext) -> int:
    """The `worker` role: train until the job's steps are done (0) or SIGTERM (143)."""
    from .worker import run_worker as run

    return run(ctx)


__all__ = ["run_ps", "run_worker"]
