"""A fault-tolerant training script (spec.ddp.faultTolerance): the script of train.py, with its model and
optimizer in `kubetrain.fault_tolerant`, so that the job trains on when one of its nodes dies.

Each node (pod) is a replica group: its ranks are a torchrun group of their own, and the groups average
their gradients through torchft. A step that a lost group could not finish is discarded and trained
again; a replacement group copies the model and the optimizer from a live one. Each group's batch is a
function of the step and the group alone, so a replacement trains exactly the batches its
predecessor would have.

    python ft_train.py --steps 600 --save-every 100
"""

import os
import time

import torch
from torch import nn

import kubetrain
from train import batch, network, options, report_final

GROUP = int(os.environ["KUBETRAIN_FT_REPLICA_GROUP"])  # this node's replica group
GROUPS = int(os.environ["KUBETRAIN_FT_REPLICA_GROUPS"])  # the most the job can have: deal the data by it
RANK = int(os.environ.get("RANK", "0"))  # the rank in the group (torchrun's)
RANKS = int(os.environ.get("WORLD_SIZE", "1"))


def main() -> None:
    parser = options(__doc__.splitlines()[0], steps=600, save_every=100)
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds each step waits: a stand-in for compute")
    args = parser.parse_args()

    model = network()  # the same initial weights in every group
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # Joins the quorum: restores this group's newest checkpoint when every group starts over, or copies
    # the model and optimizer from a live group (a replacement). No kubetrain.restore() then.
    ft = kubetrain.fault_tolerant(model, optimizer)
    if ft.step:
        print(f"group {GROUP}: starts at step {ft.step}", flush=True)

    while ft.step < args.steps:
        ft.zero_grad()  # the step's quorum starts in the background
        x, y = batch(ft.step + 1, GROUP * RANKS + RANK, args.batch_size)  # this group's batch of the step
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        time.sleep(args.sleep)
        if not ft.commit(loss):  # averaged over the groups in the quorum; the optimizer stepped if True
            continue  # discarded (a group was lost in it): the same step again
        kubetrain.report(ft.step, total_steps=args.steps, loss=ft.loss, groups=ft.participants)
        if ft.step % args.save_every == 0 or ft.step == args.steps:
            ft.save()  # this group's checkpoint: for the loss of every group

    eval_loss = report_final(model, args.steps)
    if RANK == 0:
        print(f"group {GROUP} done: {args.steps} steps, eval loss {eval_loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
