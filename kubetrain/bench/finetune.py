"""`kubetrain bench finetune`: the built-in causal-LM fine-tuning loop against a hand-written FSDP2 loop, what
loading a pretrained model costs each rank, and the Hugging Face export, measured in one run.

Made first, with examples/finetune/make_model.py (random weights: neither speed nor memory depends on them):
a Llama of `--hidden` x `--layers` (4 heads, a vocabulary of SPEED_VOCAB) for the speed, a larger one of
`--load-hidden` x `--load-layers` (LOAD_HEADS heads, a vocabulary of LOAD_VOCAB: 84M parameters by default)
saved in LOAD_FILES safetensors files for the memory, and a corpus of JSON Lines (the standard library's
top-level *.py files, one record per file, TEXT_BYTES_PER_TOKEN bytes per token the runs train on).

1. Speed (`speed`). The same fine-tuning, `--rounds` times, the two loops alternating (medians compared):
   - kubetrain: `kubetrain run` of a DDP job of 2 nodes x 1 rank (gloo, 1 thread each, kubetrain's
     default), `ddp.strategy: FSDP`, model causal-lm, `--steps` steps of `--batch` packed samples of `--seq`
     tokens per rank, AdamW, no checkpoint before the final one. Its figure: every rank's
     `samples_per_second` of results/ddp-*.json (its samples over the sum of its steps' seconds, each step
     from the batch's fetch to the loss's all-reduce; start-up, evaluations and checkpoints excluded) x
     `--seq`, summed over the 2 ranks;
   - by hand: 2 ranks under `torchrun --nproc-per-node 2` (gloo, 1 thread each), `from_pretrained` of the
     same directory, `fully_shard` on every decoder layer then on the root, AdamW with the job's learning
     rate and weight decay, the job's own samples (kubetrain's load_text and cursor on the same job file:
     the same tokens in the same shapes), the cross entropy of the shifted logits; each step timed from the
     batch's fetch to the optimizer's step, the same `--steps`, summed the same way.
   `ratio_tokens_per_second` is kubetrain's over the hand loop's (aim >= 0.95), every step counted in both.
   Both evaluate the pretrained model on the held-out samples before their first step (kubetrain's
   `baseline_eval_loss`; not timed), so FSDP's lazy initialisation falls there in both.
   `ratio_tokens_per_second_steady` leaves the first WARMUP_STEPS steps out of both: the hand loop's
   per-step seconds, and kubetrain's `train` events (written after every step of a run of up to 200 steps)
   from the event of step WARMUP_STEPS to the last one, which also counts what the loop does between two
   steps (progress, metrics, events); `ratio_tokens_per_second_median_step` compares the median step after
   the warm-up (the least moved by a burst of other processes on the machine); `ratio_tokens_per_second_cpu`
   the tokens per CPU second of the ranks over the same steps (CpuWatch): what the loop costs, unmoved by
   other processes taking the cores (on a shared machine they moved the wall-clock ratio of a round by 20 %).
   Beside them, `kubetrain_peak_rss_bytes` and `hand_peak_rss_bytes`: a rank's peak resident set (VmHWM)
   at its last step (the larger rank's, the median of the rounds).
2. Loading the pretrained model (`load`), 2 ranks under torchrun, each path in processes of its own:
   - kubetrain: CausalLM built on the meta device, `fsdp.shard` over the 2 ranks, then `materialize` on the
     CPU (every rank reading only its rows from the safetensors files);
   - naive: `from_pretrained` of the whole model on every rank, then `fully_shard` as the hand loop does.
   The figure is the highest, over the ranks, of the peak during the load minus the size before (sampled
   every 5 ms) over the rank's shard (the parameters' bytes / 2), both of the resident set (VmRSS) and of
   its anonymous part (RssAnon). The aim (kubetrain <= 1.5) is judged on the anonymous part: the file
   pages a process maps while it reads a safetensors file count in its resident set, but they are clean
   page cache the kernel drops under memory pressure rather than kill the process; the anonymous pages are
   what the rank must have room for. Both are printed.
3. The export (`export`): a 1-step FSDP run of the larger model (2 ranks, a sharded checkpoint of the model
   and AdamW's state), then `kubetrain checkpoints export RUN --format huggingface --max-shard-size
   (parameter bytes / EXPORT_FILES)`: `cli_seconds` and `cli_max_rss_bytes`, the command's wall time
   (Python's start-up included) and its peak resident set (the kernel's ru_maxrss, imports included); and
   the same export inside a process that imported the export's modules first: its seconds and its peak
   resident set and anonymous memory above the size before, over the model's parameter bytes and over one
   output file's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from .jobs import manifest
from .sharded import SAMPLE_SECONDS, PeakRSS, current_rss

RANKS = 2
THREADS = 1
"""Threads per rank in both loops: kubetrain's default (KUBETRAIN_THREADS), one core per rank on 2 cores."""
SPEED_HEADS, SPEED_VOCAB = 4, 2048
LOAD_HEADS, LOAD_VOCAB = 8, 8192
LOAD_FILES = 8
"""Safetensors files of the larger model, as a hub model of some size comes: kubetrain's materialize maps one
file at a time, so the file pages a rank holds while it loads are one file's at most."""
EXPORT_FILES = 4
"""Output files of the export (--max-shard-size = parameter bytes / this): kubetrain/trainer/hf_export.py bounds the
export's memory by one output file, which the figures over max_shard_bytes check."""
TEXT_BYTES_PER_TOKEN = 8
"""The corpus holds this many bytes of text per token the runs train on: more than twice what a token of the
speed model's vocabulary covers (3.4 bytes of the standard library's Python), so that no epoch ends (an
evaluation) inside the timed steps, and every rank tokenizes little more text than the run needs."""
EXPORT_CORPUS_BYTES = 50_000
"""The export's 1-step run needs only a few samples: less text to tokenize, fewer held-out samples to
evaluate twice with the larger model."""
EVAL_FRACTION = 0.005
LEARNING_RATE, WEIGHT_DECAY = 3e-4, 0.01
WARMUP_STEPS = 2
"""Steps left out of the steady figures: the first allocates AdamW's state and the backward's buffers, and the
second was still slow in both loops (seen: 1.3-1.6x and 1.1-1.5x the median step)."""
SUBPROCESS_TIMEOUT = 1800
MAKE_MODEL = Path(__file__).resolve().parents[2] / "examples" / "finetune" / "make_model.py"


class Progress:
    """Progress lines on stderr, each with the seconds since the benchmark began (the JSON goes to stdout)."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def __call__(self, message: str) -> None:
        print(f"bench finetune [{time.monotonic() - self.started:4.0f} s]: {message}", file=sys.stderr, flush=True)


def child_env() -> dict[str, str]:
    """Every process's environment: the bench's own threads, loopback gloo, and no shadowing of the standard
    library's `operator` by the checkout's folder when the working directory is the repository."""
    return {**os.environ, "PYTHONSAFEPATH": "1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": str(THREADS),
            "KUBETRAIN_THREADS": str(THREADS)}


def run_checked(argv: list[str], what: str, cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, env=child_env(), cwd=cwd, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    return done


def torchrun(role: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", "127.0.0.1:0", "-m", __name__, role, *args]


# --- the inputs ----------------------------------------------------------------------------------------------


def make_model(out: Path, hidden: int, layers: int, heads: int, vocab: int, files: int = 1) -> dict[str, Any]:
    """A randomly initialised Llama directory (make_model.py); `files` > 1: sharded into about that many."""
    if not MAKE_MODEL.is_file():
        raise RuntimeError(f"{MAKE_MODEL}: not found; kubetrain bench finetune runs from a checkout")
    argv = [sys.executable, str(MAKE_MODEL), str(out), "--hidden", str(hidden), "--layers", str(layers), "--heads",
            str(heads), "--vocab", str(vocab), "--pretrain-steps", "0"]
    if files > 1:
        argv += ["--shard-size", str(max(1 << 16, parameter_count(hidden, layers, vocab) * 4 // files))]
    said = run_checked(argv, f"make_model.py {out.name}", out.parent).stdout
    config = json.loads((out / "config.json").read_text())
    if config["vocab_size"] != vocab:  # its BPE stops early on too little text
        raise RuntimeError(f"{out}: the tokenizer reached {config['vocab_size']} tokens, not {vocab}")
    found = re.search(r"model: ([0-9,]+) parameters", said)
    if found is None:
        raise RuntimeError(f"make_model.py {out.name}: no parameter count in its output:\n{said[-1000:]}")
    count = int(found[1].replace(",", ""))
    return {"parameters": count, "parameter_bytes": count * 4, "files": len(list(out.glob("*.safetensors"))),
            "shape": f"Llama: hidden {hidden}, {layers} layers, {heads} heads, vocabulary {vocab}, float32"}


def parameter_count(hidden: int, layers: int, vocab: int) -> int:
    """The parameters of make_model.py's Llama (untied embedding and head, an MLP of 4 x hidden up to a multiple
    of 32, two RMSNorms per layer and a final one), for its --shard-size; the count it prints is the one
    reported."""
    mlp = -(-4 * hidden // 32) * 32
    per_layer = 4 * hidden * hidden + 3 * hidden * mlp + 2 * hidden
    return layers * per_layer + 2 * vocab * hidden + hidden


def write_corpus(path: Path, limit: int) -> int:
    """The standard library's top-level *.py files in name order, one JSON Lines record each, up to `limit`
    bytes of text; the records written."""
    import sysconfig

    count, size = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        for source in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
            if size >= limit:
                break
            text = source.read_text(encoding="utf-8", errors="replace")[: limit - size]
            f.write(json.dumps({"text": text}) + "\n")
            count, size = count + 1, size + len(text)
    return count


def job_doc(name: str, model_dir: Path, corpus: Path, steps: int, batch: int, seq: int) -> dict[str, Any]:
    return manifest(name, {
        "mode": "DDP",
        "ddp": {"nodes": RANKS, "procsPerNode": 1, "backend": "gloo", "strategy": "FSDP"},
        "model": {"name": "causal-lm", "pretrained": str(model_dir)},
        "dataset": {"path": str(corpus), "format": "text", "sequenceLength": seq, "evalFraction": EVAL_FRACTION},
        "training": {"maxSteps": steps, "batchSize": batch, "seed": 0, "device": "cpu",
                     "optimizer": {"name": "adamw", "learningRate": LEARNING_RATE, "weightDecay": WEIGHT_DECAY}},
        # Past maxSteps: the only checkpoint is the final one, after the timed steps.
        "checkpoint": {"intervalSteps": steps + 1, "keepLast": 1, "storage": {"accessMode": "ReadWriteMany"}},
        "metrics": {"port": 0},
    })


# --- 1. speed ------------------------------------------------------------------------------------------------


class CpuWatch:
    """Each rank's CPU seconds (user and system, every thread: /proc/PID/stat) from its step WARMUP_STEPS to
    its last, read as the bench sees those steps' lines in the rank's event file: kubetrain's own
    metrics/ddp-N.jsonl, or the same `start` (with the pid) and `train` lines the hand loop writes. Both loops
    are watched alike, so the watching costs both the same; a line is seen POLL_SECONDS after it was written
    at most, while the rank goes on: an error of 0.02 s of CPU against the ~10 s of the window."""

    POLL_SECONDS = 0.01

    def __init__(self, files: list[Path], steps: int):
        from kubetrain.drivers.local.progress import JsonlTail

        self.tails = [JsonlTail(f) for f in files]
        self.steps = steps
        self.pids: dict[int, int] = {}
        self.marks: dict[int, list[tuple[int, float]]] = {rank: [] for rank in range(len(files))}
        """(samples, CPU seconds) of each rank at the first step >= WARMUP_STEPS and at the last."""
        self.peak_rss: dict[int, int] = {}
        """Each rank's peak resident set (VmHWM) at its last step: the model, its gradients, AdamW's state,
        the data and the activations' high-water mark, every byte the process touched so far."""

    def run(self, argv: list[str], what: str, cwd: Path) -> float:
        """Run `argv` to its end, watching; its wall seconds."""
        started = time.perf_counter()
        with open(cwd / f"{what.replace(' ', '-')}.log", "wb") as log:
            proc = subprocess.Popen(argv, env=child_env(), cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
            try:
                while proc.poll() is None:
                    self.poll()
                    time.sleep(self.POLL_SECONDS)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        wall = time.perf_counter() - started
        if proc.returncode != 0:
            raise RuntimeError(f"{what} failed ({proc.returncode}):\n{Path(log.name).read_text()[-3000:]}")
        return wall

    def poll(self) -> None:
        for rank, tail in enumerate(self.tails):
            for event in tail.read():
                if event.get("event") == "start":
                    self.pids[rank] = event["pid"]
                elif event.get("event") == "train" and rank in self.pids:
                    marks = self.marks[rank]
                    if (not marks and event["step"] >= WARMUP_STEPS) or event["step"] == self.steps:
                        try:
                            marks.append((event["samples"], _cpu_seconds(self.pids[rank])))
                            if event["step"] == self.steps:
                                self.peak_rss[rank] = _status_bytes(self.pids[rank], "VmHWM")
                        except OSError:  # gone already: `window` names the step not seen
                            pass

    def window(self, rank: int, seq: int) -> dict[str, float]:
        """The tokens a rank trained after its warm-up steps and the CPU seconds it spent on them."""
        marks = self.marks[rank]
        if len(marks) != 2:
            raise RuntimeError(f"rank {rank}: its steps {WARMUP_STEPS} and {self.steps} were not both seen "
                               f"({marks})")
        (samples_a, cpu_a), (samples_b, cpu_b) = marks
        return {"window_tokens": (samples_b - samples_a) * seq, "window_cpu_seconds": cpu_b - cpu_a,
                "peak_rss_bytes": self.peak_rss[rank]}


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process (every thread), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def kubetrain_round(job: Path, run_dir: Path, steps: int, seq: int) -> dict[str, Any]:
    """One `kubetrain run` of the job: each rank's tokens per second over every step, steady, of its median
    step, and per CPU second."""
    from kubetrain.trainer.events import read_events

    watch = CpuWatch([run_dir / "metrics" / f"ddp-{rank}.jsonl" for rank in range(RANKS)], steps)
    wall = watch.run([sys.executable, "-m", "kubetrain.cli", "run", str(job), "--run-dir", str(run_dir), "--quiet"],
                     f"kubetrain run {run_dir.name}", run_dir.parent)
    ranks = []
    for rank in range(RANKS):
        result = json.loads((run_dir / "results" / f"ddp-{rank}.json").read_text())
        if result["steps"] != steps:
            raise RuntimeError(f"{run_dir}: ddp-{rank} ran {result['steps']} steps, not {steps}")
        train = [e for e in read_events(run_dir / "metrics" / f"ddp-{rank}.jsonl") if e["event"] == "train"]
        steady = [e for e in train if e["step"] >= WARMUP_STEPS]
        first, last = steady[0], steady[-1]
        # Between two events: every step between them, the loop's bookkeeping included.
        rates = [(b["samples"] - a["samples"]) * seq / (b["time"] - a["time"]) for a, b in zip(steady, steady[1:])]
        ranks.append({"tokens_per_second": result["samples_per_second"] * seq,
                      "steady_tokens_per_second": (last["samples"] - first["samples"]) * seq / (last["time"] -
                                                                                                first["time"]),
                      "median_step_tokens_per_second": statistics.median(rates),
                      **watch.window(rank, seq)})
    return {"ranks": ranks, "wall_seconds": wall}


def hand_round(job: Path, out: Path, steps: int, seq: int) -> dict[str, Any]:
    """One torchrun of the hand-written loop on the job's model and data."""
    watch = CpuWatch([hand_events(out, rank) for rank in range(RANKS)], steps)
    wall = watch.run(torchrun("hand", str(job), str(out)), f"hand loop {out.stem}", out.parent)
    ranks = json.loads(out.read_text())
    figures = [{**f, **watch.window(rank, seq)} for rank, f in enumerate(hand_figures(ranks))]
    return {"ranks": figures, "wall_seconds": wall, "attention": ranks[0]["attention"]}


def hand_events(out: Path | str, rank: int) -> Path:
    """The event file of a rank of the hand loop (its pid, then a line per step, as kubetrain's)."""
    return Path(f"{out}.rank{rank}.jsonl")


def hand_worker(job_file: str, out: str) -> None:
    """One rank of the hand-written FSDP2 loop (torchrun's environment)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn import functional as F
    from transformers import AutoModelForCausalLM

    from kubetrain.api import load_file
    from kubetrain.trainer.causal_lm import PAD, load_text
    from kubetrain.trainer.data import ShardCursor
    from kubetrain.trainer.objectives import IGNORE_INDEX, NEXT_TOKEN

    torch.set_num_threads(THREADS)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = load_file(job_file)[0].spec
    assert spec.model is not None and spec.model.pretrained and spec.dataset is not None  # the benchmark's own job
    model_dir = Path(spec.model.pretrained)
    data = load_text(spec.dataset, model_dir, json.loads((model_dir / "config.json").read_text()))
    # Packed samples: only the corpus's last one is padded, and it is held out (the last evalFraction).
    assert not bool((data.train_x == PAD).any()), "a padded training sample: the hand loop passes no mask"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # As kubetrain's loop does before its first step (the pretrained model's held-out loss): so that neither
    # loop's first timed step pays FSDP's lazy initialisation or the first forward's allocations alone.
    model.eval()
    with torch.no_grad():
        for x in data.eval_x.split(NEXT_TOKEN.eval_batch_size):
            model(input_ids=x.clamp(min=0), attention_mask=(x != PAD).long(), use_cache=False)
    model.train()
    training = spec.require_training()
    optimizer = torch.optim.AdamW(model.parameters(), lr=training.optimizer.learning_rate,
                                  weight_decay=training.optimizer.weight_decay)
    cursor = ShardCursor(len(data.train_x), rank, world, training.batch_size, training.seed)
    seconds, samples = [], []
    # A line per step as kubetrain's loop writes one (CpuWatch reads both), flushed as kubetrain's EventLog does.
    events = open(hand_events(out, rank), "w", buffering=1)
    events.write(json.dumps({"event": "start", "pid": os.getpid()}) + "\n")
    for step in range(1, training.max_steps + 1):  # type: ignore[operator]  # WORKERS' functions
        started = time.perf_counter()
        batch = cursor.next_batch()
        x, y = data.train_x[batch], data.train_y[batch]
        optimizer.zero_grad(set_to_none=True)
        logits = model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), y[:, 1:].reshape(-1),
                               ignore_index=IGNORE_INDEX)
        loss.backward()
        optimizer.step()
        loss.item()
        seconds.append(time.perf_counter() - started)
        samples.append(len(batch))
        line = {"time": time.time(), "event": "train", "step": step, "samples": sum(samples)}
        events.write(json.dumps(line) + "\n")
    events.close()
    mine = {"rank": rank, "step_seconds": seconds, "samples": samples, "seq": spec.dataset.sequence_length,
            "attention": model.config._attn_implementation}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        Path(out).write_text(json.dumps(everyone))
    del model, optimizer
    leave_group()


def leave_group() -> None:
    """Destroy the process group once nothing holds it: a rank that destroyed it while its sharded model (whose
    mesh holds the group) was still alive once aborted at exit ("terminate called without an active
    exception"), as kubetrain/trainer/ddp/runtime.py's `leave` says of DDP's reducer."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.destroy_process_group()


def hand_figures(ranks: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Each rank's tokens per second over every step, without the first WARMUP_STEPS, and of its median step
    after them."""
    out = []
    for r in ranks:
        seconds, samples, seq = r["step_seconds"], r["samples"], r["seq"]
        rates = [n * seq / t for n, t in zip(samples[WARMUP_STEPS:], seconds[WARMUP_STEPS:])]
        out.append({"tokens_per_second": sum(samples) * seq / sum(seconds),
                    "steady_tokens_per_second": sum(samples[WARMUP_STEPS:]) * seq / sum(seconds[WARMUP_STEPS:]),
                    "median_step_tokens_per_second": statistics.median(rates)})
    return out


# --- 2. loading memory ---------------------------------------------------------------------------------------


class PeakMemory(PeakRSS):
    """PeakRSS, and beside it the peak of the anonymous part of the resident set (RssAnon): what a process
    holds that the kernel cannot drop and read again from a file."""

    def __enter__(self) -> "PeakMemory":
        self.anon_before = self.anon_peak = _anon()
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self.anon_peak = max(self.anon_peak, _anon())

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            self.peak = max(self.peak, current_rss())
            self.anon_peak = max(self.anon_peak, _anon())

    @property
    def anon_extra(self) -> int:
        return self.anon_peak - self.anon_before


def _anon() -> int:
    """RssAnon of this process in bytes."""
    return _status_bytes("self", "RssAnon")


def _status_bytes(pid: int | str, field: str) -> int:
    """A size of /proc/PID/status in bytes (RssAnon: Linux 4.5 and later)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def load_worker(path: str, model_dir: str, out: str) -> None:
    """One rank loading the pretrained model by `path` (kubetrain or naive), measured (torchrun's environment)."""
    import torch
    import torch.distributed as dist
    from safetensors import safe_open  # noqa: F401 - imported before the measure, as both paths use it
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, LlamaForCausalLM

    from kubetrain.trainer.causal_lm import CausalLM
    from kubetrain.trainer.ddp import fsdp

    torch.set_num_threads(THREADS)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    AutoConfig.from_pretrained(model_dir)
    if path == "kubetrain":
        model: Any = CausalLM(Path(model_dir), None, seed=0)
        fsdp.shard(model, torch.device("cpu"), world)
        dist.barrier()
        with PeakMemory() as peak:
            started = time.perf_counter()
            model.materialize(torch.device("cpu"))
            seconds = time.perf_counter() - started
    else:
        mesh = init_device_mesh("cpu", (world,))
        dist.barrier()
        with PeakMemory() as peak:
            started = time.perf_counter()
            model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            seconds = time.perf_counter() - started
    dist.barrier()
    from torch.distributed.tensor import DTensor

    held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters())
    mine = {"rank": rank, "seconds": seconds, "extra_rss_bytes": peak.extra, "extra_anon_bytes": peak.anon_extra,
            "held_bytes": held}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        Path(out).write_text(json.dumps(everyone))
    del model
    leave_group()


def load_memory(model_dir: Path, work: Path, progress: Progress) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path in ("kubetrain", "naive"):
        progress(f"loading {model_dir.name} the {path} way on {RANKS} ranks")
        result = work / f"load-{path}.json"
        run_checked(torchrun("load", path, str(model_dir), str(result)), f"the {path} load", work)
        out[path] = json.loads(result.read_text())
    return out


# --- 3. export -----------------------------------------------------------------------------------------------


def export_argv(run_dir: Path, out: Path, max_shard_bytes: int) -> list[str]:
    return ["checkpoints", "export", str(run_dir), "--format", "huggingface", "--out", str(out),
            "--max-shard-size", str(max_shard_bytes)]


def export_worker(run_dir: str, out_dir: str, max_shard_bytes: str, out: str) -> None:
    """The export inside this process, its modules imported before the measure."""
    import safetensors.torch  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401

    import kubetrain.trainer.hf_export  # noqa: F401
    from kubetrain.trainer.export import main_export

    with PeakMemory() as peak:
        started = time.perf_counter()
        # What `kubetrain checkpoints export RUN --format huggingface --max-shard-size N --out DIR` runs.
        code = main_export([run_dir], out_dir, fmt="huggingface",
                           hf_options={"merge_lora": False, "max_shard_bytes": int(max_shard_bytes)})
        seconds = time.perf_counter() - started
    if code != 0:
        raise SystemExit(f"the export failed ({code})")
    Path(out).write_text(json.dumps({"seconds": seconds, "extra_rss_bytes": peak.extra,
                                     "extra_anon_bytes": peak.anon_extra}))


def timed_child(argv: list[str], log: Path, cwd: Path) -> tuple[float, int]:
    """(wall seconds, peak resident set in bytes: the kernel's ru_maxrss) of a child run to its end."""
    started = time.perf_counter()
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, env=child_env(), cwd=cwd, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[2:5])} failed ({proc.returncode}):\n{log.read_text()[-3000:]}")
    return seconds, usage.ru_maxrss * 1024  # kilobytes on Linux


def export(model_dir: Path, model: dict[str, Any], work: Path, progress: Progress) -> dict[str, Any]:
    corpus = work / "export-corpus.jsonl"
    write_corpus(corpus, EXPORT_CORPUS_BYTES)
    job = work / "export-job.yaml"
    job.write_text(yaml.safe_dump(job_doc("finetune-export", model_dir, corpus, steps=1, batch=1, seq=64)))
    run_dir = work / "export-run"
    progress(f"one FSDP step of {model_dir.name} for a sharded checkpoint to export")
    run_checked([sys.executable, "-m", "kubetrain.cli", "run", str(job), "--run-dir", str(run_dir), "--quiet"],
                "kubetrain run of the export's job", work)
    max_shard = max(1 << 20, model["parameter_bytes"] // EXPORT_FILES)
    progress("exporting it with kubetrain checkpoints export")
    cli_seconds, cli_rss = timed_child([sys.executable, "-m", "kubetrain.cli", *export_argv(run_dir, work / "hf-cli",
                                                                                         max_shard)],
                                       work / "export-cli.log", work)
    result = work / "export.json"
    run_checked([sys.executable, "-m", __name__, "export", str(run_dir), str(work / "hf-inside"), str(max_shard),
                 str(result)], "the export inside a process", work)
    inside = json.loads(result.read_text())
    files = sorted(p.name for p in (work / "hf-cli").glob("*.safetensors"))
    written = sum(p.stat().st_size for p in (work / "hf-cli").glob("*.safetensors"))
    return {"max_shard_bytes": max_shard, "files": len(files), "safetensors_bytes": written,
            "cli_seconds": cli_seconds, "cli_max_rss_bytes": cli_rss, **{f"inside_{k}": v for k, v in inside.items()}}


# --- the run -------------------------------------------------------------------------------------------------


def bench_finetune(steps: int = 24, rounds: int = 2, seq: int = 128, batch: int = 8, hidden: int = 256,
                   layers: int = 4, load_hidden: int = 1024, load_layers: int = 4,
                   keep: str | None = None) -> dict[str, Any]:
    check_arguments(steps, rounds, seq, batch, hidden, layers, load_hidden, load_layers, keep)
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    progress = Progress()
    work = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="kubetrain-bench-finetune-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        progress(f"making the models and the corpus in {work}")
        speed_model = make_model(work / "speed-model", hidden, layers, SPEED_HEADS, SPEED_VOCAB)
        load_model = make_model(work / "load-model", load_hidden, load_layers, LOAD_HEADS, LOAD_VOCAB, LOAD_FILES)
        corpus = work / "corpus.jsonl"
        write_corpus(corpus, max(EXPORT_CORPUS_BYTES, steps * RANKS * batch * seq * TEXT_BYTES_PER_TOKEN))
        job = work / "job.yaml"
        job.write_text(yaml.safe_dump(job_doc("finetune-bench", work / "speed-model", corpus, steps, batch, seq)))
        kubetrain_rounds, hand_rounds = [], []
        for r in range(rounds):
            # Alternated, and the order turned each round: neither loop always runs first (or on a cooler machine).
            for which in (("kubetrain", "hand") if r % 2 == 0 else ("hand", "kubetrain")):
                progress(f"round {r + 1}/{rounds}: the {which} loop, {steps} steps")
                if which == "kubetrain":
                    kubetrain_rounds.append(kubetrain_round(job, work / f"run-{r}", steps, seq))
                else:
                    hand_rounds.append(hand_round(job, work / f"hand-{r}.json", steps, seq))
        load = load_memory(work / "load-model", work, progress)
        exported = export(work / "load-model", load_model, work, progress)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    return {**summarise(speed_model, load_model, kubetrain_rounds, hand_rounds, load, exported,
                        {"steps": steps, "batch": batch, "seq": seq}), "load_average_at_start": load_at_start}


def check_arguments(steps: int, rounds: int, seq: int, batch: int, hidden: int, layers: int, load_hidden: int,
                    load_layers: int, keep: str | None) -> None:
    if steps <= WARMUP_STEPS:
        raise ValueError(f"--steps {steps}: must be more than the {WARMUP_STEPS} warm-up steps")
    if rounds < 1 or batch < 1 or layers < 1 or load_layers < 1:
        raise ValueError("--rounds, --batch, --layers and --load-layers must be at least 1")
    if not 8 <= seq <= 512:
        raise ValueError(f"--seq {seq}: expected 8 to 512 (the models' max_position_embeddings)")
    for flag, width, heads in (("--hidden", hidden, SPEED_HEADS), ("--load-hidden", load_hidden, LOAD_HEADS)):
        if width < heads or width % heads:
            raise ValueError(f"{flag} {width}: must be a positive multiple of {heads} (the model's heads)")
    if keep is not None and Path(keep).exists() and (not Path(keep).is_dir() or any(Path(keep).iterdir())):
        raise ValueError(f"--keep {keep}: exists and is not an empty directory")


# --- the figures ---------------------------------------------------------------------------------------------

TOKENS_DECIMALS = 1
"""Tokens per second are printed to 0.1 (thousands of them here): the ratios, of the unrounded figures, agree
with the printed ones to 1e-4 of themselves."""


def summarise(speed_model: dict[str, Any], load_model: dict[str, Any], kubetrain_rounds: list[dict[str, Any]],
              hand_rounds: list[dict[str, Any]], load: dict[str, Any], exported: dict[str, Any],
              sizes: dict[str, int]) -> dict[str, Any]:
    """The benchmark's JSON from what every phase measured (the ratios of the unrounded figures)."""

    def summed(rounds: list[dict[str, Any]], key: str) -> list[float]:
        """Each round's figure of the group: the ranks' rates added; per CPU second, the ranks' tokens over
        their CPU seconds."""
        if key == "tokens_per_cpu_second":
            return [sum(rank["window_tokens"] for rank in r["ranks"]) /
                    sum(rank["window_cpu_seconds"] for rank in r["ranks"]) for r in rounds]
        return [sum(rank[key] for rank in r["ranks"]) for r in rounds]

    def tokens(value: float) -> float:
        return round(value, TOKENS_DECIMALS)

    speed: dict[str, Any] = {
        "model": speed_model["shape"],
        "parameters": speed_model["parameters"],
        "ranks": RANKS, "threads_per_rank": THREADS, "steps": sizes["steps"], "batch_per_rank": sizes["batch"],
        "seq": sizes["seq"], "tokens_per_step": RANKS * sizes["batch"] * sizes["seq"],
        "rounds": len(kubetrain_rounds), "warmup_steps": WARMUP_STEPS,
    }
    per_round: list[dict[str, Any]] = [{"kubetrain_run_seconds": round(k["wall_seconds"], 1),
                                        "hand_run_seconds": round(h["wall_seconds"], 1)}
                                       for k, h in zip(kubetrain_rounds, hand_rounds)]
    for figure, suffix in (("tokens_per_second", ""), ("steady_tokens_per_second", "_steady"),
                           ("median_step_tokens_per_second", "_median_step"), ("tokens_per_cpu_second", "_cpu")):
        ours, theirs = summed(kubetrain_rounds, figure), summed(hand_rounds, figure)
        k, h = statistics.median(ours), statistics.median(theirs)
        speed.update({f"kubetrain_tokens_per_second{suffix}": tokens(k), f"hand_tokens_per_second{suffix}": tokens(h),
                      f"ratio_tokens_per_second{suffix}": round(k / h, 4)})
        for row, a, b in zip(per_round, ours, theirs):
            row.update({f"kubetrain{suffix}": tokens(a), f"hand{suffix}": tokens(b), f"ratio{suffix}": round(a / b, 4)})
    for name, rounds in (("kubetrain", kubetrain_rounds), ("hand", hand_rounds)):
        # The larger rank's, the median of the rounds: a rank's memory, not the group's.
        speed[f"{name}_peak_rss_bytes"] = int(statistics.median(max(rank["peak_rss_bytes"] for rank in r["ranks"])
                                                                for r in rounds))
    speed["per_round"] = per_round
    speed["hand_attention"] = hand_rounds[0].get("attention")
    shard = load_model["parameter_bytes"] // RANKS
    loads: dict[str, Any] = {"model": load_model["shape"], "parameters": load_model["parameters"],
                             "parameter_bytes": load_model["parameter_bytes"], "files": load_model["files"],
                             "shard_bytes": shard}
    for path, ranks in load.items():
        rss = max(r["extra_rss_bytes"] for r in ranks)
        anon = max(r["extra_anon_bytes"] for r in ranks)
        loads[path] = {"seconds": round(max(r["seconds"] for r in ranks), 2), "peak_extra_rss_bytes": rss,
                       "peak_extra_anon_bytes": anon, "held_bytes": max(r["held_bytes"] for r in ranks),
                       "rss_over_shard": round(rss / shard, 3), "anon_over_shard": round(anon / shard, 3)}
    model_bytes = load_model["parameter_bytes"]
    rss, anon = exported["inside_extra_rss_bytes"], exported["inside_extra_anon_bytes"]
    export_figures = {
        "model_bytes": model_bytes, "max_shard_bytes": exported["max_shard_bytes"], "files": exported["files"],
        "safetensors_bytes": exported["safetensors_bytes"],
        "cli_seconds": round(exported["cli_seconds"], 2), "cli_max_rss_bytes": exported["cli_max_rss_bytes"],
        "inside_seconds": round(exported["inside_seconds"], 2),
        "inside_peak_extra_rss_bytes": rss, "inside_peak_extra_anon_bytes": anon,
        "extra_rss_over_model": round(rss / model_bytes, 3), "extra_anon_over_model": round(anon / model_bytes, 3),
        "extra_anon_over_max_shard": round(anon / exported["max_shard_bytes"], 3),
    }
    return {
        "benchmark": "finetune",
        "speed": speed,
        "load": loads,
        "export": export_figures,
        "aims": "speed.ratio_tokens_per_second >= 0.95; load.kubetrain.anon_over_shard <= 1.5",
        "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


if __name__ == "__main__":
    WORKERS = {"hand": hand_worker, "load": load_worker, "export": export_worker}
    WORKERS[sys.argv[1]](*sys.argv[2:])  # type: ignore[operator]  # WORKERS' functions
