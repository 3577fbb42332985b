"""kubetrain's contract for your own training code: four calls, and the job does the rest.

A script run by a TrainingJob with `spec.script` (locally with `kubetrain run
job.yaml`, in a cluster with `kubectl apply`) calls::

    import kubetrain

    state, step = kubetrain.restore()          # (None, 0) on the first start
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    for step in range(step + 1, total + 1):
        loss = train_one_batch(step)
        kubetrain.report(step, total_steps=total, loss=loss)   # progress, metrics, status
        if step % 100 == 0 or step == total:
            kubetrain.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, step)

kubetrain restarts the process when it fails (the job's restartPolicy), and
`restore()` hands it the newest valid checkpoint. In mode DDP the script runs
once per rank with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT): call `restore()` after
`torch.distributed.init_process_group()` so that every rank gets the same
checkpoint; every rank may call `save()`, rank 0 writes. A sharded model
(FSDP2) saves its DTensors from every rank and restores into a template:
see `save` and `restore`, and docs/custom-code.md#sharded-models.

`kubetrain.Client` drives jobs from Python (a notebook, a script): create,
wait with a progress bar, logs, export, reports, in a cluster or on this
machine (docs/client.md); `kubetrain.client` holds its types and errors. It is
imported on first use, so the four calls of a training script never load the
Kubernetes client.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .shared import __version__  # noqa: F401

__all__ = ["restore", "save", "report", "checkpoint_dir", "fault_tolerant", "Client"]


def __getattr__(name: str) -> Any:
    if name == "Client":
        from .client import Client

        return Client
    raise AttributeError(f"module 'kubetrain' has no attribute {name!r}")


def restore(template: dict[str, Any] | None = None) -> tuple[Any, int]:
    """(state, step) of the newest valid checkpoint of this job; (None, 0) when there is none.

    Checkpoints are verified (length and sha256 of every file); a damaged newest
    one is set aside and the previous one returned. In a DDP job every rank gets
    the same step.

    `template`: a state of the structure saved, loaded in place and returned.
    A sharded model (FSDP2, tensor parallel) must pass one: build and shard the
    model and optimizer first, then
    `kubetrain.restore({"model": msd, "optimizer": osd})` with
    `msd, osd = get_state_dict(model, optimizer)`
    (torch.distributed.checkpoint.state_dict), and give them back with
    `set_state_dict`. Each rank reads only its own pieces of a sharded
    checkpoint, resharded to the current world size (a checkpoint of 2 ranks
    restores into 1 or 4); a plain (whole) checkpoint fills a sharded template
    too. Restoring a sharded checkpoint without a template is an error that
    says so. With a template every rank must call it (it is collective).
    """
    from kubetrain.trainer.userapi import session

    return session().restore(template)


def save(state: dict[str, Any], step: int, wait: bool = False) -> None:
    """Checkpoint `state` as step `step`: copied now, written, verified and made durable in the background.

    It returns once `state` is copied into memory (later in-place changes of
    your tensors or lists do not reach the file); the file is written
    atomically, read back and checked in a background thread, and only then
    does the job report it. At most one write is in flight: a `save` while the
    previous one is still being written waits for it, and raises the previous
    one's failure. The process waits for the last write at a normal exit (and
    exits with 75, retried, if it failed); `wait=True` makes this call return
    only once the checkpoint is durable (before `os._exit`, or to copy the file).

    `state` is a dict of tensors and plain values (numbers, strings, lists and
    dicts of them), what `torch.load(weights_only=True)` reads back: save a
    model's or an optimizer's `state_dict()`, not the object. The job's
    `checkpoint.keepLast` newest checkpoints are kept. In a DDP job every rank
    may call it and rank 0 alone writes.

    A sharded state (its tensors DTensors: `get_state_dict(model, optimizer)`
    of an FSDP2 or tensor-parallel model) is collective: every rank must call
    `save`, and each writes only its own shards, in parallel, through
    torch.distributed.checkpoint; no rank gathers the whole model. The
    checkpoint exists once every rank's files are durable and verified and
    rank 0 has committed them; only then is it reported. Every rank must read
    the same directory: in a cluster a DDP job of several nodes needs
    `checkpoint.storage.accessMode: ReadWriteMany`.
    """
    from kubetrain.trainer.userapi import session

    session().save(state, step, wait)


def report(step: int, total_steps: int | None = None, **metrics: float) -> None:
    """This process reached `step` (of `total_steps`); `metrics` are its numbers at that step.

    They become the job's progress (the local progress line and summary.json,
    `status.progress` in a cluster), Prometheus metrics (`kubetrain_training_step`,
    `kubetrain_steps_per_second`, `kubetrain_loss` for `loss`, and
    `kubetrain_reported_metric{name=...}` for the others) and the final results.
    Values are numbers or one-element tensors. Cheap enough to call every step.
    """
    from kubetrain.trainer.userapi import session

    session().report(step, total_steps, metrics)


def checkpoint_dir() -> Path:
    """The job's durable directory (on the checkpoint volume in a cluster, in the run directory locally).

    For files of your own beside kubetrain's checkpoints; the environment
    variable KUBETRAIN_CHECKPOINT_DIR holds the same path.
    """
    from kubetrain.trainer.userapi import checkpoint_dir as _checkpoint_dir

    return _checkpoint_dir()


def fault_tolerant(model: Any, optimizer: Any, state: Any = None, load_state: Any = None, *,
                   samples: int | None = None, batch_size: int | None = None, epochs: int | None = None,
                   max_steps: int | None = None, seed: int = 0) -> Any:
    """A DDP script's model and optimizer in a fault-tolerant replica group (spec.ddp.faultTolerance, torchft).

    Each node of the job is a replica group: when one dies, the others train on at their next step
    and its replacement copies the model and optimizer from a live group. Call it once, after building
    the model and the optimizer (and `torch.distributed.init_process_group()` if you use it; it is
    called for you when the group has several ranks); it restores this group's newest checkpoint when
    every group starts from scratch, or heals from a live group: do not call `restore()` as well.
    `state()` and `load_state(state)`: anything else of yours a peer or a checkpoint must carry (plain
    values, as for `save`). Then, every step::

        ft = kubetrain.fault_tolerant(model, optimizer)
        while ft.step < total:
            ft.zero_grad()                      # the step's quorum starts; gradients set to none
            x, y = batch(ft.step)               # this group's batch of that step
            loss = loss_fn(model(x), y)
            loss.backward()
            if ft.commit(loss):                 # averaged across groups; False: discarded, train it again
                kubetrain.report(ft.step, total_steps=total, loss=ft.loss)
                if ft.step % 100 == 0:
                    ft.save()                   # this group's checkpoint, for the loss of every group

    The model is the plain module (no DistributedDataParallel: the gradients are averaged by `commit`).

    With `samples` (your dataset's length), `batch_size` (each rank's) and `epochs` (or `max_steps`: the
    samples of that many steps of every group, ddp.nodes x procsPerNode x batch_size each), the data follows the
    quorum: `ft.indices()` gives this rank's samples of the step, dealt among the ranks of the groups that
    train it; a discarded step's samples are dealt again, so every sample of an epoch is trained exactly
    once whatever the faults (the epoch takes more steps while a group is missing). The cursor is committed
    with the model (heals and checkpoints carry it)::

        ft = kubetrain.fault_tolerant(model, optimizer, samples=len(data), batch_size=32, epochs=10)
        while not ft.done:
            ft.zero_grad()
            idx = ft.indices()                  # empty for a spare group: leave the gradients unset
            loss = loss_fn(model(x[idx]), y[idx]) if len(idx) else None
            if loss is not None:
                loss.backward()
            ft.commit(loss)

    See docs/custom-code.md#fault-tolerant-scripts.
    """
    from kubetrain.trainer.ddp.ft import FaultTolerance

    return FaultTolerance(model, optimizer, state, load_state, samples=samples, batch_size=batch_size,
                          epochs=epochs, max_steps=max_steps, seed=seed)
