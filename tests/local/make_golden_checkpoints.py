"""Make the golden checkpoints of one earlier release (hack/golden-checkpoints runs this; the tests only read them).

For each kind of job (tests/goldenlib.py KINDS) the release's own `kubetrain run` trains the manifest until a
fault stops it half-way, restartPolicy Never: its job.yaml and checkpoints become the golden. The same release
then resumes a copy to the end: what it reached itself is expected.json, which the suite's resume with today's
code must reach too. An exact kind is resumed twice, to prove the release itself reaches one result.

    hack/golden-checkpoints 0.1.0     # a worktree of the release, set up, then this script with its kubetrain
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from goldenlib import GOLDEN, RELEASES, differences, keep, kinds_of, result, run, workdir  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("release", choices=list(RELEASES))
    parser.add_argument("--kubetrain", required=True, help="the release's own kubetrain command")
    parser.add_argument("--only", nargs="*", help="these kinds only")
    args = parser.parse_args()
    root = GOLDEN / args.release
    for kind in kinds_of(args.release):
        if args.only and kind.name not in args.only:
            continue
        with tempfile.TemporaryDirectory(prefix=f"golden-{kind.name}-") as tmp:
            cwd = workdir(kind, Path(tmp) / "work")
            stopped = run([args.kubetrain], kind, cwd, Path(tmp) / "stopped", "--fault", kind.fault)
            if stopped.returncode == 0:
                print(f"{kind.name}: the fault {kind.fault} did not stop the run", file=sys.stderr)
                return 1
            keep(Path(tmp) / "stopped", root / kind.name)
            results = []
            for attempt in range(2 if kind.exact else 1):
                resumed = Path(tmp) / f"resumed-{attempt}"
                shutil.copytree(root / kind.name, resumed)
                done = run([args.kubetrain], kind, cwd, resumed)
                if done.returncode != 0:
                    print(f"{kind.name}: the release's own resume failed:\n{done.stdout}{done.stderr}", file=sys.stderr)
                    return 1
                results.append(result(resumed))
            if len(results) == 2 and differences(kind, results[0], results[1]):
                print(f"{kind.name}: two resumes of the release itself differ: "
                      f"{differences(kind, results[0], results[1])}", file=sys.stderr)
                return 1
            expected = {**results[0], "release": args.release, "commit": RELEASES[args.release],
                        "fault": kind.fault}
            (root / kind.name / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
            size = sum(f.stat().st_size for f in (root / kind.name).rglob("*") if f.is_file())
            print(f"{args.release} {kind.name}: {size} bytes, expected {expected['summary']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
