"""The seeded property test of tampering (issue 52, item 7; docs/security.md "Stored state is untrusted input").

Real states of four kinds of job (the goldens of 0.1.0: a plain Single job, FSDP's sharded state, a parameter
server's shard, a LoRA fine-tune) are written by this release's stores as three checkpoints each (steps 10, 20,
30), on a volume and in a bucket. Each mutation takes a fresh copy of one of the eight, changes it at random as
any writer of the claim or the bucket can (tests/tamperlib.py), and runs on it what reads it back: the restore
(the trainer's), verify, compare's core (`final_parameters`) and export. The property, for every mutation:

- nothing runs code (a pickle that runs writes a `ran-*` file in the canary folder) and nothing is written
  outside the sandbox (the canary folder stays empty, the decoy file keeps its bytes, the sandbox's parent
  gets no new entry);
- the restore gives the state of one of the three checkpoints, bit for bit and with its own step (the newest
  when the change did not touch it: harmless; an older one: a fall-back), or fails with a named error a job
  reports in one line (another spec's checkpoint: ConfigError; no usable data: LoadError);
- verify returns a report whose problems name the checkpoint, compare and export give exactly the weights of
  one of the three checkpoints or fail with a named error (export: exit 3), and every checkpoint the restore
  set aside is one that verify names as bad;
- a sample run through the `kubetrain checkpoints` command exits 0, 1, 2 or 3, as the in-process call says,
  with no traceback.

Seeded (SEED; each mutation's own random source is derived from it and its number) and bounded in time
(BUDGET_S): the line it prints (`tampering seed=... mutations=...`) gives the counts.
"""

from __future__ import annotations

import copy
import hashlib
import pickle
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from goldenlib import GOLDEN, MANIFESTS, final_state
from tamperlib import MARKERS, BucketCopy, Canary, Tamper, VolumeCopy, draw, fitting, shell_pickle
from kubetrain.api import load_one
from kubetrain.api.identity import JobIdentity
from kubetrain.trainer.checkpoint import CheckpointStore
from kubetrain.trainer.errors import ConfigError, LoadError
from kubetrain.trainer.export import ExportError, export
from kubetrain.trainer.object_checkpoints import ObjectCheckpointStore, ObjectShardedStore, mirror, write_job
from kubetrain.trainer.objstore import ObjectURI
from kubetrain.trainer.sharded import ShardedStore
from kubetrain.trainer.verify import VerifyError, compare_checkpoints, final_parameters, verify_checkpoints

SEED = 52
BUDGET_S = 40.0
"""Wall seconds, from the test's start, after which no new mutation starts: the suite runs on 2 shared cores, where
the setup takes about 20 s and a mutation about 0.2 s (a bucket's copy is a dozen requests), 40 times that when
the machine is loaded 15 deep."""
FIRST: list[tuple[Any, str, Any]] = []
"""Filled below: every kind of change with every kind and storage it applies to, in turn: the first mutations,
run whatever the budget says, so that a loaded machine covers each pair once (a random draw first met one bug
at mutation 40). Random draws follow, while the budget lasts."""
MIN_MUTATIONS = 0  # set below: len(FIRST)
MAX_MUTATIONS = 1000
"""The most on a fast machine: what the time bound would otherwise leave unbounded (each failing mutation keeps
its copy, about 300 KB, to look at)."""
STEPS = (10, 20, 30)
RELEASE = "0.1.0"
CLI_SAMPLE: dict[int, str] = {}
"""Filled below: mutations that also run through `kubetrain checkpoints` (the first of plain on a volume, of
sharded in a bucket, of a parameter server on a volume, of LoRA in a bucket), at once in subprocesses, each
about 3 CPU seconds of imports."""


@dataclass(frozen=True)
class Kind:
    name: str
    golden: str
    replica: str
    sharded: bool = False


KINDS = [Kind("plain", "single", "single-0"), Kind("sharded", "fsdp", "ddp-0", sharded=True),
         Kind("parameter-server", "ps", "ps-0"), Kind("lora", "lora", "single-0")]
STORAGES = ("volume", "bucket")
COMBINATIONS = [(kind, storage) for kind in KINDS for storage in STORAGES]
FIRST.extend((kind, storage, mutation) for kind, storage in COMBINATIONS
             for mutation in fitting(kind.sharded, storage == "bucket"))
MIN_MUTATIONS = len(FIRST)
for (_name, _storage), _action in {("plain", "volume"): "verify", ("sharded", "bucket"): "export",
                                   ("parameter-server", "volume"): "compare", ("lora", "bucket"): "verify"}.items():
    CLI_SAMPLE[next(i for i, (k, st, _) in enumerate(FIRST) if (k.name, st) == (_name, _storage))] = _action


@dataclass
class Pristine:
    """One kind's checkpoints as this release writes them, kept in memory: a run directory's files (relative
    to it) and a job URI's objects (relative to it), with the states and weights each step holds."""

    kind: Kind
    job_yaml: bytes
    identity: JobIdentity
    states: dict[int, dict[str, Any]]
    weights: dict[int, dict[str, torch.Tensor]]
    """What export writes and compare reads of each step: the model's state_dict, or the shard's params."""
    volume: dict[str, bytes] = field(default_factory=dict)
    bucket: dict[str, bytes] = field(default_factory=dict)


# --- the states and their checkpoints -------------------------------------------------------------------------


def step_state(base: dict[str, Any], step: int) -> dict[str, Any]:
    """The golden state as the checkpoint of `step`: its step, and its first weight's first element moved by
    `step` so that no two checkpoints hold the same tensors."""
    state = copy.deepcopy(base)
    state["step"] = step
    weights = state["params"] if "params" in state else state["model"]
    first = next(iter(weights))
    weights[first] = weights[first].clone()
    weights[first].view(-1)[0] += step
    return state


def job_yaml(kind: Kind, base_model: Path) -> bytes:
    """The golden's manifest; LoRA's pretrained model where the Hugging Face export finds it (the sandbox)."""
    text = (GOLDEN / RELEASE / kind.golden / "job.yaml").read_text()
    if kind.golden == "lora":
        text = text.replace("pretrained: base-model", f"pretrained: {base_model}")
        assert str(base_model) in text
    return text.encode()


def write_volume(p: Pristine, run: Path) -> None:
    directory = run / "checkpoints" / p.kind.replica
    store: Any
    if p.kind.sharded:
        store = ShardedStore(directory, len(STEPS), p.identity)
    else:
        store = CheckpointStore(directory, len(STEPS), p.identity, background=False)
    for step in STEPS:
        store.save(step, p.states[step])
        store.wait()
    (run / "job.yaml").write_bytes(p.job_yaml)
    p.volume = {str(f.relative_to(run)): f.read_bytes() for f in sorted(run.rglob("*")) if f.is_file()}


def write_bucket(p: Pristine, client: Any, bucket: str, local: Path) -> None:
    root = ObjectURI(bucket, f"pristine-{p.kind.golden}/")
    prefix = root.child(f"{p.kind.replica}/")
    if p.kind.sharded:
        store: Any = ObjectShardedStore(local, prefix, len(STEPS), p.identity, store=client)
    else:
        store = ObjectCheckpointStore(local, prefix, len(STEPS), p.identity, background=False, store=client)
    for step in STEPS:
        store.save(step, p.states[step])
        store.wait()
    write_job(root, p.job_yaml, client)
    p.bucket = {i.uri.key[len(root.key):]: client.get_bytes(i.uri, 64 << 20) for i in client.list(root)}


def pristine(kind: Kind, scratch: Path, base_model: Path, client: Any, bucket: str) -> Pristine:
    _, base = final_state(GOLDEN / RELEASE / kind.golden / "checkpoints" / kind.replica)
    yaml_bytes = job_yaml(kind, base_model)
    (scratch / f"{kind.golden}.yaml").write_bytes(yaml_bytes)
    identity = JobIdentity.of(load_one(scratch / f"{kind.golden}.yaml").spec)
    states = {step: step_state(base, step) for step in STEPS}
    weights = {step: dict(states[step]["params"] if "params" in states[step] else states[step]["model"])
               for step in STEPS}
    p = Pristine(kind, yaml_bytes, identity, states, weights)
    write_volume(p, scratch / "volume" / kind.golden)
    write_bucket(p, client, bucket, scratch / "bucket" / kind.golden)
    return p


def fresh_copy(p: Pristine, storage: str, n: int, folder: Path, client: Any, bucket: str) -> VolumeCopy | BucketCopy:
    """Mutation `n`'s own copy of a kind's pristine checkpoints: a run directory in `folder`, or prefix t<n>/."""
    if storage == "volume":
        run = folder / "run"
        for name, data in p.volume.items():
            (run / name).parent.mkdir(parents=True, exist_ok=True)
            (run / name).write_bytes(data)
        return VolumeCopy(run, p.kind.replica)
    root = f"t{n:04d}/"
    for key, data in p.bucket.items():
        client.put_bytes(ObjectURI(bucket, root + key), data)
    return BucketCopy(client, bucket, root, p.kind.replica, folder / "mirror")


# --- what reads checkpoints back ------------------------------------------------------------------------------


@dataclass
class Outcome:
    value: Any = None
    error: BaseException | None = None


def attempt(call: Any, *args: Any, **kwargs: Any) -> Outcome:
    try:
        return Outcome(value=call(*args, **kwargs))
    except KeyboardInterrupt:
        raise
    except BaseException as err:  # noqa: BLE001 - DCP's CheckpointException is one: every escape is judged
        return Outcome(error=err)


def template_of(state: Any) -> Any:
    """What a restarted sharded job passes to the restore: the state's structure, tensors zeroed, step -1."""
    def zeroed(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return torch.zeros_like(value)
        if isinstance(value, dict):
            return {k: zeroed(v) for k, v in value.items()}
        if isinstance(value, list):
            return [zeroed(v) for v in value]
        return copy.deepcopy(value)

    return {**zeroed(state), "step": -1}


def restore(p: Pristine, copy_: VolumeCopy | BucketCopy, local: Path, client: Any) -> tuple[Any, list[str]]:
    """(step, state) as the job's restore gives it (None: nothing to resume), and what it set aside."""
    if not p.kind.sharded:
        if isinstance(copy_, VolumeCopy):
            store: Any = CheckpointStore(copy_.dir, len(STEPS), p.identity, background=False)
        else:
            store = ObjectCheckpointStore(local, copy_.prefix, len(STEPS), p.identity, background=False,
                                          store=client)
        found = store.load_latest()
        return found, [where for where, _ in store.set_aside_log]
    if isinstance(copy_, VolumeCopy):
        store = ShardedStore(copy_.dir, len(STEPS), p.identity)
    else:
        store = ObjectShardedStore(local, copy_.prefix, len(STEPS), p.identity, store=client)
    for _ in range(len(STEPS) + 3):  # each round sets one aside; more rounds than checkpoints is a loop
        newest = store.newest()
        if newest is None:
            return None, [where for where, _ in store.set_aside_log]
        template = template_of(p.states[STEPS[-1]])
        if store.load_or_set_aside(newest[1], template):
            return (newest[0], template), [where for where, _ in store.set_aside_log]
    raise AssertionError(f"the sharded restore kept offering checkpoints: {store.set_aside_log}")


@dataclass
class Observed:
    source: Path | None
    mirror: Outcome | None
    verify: Outcome
    compare: Outcome
    export: Outcome
    export_path: Path
    fmt: str
    restore: Outcome


def observe(p: Pristine, copy_: VolumeCopy | BucketCopy, folder: Path, client: Any, fmt: str) -> Observed:
    """Every reader of the copy, the read-only tools first (the restore sets checkpoints aside)."""
    mirrored = None
    if isinstance(copy_, BucketCopy):
        mirrored = attempt(mirror, copy_.root, copy_.mirror, client)
        source = copy_.mirror if mirrored.error is None else None
    else:
        source = copy_.run
    out = folder / "out" / {"torch": "model.pt", "safetensors": "model.safetensors", "huggingface": "hf"}[fmt]
    out.parent.mkdir(parents=True)
    if source is None:
        assert mirrored is not None
        verified = compared = exported = mirrored
    else:
        verified = attempt(verify_checkpoints, source, run_eval=False)
        compared = attempt(final_parameters, source)
        exported = attempt(export, [source], out, fmt=fmt)
    restored = attempt(restore, p, copy_, folder / "local", client)
    return Observed(source, mirrored, verified, compared, exported, out, fmt, restored)


# --- what is accepted -----------------------------------------------------------------------------------------


def equal(a: Any, b: Any) -> bool:
    """Bit for bit (tensors: dtype, shape and bytes), a tuple and a list of the same items alike."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


CHECKPOINT_NAME = re.compile(r"(ckpt-[0-9]{8}\.pt|sharded-[0-9]{8})")


def named(err: BaseException, copy_: VolumeCopy | BucketCopy, source: Path | None) -> bool:
    """Whether an error's message names the checkpoint, its folder or its URI."""
    text = str(err)
    places = [copy_.where, str(copy_.root) if isinstance(copy_, BucketCopy) else str(copy_.run)]
    if source is not None:
        places.append(str(source))
    return bool(CHECKPOINT_NAME.search(text)) or any(place in text for place in places)


def digests(tensors: Any) -> set[str]:
    """Each tensor's bytes and shape, as one string."""
    found = tensors.values() if isinstance(tensors, dict) else tensors
    return {hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest() + str(tuple(t.shape))
            for t in found}


def exported_weights(obs: Observed) -> Any:
    """What the export wrote, read back as a user would."""
    if obs.fmt == "torch":
        return torch.load(obs.export_path, weights_only=True)
    from safetensors.torch import load_file

    if obs.fmt == "safetensors":
        return load_file(str(obs.export_path))
    return load_file(str(obs.export_path / "adapter_model.safetensors"))


def written_are(fmt: str, got: Any, weights: dict[str, torch.Tensor]) -> bool:
    """Whether an export's file holds `weights`: all of them (torch, safetensors), or a LoRA job's adapters among
    them (huggingface)."""
    if fmt == "huggingface":
        return bool(digests(got)) and digests(got) <= digests(weights)
    return equal(got, weights)


def holder(holds: list[int]) -> str:
    return f"step {holds[0]}" if holds else "no checkpoint written"


def escaped(op: str, err: BaseException) -> str:
    return f"{op}: {type(err).__name__} escaped: {str(err)[:300]}"


def judge_tools(p: Pristine, copy_: VolumeCopy | BucketCopy, obs: Observed) -> list[str]:
    """What verify, compare and export (and a bucket's mirror, which they read) did wrong; empty if nothing."""
    faults: list[str] = []
    # The mirror: what `kubetrain checkpoints ... s3://` copies first; a LoadError is its exit 3.
    if obs.mirror is not None and obs.mirror.error is not None:
        if not (isinstance(obs.mirror.error, LoadError) and named(obs.mirror.error, copy_, None)):
            faults.append(escaped("mirror", obs.mirror.error))
    if obs.source is None:
        return faults
    if obs.verify.error is not None:
        if not (isinstance(obs.verify.error, VerifyError) and named(obs.verify.error, copy_, obs.source)):
            faults.append(escaped("verify", obs.verify.error))
    else:
        # A problem names the file in the copy verify read, or (what a bucket's copy left out) the object's URI.
        unnamed = [q for q in obs.verify.value["problems"] if str(obs.source) not in q and copy_.where not in q]
        if unnamed:
            faults.append(f"verify: problems that name no checkpoint: {unnamed}")
    if obs.compare.error is not None:
        if not (isinstance(obs.compare.error, VerifyError) and named(obs.compare.error, copy_, obs.source)):
            faults.append(escaped("compare", obs.compare.error))
    else:
        final = obs.compare.value
        holds = [s for s in STEPS if equal(final["params"], p.weights[s])]
        if holds != [final["step"]]:
            faults.append(f"compare: read step {final['step']} with the parameters of {holder(holds)}")
    if obs.export.error is not None:
        err = obs.export.error
        if not (isinstance(err, ExportError) and err.exit_code == 3 and named(err, copy_, obs.source)):
            faults.append(escaped(f"export ({obs.fmt})", err))
    else:
        got = exported_weights(obs)
        holds = [s for s in STEPS if written_are(obs.fmt, got, p.weights[s])]
        if holds != [obs.export.value.step]:
            faults.append(f"export: reported step {obs.export.value.step} and wrote the weights of {holder(holds)}")
    return faults


def judge_restore(p: Pristine, copy_: VolumeCopy | BucketCopy, obs: Observed) -> tuple[str, list[str]]:
    """What the restore did (fallback, refusal or harmless), and what it did wrong."""
    if obs.restore.error is not None:
        err = obs.restore.error
        spec = isinstance(err, ConfigError) and "different spec" in str(err)
        if (spec or type(err) is LoadError) and named(err, copy_, None):
            return "refusal", []
        return "refusal", [escaped("restore", err)]
    found, set_aside = obs.restore.value
    if found is None:
        return "refusal", ["restore: found nothing to resume, though the older checkpoints were valid"]
    step, state = found
    faults = []
    holds = [s for s in STEPS if equal(state, p.states[s])]
    if holds != [step]:
        faults.append(f"restore: returned step {step} with the state of {holder(holds)}")
    # What the restore sets aside, verify names as bad: the same checks, seen by the tools.
    if obs.source is not None and obs.verify.error is None:
        problems = obs.verify.value["problems"]
        for where in set_aside:
            name = CHECKPOINT_NAME.search(where)
            if name is None or not any(name.group(1) in q for q in problems):
                faults.append(f"verify: says nothing of {where}, which the restore set aside (problems: {problems})")
    return ("harmless" if step == STEPS[-1] else "fallback"), faults


# --- the command line -----------------------------------------------------------------------------------------


def cli_command(action: str, copy_: VolumeCopy | BucketCopy, folder: Path, pristine_run: Path) -> list[str]:
    source = str(copy_.root) if isinstance(copy_, BucketCopy) else str(copy_.run)
    base = [sys.executable, "-m", "kubetrain.cli", "checkpoints", action]
    if action == "verify":
        return [*base, source, "--no-eval"]
    if action == "export":
        return [*base, source, "--out", str(folder / "cli-model.pt")]
    return [*base, source, str(pristine_run)]


def cli_expected(action: str, copy_: VolumeCopy | BucketCopy, folder: Path, pristine_run: Path) -> int:
    """The exit code the command's own calls give in this process, on the copy as the command saw it (before the
    restore sets anything aside): what the command must exit with."""
    if isinstance(copy_, BucketCopy):
        staged = attempt(mirror, copy_.root, folder / "cli-mirror", copy_.client)
        if staged.error is not None:
            return 3 if isinstance(staged.error, LoadError) else -1
        source = folder / "cli-mirror"
    else:
        source = copy_.run
    if action == "verify":
        got = attempt(verify_checkpoints, source, run_eval=False)
        return 2 if isinstance(got.error, VerifyError) else (-1 if got.error else (0 if got.value["ok"] else 1))
    if action == "export":
        (folder / "cli-expected").mkdir()
        got = attempt(export, [source], folder / "cli-expected" / "model.pt")
        return got.error.exit_code if isinstance(got.error, ExportError) else (-1 if got.error else 0)
    got = attempt(compare_checkpoints, [source, pristine_run], run_eval=False)
    return 2 if isinstance(got.error, VerifyError) else (-1 if got.error else (0 if got.value["ok"] else 1))


# --- the run --------------------------------------------------------------------------------------------------


@dataclass
class Sandbox:
    """The folder the tools are given (`root`), and what lies outside it: the canary folder and the decoy file,
    beside it in `parent`, whose entries must not change."""

    parent: Path
    root: Path
    canary: Canary
    entries: list[str] = field(default_factory=list)
    decoy: tuple[bytes, int] = (b"", 0)

    @classmethod
    def make(cls, parent: Path) -> "Sandbox":
        box = cls(parent, parent / "sandbox", Canary(parent / "canary", parent / "decoy" / "secret.pt"))
        for folder in (box.root / "tmp", box.canary.folder, box.canary.decoy.parent):
            folder.mkdir(parents=True)
        box.canary.decoy.write_bytes(b"decoy: nothing may write here\n")
        return box

    def seal(self) -> None:
        """From here on nothing may appear beside the sandbox, nor change in the decoy."""
        self.entries = sorted(p.name for p in self.parent.iterdir())
        self.decoy = (self.canary.decoy.read_bytes(), self.canary.decoy.stat().st_mtime_ns)

    def written_outside(self) -> list[str]:
        found = [str(self.canary.folder / e) for e in self.canary.escapes()]
        found += [str(self.parent / e) for e in sorted(p.name for p in self.parent.iterdir()) if e not in self.entries]
        if (self.canary.decoy.read_bytes(), self.canary.decoy.stat().st_mtime_ns) != self.decoy:
            found.append(str(self.canary.decoy))
        return found


@dataclass
class Prepared:
    """Mutation `n` applied to its own copy."""

    n: int
    pristine: Pristine
    storage: str
    copy: VolumeCopy | BucketCopy
    mutation: str
    what: str
    folder: Path
    fmt: str


@dataclass
class Tally:
    counts: dict[str, int] = field(default_factory=lambda: {"fallback": 0, "refusal": 0, "harmless": 0})
    failures: list[str] = field(default_factory=list)
    executions: list[str] = field(default_factory=list)
    escapes: list[str] = field(default_factory=list)
    mutations: dict[str, int] = field(default_factory=dict)
    covered: set[tuple[str, str]] = field(default_factory=set)
    commands: list[str] = field(default_factory=list)
    """Each command of the sample with its exit code."""

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def line(self, seconds: float) -> str:
        return (f"tampering seed={SEED} mutations={self.total} fallbacks={self.counts['fallback']} "
                f"refusals={self.counts['refusal']} harmless={self.counts['harmless']} "
                f"executions={len(self.executions)} escapes={len(self.escapes)} combinations={len(self.covered)} "
                f"cli={len(CLI_SAMPLE)} failures={len(self.failures)} seconds={seconds:.0f}")


def prepare(n: int, pristines: dict[str, Pristine], box: Sandbox, client: Any, bucket: str) -> Prepared:
    """Mutation n: its kind and storage in turn, its change drawn from its own random source (SEED and n)."""
    rng = random.Random(f"{SEED}/{n}")
    if n < len(FIRST):
        kind, storage, mutation = FIRST[n]
    else:
        kind, storage = COMBINATIONS[n % len(COMBINATIONS)]
        mutation = draw(rng, kind.sharded, storage == "bucket")
    p = pristines[kind.name]
    folder = box.root / f"m{n:04d}"
    folder.mkdir()
    copy_ = fresh_copy(p, storage, n, folder, client, bucket)
    other = pristines[rng.choice([o for o in KINDS if o is not kind]).name].identity
    detail = mutation.apply(Tamper(n, rng, copy_, box.canary, (other.spec_hash, dict(other.document or {}))))
    fmt = rng.choice(["torch", "safetensors"] + (["huggingface"] if kind.golden == "lora" else []))
    return Prepared(n, p, storage, copy_, mutation.name, f"{kind.name}/{storage} {mutation.name}: {detail}", folder,
                    fmt)


def shown(caplog: Any, capsys: Any) -> list[str]:
    """Tracebacks logged or printed since the last call."""
    found = []
    for record in caplog.records:
        # torch's DCP logs each failed load with its traceback to its own logger, whose only handler is a
        # NullHandler and which does not propagate: never shown. Any other record is.
        if record.name.startswith("c10d-"):
            continue
        if record.exc_info or "Traceback" in record.getMessage():
            found.append(f"a traceback was logged: {record.getMessage()[:300]}")
    caplog.clear()
    printed = capsys.readouterr()
    if "Traceback" in printed.out + printed.err:
        found.append(f"a traceback was printed: {(printed.out + printed.err)[-1500:]}")
    return found


def check_one(m: Prepared, box: Sandbox, tally: Tally, client: Any, caplog: Any, capsys: Any,
              cli: tuple[str, subprocess.Popen[str], Path] | None = None) -> None:
    """Every reader of mutation m's copy, judged; its outcome counted, its faults noted."""
    tally.covered.add((m.pristine.kind.name, m.storage))
    tally.mutations[m.mutation] = tally.mutations.get(m.mutation, 0) + 1
    faults: list[str] = []
    if cli is not None:
        action, process, pristine_run = cli
        _, err = process.communicate(timeout=600)
        expected = cli_expected(action, m.copy, m.folder, pristine_run)
        tally.commands.append(f"{action} ({m.pristine.kind.name}, {m.storage}) exit {process.returncode}")
        if process.returncode not in (0, 1, 2, 3) or process.returncode != expected or "Traceback" in err:
            faults.append(f"kubetrain checkpoints {action}: exit {process.returncode} (in-process: {expected}), "
                          f"stderr: {err.strip()[-1500:]}")
    obs = observe(m.pristine, m.copy, m.folder, client, m.fmt)
    outcome, found = judge_restore(m.pristine, m.copy, obs)
    faults += judge_tools(m.pristine, m.copy, obs) + found + shown(caplog, capsys)
    tally.counts[outcome] += 1
    ran = [e for e in box.canary.executions() if e not in tally.executions]
    tally.executions += ran
    if ran:
        faults.append(f"code ran: {ran}")
    outside = [e for e in box.written_outside() if e not in tally.escapes]
    tally.escapes += outside
    if outside:
        faults.append(f"written outside the sandbox: {outside}")
    if faults:
        tally.failures.append(f"mutation {m.n} ({m.what}) -> {outcome}:\n    " + "\n    ".join(faults))
        return  # its copy stays, to look at
    shutil.rmtree(m.folder)
    if isinstance(m.copy, BucketCopy):
        client.delete([i.uri for i in client.list(m.copy.root)])


def markers_run(box: Sandbox) -> None:
    """The markers write their file when something trusting unpickles them: no file in the canary folder is
    proof that nothing did."""
    for label, make in [*((cls.__name__, lambda path, cls=cls: pickle.dumps(cls(path))) for cls in MARKERS),
                        ("shell_pickle", shell_pickle)]:
        path = box.root / "tmp" / f"self-check-{label}"
        pickle.loads(make(path))
        assert path.exists(), f"{label} did not write {path} when unpickled"
        path.unlink()


# --- the test -------------------------------------------------------------------------------------------------


def test_tampered_checkpoints_run_no_code_write_nothing_outside_and_fall_back_or_fail_by_name(
        tmp_path, s3, bucket, caplog, capsys, monkeypatch):
    started = time.monotonic()
    box = Sandbox.make(tmp_path)
    # The tools' own temporary folders (the Hugging Face export's, a command's staging) in the sandbox too.
    monkeypatch.setattr(tempfile, "tempdir", str(box.root / "tmp"))
    shutil.copytree(MANIFESTS / "base-model", box.root / "base-model")
    client = s3.store()
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    pristines = {kind.name: pristine(kind, scratch, box.root / "base-model", client, bucket) for kind in KINDS}
    shutil.rmtree(scratch)
    pristine_runs = {kind.name: fresh_copy(pristines[kind.name], "volume", -1, box.root / f"pristine-{kind.golden}",
                                           client, bucket).run for kind in KINDS}
    box.seal()
    markers_run(box)
    caplog.clear()
    capsys.readouterr()

    # The command-line sample runs in subprocesses beside the rest; each copy is judged once its command ended.
    env = {**s3.environ(), "PYTHONSAFEPATH": "1", "TMPDIR": str(box.root / "tmp")}
    sample = {}
    for n, action in CLI_SAMPLE.items():
        m = prepare(n, pristines, box, client, bucket)
        run = pristine_runs[m.pristine.kind.name]
        process = subprocess.Popen(cli_command(action, m.copy, m.folder, run), cwd=box.root, env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        sample[n] = (m, (action, process, run))
    tally = Tally()
    n = 0
    while n < MIN_MUTATIONS or (time.monotonic() - started < BUDGET_S and n < MAX_MUTATIONS):
        if n not in sample:
            check_one(prepare(n, pristines, box, client, bucket), box, tally, client, caplog, capsys)
        n += 1
    for m, cli in sample.values():
        check_one(m, box, tally, client, caplog, capsys, cli)

    with capsys.disabled():
        print(f"\n{tally.line(time.monotonic() - started)}")
        print("  by mutation: " + ", ".join(f"{k} {v}" for k, v in sorted(tally.mutations.items())))
        print("  kubetrain checkpoints: " + ", ".join(tally.commands))
    assert len(tally.covered) == len(COMBINATIONS)
    assert not tally.executions, f"code ran: {tally.executions}"
    assert not tally.escapes, f"written outside the sandbox: {tally.escapes}"
    assert not tally.failures, (f"{len(tally.failures)} of {tally.total} mutations had an outcome the property "
                                "refuses:\n" + "\n".join(tally.failures[:12]))
