"""The smallest sharded script: an MLP sharded with FSDP2, checkpointed by kubetrain from every rank.

Each rank holds 1/world of every weight and of the optimizer's state. Every
rank calls `kubetrain.save` with the DTensors of `get_state_dict` (each writes
only its own shards) and `kubetrain.restore` with a template of the same
structure (each reads only the pieces it needs, whatever the world size the
checkpoint was written at). Each rank's batch is a function of the step and
the rank alone, so a run resumed from a checkpoint follows exactly the path
of one that never stopped.

    python fsdp_mlp.py --steps 200 --save-every 50
"""

import argparse
import hashlib
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import kubetrain

FEATURES = 32


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples of one step on one rank: the same on every run, whatever restarts happened."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(size, FEATURES, generator=g)
    w = torch.linspace(-1.0, 1.0, FEATURES)
    return x, torch.sin(x @ w).unsqueeze(1) + 0.1 * x[:, :1]


def build(hidden: int, layers: int) -> nn.Sequential:
    blocks: list[nn.Module] = []
    width = FEATURES
    for _ in range(layers):
        blocks += [nn.Linear(width, hidden), nn.Tanh()]
        width = hidden
    return nn.Sequential(*blocks, nn.Linear(width, 1))


def join() -> tuple[int, int, torch.device]:
    """Joins torchrun's group (NCCL on GPUs, else Gloo): this rank, the world size and this rank's device."""
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")  # torchrun's environment says who is who
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def resume(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Callable[[], dict], int]:
    """What kubetrain.save takes (`state()`) and the step to train after: the job's newest checkpoint
    restored into the model and optimizer, or 0 on the first start. Collective: every rank calls it."""

    def state() -> dict:
        # Sharded: DTensors, this rank's shards. Unsharded: plain tensors of the same names, so that either
        # kind of checkpoint restores into the other.
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": model_sd, "optimizer": optim_sd}

    # Every rank passes a template and gets the same step; (None, 0) on the first start.
    restored, start = kubetrain.restore(state())
    if restored is not None:
        set_state_dict(model, optimizer, model_state_dict=restored["model"], optim_state_dict=restored["optimizer"])
        print(f"rank {dist.get_rank()}: resumed from step {start} at world size {dist.get_world_size()}", flush=True)
    return state, start


def digest(model: nn.Module) -> str:
    """sha256 of the whole weights, gathered (for the tests and this printout only: costs a full copy)."""
    sha = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        sha.update(name.encode())
        sha.update(full.detach().cpu().contiguous().numpy().tobytes())
    return sha.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--save-every", type=int, default=50)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--wait-saves", action="store_true",
                        help="each save returns once the checkpoint is committed (not only copied into memory)")
    parser.add_argument("--print-digest", action="store_true",
                        help="print a digest of the whole weights after the restore and at the end")
    parser.add_argument("--no-shard", action="store_true",
                        help="train the same model unsharded, on one rank (a plain state, written whole)")
    args = parser.parse_args()

    rank, world, device = join()

    torch.manual_seed(0)  # the same initial weights on every rank, before they are sharded
    model = build(args.hidden, args.layers).to(device)
    if not args.no_shard:
        mesh = init_device_mesh(device.type, (world,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)  # each layer is gathered only while it runs
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    state, start = resume(model, optimizer)
    if args.print_digest:
        text = digest(model)
        if rank == 0:
            print(f"restored step {start} digest {text}", flush=True)

    loss = torch.zeros((), device=device)
    for step in range(start + 1, args.steps + 1):
        x, y = batch(step, rank, args.batch_size)
        loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        kubetrain.report(step, total_steps=args.steps, loss=mean.item() / world)
        if step % args.save_every == 0 or step == args.steps:
            # Collective: every rank writes its own shards; returns once they are copied into memory.
            kubetrain.save(state(), step, wait=args.wait_saves)

    x, y = batch(0, 10_000, 1024)  # held out: no training step uses step 0
    with torch.no_grad():
        eval_loss = nn.functional.mse_loss(model(x.to(device)), y.to(device)).item()
    text = digest(model)
    # The digest's first 48 bits as a number (exact in a float): the job's status and results carry it.
    kubetrain.report(args.steps, total_steps=args.steps, eval_loss=eval_loss, digest48=float(int(text[:12], 16)))
    if rank == 0:
        print(f"done: {args.steps} steps, eval loss {eval_loss:.6f}, digest {text}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
