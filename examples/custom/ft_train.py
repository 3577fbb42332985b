"""A fault-tolerant training script (spec.ddp.faultTolerance): the script of train.py, with its model and
optimizer in `kubetrain.fault_tolerant`, so that the job trains on when one of its nodes dies.

Each node (pod) is a replica group: its ranks are a torchrun group of their own, and the groups average
their gradients through torchft. A step that a lost group could not finish is discarded and trained
again; a replacement group copies the model and the optimizer from a live one. The data follows the
quorum: `ft.indices()` deals each step's batch among the ranks of the groups that train it, so every
sample is trained exactly once per epoch whatever the faults (a spare group, spec.ddp.faultTolerance.
spareGroups, gets none until a group is lost).

    python ft_train.py --steps 600 --save-every 100
"""

import os
import time

import torch
from torch import nn

import kubetrain
from train import batch, network, options, report_final

GROUP = int(os.environ["KUBETRAIN_FT_REPLICA_GROUP"])  # this node's replica group
RANK = int(os.environ.get("RANK", "0"))  # the rank in the group (torchrun's)
SAMPLES = 9600  # the training set: fixed samples of the function train.py learns


def main() -> None:
    parser = options(__doc__.splitlines()[0], steps=600, save_every=100)
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds each step waits: a stand-in for compute")
    args = parser.parse_args()

    model = network()  # the same initial weights in every group
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    x, y = batch(10**6, 0, SAMPLES)  # the same dataset in every process (step 10**6: no other batch uses it)
    # Joins the quorum: restores this group's newest checkpoint when every group starts over, or copies
    # the model, the optimizer and the data's cursor from a live group (a replacement). No kubetrain.restore().
    # --steps: the samples of that many steps at full width (every group training).
    ft = kubetrain.fault_tolerant(model, optimizer, samples=SAMPLES, batch_size=args.batch_size, max_steps=args.steps)
    if ft.step:
        print(f"group {GROUP}: starts at step {ft.step}", flush=True)
    while not ft.done:
        ft.zero_grad()  # the step's quorum starts in the background
        idx = ft.indices()  # this rank's samples of the step; none for a spare group
        loss = None
        if len(idx):
            loss = nn.functional.mse_loss(model(x[idx]), y[idx])
            loss.backward()
        time.sleep(args.sleep)
        if not ft.commit(loss):  # averaged over the groups in the quorum; the optimizer stepped if True
            continue  # discarded (a group was lost in it): its samples are dealt again
        kubetrain.report(ft.step, loss=ft.loss, groups=ft.participants, epoch=ft.epoch)
        if ft.step % args.save_every == 0 or ft.done:
            ft.save()  # this group's checkpoint: for the loss of every group
    eval_loss = report_final(model, ft.step)
    if RANK == 0:
        print(f"group {GROUP} done: {ft.step} steps, eval loss {eval_loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
