"""An unchanged Hugging Face `Trainer` script, run by kubetrain: one callback gives it progress, checkpoints, resume.

The model is a small causal language model built from a `LlamaConfig` and
randomly initialised (nothing is downloaded): 2 decoder layers over bytes
(vocabulary 256). The data set is local: windows of the bytes of a text
file, `--data` (by default the Python standard library's `ast.py`, which every
machine with Python has). `KubetrainCallback` reports every logging step,
saves every `--save-every` steps through `kubetrain.save`, and on a restart
resumes the Trainer from kubetrain's newest checkpoint, the skipped batches
and random state included: a run killed and resumed ends with the loss of one
that was never killed.

    python train.py --steps 60 --save-every 20
"""

import argparse
import ast
import os
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from kubetrain.integrations.hf import KubetrainCallback


class ByteWindows(torch.utils.data.Dataset):
    """Fixed windows of a file's bytes: input_ids and labels (the Trainer's model shifts them)."""

    def __init__(self, path: str, length: int):
        with open(path, "rb") as f:
            data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
        self.windows = data[: len(data) // length * length].view(-1, length)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


def build_model() -> LlamaForCausalLM:
    """The model, randomly initialised from seed 0: 2 decoder layers over bytes (vocabulary 256)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    return LlamaForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--data", default=ast.__file__, help="a text file (default: the standard library's ast.py)")
    parser.add_argument("--output-dir", default=os.path.join(tempfile.gettempdir(), "hf-output"))
    args = parser.parse_args()

    model = build_model()
    training = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=8, learning_rate=3e-3,
        logging_steps=args.log_every, save_steps=args.save_every, save_total_limit=1, seed=0, use_cpu=True,
        report_to=[], disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = Trainer(model=model, args=training, train_dataset=ByteWindows(args.data, 64),
                      callbacks=[KubetrainCallback()])
    result = trainer.train()
    print(f"done: step {result.global_step}, last logged loss {trainer.state.log_history[-2].get('loss')}")


if __name__ == "__main__":
    main()
