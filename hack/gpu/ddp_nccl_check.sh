#!/usr/bin/env bash
# The DDP runtime's NCCL path on one GPU: a world of size 1 under the real
# torchrun agent (kubetrain.trainer.ddp.agent), digits MLP, once per comm hook.
#
#   hack/gpu/ddp_nccl_check.sh [WORK_DIR]      (PYTHON overrides the interpreter)
#
# Prints one JSON line per hook and exits 0 when every run trained on cuda to
# eval accuracy >= 0.9. Otherwise it prints the end of the failed node's log
# and exits with the agent's exit code: 2 where no GPU is visible (the ranks
# refuse nccl, naming spec.ddp.backend).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
python="${PYTHON:-$repo/.venv/bin/python}"
work="${1:-$(mktemp -d /tmp/ddp-nccl.XXXXXX)}"
port="${KUBETRAIN_RDZV_PORT:-29471}"

for hook in None FP16 PowerSGD; do
  dir="$work/$hook"
  mkdir -p "$dir"
  cat >"$dir/job.yaml" <<EOF
apiVersion: kubetrain.dev/v1alpha1
kind: TrainingJob
metadata: {name: ddp-nccl-check}
spec:
  mode: DDP
  model: {name: mlp, args: {hidden: 64}}
  dataset: {name: digits}
  training: {epochs: 10, batchSize: 32}
  ddp: {nodes: 1, procsPerNode: 1, backend: nccl, commHook: $hook, maxRestarts: 0}
  checkpoint: {intervalSteps: 50}
  metrics: {port: 0}
EOF
  mapfile -t argv < <("$python" - "$dir/job.yaml" "$port" <<'EOF'
import sys
from kubetrain.api import load_one
from kubetrain.shared.launch import torchrun_command
spec = load_one(sys.argv[1]).spec
print("\n".join(torchrun_command(spec, 0, f"127.0.0.1:{sys.argv[2]}", "nccl-check",
                                 python=sys.executable, local_addr="127.0.0.1")))
EOF
  )
  set +e
  KUBETRAIN_JOB_FILE="$dir/job.yaml" KUBETRAIN_RUN_DIR="$dir/run" KUBETRAIN_REPLICA=ddp-0 \
    KUBETRAIN_CHECKPOINT_DIR="$dir/run/checkpoints/ddp-0" KUBETRAIN_METRICS_PORT=0 \
    "${argv[@]}" >"$dir/node-0.log" 2>&1
  code=$?
  set -e
  if [ "$code" -ne 0 ]; then
    echo "ddp_nccl_check: commHook $hook: the agent exited $code; end of $dir/node-0.log:" >&2
    grep -v '^\s*$' "$dir/node-0.log" | grep -i 'error\|exitcode' | tail -n 5 >&2
    exit "$code"
  fi
  "$python" - "$dir/run" "$hook" <<'EOF'
import json, sys
from pathlib import Path
run, hook = Path(sys.argv[1]), sys.argv[2]
result = json.loads((run / "results" / "ddp-0.json").read_text())
start = [json.loads(l) for l in (run / "metrics" / "ddp-0.jsonl").read_text().splitlines() if '"start"' in l][-1]
summary = {"hook": hook, "device": start["device"], "backend": start["backend"],
           "eval_accuracy": result["eval_accuracy"], "samples_per_second": result["samples_per_second"],
           "compression_ratio": result["compression_ratio"], "wall_seconds": result["wall_seconds"]}
print(json.dumps(summary))
ok = start["device"].startswith("cuda") and start["backend"] == "nccl" and result["eval_accuracy"] >= 0.9
sys.exit(0 if ok else 1)
EOF
done
