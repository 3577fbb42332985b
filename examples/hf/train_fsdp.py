"""train.py's Trainer with its model sharded by FSDP2: each rank checkpoints its own shards through kubetrain.

The same model and data as train.py (a Llama-style model from a
`LlamaConfig`, randomly initialised, over windows of a local file's bytes),
trained by the same `Trainer` with Accelerate's FSDP2 plugin
(`TrainingArguments(fsdp=True, fsdp_config={"version": 2, ...})`): each
decoder layer, then the whole model, sharded over the ranks of torchrun's
group. `KubetrainCallback` saves every `--save-every` steps from every rank
through kubetrain's sharded path (each rank writes only its shards of the
model and of AdamW's state) and on a restart resumes the Trainer from the
newest such checkpoint, loaded into the freshly sharded model: a run killed
and resumed ends with the weights of one that was never killed.

    kubetrain run fsdp.yaml     (2 nodes of 1 rank: torchrun starts this script on each)

On machines without GPUs Accelerate ignores the FSDP plugin and trains with
DDP instead (its `AcceleratorState` makes FSDP a distributed type of
accelerators only; accelerate 1.15). `FSDPOnCPUTrainer` turns the plugin back
on there, so that this script shards on CPUs too (gloo); with GPUs it changes
nothing.
"""

import argparse
import ast
import hashlib
import os
import tempfile

import torch
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from transformers import Trainer, TrainingArguments

from kubetrain.integrations.hf import KubetrainCallback
from train import ByteWindows, build_model


class FSDPOnCPUTrainer(Trainer):
    """A Trainer whose `fsdp` arguments shard the model on CPUs too (Accelerate alone would train with DDP there)."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        state = self.accelerator.state
        if self.args.fsdp_plugin_args is not None and state.distributed_type == DistributedType.MULTI_CPU:
            # AcceleratorState is shared by every Accelerator of the process: this is what it would have set
            # had FSDP been allowed on CPUs. Accelerate's prepare then shards with fully_shard over a CPU mesh.
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            state.distributed_type = DistributedType.FSDP
            self.is_fsdp_enabled = True


def digest(model: torch.nn.Module) -> str:
    """sha256 of the whole weights, each gathered from every rank's shards (collective: every rank calls it)."""
    sha = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        sha.update(name.encode())
        sha.update(full.detach().cpu().contiguous().numpy().tobytes())
    return sha.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=4, help="per rank")
    parser.add_argument("--data", default=ast.__file__, help="a text file (default: the standard library's ast.py)")
    parser.add_argument("--output-dir", default=os.path.join(tempfile.gettempdir(), "hf-fsdp-output"))
    args = parser.parse_args()

    model = build_model()  # the same initial weights on every rank, before they are sharded
    training = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        learning_rate=3e-3, logging_steps=args.log_every, save_steps=args.save_every, save_total_limit=1, seed=0,
        use_cpu=not torch.cuda.is_available(), report_to=[], disable_tqdm=True, dataloader_num_workers=0,
        # The Trainer's own checkpoints (beside kubetrain's) sharded too: the default, FULL_STATE_DICT, gathers
        # the whole model onto rank 0 at every save (and on CPUs fails in safetensors: "Attempted to access the
        # data pointer on an invalid python storage").
        fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                                "state_dict_type": "SHARDED_STATE_DICT"},
    )
    trainer = FSDPOnCPUTrainer(model=model, args=training, train_dataset=ByteWindows(args.data, 64),
                               callbacks=[KubetrainCallback()])
    result = trainer.train()
    text = digest(trainer.model)
    if trainer.args.process_index == 0:
        print(f"done: step {result.global_step}, last logged loss {trainer.state.log_history[-2].get('loss')}, "
              f"weights {text}", flush=True)


if __name__ == "__main__":
    main()
