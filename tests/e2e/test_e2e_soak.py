"""A short soak in the e2e lane (kubetrain/bench/soak.py; `kubetrain bench soak` runs it for as long as it is told):
jobs of every kind on the real node, every fault class at least once from a seeded schedule, and the
soak's invariants checked at the end. KUBETRAIN_SOAK_SECONDS and KUBETRAIN_SOAK_SEED set its length and
seed (a failed seed is replayed by giving it again); KUBETRAIN_SOAK_OUT, where its JSON goes."""

from __future__ import annotations

import json
import os

import pytest
from e2elib import figure
from soak import OPERATOR_LIMIT_MIB, Soak

from kubetrain.bench.soak import summarize

pytestmark = pytest.mark.e2e

SECONDS = float(os.environ.get("KUBETRAIN_SOAK_SECONDS", "240"))
SEED = int(os.environ.get("KUBETRAIN_SOAK_SEED", "44"))


def test_a_soak_of_every_mode_under_every_fault_class_keeps_its_invariants(e2e, custom_image):
    # custom_image loads every example image (the FSDP script's is examples/llm's).
    soak = Soak(e2e, SEED, SECONDS)
    try:
        soak.run()
        soak.reasons()
        orphans = soak.orphans()
    finally:
        soak.close()
    result = summarize(SEED, SECONDS, soak.injected, list(soak.jobs.values()), orphans, soak.operator_peak_mib,
                       OPERATOR_LIMIT_MIB)
    soak.write(result, os.environ.get("KUBETRAIN_SOAK_OUT"))
    for kind, figures in result["faults"].items():
        figure(f"soak (seed {SEED}, {SECONDS:.0f} s): {kind}: {figures['injected']} injected, "
               f"{figures['skipped']} skipped, time lost median {figures['seconds_lost_median']} s, "
               f"max {figures['seconds_lost_max']} s")
    figure(f"soak (seed {SEED}): jobs {result['jobs']}, operator peak {result['operator_peak_mib']} MiB")
    broken = {name: inv["broken"] for name, inv in result["invariants"].items() if not inv["held"]}
    assert not broken, json.dumps(broken, indent=1) + f"\nreplay: KUBETRAIN_SOAK_SEED={SEED}"
    assert sum(f["injected"] for f in result["faults"].values()) >= 1
