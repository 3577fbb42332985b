"""`python -m kubetrain.trainer.ddp.agent TORCHRUN-ARGS`: torchrun, fixed for restarts, with a rank's exit code.

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

And one thing it makes slow: every rank of every attempt is a new interpreter
that imports torch again (1.5-3 s idle on the 2-core machine, several times
that under load), after the agent's own import and on the path of every
recovery. The built-in loop's ranks on CPUs are forked from the agent instead
(`fork_ranks`), with torch already imported. Ranks on GPUs (a CUDA context
does not survive a fork) and a user's command (the `script` role: it is the
user's process) are started as torchrun starts any command.
"""

import logging
import os
import signal
import sys

from kubetrain.shared.exitcodes import shell_code, signaled
from kubetrain.shared.launch import FT_STORE_VAR, JOB_FILE_VAR, NODE_RANK_VAR

from ..errors import first_line
from ..exiting import exit_now


def host_conf(argv: list[str], environ: dict[str, str]) -> list[str]:
    """In a StatefulSet every pod runs one template: node 0 (pod ordinal 0, from
    KUBETRAIN_NODE_RANK) hosts the rendezvous store, the others connect to it."""
    rank = environ.get(NODE_RANK_VAR)
    if rank is None or "--rdzv-conf" in argv:
        return argv
    return ["--rdzv-conf", f"is_host={'true' if rank == '0' else 'false'}", *argv]


# How often an agent waiting in the c10d rendezvous (for a replaced node to join, or for the
# others to notice it joined) reads the rendezvous state again. torch sleeps a fixed 1 s
# between reads, which cost a replaced rank 0.5-1 s on average at each of the waits of its
# re-formed group. A read is one small get from node 0's store: ten a second per waiting
# agent is nothing to it; much shorter only spins.
RENDEZVOUS_POLL_SECONDS = 0.1
_TORCH_POLL_SECONDS = 1  # dynamic_rendezvous' `_delay(seconds=1)` between two reads of the state


RDZV_SHUTDOWN_FAILED = "Error shutting down rendezvous handler"
"""torch's launcher logs this, with a traceback, when closing the rendezvous fails after the group ended (its
store gone or slow: a loaded machine); the agent's exit code is the failed rank's all the same."""


class OneLineShutdownError(logging.Filter):
    """A failed rendezvous shutdown as one line (its error's first line), not torch's traceback: it comes after
    the group's own outcome, which the pod's log already says, and a traceback there reads as the cause."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.getMessage().startswith(RDZV_SHUTDOWN_FAILED):
            error = record.exc_info[1]
            cause = f"{type(error).__name__}: {first_line(error)}" if error is not None else "?"
            record.msg, record.args = f"{RDZV_SHUTDOWN_FAILED}: {cause}", ()
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def quiet_rendezvous_shutdown() -> None:
    """Install OneLineShutdownError on torch's launcher logger (once)."""
    launcher = logging.getLogger("torch.distributed.launcher.api")
    if not any(isinstance(f, OneLineShutdownError) for f in launcher.filters):
        launcher.addFilter(OneLineShutdownError())


def poll_rendezvous_faster() -> None:
    """Make torch's c10d rendezvous read its state every RENDEZVOUS_POLL_SECONDS instead of 1 s.

    Only that poll changes: the random delays (tuples: the first join's skew, the
    backoff after a lost write) stay as torch has them. Where torch has no such
    hook any more, nothing changes.
    """
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    original = getattr(dynamic_rendezvous, "_delay", None)
    if original is None or getattr(original, "kubetrain_poll", False):
        return

    def delay(seconds):
        original(seconds=RENDEZVOUS_POLL_SECONDS if seconds == _TORCH_POLL_SECONDS else seconds)

    delay.kubetrain_poll = True  # type: ignore[attr-defined]  # a marker on our patch of torchrun
    dynamic_rendezvous._delay = delay


# The argv tail (after the interpreter and its `-u`) of a rank that runs the built-in loop.
FORKED_COMMAND = ("-m", "kubetrain.trainer", "ddp")

# The signals torch elastic's agent turns into SignalException (its default `signals_to_handle`).
AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def forked_rank(role: str) -> None:
    """One rank, forked from the agent: what `python -u -m kubetrain.trainer ROLE` runs, minus the new
    interpreter and its imports.

    The agent's signal handlers and log handlers are not the rank's: they are reset to what a new
    interpreter has, and the trainer installs its own. A non-zero exit code leaves as SystemExit,
    which multiprocessing turns into the process's exit code, so the agent reads it as it reads a
    command's.
    """
    for sig in AGENT_SIGNALS:
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    for handler in list(logging.root.handlers):
        logging.root.removeHandler(handler)
    logging.root.setLevel(logging.WARNING)
    from ..__main__ import main as trainer_main

    code = trainer_main([role])
    if code:
        raise SystemExit(code)


def ranks_on_cpu(environ: dict[str, str]) -> bool:
    """Whether the job's ranks train on CPUs only: gloo, and `spec.training.device` cpu, or auto with no
    GPU visible. Only then are they forked: a CUDA context does not survive a fork, and torch elastic
    spawns ranks for a GPU anyway. `torch.cuda.device_count` asks NVML, which leaves CUDA untouched
    in the agent. A job file that does not load is not this function's to report: no fork, and the
    rank says what is wrong."""
    try:
        from kubetrain.api import load_one

        spec = load_one(environ[JOB_FILE_VAR]).spec
    except Exception:  # noqa: BLE001 - see the docstring
        return False
    if spec.ddp is None or spec.ddp.backend != "gloo":
        return False
    if spec.require_training().device == "cpu":
        return True
    import torch

    return spec.require_training().device == "auto" and torch.cuda.device_count() == 0


def fork_ranks() -> None:
    """Make torchrun fork the built-in loop's ranks from this process instead of starting interpreters.

    torchrun hands `elastic_launch` the interpreter and its arguments; for the built-in loop's
    command the launch gets `forked_rank` with the start method `fork` instead (torch elastic's
    own path for a function entry point). Any other command is launched unchanged. Where torch
    has no such hook any more, nothing changes.
    """
    from torch.distributed import run

    original = getattr(run, "elastic_launch", None)
    if original is None or getattr(original, "kubetrain_fork", False):
        return

    def launch(config, entrypoint):
        def call(*args):
            if entrypoint == sys.executable and tuple(args[-len(FORKED_COMMAND):]) == FORKED_COMMAND:
                config.start_method = "fork"
                return original(config, forked_rank)(FORKED_COMMAND[-1])
            return original(config, entrypoint)(*args)
        return call

    launch.kubetrain_fork = True  # type: ignore[attr-defined]  # a marker on our patch of torchrun
    run.elastic_launch = launch  # type: ignore[assignment, misc]  # torchrun's function, patched (docstring)


def stop_on_permanent_failures() -> None:
    """Make the agent give up at once when a rank exits 2 or 3 (a permanent failure) instead of restarting it.

    torchrun restarts a failed group up to `--max-restarts` whatever the
    rank's exit code; a bad configuration (a sharded save on a volume per
    node, a model that does not load) then failed the same way maxRestarts
    more times, each after the group's rendezvous and the ranks' imports,
    before the pod said so. A failed group whose ranks include a permanent
    code now has no restart left; the agent exits with that code. Where torch
    has no such hook any more, nothing changes.
    """
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from ..errors import EXIT_CONFIG, EXIT_LOAD

    original = getattr(LocalElasticAgent, "_monitor_workers", None)
    if original is None or getattr(original, "kubetrain_permanent", False):
        return

    def monitor(self, worker_group):
        result = original(self, worker_group)
        failures = getattr(result, "failures", None) or {}
        if result.state == WorkerState.FAILED and any(f.exitcode in (EXIT_CONFIG, EXIT_LOAD)
                                                      for f in failures.values()):
            self._remaining_restarts = 0
        return result

    monitor.kubetrain_permanent = True  # type: ignore[attr-defined]  # a marker on our patch of torchrun
    LocalElasticAgent._monitor_workers = monitor  # type: ignore[method-assign]  # torchrun's method, patched (docstring)


def main(argv: list[str] | None = None) -> int:
    from ..events import startup

    startup("main", role="agent")
    if FT_STORE_VAR not in os.environ:
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    # else a fault-tolerant replica group: its ranks and torchft (the other groups too, through
    # KUBETRAIN_FT_STORE) share the agent's store, which lives as long as the node, and torchrun
    # restarts nothing there (--max-restarts 0), so no attempt reads an older one's keys.
    argv = host_conf(list(sys.argv[1:] if argv is None else argv), dict(os.environ))
    # The agent's own rendezvous and restarts at INFO, timed (torch.distributed.elastic reads
    # LOGLEVEL when its modules are imported): how a group re-formed after a rank's loss shows in
    # the pod's log. The ranks, started later, do not inherit it.
    quiet = "LOGLEVEL" not in os.environ
    if quiet:
        os.environ["LOGLEVEL"] = "INFO"
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    from ..preload import preload

    if quiet:
        del os.environ["LOGLEVEL"]
    poll_rendezvous_faster()
    stop_on_permanent_failures()
    quiet_rendezvous_shutdown()
    if tuple(argv[-len(FORKED_COMMAND):]) == FORKED_COMMAND and ranks_on_cpu(dict(os.environ)):
        fork_ranks()
        # torch._dynamo, which every rank imports, imported beside the rendezvous: a forked rank
        # inherits it, and a rank a surviving agent restarts gets it free (kubetrain/trainer/preload.py).
        preload(before_fork=True)

    # What follows, up to the ranks' own `process`: torchrun's rendezvous of the nodes.
    startup("imports", role="agent")

    try:
        torchrun(argv)
    except ChildFailedError as err:
        _, failure = err.get_first_failure()
        return shell_code(failure.exitcode)
    except SignalException as err:
        return signaled(err.sigval)
    return 0


if __name__ == "__main__":
    exit_now(main())  # no interpreter teardown: it would delay a recovery by seconds (kubetrain/trainer/exiting.py)
