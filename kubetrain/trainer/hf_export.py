"""A causal-lm job's model as a Hugging Face directory: `kubetrain checkpoints export SOURCE --format huggingface`.

The directory is what `AutoModelForCausalLM.from_pretrained` (and so any
inference server that reads Hugging Face directories) loads: the pretrained
model's config.json (and generation_config.json), the weights as safetensors
(`model.safetensors`, or shards of at most `max_shard_bytes` named by
`model.safetensors.index.json`), and the tokenizer's files, copied from the
pretrained directory. For a LoRA job it is either

- the adapter alone (default): `adapter_config.json` and
  `adapter_model.safetensors`, what `peft.PeftModel.from_pretrained(base,
  DIR)` loads over the pretrained model (`base_model_name_or_path` names it),
  with the tokenizer beside them; or
- the merged model (`merge_lora`): every adapted weight W replaced by
  W + (alpha / rank) * B @ A, a plain model of the pretrained shape.

Memory stays bounded by about two output shards (`max_shard_bytes`): the
weights are written shard by shard, each read from the checkpoint as it is
needed, a sharded (FSDP) checkpoint's tensors through DCP a shard's worth of
keys at a time (held while they are copied into the file being written), the
pretrained weights of a merge from their safetensors files tensor by tensor. The
directory is written under a temporary name beside OUT and renamed when whole
(an s3:// OUT: uploaded from a temporary directory, config.json last, so a
reader that finds config.json finds the weights).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from kubetrain.shared.launch import pretrained_in_place

from . import dcp_reader, sharded
from .causal_lm import hf_name, is_adapter
from .conversations import TEMPLATE_FILE as CHAT_TEMPLATE_FILE
from .export_source import EXIT_NO_DATA, EXIT_USAGE, MODEL, Exported, ExportError, Reader, locate, newest
from .pretrained import CONFIG, INDEX, READY_FILE, SINGLE_WEIGHTS, SUMS, Checked, fetch

DEFAULT_SHARD_BYTES = 5 << 30
"""Weights per output file (transformers' own default for save_pretrained): the bound on the export's memory."""
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
NOT_COPIED = {INDEX, SINGLE_WEIGHTS, SUMS, READY_FILE}
"""Files of the pretrained directory the export writes itself (or leaves out); every other one is copied."""
LAST = (INDEX, CONFIG, ADAPTER_CONFIG)
"""Uploaded last, in this order: the files a reader opens first."""


def export_huggingface(sources: Sequence[str | Path], out: str | Path, job_file: str | Path | None = None,
                       on_skip: Callable[[Path, str], None] | None = None, merge_lora: bool = False,
                       max_shard_bytes: int = DEFAULT_SHARD_BYTES, pretrained_cache: Path | None = None) -> Exported:
    """Write the newest usable checkpoint of a causal-lm job under `sources` to `out` (a directory, or
    s3://BUCKET/PREFIX/) as a Hugging Face model directory; ExportError on bad input."""
    target = _target(out)
    source = locate(sources, job_file)
    job = source.job
    if job is None:
        raise ExportError(f"{', '.join(map(str, sources))}: --format huggingface needs the job's manifest (the run "
                          "directory's job.yaml, or --job FILE): it names the pretrained model", EXIT_USAGE)
    spec = job.spec
    if spec.model is None or spec.model.name != "causal-lm" or not spec.model.pretrained:
        what = "a script job" if spec.model is None else f"model {spec.model.name or spec.model.entrypoint}"
        raise ExportError(f"{job.name}: --format huggingface exports a causal-lm job's model, this is {what} (use "
                          "--format torch or safetensors)", EXIT_USAGE)
    lora = spec.training.lora if spec.training is not None else None
    if merge_lora and lora is None:
        raise ExportError(f"{job.name}: --merge-lora: the job trains no LoRA adapters (spec.training.lora)",
                          EXIT_USAGE)
    reader = Reader(source, on_skip or (lambda path, reason: None))
    _, info, weights = _newest_weights(reader, list(source.replicas))
    pretrained = _pretrained(spec.model.pretrained, pretrained_cache or _run_cache(source.job_file,
                                                                                   spec.model.pretrained))
    with tempfile.TemporaryDirectory(prefix="kubetrain-hf-") as tmp:
        staging = Path(tmp) / "model"
        staging.mkdir()
        if lora is None:
            tensors = _write_weights(staging, _renamed(weights, hf_name, max_shard_bytes), max_shard_bytes)
        elif merge_lora:
            tensors = _write_weights(staging, _merged(pretrained, weights, lora.alpha / lora.rank), max_shard_bytes)
        else:
            tensors = _write_adapter(staging, weights, lora, spec.model.pretrained)
        _copy_pretrained_files(pretrained.path, staging, adapter=lora is not None and not merge_lora)
        _write_chat_template(spec, staging)
        written = _publish(staging, target, out)
    return Exported(kind=MODEL, mode=spec.mode, step=info.step, tensors=tensors[0], tensor_bytes=tensors[1],
                    out=target if isinstance(target, Path) else str(target), file_bytes=written, files=[info.path],
                    notes=[])


def _target(out: str | Path) -> Any:
    """--out as a Path (a directory to create, or an empty one) or an ObjectURI prefix; ExportError (exit 2)."""
    from .errors import ConfigError
    from .objstore import is_uri, parse_uri

    if is_uri(str(out)):
        try:
            return parse_uri(str(out), "--out").prefix()
        except ConfigError as err:
            raise ExportError(str(err), EXIT_USAGE) from None
    path = Path(out)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ExportError(f"{path}: exists and is not an empty directory; --format huggingface writes a new "
                          "directory", EXIT_USAGE)
    if not path.parent.is_dir():
        raise ExportError(f"{path.parent}: no such directory (the directory of --out {path})", EXIT_USAGE)
    return path


def _run_cache(job_file: Path | None, uri: str) -> Path | None:
    """A local run's own copy of a fetched pretrained model (<run>/cache/model), when there is one."""
    if job_file is None or pretrained_in_place(uri):
        return None
    cache = job_file.parent / "cache" / "model"
    return cache if (cache / READY_FILE).is_file() else None


def _pretrained(uri: str, cache: Path | None) -> Checked:
    """The pretrained directory the tokenizer, the config (and a merge's base weights) come from: where it lies,
    or fetched (s3://) into `cache` or a temporary one."""
    from .errors import TrainerError

    try:
        if cache is None and not pretrained_in_place(uri):
            cache = Path(tempfile.mkdtemp(prefix="kubetrain-pretrained-")) / "model"
        return fetch(uri, cache or Path(tempfile.gettempdir()) / "kubetrain-unused")
    except TrainerError as err:
        raise ExportError(f"the pretrained model: {err}") from None


class _Weights:
    """The model state of one checkpoint, tensor by tensor: a plain checkpoint's dict, or a sharded one read
    through DCP a group of keys at a time (never the whole model at once)."""

    def __init__(self, state: dict[str, Any] | None, path: Path):
        self.path = path
        self.plain = state
        if state is None:
            # Through the restricted reader: the checkpoint may be a copy of a bucket another job can write.
            metadata = dcp_reader.Reader(path, sharded.Commit.read(path).lengths).read_metadata()
            self.sizes = {key.removeprefix("model."): _numel_bytes(meta) for key, meta in
                          metadata.state_dict_metadata.items() if key.startswith("model.")}
        else:
            self.sizes = {k: v.numel() * v.element_size() for k, v in state.items()}

    def names(self) -> list[str]:
        return list(self.sizes)

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        if self.plain is not None:
            return {name: self.plain[name] for name in names}
        loaded = sharded.load_whole(self.path, keys={f"model.{name}" for name in names})
        return {name: loaded["model"][name] for name in names}


def _numel_bytes(meta: Any) -> int:
    size = getattr(meta, "size", None)
    props = getattr(meta, "properties", None)
    if size is None or props is None:
        return 0
    count = 1
    for d in size:
        count *= d
    return count * torch.tensor([], dtype=props.dtype).element_size()


def _newest_weights(reader: Reader, replicas: list[str]) -> tuple[str, Any, _Weights]:
    """The newest usable checkpoint's model state, a sharded one not loaded yet."""
    replica, info, state = newest(reader, replicas)
    if state is None:
        return replica, info, _Weights(None, info.path)
    model = state.get("model") if isinstance(state, dict) else None
    if not isinstance(model, dict):
        raise ExportError(f"{info.path}: holds no model state_dict; not a checkpoint of the causal-lm loop")
    return replica, info, _Weights(model, info.path)


def _renamed(weights: _Weights, rename: Callable[[str], str],
             budget: int) -> Iterator[tuple[str, int, Callable[[], torch.Tensor]]]:
    """(output name, bytes, read) of every tensor, in the checkpoint's order, read `budget` bytes at a time (a
    sharded checkpoint's keys in groups: one DCP read each)."""
    names = weights.names()
    cache: dict[str, torch.Tensor] = {}

    def reader(name: str, group: list[str]) -> Callable[[], torch.Tensor]:
        def read() -> torch.Tensor:
            if name not in cache:
                cache.clear()
                cache.update(weights.read(group))
            return cache.pop(name)
        return read

    for group in _groups(names, weights.sizes, budget):
        for name in group:
            yield rename(name), weights.sizes[name], reader(name, group)


def _groups(names: list[str], sizes: dict[str, int], budget: int) -> list[list[str]]:
    """`names` in order, cut into groups of at most `budget` bytes (one tensor alone may be more)."""
    groups: list[list[str]] = [[]]
    used = 0
    for name in names:
        if groups[-1] and used + sizes[name] > budget:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += sizes[name]
    return [g for g in groups if g]


def _merged(pretrained: Checked, weights: _Weights, scale: float) -> Iterator[tuple[str, int,
                                                                                 Callable[[], torch.Tensor]]]:
    """The pretrained tensors, each adapted one with its adapter merged in: W + scale * B @ A."""
    from safetensors import safe_open

    adapters = weights.read(weights.names())  # small: rank x features per adapted layer
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in adapters.items():
        # hf.base_model.model.<module>.lora_A.default.weight -> <module>.weight
        module, _, rest = hf_name(name).partition(".lora_")
        pairs.setdefault(f"{module}.weight", {})[rest[0]] = tensor
    for file in pretrained.weights:
        with safe_open(str(pretrained.path / file), framework="pt") as f:
            for key in f.keys():
                shape = f.get_slice(key).get_shape()
                count = 1
                for d in shape:
                    count *= d

                def read(key: str = key, file: str = file) -> torch.Tensor:
                    with safe_open(str(pretrained.path / file), framework="pt") as g:
                        base = g.get_tensor(key)
                    pair = pairs.get(key)
                    if pair is None:
                        return base
                    return (base.float() + scale * (pair["B"].float() @ pair["A"].float())).to(base.dtype)

                dtype = f.get_slice(key).get_dtype()
                width = {"F64": 8, "F32": 4, "I64": 8, "I32": 4}.get(dtype, 2)
                yield key, count * width, read


def _write_weights(directory: Path, tensors: Iterator[tuple[str, int, Callable[[], torch.Tensor]]],
                   max_shard_bytes: int) -> tuple[int, int]:
    """The tensors as safetensors files of at most `max_shard_bytes` each (and their index when more than one):
    (tensors, bytes)."""
    from safetensors.torch import save_file

    plan: list[list[tuple[str, int, Callable[[], torch.Tensor]]]] = [[]]
    used = 0
    for item in tensors:
        if plan[-1] and used + item[1] > max_shard_bytes:
            plan.append([])
            used = 0
        plan[-1].append(item)
        used += item[1]
    if not plan[0]:
        raise ExportError("the checkpoint holds no model tensors", EXIT_NO_DATA)
    names = ([SINGLE_WEIGHTS] if len(plan) == 1 else
             [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))])
    weight_map, total, count = {}, 0, 0
    for file, shard in zip(names, plan):
        # A copy each: safetensors refuses tensors that share memory (tied embeddings).
        data = {name: read().detach().cpu().clone() for name, _, read in shard}
        save_file(data, str(directory / file), metadata={"format": "pt"})
        for name, tensor in data.items():
            weight_map[name] = file
            total += tensor.numel() * tensor.element_size()
            count += 1
        del data
    if len(plan) > 1:
        (directory / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                  indent=2, sort_keys=True))
    return count, total


def _write_adapter(directory: Path, weights: _Weights, lora: Any, pretrained_uri: str) -> tuple[int, int]:
    """The adapters as peft saves them: adapter_model.safetensors (names without the adapter's name) and
    adapter_config.json."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    tensors = {hf_name(name).replace(".default.", "."): t.detach().cpu().contiguous()
               for name, t in weights.read(weights.names()).items() if is_adapter(name)}
    if not tensors:
        raise ExportError(f"{weights.path}: holds no LoRA adapters", EXIT_NO_DATA)
    save_file({f"base_model.model.{k}": v for k, v in tensors.items()}, str(directory / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    modules = sorted({name.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for name in tensors})
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=list(lora.target_modules) or modules, task_type="CAUSAL_LM",
                        base_model_name_or_path=pretrained_uri)
    config.save_pretrained(str(directory))
    return len(tensors), sum(t.numel() * t.element_size() for t in tensors.values())


def _copy_pretrained_files(source: Path, directory: Path, adapter: bool) -> None:
    """The config and the tokenizer's files (every file that is not weights); an adapter takes the tokenizer
    only (its base's config stays the base's)."""
    for file in sorted(source.iterdir()):
        # Regular files only: a link in a claim's model directory could point anywhere on the machine.
        if file.is_symlink() or not file.is_file() or file.name in NOT_COPIED or file.name.endswith(".safetensors"):
            continue
        if adapter and file.name in (CONFIG, "generation_config.json"):
            continue
        shutil.copyfile(file, directory / file.name)


def _write_chat_template(spec: Any, directory: Path) -> None:
    """A chat job trained with the manifest's template (dataset.chatTemplate): it goes with the model, as
    chat_template.jinja, which transformers takes over a template in tokenizer_config.json, so
    `tokenizer.apply_chat_template` on the export renders as the training did. A template of the tokenizer's
    own, or the pretrained directory's chat_template.jinja, came with the tokenizer's files already."""
    if spec.dataset.format == "chat" and spec.dataset.chat_template:
        (directory / CHAT_TEMPLATE_FILE).write_text(spec.dataset.chat_template, encoding="utf-8")


def _publish(staging: Path, target: Any, out: str | Path) -> int:
    """Move the whole staged directory to its place (renamed in, or uploaded with config.json last): its bytes."""
    from .errors import TrainerError
    from .objstore import shared_store

    files = sorted(staging.iterdir(), key=lambda p: (LAST.index(p.name) if p.name in LAST else -1, p.name))
    total = sum(p.stat().st_size for p in files)
    if isinstance(target, Path):
        if target.exists():
            target.rmdir()  # empty: checked by _target
        final = target.parent / f".{target.name}.tmp-export"
        shutil.rmtree(final, ignore_errors=True)
        shutil.copytree(staging, final)
        final.rename(target)
        return total
    store = shared_store()
    try:
        store.ensure_bucket(target)
        for file in files:
            store.upload(file, target.child(file.name))
    except TrainerError as err:
        raise ExportError(f"{out}: {err}") from None
    return total
