"""Checkpoint validation: is each checkpoint whole, loadable, of this job and step, and how good is its model.

Three questions, one module:

- `verify_checkpoints(DIR)`: every checkpoint of a run (or of one replica's
  checkpoint directory) is checked for integrity (length and sha256 of the
  payload), that it loads, the step and the spec hash it was written for,
  and its model is evaluated on the job's eval split.
- `compare_checkpoints(DIRS)`: the final parameters of several runs, side by side.
- `recovery_check(MANIFEST, FAULT, ROOT)`: the job once with an injected
  fault and once without; the resumed run must end where the clean one does,
  within the tolerance of its mode.

The `main_*` functions are the CLI's: they print and return an exit code,
`0` all good, `1` a checkpoint is bad or runs differ, `2` bad input (a
missing directory, no checkpoints, an unreadable job file).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO
from collections.abc import Callable, Sequence

import torch

from kubetrain.shared.checkpoints import (FILE_PATTERN, LATEST, MIRROR_PROBLEMS, RUN_JOB_FILE, SHARDED_PATTERN,
                                          read_latest, replica_dirs, step_of)
from kubetrain.shared.files import unreadable
from kubetrain.api import InvalidSpec, TrainingJob, load_one

from . import sharded
from kubetrain.api.identity import JobIdentity

from .checkpoint import CheckpointStore, CorruptCheckpoint
from .errors import TrainerError
from .models import evaluate, model_and_data

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2
# What "the resumed run ends where the clean one does" means per mode (the runtime issues' tolerances):
# Single replays the very same arithmetic; PS and DDP runs differ in summation order and timing.
RECOVERY_TOLERANCE = {"Single": ("parameters", 1e-6), "ParameterServer": ("eval_accuracy", 0.02),
                      "DDP": ("eval_accuracy", 0.02)}


class VerifyError(Exception):
    """Input that cannot be verified at all; the message names the path and what is wrong."""


@dataclass
class Layout:
    """Where the checkpoints of a run are, and the job they should belong to (None when unknown)."""

    directory: Path
    job: TrainingJob | None
    job_file: Path | None
    replicas: dict[str, Path]  # replica -> its checkpoint directory


def _has_checkpoints(path: Path) -> bool:
    return any(FILE_PATTERN.fullmatch(p.name) or p.name.startswith(("ckpt-", "sharded-")) for p in path.iterdir())


def layout(directory: str | Path, job_file: str | Path | None = None) -> Layout:
    """A run directory (job.yaml, checkpoints/<replica>/) or one replica's checkpoint directory."""
    directory = Path(directory)
    if not directory.exists():
        raise VerifyError(f"{directory}: no such directory")
    if not directory.is_dir():
        raise VerifyError(f"{directory}: not a directory")
    if (in_run := replica_dirs(directory)) is not None:
        replicas = in_run
        default_job = directory / RUN_JOB_FILE
    else:
        replicas = {directory.name: directory}
        default_job = directory.parent.parent / RUN_JOB_FILE  # runs/<name>/checkpoints/<replica>
    replicas = {name: path for name, path in replicas.items() if _has_checkpoints(path)}
    if not replicas:
        raise VerifyError(f"{directory}: no checkpoints here (expected ckpt-<step>.pt files or sharded-<step>/ "
                          "directories, or a run directory "
                          "with checkpoints/<replica>/)")
    if job_file is None and default_job.exists():
        job_file = default_job
    job = None
    if job_file is not None:
        try:
            job = load_one(job_file)
        except InvalidSpec as err:
            raise VerifyError(f"{job_file}: not a valid TrainingJob: {'; '.join(map(str, err.problems))}") from None
        except OSError as err:
            raise VerifyError(f"{job_file}: cannot be read: {err.strerror}") from None
    return Layout(directory, job, Path(job_file) if job_file else None, replicas)


def check_file(path: Path, expected: JobIdentity | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The verdict on one checkpoint file, and its state when it is usable."""
    match = FILE_PATTERN.fullmatch(path.name)
    # lstat: a link is judged (and refused) itself, never the file it points to.
    entry: dict[str, Any] = {"file": str(path), "step": int(match.group(1)) if match else None,
                             "bytes": path.lstat().st_size, "spec_hash": None, "ok": False, "error": None}
    try:
        written, state = CheckpointStore._read(path)
    except CorruptCheckpoint as err:
        entry["error"] = f"corrupt: {err}"
        return entry, None
    except Exception as err:  # noqa: BLE001 - whatever torch.load raises, the file does not load
        entry["error"] = f"does not load: {type(err).__name__}: {err}"
        return entry, None
    entry["spec_hash"] = written.spec_hash
    entry["written_by"] = written.release or "0.1.0 or earlier"
    verdict = written.judge(expected) if expected is not None else None  # (a header's step off its name: corrupt)
    if verdict is not None and not verdict.ok:
        entry["error"] = f"written for another job: {verdict.reason}"
    else:
        entry["ok"] = True
        return entry, state
    return entry, None


def check_sharded(path: Path, expected: JobIdentity | None, load: bool) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The verdict on one sharded checkpoint (its COMMIT and every file), and its whole state when `load`."""
    match = SHARDED_PATTERN.fullmatch(path.name)
    entry: dict[str, Any] = {"directory": str(path), "step": int(match.group(1)) if match else None, "files": 0,
                             "bytes": 0, "spec_hash": None, "world_size": None, "ok": False, "error": None}
    try:
        commit = sharded.check(path, expected)
    except sharded.CorruptSharded as err:
        entry["error"] = f"corrupt: {err}"
        return entry, None
    entry.update(files=len(commit.files), bytes=sum(n for n, _ in commit.files.values()),
                 spec_hash=commit.spec_hash, world_size=commit.world_size)
    try:
        state = sharded.load_whole(path) if load else None
    except Exception as err:  # noqa: BLE001 - whatever DCP raises, the checkpoint does not load
        entry["error"] = f"does not load: {type(err).__name__}: {str(err)[:200]}"
        return entry, None
    entry["ok"] = True
    return entry, state


def model_parameters(job: TrainingJob, states: dict[str, dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The model's tensors from the checkpoint states of one step: the model's, or every shard's part."""
    if job.spec.mode == "ParameterServer":
        params: dict[str, torch.Tensor] = {}
        for replica in sorted(states):
            params.update(states[replica]["params"])
        return params
    state = next(iter(states.values()))["model"]
    return {k.removeprefix("module."): v for k, v in state.items()}


class Evaluator:
    """Builds the job's model once per call and evaluates parameters on the eval split (data loaded once)."""

    def __init__(self, job: TrainingJob):
        self.job = job
        _, self.data = model_and_data(job.spec)

    def __call__(self, params: dict[str, torch.Tensor]) -> tuple[float, float]:
        model, _ = model_and_data(self.job.spec, self.data)
        missing, unexpected = model.load_state_dict(params, strict=False)
        missing = [m for m in missing if m in dict(model.named_parameters())]
        if missing or unexpected:
            raise VerifyError(f"the parameters do not fit the job's model: missing {missing}, unexpected {unexpected}")
        return evaluate(model, self.data.eval_x, self.data.eval_y, objective=self.data.objective)


def verify_checkpoints(directory: str | Path, job_file: str | Path | None = None,
                       run_eval: bool = True) -> dict[str, Any]:
    """Check every checkpoint under `directory`; the report's `ok` is False when any one is bad.

    The job is `job_file`, or the run directory's job.yaml. Without a job
    the spec hash and the eval are not checked (the report says so). A
    parameter-server job's model is evaluated from its shards' checkpoints of
    one step together. Raises VerifyError for input that cannot be verified.
    """
    where = layout(directory, job_file)
    job = where.job
    expected = JobIdentity.of(job.spec) if job else None
    report: dict[str, Any] = {
        "directory": str(where.directory), "job_file": str(where.job_file) if where.job_file else None,
        "job": job.name if job else None, "mode": job.spec.mode if job else None,
        "spec_hash": expected.spec_hash if expected else None,
        "replicas": {}, "evaluations": [], "problems": [], "notes": [],
    }
    usable: dict[int, dict[str, dict[str, Any]]] = {}  # step -> replica -> state
    for replica, path in where.replicas.items():
        files = sorted((p for p in path.iterdir() if FILE_PATTERN.fullmatch(p.name)), key=lambda p: p.name)
        entries = []
        for file in files:
            entry, state = check_file(file, expected)
            entries.append(entry)
            if state is None:
                report["problems"].append(f"{file}: {entry['error']}")
            else:
                usable.setdefault(entry["step"], {})[replica] = state
        # Sharded checkpoints: loaded whole only for the eval of a built-in job.
        load = job is not None and job.spec.script is None and run_eval
        for step_dir in (p for _, p in sharded.complete(path)):
            entry, state = check_sharded(step_dir, expected, load)
            entries.append(entry)
            if not entry["ok"]:
                report["problems"].append(f"{step_dir}: {entry['error']}")
            elif state is not None:
                usable.setdefault(entry["step"], {})[replica] = state
        cut_short = sharded.incomplete(path)
        if cut_short:
            report["notes"].append(f"{path}: sharded saves that never completed (no COMMIT; never restored, removed at "
                                   f"the next start): {', '.join(p.name for p in cut_short)}")
        set_aside = sorted(p.name for p in path.glob("*.corrupt"))
        if set_aside:
            report["notes"].append(f"{path}: set aside earlier as corrupt by the trainer: {', '.join(set_aside)}")
        try:
            latest = read_latest(path)
        except OSError as err:  # a link or FIFO in its place (reading a FIFO would hang)
            latest = None
            report["problems"].append(f"{path / LATEST}: {unreadable(err)}")
        if latest is not None and step_of(latest) is None:  # never a path: `latest` is as untrusted as the rest
            report["problems"].append(f"{path / LATEST}: holds {latest[:80]!r}, not a checkpoint's name")
        elif latest is not None and not (path / latest).exists():
            report["problems"].append(f"{path / LATEST}: points to {latest}, which does not exist")
        report["replicas"][replica] = {"directory": str(path), "latest": latest, "checkpoints": entries}
    report["problems"].extend(mirror_problems(where.directory))
    if job is None:
        report["notes"].append("no job file: the spec hash and the eval were not checked (pass the job's manifest)")
    elif job.spec.script is not None:
        report["notes"].append("a script job: its state is the script's own, so only the files were checked (no eval)")
    elif run_eval:
        model_replicas = _model_replicas(job, where)
        evaluator = None
        for step in sorted(usable):
            states = {r: s for r, s in usable[step].items() if r in model_replicas}
            if set(states) != model_replicas:
                continue  # a shard's checkpoint of this step is missing or bad: reported above
            evaluator = evaluator or Evaluator(job)
            try:
                loss, accuracy = evaluator(model_parameters(job, states))
            except (VerifyError, KeyError, RuntimeError, TrainerError) as err:
                report["problems"].append(f"step {step}: the model cannot be rebuilt from the checkpoint: {err}")
                continue
            report["evaluations"].append({"step": step, "eval_loss": loss, "eval_accuracy": accuracy})
    report["ok"] = not report["problems"]
    return report


def mirror_problems(directory: Path) -> list[str]:
    """What a copy of a bucket's checkpoints (object_checkpoints.mirror) found and left out: objects missing, or
    not what their commits say."""
    try:
        found = json.loads((directory / MIRROR_PROBLEMS).read_text())
    except (OSError, ValueError):
        return []
    return [str(p) for p in found] if isinstance(found, list) else []


def _model_replicas(job: TrainingJob, where: Layout) -> set[str]:
    """The replicas whose checkpoints hold the model: every shard of a PS job, else the one directory."""
    if job.spec.mode == "ParameterServer":
        assert job.spec.parameter_server is not None
        shards = {f"ps-{i}" for i in range(job.spec.parameter_server.replicas)}
        return shards if shards <= set(where.replicas) else set(where.replicas)
    return {next(iter(where.replicas))}


def final_parameters(directory: str | Path, job_file: str | Path | None = None) -> dict[str, Any]:
    """The newest step whose model checkpoints are all valid: {step, spec_hash, job, mode, params}."""
    where = layout(directory, job_file)
    if where.job is None:
        raise VerifyError(f"{directory}: no job.yaml here; pass the job's manifest to know its model")
    expected = JobIdentity.of(where.job.spec)
    replicas = _model_replicas(where.job, where)
    by_step: dict[int, dict[str, dict[str, Any]]] = {}
    for replica in replicas:
        for file in where.replicas[replica].iterdir():
            if FILE_PATTERN.fullmatch(file.name):
                entry, state = check_file(file, expected)
                if state is not None:
                    by_step.setdefault(entry["step"], {})[replica] = state
        newest = sharded.complete(where.replicas[replica])
        for _, step_dir in reversed(newest):  # the newest that verifies, loaded whole
            entry, state = check_sharded(step_dir, expected, load=True)
            if state is not None:
                by_step.setdefault(entry["step"], {})[replica] = state
                break
    complete = [step for step, states in by_step.items() if set(states) == replicas]
    if not complete:
        raise VerifyError(f"{directory}: no valid checkpoint of job {where.job.name} (spec hash "
                          f"{expected.spec_hash})")
    step = max(complete)
    return {"directory": str(where.directory), "step": step, "spec_hash": expected.spec_hash, "job": where.job,
            "mode": where.job.spec.mode, "params": model_parameters(where.job, by_step[step])}


def compare_checkpoints(dirs: Sequence[str | Path], tolerance: float = 1e-6, run_eval: bool = True) -> dict[str, Any]:
    """The final parameters of each run against the first's: max |a-b| over all tensors, and eval accuracy.

    `ok` when every run has the same parameter names and shapes and differs
    by at most `tolerance`. Raises VerifyError for a directory without a
    valid checkpoint.
    """
    if len(dirs) < 2:
        raise VerifyError(f"compare needs at least two directories, got {len(dirs)}")
    finals = [final_parameters(d) for d in dirs]
    runs: list[dict[str, Any]] = []
    for final in finals:
        run = {k: final[k] for k in ("directory", "step", "spec_hash", "mode")}
        run["job"] = final["job"].name
        if run_eval:
            run["eval_loss"], run["eval_accuracy"] = Evaluator(final["job"])(final["params"])
        runs.append(run)
    base = finals[0]
    comparisons: list[dict[str, Any]] = []
    for final in finals[1:]:
        a, b = base["params"], final["params"]
        row = {"a": base["directory"], "b": final["directory"], "same_step": base["step"] == final["step"],
               "max_abs_diff": None, "problem": None}
        shapes_a = {k: tuple(v.shape) for k, v in a.items()}
        shapes_b = {k: tuple(v.shape) for k, v in b.items()}
        if shapes_a != shapes_b:
            row["problem"] = f"different parameters: {sorted(set(shapes_a.items()) ^ set(shapes_b.items()))}"
        else:
            row["max_abs_diff"] = max((float((a[k].float() - b[k].float()).abs().max()) for k in a), default=0.0)
        row["within_tolerance"] = row["max_abs_diff"] is not None and row["max_abs_diff"] <= tolerance
        comparisons.append(row)
    return {"tolerance": tolerance, "runs": runs, "comparisons": comparisons,
            "ok": all(c["within_tolerance"] for c in comparisons)}


def recovery_check(job: TrainingJob, fault: str, faults: dict[str, str], run_root: str | Path,
                   run: Callable[[TrainingJob, Path, dict[str, str], TextIO], int],
                   stream: TextIO = sys.stderr) -> dict[str, Any]:
    """Run `job` uninterrupted and with `faults` (parsed from `fault`, REPLICA:kill@step=N); compare
    their final checkpoints.

    `run(job, run_dir, faults, stream)` runs a job to its end and returns its
    exit code: the CLI passes the local backend (the trainer does not import
    the control plane). Run directories: RUN_ROOT/clean and RUN_ROOT/faulted
    (a finished one is not run again). Single must end with the same
    parameters (within 1e-6); ParameterServer and DDP with the same eval
    accuracy within 0.02.
    """
    if job.spec.script is not None:
        raise VerifyError(f"{job.name}: a script job's state is its own: compare its final reports instead")
    root = Path(run_root)
    runs = {"clean": root / "clean", "faulted": root / "faulted"}
    codes = {}
    for name, path in runs.items():
        print(f"recovery check: the {name} run in {path}", file=stream)
        codes[name] = run(job, path, faults if name == "faulted" else {}, stream)
    criterion, tolerance = RECOVERY_TOLERANCE[job.spec.mode]
    report: dict[str, Any] = {"job": job.name, "mode": job.spec.mode, "fault": fault, "criterion": criterion,
                              "tolerance": tolerance, "runs": {k: str(v) for k, v in runs.items()},
                              "exit_codes": codes, "problems": []}
    restart_log = json.loads((runs["faulted"] / "state.json").read_text()).get("restart_log") or []
    report["restarts"] = len(restart_log)
    if not restart_log:
        report["problems"].append(f"the fault {fault} did not fire: the faulted run never restarted")
    for name, code in codes.items():
        if code != 0:
            report["problems"].append(f"the {name} run failed (exit code {code}); see {runs[name]}/summary.json")
    if not report["problems"]:
        compared = compare_checkpoints([runs["clean"], runs["faulted"]], tolerance=tolerance)
        report["comparison"] = compared
        clean, faulted = compared["runs"]
        if clean["step"] != faulted["step"]:
            report["problems"].append(f"final steps differ: clean {clean['step']}, faulted {faulted['step']}")
        if criterion == "parameters" and not compared["ok"]:
            diff = compared["comparisons"][0]
            report["problems"].append(f"final parameters differ by {diff['max_abs_diff']} (> {tolerance})"
                                      + (f": {diff['problem']}" if diff["problem"] else ""))
        if criterion == "eval_accuracy" and abs(clean["eval_accuracy"] - faulted["eval_accuracy"]) > tolerance:
            report["problems"].append(f"eval accuracy {faulted['eval_accuracy']:.4f} after recovery, "
                                      f"{clean['eval_accuracy']:.4f} uninterrupted (tolerance {tolerance})")
    report["ok"] = not report["problems"]
    return report


# --- the CLI's side ----------------------------------------------------------------


def _emit(report: dict[str, Any], as_json: bool, text: str, out: TextIO) -> None:
    print(json.dumps(report, indent=2, default=str) if as_json else text, file=out)


def main_verify(directory: str | Path, job_file: str | Path | None = None, as_json: bool = False,
                run_eval: bool = True, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """`kubetrain checkpoints verify DIR [--job FILE] [--json]`: 0 all valid, 1 a bad checkpoint, 2 bad input."""
    try:
        report = verify_checkpoints(directory, job_file, run_eval)
    except VerifyError as error:
        print(f"kubetrain checkpoints verify: error: {error}", file=err)
        return EXIT_USAGE
    lines = [f"{report['directory']}: job {report['job'] or '?'} ({report['mode'] or 'mode unknown'}), "
             f"spec hash {report['spec_hash'] or '?'}"]
    evals = {e["step"]: e for e in report["evaluations"]}
    for replica, info in report["replicas"].items():
        lines.append(f"  {replica}: latest -> {info['latest'] or '(none)'}")
        for c in info["checkpoints"]:
            verdict = "ok" if c["ok"] else f"BAD: {c['error']}"
            ev = evals.get(c["step"]) if c["ok"] else None
            score = f", eval accuracy {ev['eval_accuracy']:.4f}, loss {ev['eval_loss']:.4f}" if ev else ""
            if "directory" in c:  # a sharded checkpoint: a directory of every rank's files and COMMIT
                what = (f"{Path(c['directory']).name}/  step {c['step']}  {c['files']} files of "
                        f"{c['world_size'] or '?'} ranks, {c['bytes']:,} bytes")
            else:
                what = f"{Path(c['file']).name}  step {c['step']}  {c['bytes']:,} bytes"
            lines.append(f"    {what}  {verdict}{score}")
    lines += [f"  note: {n}" for n in report["notes"]]
    bad = len(report["problems"])
    lines.append("all checkpoints are valid" if report["ok"] else f"{bad} problem(s)")
    _emit(report, as_json, "\n".join(lines), out)
    for problem in report["problems"]:
        print(f"kubetrain checkpoints verify: {problem}", file=err)
    return EXIT_OK if report["ok"] else EXIT_INVALID


def main_compare(dirs: Sequence[str | Path], tolerance: float = 1e-6, as_json: bool = False,
                 out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """`kubetrain checkpoints compare DIR DIR... [--tolerance T] [--json]`: 0 within tolerance, 1 differ, 2 bad input."""
    try:
        report = compare_checkpoints(dirs, tolerance)
    except VerifyError as error:
        print(f"kubetrain checkpoints compare: error: {error}", file=err)
        return EXIT_USAGE
    lines = [f"  {r['directory']}: job {r['job']} ({r['mode']}), step {r['step']}, "
             f"eval accuracy {r['eval_accuracy']:.4f}" for r in report["runs"]]
    for c in report["comparisons"]:
        diff = c["problem"] or f"max |a-b| {c['max_abs_diff']:.3g}"
        verdict = "same" if c["within_tolerance"] else "DIFFERENT"
        lines.append(f"{c['b']} vs {c['a']}: {diff} ({verdict} within {tolerance:g})"
                     + ("" if c["same_step"] else " (different steps)"))
    _emit(report, as_json, "\n".join(lines), out)
    return EXIT_OK if report["ok"] else EXIT_INVALID


def main_recovery(job: TrainingJob, fault: str, faults: dict[str, str], run_root: str | Path,
                  run: Callable[[TrainingJob, Path, dict[str, str], TextIO], int], as_json: bool = False,
                  out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """`kubetrain checkpoints recovery FILE --fault REPLICA:kill@step=N [--run-root DIR]`: 0 recovered, 1 not, 2 bad input."""
    try:
        report = recovery_check(job, fault, faults, run_root, run, stream=err)
    except VerifyError as error:
        print(f"kubetrain checkpoints recovery: error: {error}", file=err)
        return EXIT_USAGE
    text = [f"{report['job']} ({report['mode']}) with {fault}: {report['restarts']} restart(s)"]
    comparison = report.get("comparison")
    if comparison:
        clean, faulted = comparison["runs"]
        diff = comparison["comparisons"][0]["max_abs_diff"]
        text.append(f"  final step {clean['step']} / {faulted['step']}, max |a-b| {diff:.3g}, eval accuracy "
                    f"{clean['eval_accuracy']:.4f} / {faulted['eval_accuracy']:.4f} (clean / faulted)")
    text += [f"  problem: {p}" for p in report["problems"]]
    text.append(f"recovered: {report['criterion']} within {report['tolerance']:g}" if report["ok"] else "NOT recovered")
    _emit(report, as_json, "\n".join(text), out)
    return EXIT_OK if report["ok"] else EXIT_INVALID
