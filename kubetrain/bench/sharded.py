"""`kubetrain bench checkpoint --sharded`: what a sharded checkpoint costs, in one run, as ratios.

A model of square linear layers sharded with FSDP2 over RANKS gloo ranks on
this machine, trained one step with AdamW so that the state (parameters and
the optimizer's two moments) holds at least `gib` GiB in all. Measured in one
torchrun group, on one disk (the same directory for every rank, as one
ReadWriteMany volume is in a cluster):

- `blocking_seconds`: how long `save` holds the loop (the copy of this rank's
  shards into memory; the first save also allocates the buffers, later ones
  refill them: both reported); `sync_seconds`: the same save made durable
  before returning (written, fsynced, read back and hashed by every rank, the
  COMMIT written by rank 0). `ratio_blocking_to_sync` is the figure (aim <= 0.1).
- `plain_seconds`: today's path for the same state: every tensor gathered
  whole onto rank 0 (`full_tensor`), and rank 0's `torch.save` of it
  through CheckpointStore (synchronous). `ratio_sharded_to_plain`: the
  sharded save's wall time against it.
- Peak extra memory (resident set, sampled every 5 ms) of each rank during a
  save and during a restore, over its own shard's bytes (aim <= 1.5: no rank
  gathers the whole model); the plain path's rank 0 beside it.
- `restore_2_to_1_seconds`: one process loading the RANKS-rank checkpoint
  into a template of the whole model (resharded), and the same into RANKS
  ranks (`restore_seconds`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kubetrain.api.identity import JobIdentity

RANKS = 2
WIDTH = 4096  # a 4096 x 4096 float32 layer: 64 MiB of parameters, 192 MiB with AdamW's two moments
SAMPLE_SECONDS = 0.005


class PeakRSS:
    """The highest resident set size seen while the block runs, sampled from /proc, minus the size before."""

    def __init__(self) -> None:
        self.before = self.peak = current_rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> "PeakRSS":
        self.before = self.peak = current_rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, current_rss())

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            self.peak = max(self.peak, current_rss())

    @property
    def extra(self) -> int:
        return self.peak - self.before


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def layers_for(gib: float) -> int:
    per_layer = WIDTH * WIDTH * 4 * 3  # parameters + AdamW's exp_avg and exp_avg_sq
    return max(1, -(-int(gib * (1 << 30)) // per_layer))


def build(layers: int) -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])


def make_store(directory: str, store_uri: str) -> Any:
    """The sharded store under measure: on the shared directory, or in object storage (every rank staging
    on its own)."""
    from kubetrain.trainer.sharded import ShardedStore

    if not store_uri:
        return ShardedStore(Path(directory) / "sharded", keep_last=1, identity=JobIdentity("bench"))
    from kubetrain.trainer.object_checkpoints import ObjectShardedStore
    from kubetrain.trainer.objstore import parse_uri

    return ObjectShardedStore(Path(directory) / "stage", parse_uri(store_uri, "--to"), keep_last=1,
                              identity=JobIdentity("bench"))


def worker(directory: str, layers: int, out: str) -> None:
    """One rank of the group (torchrun's environment)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from kubetrain.trainer.checkpoint import CheckpointStore

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build(layers)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, WIDTH)).sum().backward()
    optimizer.step()

    def state() -> dict[str, Any]:
        msd, osd = get_state_dict(model, optimizer)
        return {"model": msd, "optimizer": osd}

    def leaves(value: Any) -> list[Any]:
        if isinstance(value, dict):
            return [t for v in value.values() for t in leaves(v)]
        return [value] if isinstance(value, torch.Tensor) else []

    mine = sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in leaves(state()))
    total = sum(t.numel() * t.element_size() for t in leaves(state()))
    store = make_store(directory, os.environ.get(STORE_VAR, ""))
    result: dict[str, Any] = {"rank": rank, "shard_bytes": mine, "state_bytes": total}

    def timed(label: str, fn: Any) -> None:
        dist.barrier()
        with PeakRSS() as peak:
            started = time.perf_counter()
            fn()
            result[f"{label}_seconds"] = time.perf_counter() - started
        result[f"{label}_extra_bytes"] = peak.extra

    timed("first_blocking", lambda: store.save(1, state()))  # allocates the buffers
    timed("first_wait", store.wait)
    timed("blocking", lambda: store.save(2, state()))  # refills them
    timed("wait", store.wait)
    timed("sync", lambda: (store.save(3, state()), store.wait()))
    timed("restore", lambda: store.load(store.newest()[1], state()))

    # Today's path: the whole state gathered onto every rank (full_tensor is a collective), rank 0 writes it.
    plain = CheckpointStore(Path(directory) / "plain", keep_last=1, identity=JobIdentity("bench"), background=False)

    def gather_and_write() -> None:
        whole = {k: ({n: (v.full_tensor() if isinstance(v, DTensor) else v) for n, v in d.items()}
                     if isinstance(d, dict) and k == "model" else d) for k, d in state().items()}
        osd = whole["optimizer"]["state"]
        whole["optimizer"] = {"state": {p: {n: (v.full_tensor() if isinstance(v, DTensor) else v)
                                            for n, v in s.items()} for p, s in osd.items()},  # type: ignore[union-attr]  # a parameter's state
                              "param_groups": whole["optimizer"]["param_groups"]}
        if rank == 0:
            plain.save(3, whole)

    timed("plain", gather_and_write)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    if rank == 0:
        Path(out).write_text(json.dumps(everyone))
    dist.destroy_process_group()


def restore_alone(directory: str, layers: int, out: str) -> None:
    """One process, not sharded: the whole model as the template of the RANKS-rank checkpoint."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.set_num_threads(1)
    model = build(layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    msd, osd = get_state_dict(model, optimizer)
    store = make_store(directory, os.environ.get(STORE_VAR, ""))
    _, path = store.newest()
    with PeakRSS() as peak:
        started = time.perf_counter()
        store.load(path, {"model": msd, "optimizer": osd})
        seconds = time.perf_counter() - started
    Path(out).write_text(json.dumps({"restore_2_to_1_seconds": seconds, "restore_2_to_1_extra_bytes": peak.extra}))


STORE_VAR = "KUBETRAIN_BENCH_STORE_URI"
"""The group's and the lone restore's checkpoint prefix in object storage (`--to`); unset: the directory."""


def bench_sharded(gib: float, directory: str | None = None, store_uri: str | None = None) -> dict[str, Any]:
    if not 0.1 <= gib <= 64:
        raise ValueError(f"--gib {gib}: expected 0.1 to 64 (GiB of state in all)")
    if directory is not None and not Path(directory).is_dir():
        raise ValueError(f"--dir {directory}: not a directory")
    layers = layers_for(gib)
    tmp = tempfile.mkdtemp(prefix="kubetrain-bench-sharded-", dir=directory)
    try:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONSAFEPATH": "1",
               STORE_VAR: store_uri or ""}
        group_out, alone_out = Path(tmp) / "group.json", Path(tmp) / "alone.json"
        for argv in ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS),
                      "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "-m", __name__, "worker", tmp,
                      str(layers), str(group_out)],
                     [sys.executable, "-m", __name__, "alone", tmp, str(layers), str(alone_out)]):
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(argv[2:5])} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        ranks = json.loads(group_out.read_text())
        alone = json.loads(alone_out.read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return summarise(ranks, alone, layers)


SECONDS_DECIMALS = 4
"""The printed seconds' precision: a blocking save of the test's 0.1 GiB takes about 0.01 s, so 3 decimals
(0.0005 s) were 4 % of it, more than the ratio's own precision."""


def summarise(ranks: list[dict[str, Any]], alone: dict[str, Any], layers: int) -> dict[str, Any]:
    worst = {key: max(r[key] for r in ranks) for key in ranks[0] if key.endswith("_seconds")}
    shard = max(r["shard_bytes"] for r in ranks)
    memory = {label: round(max(r[f"{label}_extra_bytes"] / r["shard_bytes"] for r in ranks), 3)
              for label in ("first_blocking", "blocking", "sync", "restore")}
    rank0 = ranks[0]
    save_wall = worst["blocking_seconds"] + worst["wait_seconds"]
    return {
        "benchmark": "checkpoint --sharded",
        "state": f"{layers} layers of {WIDTH}x{WIDTH} float32, FSDP2 over {len(ranks)} gloo ranks, AdamW",
        "state_gib": round(ranks[0]["state_bytes"] / (1 << 30), 3),
        "shard_gib_per_rank": round(shard / (1 << 30), 3),
        "seconds": {k.removesuffix("_seconds"): round(v, SECONDS_DECIMALS) for k, v in worst.items()},
        "ratio_blocking_to_sync": round(worst["blocking_seconds"] / worst["sync_seconds"], 4),
        "ratio_first_blocking_to_sync": round(worst["first_blocking_seconds"] / worst["sync_seconds"], 4),
        "ratio_sharded_to_plain": round(save_wall / worst["plain_seconds"], 4),
        "peak_extra_memory_over_shard": memory,
        "plain_rank0_peak_extra_over_shard": round(rank0["plain_extra_bytes"] / rank0["shard_bytes"], 3),
        "restore_2_to_1_seconds": round(alone["restore_2_to_1_seconds"], 3),
        "restore_2_to_1_peak_extra_over_whole_state": round(
            alone["restore_2_to_1_extra_bytes"] / ranks[0]["state_bytes"], 3),
        "aims": "ratio_blocking_to_sync <= 0.1; peak_extra_memory_over_shard <= 1.5",
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


if __name__ == "__main__":
    role, directory, layers, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    (worker if role == "worker" else restore_alone)(directory, layers, out)
