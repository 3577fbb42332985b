"""The exit codes of every replica, defined once: the trainer exits with them, the policies read them.

A supervisor (the local backend, the operator's restart policy, torchrun)
decides from the exit code alone whether a failure is worth a retry: 2 and 3
are permanent, 75 and 128+N are retried; 76 is a worker's release at a resize. A user's script (spec.script) speaks
the same language: its own exit code is the replica's.
"""

EXIT_OK = 0
EXIT_CONFIG = 2
"""The configuration cannot work (a bad field, a changed spec): retrying will not help."""
EXIT_LOAD = 3
"""The data or the model could not be loaded (a missing file, a bad entry point)."""
EXIT_TRANSIENT = 75
"""A failure that may pass (a peer not up yet, a port still taken): retried."""
EXIT_RELEASED = 76
"""A parameter-server worker that ps-0 released at a resize (its index at or past the job's new
size): no failure, no success. The engine deletes its pod, and starts it again, with no restart
counted, only if the job has grown back past its index meanwhile (3 -> 1 -> 3 within a step).
Only a parameter-server worker (kubetrain's own loop) means that by 76: from a user's script (a
Single or DDP replica) it is a failure like any other code."""
EXIT_TERMINATED = 143
"""128 + SIGTERM: stopped on request after writing a checkpoint, not finished."""
