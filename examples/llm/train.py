"""A Llama-style decoder trained with FSDP2, its sharded state checkpointed and restored by kubetrain.

The model is Hugging Face transformers' `LlamaForCausalLM`, built from a
`LlamaConfig` and randomly initialised: nothing is downloaded. The data is a
byte-level corpus every machine has without a download: the Python standard
library's own source files, read at start-up (about 4.7 MB). Each decoder
layer, then the model, is sharded across the ranks with `fully_shard`; every
rank saves its own shards with `kubetrain.save` and restores them, resharded
to the current world size, with `kubetrain.restore(template)` (fsdp_mlp.py's
`resume`, beside this file and in the same image).

The loss is in nats per byte. The corpus's unigram entropy (what a model that
knows only byte frequencies achieves) is printed at the start: the model must
fall clearly below it, by predicting bytes from their context.

    python train.py --steps 200 --save-every 50
"""

import argparse
import math
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import kubetrain
from fsdp_mlp import join, resume  # the same group and checkpoint calls as the smallest sharded script

# The corpus: the standard library's *.py files in sorted order, up to this many bytes.
CORPUS_BYTES = 4_700_000
# The last share of it is held out for the eval loss.
EVAL_FRACTION = 0.05


def corpus(limit: int = CORPUS_BYTES) -> torch.Tensor:
    """The bytes of the standard library's source files, as a uint8 tensor (the same on every rank)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, size = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


def unigram_entropy(data: torch.Tensor) -> float:
    """Nats per byte of the best model that ignores context: the entropy of the byte frequencies."""
    p = torch.bincount(data, minlength=256).double() / len(data)
    p = p[p > 0]
    return float(-(p * p.log()).sum())


def windows(data: torch.Tensor, seed: int, count: int, length: int) -> torch.Tensor:
    """`count` windows of `length` bytes at positions drawn from `seed` alone (a step and a rank)."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(data) - length, (count,), generator=g)
    return torch.stack([data[s : s + length] for s in starts.tolist()])


def build(args: argparse.Namespace) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, max_position_embeddings=args.context,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8, help="windows per rank and step")
    parser.add_argument("--context", type=int, default=128, help="bytes per window")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    args = parser.parse_args()

    rank, world, device = join()

    data = corpus()
    split = int(len(data) * (1 - EVAL_FRACTION))
    train, held_out = data[:split], data[split:]
    entropy = unigram_entropy(train)

    torch.manual_seed(0)  # the same initial weights on every rank, before they are sharded
    model = build(args).to(device)
    mesh = init_device_mesh(device.type, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)  # a decoder layer's weights are gathered only while it runs
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    if rank == 0:
        count = sum(p.numel() for p in model.parameters())
        print(f"{count / 1e6:.2f} M parameters, {len(data):,} bytes of corpus, unigram entropy {entropy:.3f} "
              f"nats/byte, {world} ranks", flush=True)

    state, start = resume(model, optimizer)

    began = time.perf_counter()
    for step in range(start + 1, args.steps + 1):
        batch = windows(train, 1_000_003 * step + rank, args.batch_size, args.context).to(device)
        # labels = inputs: the model shifts them itself, each byte predicted from the ones before it.
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        mean = mean.item() / world
        kubetrain.report(step, total_steps=args.steps, loss=mean, unigram_entropy=entropy,
                         samples_per_second=args.batch_size * world * (step - start) / (time.perf_counter() - began))
        if rank == 0 and (step % 25 == 0 or step == args.steps):
            print(f"step {step}: loss {mean:.3f} nats/byte (unigram entropy {entropy:.3f})", flush=True)
        if step % args.save_every == 0 or step == args.steps:
            kubetrain.save(state(), step)  # every rank its own shards

    model.eval()
    with torch.no_grad():
        batch = windows(held_out, 7, 32, args.context).to(device)
        eval_loss = model(input_ids=batch, labels=batch).loss.item()
    kubetrain.report(args.steps, total_steps=args.steps, eval_loss=eval_loss)
    if rank == 0:
        print(f"done: {args.steps} steps, eval loss {eval_loss:.3f} nats/byte, unigram entropy {entropy:.3f}, "
              f"{eval_loss / math.log(2):.2f} bits/byte", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
