"""Recovery break-downs on a kept e2e cluster, without the fault tests' fault-free references and runs to the end.

    KUBETRAIN_E2E_KEEP=1 .venv/bin/python -m pytest tests/e2e -k real_node   # once: up, images loaded, chart
    .venv/bin/python tests/e2e/measure_recovery.py [--runs N] [worker] [ps] [ddp] [standby]

Each run applies the example (as test_e2e_faults.py does), faults the victim
right after the first durable checkpoint (SIGKILL of a PS worker's or shard's
process, deletion of DDP rank 1's pod; `standby`: a PS worker's process in a job
with a standby worker), waits for its replacement's (the standby's) first step,
prints the break-down (helpers/recovery.py) and deletes the job. The fault
tests print the same break-down in every e2e run; this is for measuring a
change quickly (a run takes about a minute, not the tests' several).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

from e2elib import (  # noqa: E402
    CACHE, E2E, E2E_CLUSTER, EPOCHS, HOLDER, apply, example, first_checkpoint,
)
from helpers.kube import connect  # noqa: E402
from test_e2e_faults import delete_pod, sigkill, standby_job, strike, strike_with_standby  # noqa: E402

CASES = {"worker": ("parameter-server.yaml", "worker-1", sigkill), "ps": ("parameter-server.yaml", "ps-0", sigkill),
         "ddp": ("ddp.yaml", "ddp-1", delete_pod),
         # worker-1 SIGKILLed in a job with a standby worker: the standby's first step in its place.
         "standby": ("parameter-server.yaml", "worker-1", sigkill)}


def attach() -> E2E:
    """The kept cluster, as the e2e fixture hands it to the tests (nothing started or loaded here)."""
    cluster = connect(E2E_CLUSTER, 1, dict(os.environ, KUBETRAIN_CLUSTER=E2E_CLUSTER))
    net = dict(line.split("=", 1) for line in (CACHE / "realnode" / E2E_CLUSTER / "net.env").read_text().split())
    return E2E(cluster=cluster, pod_cidr=net["pod_cidr"], containerd=f"/run/kubetrain/{E2E_CLUSTER}/containerd.sock")


def measure(e2e: E2E, kind: str, run: int) -> str:
    manifest, victim, fault = CASES[kind]
    name = f"rec-{kind}-{run}"
    doc = standby_job(name) if kind == "standby" else example(manifest, EPOCHS[manifest])
    doc["metadata"]["name"] = name
    apply(e2e, doc)
    try:
        first_checkpoint(e2e, f"{name}-{HOLDER[manifest][0]}")
        if kind == "standby":
            faulted, seen, parts = strike_with_standby(e2e, name, victim)
        else:
            faulted, seen, parts = strike(e2e, name, victim, fault)
        problems = f" MISSING {parts.missing}" if parts.missing else ""
        problems += f" OUT OF ORDER {parts.out_of_order()}" if parts.out_of_order() else ""
        return (f"{name}: {parts.describe()} | first step seen on /metrics {seen.at - faulted:.2f} s after the fault"
                f"{problems}")
    finally:
        e2e.kubectl("delete", "trainingjob", name, "--wait=false")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kinds", nargs="*", choices=sorted(CASES), default=sorted(CASES))
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    e2e = attach()
    for run in range(args.runs):
        for kind in args.kinds:
            print(measure(e2e, kind, run), flush=True)
            print(f"  load average {os.getloadavg()[0]:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
