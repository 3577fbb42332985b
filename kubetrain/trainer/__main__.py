"""`python -m kubetrain.trainer ROLE`: the one command every replica runs, locally and in pods.

It reads the replica's context from the environment, turns SIGTERM into a
checkpoint-and-stop request, runs the role, and turns a TrainerError into its
exit code with a one-line message on stderr (no traceback: the message names
the field or file to fix).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable

from .context import ReplicaContext
from .errors import TrainerError
from .events import startup
from .exiting import exit_now

PROG = "python -m kubetrain.trainer"

# Each role is a function `run_*(ctx) -> int` of the module that implements it,
# imported only when chosen, so a Single replica never loads gRPC, a PS replica
# never loads DDP and a script's supervisor never loads torch; importing it is
# the `imports` start-up milestone.
ROLES = {
    "single": "kubetrain.trainer.single:run_single",
    "ps": "kubetrain.trainer.ps.serve:run_ps",
    "worker": "kubetrain.trainer.ps.worker:run_worker",
    "standby": "kubetrain.trainer.ps.worker:run_standby",  # a standby worker (ps/standby.py)
    "ddp": "kubetrain.trainer.ddp.entry:run_ddp",
    "script": "kubetrain.trainer.script:run_script",  # the user's own command (spec.script)
    "lighthouse": "kubetrain.trainer.ddp.lighthouse:run_lighthouse",  # a fault-tolerant DDP job's quorum
    "initializer": "kubetrain.trainer.pretrained:run_initializer",  # spec.model.pretrained, before training
}


def runner(role: str) -> Callable[[ReplicaContext], int]:
    module, _, name = ROLES[role].partition(":")
    return getattr(importlib.import_module(module), name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description="Run one replica of a TrainingJob.")
    parser.add_argument("role", choices=sorted(ROLES), help="the replica's role")
    args = parser.parse_args(argv)
    startup("main", role=args.role)  # the interpreter and kubetrain's own light imports
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        ctx = ReplicaContext.from_env(args.role)
        ctx.install_signal_handlers()
        run = runner(args.role)
        startup("imports")  # the role's modules (torch, grpc)
        return run(ctx)
    except TrainerError as err:
        print(f"{PROG} {args.role}: error: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    exit_now(main())  # no interpreter teardown: it would delay a recovery by seconds (kubetrain/trainer/exiting.py)
