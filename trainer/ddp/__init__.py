"""The DDP runtime: torchrun groups that train data-parallel and resume from kubetrain's checkpoints.

`kubetrain_contract.launch.torchrun_command` (standard library only, the
launch contract the plan and the trainer share) builds a node's torchrun argv;
`run_ddp` is what every rank runs under it
(`python -m kubetrain_trainer ddp`). torch is imported only by `run_ddp`, so
the control plane can import this package without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..context import ReplicaContext

__all__ = ["run_ddp"]


def run_ddp(ctx: "ReplicaContext") -> int:
    """Train as one rank of the torchrun group; returns the exit code (see runtime.run_ddp)."""
    from .runtime import run_ddp as run

    return run(ctx)
