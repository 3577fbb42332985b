"""torch._dynamo, imported off the path of a replica's (re)start.

torch._dynamo (with sympy and parts of the inductor, ~900 modules) takes 2.4 s
to import on an idle 2-core machine, several times that under load, and every
training process imports it: the optimizer's step imports it (to mark a graph
break for torch.compile), DDP's constructor imports it (to read a setting), and
so do the optimizer's constructor, state_dict, load_state_dict and zero_grad
(wrapped in `torch._disable_dynamo`) and torch's log formatter for a record
with a traceback. Measured in real pods: 2.3 s of a PS shard's restore, and the
largest part of a DDP rank's start after its rendezvous.

Three tools move it off the path, each where its process has time to spare:

- `without_dynamo_import` lets the optimizer's wrapped methods run without the
  import, so a shard restores its checkpoint without waiting for it;
- `optimizer_step` runs an optimizer's step without it while it is not loaded
  yet, so a restored shard's first updates do not wait for a preload still
  under way (1.3-1.5 s of a shard's recovery in real pods);
- `preload` imports it in a thread while the process waits for its peers (a
  shard for its workers to reconnect, a DDP agent in its rendezvous); whoever
  needs it next finds it loaded, or waits for the rest of the import on the
  module's own lock.

A preload imports only modules no other thread of the process imports at the
same moment through a cycle, so Python's import locks cannot deadlock: the DDP
agent's main thread runs the rendezvous (torch.distributed.elastic, loaded
before), a shard's threads serve gRPC calls. A fork waits for it
(`before_fork`): a child forked while another thread imports could start with
the import machinery's locks held.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

HEAVY_IMPORTS = ("torch._dynamo",)

# What torch wraps in `torch._disable_dynamo` and kubetrain's loops call: the optimizer's
# add_param_group (from its constructor), state_dict, load_state_dict and zero_grad.
DYNAMO_DISABLED = ((torch.optim.Optimizer, ("add_param_group", "state_dict", "load_state_dict", "zero_grad")),)
# The code of the wrapper `torch._disable_dynamo` makes (functools.wraps gives the wrapper the
# wrapped function's names, not its code).
_DISABLE_DYNAMO_CODE = getattr(getattr(torch, "_disable_dynamo", lambda fn: fn)(lambda: None), "__code__", None)


def without_dynamo_import() -> None:
    """Let the functions of DYNAMO_DISABLED run without importing torch._dynamo first.

    `torch._disable_dynamo` imports torch._dynamo at a wrapped function's first
    call only to mark it "not to be traced" by torch.compile, and keeps the
    marked function on the original as `__dynamo_disable`. kubetrain's loops
    never compile, so the original itself is given as its marked version: the
    cache the first call would fill, filled with the function. Where
    torch._dynamo is loaded already, nothing changes. What this gives up: a
    compiled function calling one of these would trace into it rather than
    around it (no built-in loop compiles).
    """
    if "torch._dynamo" in sys.modules:
        return
    for owner, names in DYNAMO_DISABLED:
        for name in names:
            wrapper = getattr(owner, name, None)
            while wrapper is not None:
                inner = getattr(wrapper, "__wrapped__", None)
                if getattr(wrapper, "__code__", None) is _DISABLE_DYNAMO_CODE and inner is not None:
                    if getattr(inner, "__dynamo_disable", None) is None:
                        inner.__dynamo_disable = inner
                    break
                wrapper = inner


def loaded(name: str) -> bool:
    """Whether `import name` returns at once: imported, and not still being imported by another thread
    (importlib marks a module's spec `_initializing` until its import ends, and makes an importer wait)."""
    module = sys.modules.get(name)
    return module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False)


def _inner_step(optimizer: torch.optim.Optimizer) -> Callable[[torch.optim.Optimizer], object] | None:
    """The optimizer class's own step, under torch's two wrappers: the profiler's and hooks' one, and
    `_use_grad_for_differentiable`, which sets the grad mode and marks graph breaks for torch.compile
    (importing torch._dynamo for them). None where the step is not wrapped that way (another torch)."""
    fn: Any = type(optimizer).step
    while fn is not None:
        inner = getattr(fn, "__wrapped__", None)
        if getattr(getattr(fn, "__code__", None), "co_name", None) == "_use_grad":
            return inner
        fn = inner
    return None


def optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """`optimizer.step()`, without importing torch._dynamo while it is not loaded yet.

    torch's wrappers of `step` import torch._dynamo at every call to mark a
    graph break for torch.compile, and run the step without grad (for an
    optimizer that is not `differentiable`), between the step hooks. While
    torch._dynamo is not loaded (a preload under way), the step runs as those
    wrappers would, without grad, minus the marks (no built-in loop
    compiles) and the profiler's label; with a hook registered, a
    differentiable optimizer, or torch._dynamo loaded, it is the ordinary
    call. The update is the same either way (tests/trainer/test_preload.py).
    """
    inner = None
    if not loaded("torch._dynamo") and not optimizer.defaults.get("differentiable", False) and not _hooked(optimizer):
        inner = _inner_step(optimizer)
    if inner is None:
        optimizer.step()
        return
    with torch.no_grad():
        inner(optimizer)


def _hooked(optimizer: torch.optim.Optimizer) -> bool:
    module = sys.modules.get("torch.optim.optimizer")
    return bool(
        getattr(optimizer, "_optimizer_step_pre_hooks", None) or getattr(optimizer, "_optimizer_step_post_hooks", None)
        or getattr(module, "_global_optimizer_pre_hooks", None) or getattr(module, "_global_optimizer_post_hooks", None)
    )


def preload(*, before_fork: bool = False) -> threading.Thread:
    """Import HEAVY_IMPORTS in a daemon thread; with `before_fork`, every later fork of this
    process waits for it first (os.register_at_fork's `before` runs in the forking thread)."""

    def load() -> None:
        for name in HEAVY_IMPORTS:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - an optimisation only: whoever needs it imports it again
                log.warning("preloading %s failed", name, exc_info=True)

    thread = threading.Thread(target=load, name="preload", daemon=True)
    thread.start()
    if before_fork:
        os.register_at_fork(before=thread.join)
    return thread
