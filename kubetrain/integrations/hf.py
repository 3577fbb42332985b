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

The callback must be given to the Trainer when it is made (`callbacks=[...]`),
so that it sees the Trainer at the end of its `__init__`. A model sharded
with FSDP2 or tensor parallelism (DTensor parameters) is not covered yet: it
raises at the first save with what to do instead (`kubetrain.save` of
`get_state_dict`, docs/custom-code.md#sharded-models-fsdp2-tensor-parallel).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path
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

    def _cleanup(self) -> None:
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
        weights = model.state_dict()
        if any(_is_dtensor(t) for t in weights.values()):
            raise RuntimeError("KubetrainCallback: the model is sharded (DTensor parameters: FSDP2 or tensor "
                               "parallel), which it does not save yet; save get_state_dict(model, optimizer) with "
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
        scaler = getattr(getattr(self.trainer, "accelerator", None), "scaler", None)
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

    def on_train_end(self, args, state, control, **kwargs):
        self._cleanup()
        return control


def _is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor"


def _calling_trainer(callback: KubetrainCallback) -> Trainer | None:
    """The Trainer whose __init__ is calling on_init_end with this callback among its own."""
    frame = sys._getframe(2)
    for _ in range(FRAMES):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer) and callback in getattr(owner.callback_handler, "callbacks", ()):
            return owner
        frame = frame.f_back
    return None
