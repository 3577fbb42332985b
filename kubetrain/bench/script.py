"""The script `kubetrain bench contract` times: a plain DDP loop, with `kubetrain.report` every step or not.

    python -m kubetrain.bench.script --steps 400 [--no-report]

Each rank trains an MLP on fixed random batches; after a warm-up the loop
is timed, and the samples per second of the whole group (the slowest rank's
time) is reported once at the end, in both variants.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import kubetrain

WARMUP_STEPS = 20
BATCH = 64


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--no-report", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    world = dist.get_world_size() if distributed else 1
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    model = DistributedDataParallel(net) if distributed else net
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(BATCH, 64), torch.randint(0, 10, (BATCH,))
    total = WARMUP_STEPS + args.steps
    started = 0.0
    for step in range(1, total + 1):
        if step == WARMUP_STEPS + 1:
            started = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if not args.no_report:
            kubetrain.report(step, total_steps=total, loss=loss.item())
    elapsed = torch.tensor([time.perf_counter() - started])
    if distributed:
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        dist.destroy_process_group()
    kubetrain.report(total, total_steps=total, loop_samples_per_second=args.steps * BATCH * world / elapsed.item())


if __name__ == "__main__":
    main()
