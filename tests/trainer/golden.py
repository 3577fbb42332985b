"""The golden loss curve of the Single trainer (tests/assets/losses), and the command that writes it.

`hack/golden` runs this file to write the curve again after a change that is
meant to move it (a new default, a new torch). The tests only read it
(tests/trainer/test_single.py): a test that wrote its own reference would pass
against itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

GOLDEN = Path(__file__).parent.parent / "assets" / "losses" / "single_digits_mlp.json"
GOLDEN_STEPS = 30
GOLDEN_OVERRIDES = {"training": {"epochs": None, "maxSteps": GOLDEN_STEPS}}
DESCRIPTION = "tests/trainer/conftest.py BASE_SPEC, maxSteps 30"


def main() -> int:
    sys.path.insert(0, str(Path(__file__).parent))
    from conftest import BASE_SPEC, merged

    with tempfile.TemporaryDirectory(prefix="kubetrain-golden-") as tmp:
        job = Path(tmp) / "job.yaml"
        job.write_text(yaml.safe_dump({"apiVersion": "kubetrain.dev/v1alpha1", "kind": "TrainingJob",
                                       "metadata": {"name": "golden"}, "spec": merged(BASE_SPEC, GOLDEN_OVERRIDES)}))
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBETRAIN_")}
        env.update(KUBETRAIN_JOB_FILE=str(job), KUBETRAIN_RUN_DIR=str(Path(tmp) / "run"), KUBETRAIN_METRICS_PORT="0",
                   PYTHONSAFEPATH="1")
        done = subprocess.run([sys.executable, "-m", "kubetrain.trainer", "single"], env=env, cwd=tmp,
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            print(f"hack/golden: the trainer exited {done.returncode}:\n{done.stderr[-3000:]}", file=sys.stderr)
            return 1
        events = [json.loads(line) for line in (Path(tmp) / "run" / "metrics" / "single-0.jsonl").read_text().splitlines()]
    losses = [e["loss"] for e in events if e.get("event") == "train"]
    if len(losses) != GOLDEN_STEPS:
        print(f"hack/golden: {len(losses)} train events, expected {GOLDEN_STEPS}", file=sys.stderr)
        return 1
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps({"spec": DESCRIPTION, "losses": losses}, indent=1) + "\n")
    print(f"hack/golden: wrote {GOLDEN} ({len(losses)} losses, {losses[0]:.4f} -> {losses[-1]:.4f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
