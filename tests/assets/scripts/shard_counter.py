"""A script job on shards through kubetrain.data: it trains a linear model and counts, in its checkpointed
state, how often it trained each sample, so that a test can see every sample trained once an epoch across
a kill and a resume.

    python shard_counter.py SOURCE EPOCHS
"""

import sys

import torch

import kubetrain
import kubetrain.data

source, epochs = sys.argv[1], int(sys.argv[2])
loader = kubetrain.data.shards(source, batch_size=32, seed=1)
torch.manual_seed(0)
model = torch.nn.Linear(64, 10)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
counts = torch.zeros(len(loader), dtype=torch.int64)
total = epochs * loader.steps_per_epoch
state, step = kubetrain.restore()
if state is not None:
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    counts = state["counts"]
    loader.load_state_dict(state["data"])
while step < total:
    x, y, indices = loader.next_batch()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    counts[indices] += 1
    step += 1
    kubetrain.report(step, total_steps=total, loss=loss.item())
    if step % 10 == 0 or step == total:
        kubetrain.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "counts": counts,
                        "data": loader.state_dict()}, step, wait=step == total)
kubetrain.report(total, total_steps=total, min_count=int(counts.min()), max_count=int(counts.max()),
                 trained=int(counts.sum()))
