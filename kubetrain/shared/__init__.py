"""What the control plane and the trainer processes agree on, defined once: both import it, it imports neither.

- `exitcodes`: the exit codes of a replica, the reasons they stand for, and the 128+N rule of signals.
- `launch`: the launch contract: the environment a replica finds, a DDP node's torchrun argv, rank names.
- `checkpoints`: the layout of a checkpoint directory (files, sharded directories, COMMIT, `latest`).
- `files`: the one atomic write (temporary file, fsync, rename, fsync of the directory) and safe reads.
- `timestamps`: the one format of an ISO 8601 UTC timestamp (Kubernetes', the event log's, the run's).

The bottom layer (pyproject.toml's import-linter contracts): the API model, the engine, both drivers, the
trainer (`kubetrain.trainer`) and the public API (`kubetrain`) import this package;
it imports none of them, and nothing beyond the standard library, so that the operator's image (no
torch) and the trainer's (no Kubernetes client) load it alike. The API model (the TrainingJob spec
and status) stays in `kubetrain.api`, pure data that both sides read: this package holds
what the processes of a job and their supervisor exchange at run time (codes, variables, files).
"""

__version__ = "0.2.0"
"""kubetrain's one version: the package's (pyproject.toml reads it), the images' tags, the chart's version and
appVersion, the CRD's `kubetrain.dev/version` annotation. Set here only: `hack/release bump VERSION` rewrites
the copies that cannot read it (Chart.yaml, the Dockerfiles' defaults, the examples' image tags) and
tests/api/test_versions.py holds them equal (docs/operating.md#upgrades)."""

