"""A script that restores without a template: fine for a plain checkpoint, an error for a sharded one."""

import torch.distributed as dist

import kubetrain

dist.init_process_group("gloo")
state, step = kubetrain.restore()
print(f"restored step {step}", flush=True)
dist.destroy_process_group()
