"""`python -m kubetrain_trainer.ddp.agent TORCHRUN-ARGS`: torchrun, fixed for restarts, with a rank's exit code.

Two things torchrun alone gets wrong for kubetrain:

- Restarts. Since torch 2.5 the c10d rendezvous shares its agent's TCPStore
  with the ranks, and that store outlives a group restart: a restarted rank
  can read the address a dead rank published in the previous attempt, and
  gloo's connectFullMesh (or NCCL's unique id exchange) fails with
  "Connection refused" (pytorch/pytorch#135712, #167288; seen here in the
  fault tests). TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives every attempt a
  fresh store hosted by its rank 0.
- Exit codes. torchrun exits 1 whatever its ranks said. A supervisor needs
  the rank's own code: 2 and 3 are permanent, 75 and 128+N are retried. The
  agent exits with the first failed rank's code (a rank killed by signal N as
  128+N), and with 128+N itself when it is stopped by signal N.
"""

import os
import sys


def host_conf(argv: list[str], environ: dict[str, str]) -> list[str]:
    """In a StatefulSet every pod runs one template: node 0 (pod ordinal 0, from
    KUBETRAIN_NODE_RANK) hosts the rendezvous store, the others connect to it."""
    rank = environ.get("KUBETRAIN_NODE_RANK")
    if rank is None or "--rdzv-conf" in argv:
        return argv
    return ["--rdzv-conf", f"is_host={'true' if rank == '0' else 'false'}", *argv]


def main(argv: list[str] | None = None) -> int:
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    argv = host_conf(list(sys.argv[1:] if argv is None else argv), dict(os.environ))
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except ChildFailedError as err:
        _, failure = err.get_first_failure()
        return 128 - failure.exitcode if failure.exitcode < 0 else failure.exitcode
    except SignalException as err:
        return 128 + int(err.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
