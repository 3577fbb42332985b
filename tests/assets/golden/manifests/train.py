"""A plain PyTorch training script that kubetrain runs, restarts and reports: four calls to `kubetrain`.

It trains a small regression network with DDP when torchrun's environment
says there are several ranks (mode DDP), and alone otherwise (mode Single).
Each rank's batch is a function of the step and the rank alone, so a run
resumed from a checkpoint follows exactly the path of one that never stopped.

    python train.py --steps 300 --save-every 50
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import kubetrain

FEATURES = 16


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples of one step on one rank: the same on every run, whatever restarts happened."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(size, FEATURES, generator=g)
    return x, target(x)


def target(x: torch.Tensor) -> torch.Tensor:
    """What the network learns: a smooth function of the features."""
    w = torch.linspace(-1.0, 1.0, FEATURES)
    return torch.sin(x @ w).unsqueeze(1) + 0.1 * x[:, :1]


def network() -> nn.Module:
    """The regression network, the same initial weights in every process (seeded: every rank or group
    starts from them)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.Tanh(), nn.Linear(64, 1))


def options(description: str, steps: int, save_every: int) -> argparse.ArgumentParser:
    """The options of this script and of ft_train.py, with their defaults for `steps` and `save_every`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--save-every", type=int, default=save_every)
    return parser


def report_final(net: nn.Module, steps: int) -> float:
    """The trained network's loss on held-out samples, reported with its weights' norm; returns the loss."""
    x, y = batch(0, 10_000, 2048)  # held out: no training step uses step 0
    with torch.no_grad():
        eval_loss = nn.functional.mse_loss(net(x), y).item()
    kubetrain.report(steps, total_steps=steps, eval_loss=eval_loss,
                     weight_norm=float(sum(p.detach().norm() ** 2 for p in net.parameters()) ** 0.5))
    return eval_loss


def main() -> None:
    args = options(__doc__.splitlines()[0], steps=300, save_every=50).parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")  # MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE come from torchrun
    rank = dist.get_rank() if distributed else 0

    net = network()
    model = DistributedDataParallel(net) if distributed else net
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    # The newest checkpoint of the job, the same on every rank; (None, 0) on the first start.
    state, start = kubetrain.restore()
    if state is not None:
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        print(f"rank {rank}: resumed from step {start}", flush=True)

    for step in range(start + 1, args.steps + 1):
        x, y = batch(step, rank, args.batch_size)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        kubetrain.report(step, total_steps=args.steps, loss=loss.item())
        if step % args.save_every == 0 or step == args.steps:
            # Every rank may call it; rank 0 writes. Durable when it returns.
            kubetrain.save({"model": net.state_dict(), "optimizer": optimizer.state_dict()}, step)

    eval_loss = report_final(net, args.steps)
    if rank == 0:
        print(f"done: {args.steps} steps, eval loss {eval_loss:.4f}", flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
