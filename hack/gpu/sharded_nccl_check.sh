#!/usr/bin/env bash
# Sharded training and checkpoints on GPUs with NCCL: what the CPU tests cover with gloo.
#
#   hack/gpu/sharded_nccl_check.sh [WORK_DIR]      (KUBETRAIN, PYTHON override the commands; default .venv's)
#
# With G visible GPUs (at least 1), through `kubetrain run`:
#   1. the built-in loop, ddp.strategy FSDP, backend nccl, G ranks: trains on cuda to eval accuracy
#      >= 0.9 with sharded checkpoints (one file per rank in each);
#   2. examples/llm/fsdp_mlp.py on G ranks (nccl, pinned staging), clean and with rank G-1 killed
#      while it writes the save of step 100 (kill@save): resumed from 50, the same final digest of the
#      gathered weights;
#   3. examples/llm/train.py (the Llama decoder) for 100 steps: eval loss below the unigram entropy.
# Prints one JSON line per check and exits 0 when all passed; 1 (with the failed run's log tail) if not;
# 2 when no GPU is visible.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
kubetrain="${KUBETRAIN:-$repo/.venv/bin/kubetrain}"
python="${PYTHON:-$repo/.venv/bin/python}"
work="${1:-$(mktemp -d /tmp/sharded-nccl.XXXXXX)}"
gpus=$(cd / && "$python" -c 'import torch; print(torch.cuda.device_count())')
if [ "$gpus" -lt 1 ]; then
  echo "sharded_nccl_check: no GPU visible to torch" >&2
  exit 2
fi
last=$((gpus - 1))

run() {  # NAME MANIFEST [kubetrain run args...]
  local name=$1 manifest=$2; shift 2
  if ! "$kubetrain" run "$manifest" --run-dir "$work/$name" --quiet "$@" >"$work/$name.out" 2>&1; then
    echo "sharded_nccl_check: $name failed; end of its logs:" >&2
    tail -n 30 "$work/$name.out" "$work/$name"/logs/*.log >&2 || true
    exit 1
  fi
}

cat >"$work/builtin.yaml" <<EOF
apiVersion: kubetrain.dev/v1alpha1
kind: TrainingJob
metadata: {name: fsdp-nccl}
spec:
  mode: DDP
  model: {name: mlp, args: {hidden: 256, layers: 2}}
  dataset: {name: digits}
  training: {epochs: 10, batchSize: 32, device: cuda}
  ddp: {nodes: 1, procsPerNode: $gpus, backend: nccl, strategy: FSDP}
  checkpoint: {intervalSteps: 50, storage: {accessMode: ReadWriteMany}}
  metrics: {port: 0}
EOF
run builtin "$work/builtin.yaml"
(cd / && "$python" - "$work/builtin" "$gpus") <<'EOF'
import json, sys
from pathlib import Path
run, gpus = Path(sys.argv[1]), int(sys.argv[2])
summary = json.loads((run / "summary.json").read_text())
start = [json.loads(l) for l in (run / "metrics" / "ddp-0.jsonl").read_text().splitlines() if '"start"' in l][-1]
newest = sorted((run / "checkpoints" / "ddp-0").glob("sharded-*"))[-1]
files = sorted(p.name for p in newest.glob("__*_0.distcp"))
print(json.dumps({"check": "builtin FSDP", "device": start["device"], "backend": start["backend"],
                  "eval_accuracy": summary["eval_accuracy"], "checkpoint": newest.name, "rank_files": files}))
ok = start["device"].startswith("cuda") and summary["eval_accuracy"] >= 0.9 and len(files) == gpus
sys.exit(0 if ok else 1)
EOF

# The examples' manifests on one node of G ranks, run from the examples' folder.
example() {  # MANIFEST OUT STEPS_FROM STEPS_TO
  sed -e "s/nodes: 2/nodes: 1/" -e "s/procsPerNode: 1/procsPerNode: $gpus/" -e "s/\"$3\"/\"$4\"/" \
      -e "s|^\(  script:\)$|\1\n    workingDir: $repo/examples/llm|" "$repo/examples/llm/$1" >"$2"
}
example fsdp-mlp.yaml "$work/fsdp-mlp.yaml" 200 200
run mlp-clean "$work/fsdp-mlp.yaml"
run mlp-fault "$work/fsdp-mlp.yaml" --fault "ddp-$last:kill@save=100"
(cd / && "$python" - "$work") <<'EOF'
import json, re, sys
from pathlib import Path
work = Path(sys.argv[1])
digests = {name: re.findall(r"digest ([0-9a-f]+)", (work / name / "logs" / "ddp-0.log").read_text())[-1]
           for name in ("mlp-clean", "mlp-fault")}
resumed = re.findall(r"resumed from step (\d+)", (work / "mlp-fault" / "logs" / "ddp-0.log").read_text())
print(json.dumps({"check": "fsdp_mlp.py kill@save", "digests": digests, "resumed": resumed}))
sys.exit(0 if digests["mlp-clean"] == digests["mlp-fault"] and resumed[:1] == ["50"] else 1)
EOF

example job.yaml "$work/llm.yaml" 200 100
run llm "$work/llm.yaml"
(cd / && "$python" - "$work/llm") <<'EOF'
import json, sys
from pathlib import Path
summary = json.loads((Path(sys.argv[1]) / "summary.json").read_text())
entropy = summary["metrics"]["unigram_entropy"]
print(json.dumps({"check": "llm train.py", "eval_loss": summary["eval_loss"], "unigram_entropy": entropy,
                  "wall_seconds": summary["wall_seconds"]}))
sys.exit(0 if summary["eval_loss"] < entropy - 0.3 else 1)
EOF
