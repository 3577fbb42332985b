"""Hugging Face `transformers.Trainer` as a kubetrain script job: progress, checkpoints and resume, one callback.

    from kubetrain.integrations.hf import KubetrainCallback
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[KubetrainCallback()])
    trainer.train()

- Every logging step (`logging_steps`) goes to `kubetrain.report`: the job's
  progress, its ETA and its metrics (`loss`, `learning_rate`, `grad_norm`, ...).
- Every save step (`save_steps`) saves the model's state_dict, the
  optimizer's, the learning-rate scheduler's, the Trainer's state and its RNG
  state through `kubetrain.save`: the job's checkpoint, written in the
  background, verified, kept on the job's volume.
- On a restart (a killed pod, a failed node, `kubetrain run` again) the
  Trainer resumes from the newest kubetrain checkpoint as from one of its own:
  the callback lays that checkpoint out in the Trainer's format in a temporary
  directory and `trainer.train()` is called with it as
  `resume_from_checkpoint`, so the Trainer's own resume restores the model,
  optimizer, scheduler, RNG and step, and skips the batches already trained:
  the run continues as if it had not stopped. A `resume_from_checkpoint` the
  script passes itself wins.

A model sharded with FSDP2 (Accelerate's plugin: `TrainingArguments(fsdp=True,
fsdp_config={"version": 2, ...})`; DTensor parameters) takes kubetrain's
sharded path instead: every rank saves `get_state_dict(model, optimizer)`, its
own shards of the weights and of the optimizer's state, with the scheduler's
state, the Trainer's state and every rank's RNG file, and no rank gathers the
model. Its resume comes in two parts, because the Trainer reads its state
(the step, the batches to skip) before it shards the model: at `train()` the
callback restores only the Trainer's state and RNG files into the temporary
directory; once the Trainer has sharded the model and made the optimizer and
scheduler, where it would load them from that directory, this Trainer's own
`_load_from_checkpoint` and `_load_optimizer_and_scheduler` are replaced by a
second `kubetrain.restore` into a template of the sharded model and optimizer
(each rank reads only its pieces) and `set_state_dict`. So a resume verifies
the checkpoint's files twice and logs two `resume` events of the same step.

The callback must be given to the Trainer when it is made (`callbacks=[...]`),
so that it sees the Trainer at the end of its `__init__`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

import kubetrain

# The Trainer's checkpoint file names (transformers.trainer's constants; the format of its own checkpoints).
WEIGHTS = "pytorch_model.bin"
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"
SCALER = "scaler.pt"
TRAINER_STATE = "trainer_state.json"
RNG = "rng_state.pth"
FRAMES = 8
"""How far up the stack the callback looks for the Trainer whose __init__ calls its on_init_end: the
Trainer's __init__, CallbackHandler.on_init_end, call_event, then the callback; a few more for a subclass."""


class KubetrainCallback(TrainerCallback):
    """Reports, checkpoints and resumes a Trainer through kubetrain (module docstring)."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.restored_step = 0
        self._resume_dir: Path | None = None
        self._replaced: dict[str, Any] = {}

    # -- resume -------------------------------------------------------------------------------

    def on_init_end(self, args, state, control, **kwargs):
        trainer = _calling_trainer(self)
        if trainer is None:
            return control
        self.trainer = trainer
        train = trainer.train

        def train_resuming(resume_from_checkpoint=None, *rest, **kw):
            if resume_from_checkpoint in (None, False):
                resume_from_checkpoint = self._restore() or resume_from_checkpoint
            try:
                return train(resume_from_checkpoint, *rest, **kw)
            finally:
                self._cleanup()

        trainer.train = train_resuming  # this Trainer only; the class stays as it is
        return control

    def _restore(self) -> str | None:
        """The newest kubetrain checkpoint as a directory the Trainer resumes from; None when there is none."""
        assert self.trainer is not None
        if _trains_sharded(self.trainer):
            return self._restore_sharded_state()
        saved, step = kubetrain.restore()
        if saved is None:
            return None
        if not isinstance(saved, dict) or not {"model", "trainer_state"} <= saved.keys():
            keys = ", ".join(map(str, saved)) if isinstance(saved, dict) else type(saved).__name__
            raise RuntimeError(f"kubetrain checkpoint of step {step} was not written by KubetrainCallback "
                               f"(keys {keys}); it cannot resume a Trainer")
        where = Path(tempfile.mkdtemp(prefix=f"kubetrain-hf-{step}-"))
        torch.save(saved["model"], where / WEIGHTS)
        for key, name in (("optimizer", OPTIMIZER), ("scheduler", SCHEDULER), ("scaler", SCALER)):
            if saved.get(key) is not None:
                torch.save(saved[key], where / name)
        (where / TRAINER_STATE).write_text(saved["trainer_state"])
        for name, data in (saved.get("files") or {}).items():
            (where / name).write_bytes(data.numpy().tobytes())
        self.restored_step = step
        self._resume_dir = where
        print(f"kubetrain: resuming the Trainer from kubetrain's checkpoint of step {step}", file=sys.stderr)
        return str(where)

    def _restore_sharded_state(self) -> str | None:
        """A sharded run's resume, first part (every rank, before the Trainer shards the model): the Trainer's
        state and RNG files of the newest checkpoint in a temporary directory; the shards wait for the model."""
        assert self.trainer is not None
        saved, step = kubetrain.restore({"trainer_state": "", "files": []})
        if saved is None:
            return None
        where = Path(tempfile.mkdtemp(prefix=f"kubetrain-hf-{step}-"))
        (where / TRAINER_STATE).write_text(saved["trainer_state"])
        for name, data in saved["files"]:
            (where / Path(name).name).write_bytes(data)
        self.restored_step = step
        self._resume_dir = where
        self._replace_loaders(self.trainer, str(where))
        print(f"kubetrain: resuming the Trainer from kubetrain's checkpoint of step {step} (sharded)",
              file=sys.stderr)
        return str(where)

    def _replace_loaders(self, trainer: Trainer, where: str) -> None:
        """On this Trainer only: its loads from `where` become the load of the shards; any other directory is
        the Trainer's own business."""
        load_model = trainer._load_from_checkpoint
        load_optimizer = trainer._load_optimizer_and_scheduler

        def _load_from_checkpoint(resume_from_checkpoint, model=None):
            if resume_from_checkpoint != where:
                return load_model(resume_from_checkpoint, model)
            # Nothing yet: the model's shards come with the optimizer's, below. A model sharded when it was
            # loaded (tensor parallel) is loaded here before its optimizer exists, and the template needs both.
            return None

        def _load_optimizer_and_scheduler(checkpoint):
            if checkpoint != where:
                return load_optimizer(checkpoint)
            return self._load_shards(trainer)

        self._replaced = {"_load_from_checkpoint": _load_from_checkpoint,
                          "_load_optimizer_and_scheduler": _load_optimizer_and_scheduler}
        for name, method in self._replaced.items():
            setattr(trainer, name, method)

    def _load_shards(self, trainer: Trainer) -> None:
        """A sharded run's resume, second part (every rank, the model sharded, the optimizer and scheduler made):
        each rank reads its own pieces of the checkpoint into them."""
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model, optimizer = trainer.model, _unwrapped(trainer.optimizer)
        assert model is not None  # the Trainer made it before its first step
        model_sd, optim_sd = get_state_dict(model, optimizer)
        template: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd}
        if trainer.lr_scheduler is not None:
            template["scheduler"] = _copy(trainer.lr_scheduler.state_dict())
        scaler = _scaler(trainer)
        if scaler is not None:
            template["scaler"] = _copy(scaler.state_dict())
        saved, step = kubetrain.restore(template)
        if step != self.restored_step:
            # Both parts read the newest checkpoint, and nothing saves in between.
            raise RuntimeError(f"KubetrainCallback: the Trainer's state was restored from step "
                               f"{self.restored_step}, but its model and optimizer from step {step}")
        set_state_dict(model, optimizer, model_state_dict=saved["model"], optim_state_dict=saved["optimizer"])
        if trainer.lr_scheduler is not None:
            trainer.lr_scheduler.load_state_dict(saved["scheduler"])
        if scaler is not None:
            scaler.load_state_dict(saved["scaler"])

    def _cleanup(self) -> None:
        if self.trainer is not None:
            for name in self._replaced:
                self.trainer.__dict__.pop(name, None)  # the class's methods again
        self._replaced = {}
        if self._resume_dir is not None:
            shutil.rmtree(self._resume_dir, ignore_errors=True)
            self._resume_dir = None

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer is None:
            raise RuntimeError("KubetrainCallback must be passed to the Trainer when it is made "
                               "(Trainer(..., callbacks=[KubetrainCallback()])): added later it cannot resume it")
        return control

    # -- progress -----------------------------------------------------------------------------

    def on_log(self, args, state, control, logs=None, **kwargs):
        numbers = {k: float(v) for k, v in (logs or {}).items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        numbers.pop("epoch", None)  # not a metric of the step; the job's progress has its step
        # The Trainer's summary at the end (train_loss: the mean over this process's steps only, so not the
        # loss of the last step) stays a metric of its own name.
        kubetrain.report(state.global_step, total_steps=state.max_steps or None, **numbers)
        return control

    # -- checkpoints --------------------------------------------------------------------------

    def on_save(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if model is None:
            return control
        if any(_is_dtensor(p) for p in model.parameters()):
            self._save_sharded(args, state, model, optimizer, lr_scheduler)
            return control
        weights = model.state_dict()
        if any(_is_dtensor(t) for t in weights.values()):
            raise RuntimeError("KubetrainCallback: the model's state_dict holds DTensors but its parameters are "
                               "none, which it does not save; save get_state_dict(model, optimizer) with "
                               "kubetrain.save from every rank instead "
                               "(docs/custom-code.md#sharded-models-fsdp2-tensor-parallel)")
        saved: dict[str, Any] = {
            "model": weights,
            "trainer_state": json.dumps(dataclasses.asdict(state), sort_keys=True),
        }
        if optimizer is not None:
            saved["optimizer"] = optimizer.state_dict()
        if lr_scheduler is not None:
            saved["scheduler"] = lr_scheduler.state_dict()
        scaler = _scaler(self.trainer)
        if scaler is not None:
            saved["scaler"] = scaler.state_dict()
        # The RNG state the Trainer wrote beside its own checkpoint: python's and numpy's generators are no
        # tensors, so the file goes whole, as bytes.
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        files = {p.name: torch.frombuffer(bytearray(p.read_bytes()), dtype=torch.uint8)
                 for p in folder.glob("rng_state*.pth")}
        if files:
            saved["files"] = files
        kubetrain.save(saved, state.global_step)
        return control

    def _save_sharded(self, args, state, model, optimizer, lr_scheduler) -> None:
        """Every rank: its shards of the model and optimizer, through kubetrain's sharded path (collective)."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if optimizer is None:
            raise RuntimeError("KubetrainCallback: a sharded model is saved with its optimizer, and the Trainer "
                               "passed none to on_save")
        # Each rank's RNG file is its own (rng_state_<rank>.pth), read from where this rank wrote it; the
        # Trainer's state is rank 0's (only rank 0 records the stateful callbacks in it). A value that is no
        # DTensor is stored once for every rank, so every rank must hold all of them: gathered here.
        name = RNG if args.world_size <= 1 else f"rng_state_{args.process_index}.pth"
        path = Path(args.output_dir) / f"checkpoint-{state.global_step}" / name
        mine = ([name, path.read_bytes()] if path.is_file() else None,
                json.dumps(dataclasses.asdict(state), sort_keys=True))
        everyone: list[Any] = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        model_sd, optim_sd = get_state_dict(model, _unwrapped(optimizer))
        saved: dict[str, Any] = {
            "model": model_sd,
            "optimizer": optim_sd,
            "trainer_state": everyone[0][1],
            "files": sorted(file for file, _ in everyone if file is not None),
        }
        if lr_scheduler is not None:
            saved["scheduler"] = lr_scheduler.state_dict()
        scaler = _scaler(self.trainer)
        if scaler is not None:
            saved["scaler"] = scaler.state_dict()
        kubetrain.save(saved, state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self._cleanup()
        return control


def _is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor"


def _trains_sharded(trainer: Trainer) -> bool:
    """Whether this Trainer's model is or will be sharded (DTensors): FSDP2 shards it in `train()`, a model
    loaded sharded (tensor parallel) already is. Then its checkpoints take kubetrain's sharded path."""
    if getattr(trainer, "is_fsdp_enabled", False) and getattr(trainer.accelerator, "is_fsdp2", False):
        return True
    return trainer.model is not None and any(_is_dtensor(p) for p in trainer.model.parameters())


def _unwrapped(optimizer: Any) -> Any:
    """The torch optimizer inside Accelerate's wrapper: get_state_dict maps its parameters to the model's."""
    from accelerate.optimizer import AcceleratedOptimizer

    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _scaler(trainer: Trainer | None) -> Any:
    return getattr(getattr(trainer, "accelerator", None), "scaler", None)


def _copy(state: dict[str, Any]) -> dict[str, Any]:
    """A template of `state` that restoring fills without touching the lists the live object holds."""
    import copy

    return copy.deepcopy(state)


def _calling_trainer(callback: KubetrainCallback) -> Trainer | None:
    """The Trainer whose __init__ is calling on_init_end with this callback among its own."""
    frame: FrameType | None = sys._getframe(2)
    for _ in range(FRAMES):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer) and callback in getattr(owner.callback_handler, "callbacks", ()):
            return owner
        frame = frame.f_back
    return None
