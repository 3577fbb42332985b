"""The DDP runtime: torchrun groups that train data-parallel and resume from kubetrain's checkpoints.

`kubetrain.shared.launch.torchrun_command` (standard library only, the
launch contract the plan and the trainer share) builds a node's torchrun argv;
`entry.run_ddp` is what every rank runs under it (`python -m kubetrain.trainer ddp`): a rank of a
torchrun group (`runtime`) or of a fault-tolerant replica group (`ft`). This package imports nothing itself
(torch comes with `runtime`), so the control plane can import it without torch.
"""
