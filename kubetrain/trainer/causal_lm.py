"""The built-in causal-LM fine-tuning model (`spec.model.name: causal-lm`) and its text data (`dataset.format: text`;
chat and prompt-completion: conversations.py).

The model is the pretrained Hugging Face causal LM of `spec.model.pretrained`
(kubetrain/trainer/pretrained.py fetched and checked it into KUBETRAIN_MODEL_DIR),
wrapped as every built-in model is: token ids in, one sample per row, the
logits out. It is always built on the meta device (no memory, no random
initialisation) and given its weights by `materialize`, which reads from the
safetensors files only the rows of each tensor this process holds: all of
them unsharded, 1/world of them under FSDP, so no rank ever holds the whole
model. With `training.lora` peft adds low-rank adapters to the named linear
layers; the pretrained weights are frozen, and checkpoints hold only the
adapters (`trainable_state`).

The text: JSON Lines, Parquet or plain text files at a path or a uri, read
whole, tokenized with the model's own tokenizer, and either packed (every
record's tokens end to end, an end-of-sequence token between records, cut
into samples of sequenceLength) or one sample per record (cut, and padded).
A sample is a row of token ids with PAD (-1) where there is no token; its
targets are the same ids with IGNORE_INDEX there, so padding is neither
attended to nor trained on. The last evalFraction of the samples is held out.
Every rank reads and tokenizes the same text in the same order, so every rank
holds the same samples and the cursor deals them as any dataset's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from kubetrain.api.spec import Dataset, Lora, Spec

from .conversations import json_lines, load_answers
from .errors import ConfigError, LoadError
from .objectives import IGNORE_INDEX, NEXT_TOKEN, PAD

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".jsonl", ".parquet", ".txt", ".md", ".text")
MAX_TEXT_BYTES = 512 << 20
"""format text is read whole into every rank's memory and tokenized there (about 30 bytes a token at the peak:
the text, its tokens as arrays, then the samples and their targets, 16 bytes a token): a corpus larger than
this is refused (split it across jobs, or tokenize it into .npz shards of token ids and train a script on them)."""
TOKENIZE_RECORDS = 4096
"""Records tokenized at once (the tokenizer's Python lists cost about 30 bytes a token while they live)."""
MAX_TEXT_FILES = 100_000


# --- the text ----------------------------------------------------------------------------------------------


def _text_files(dataset: Dataset) -> list[tuple[str, Path]]:
    """(name as the user knows it, local file) of every text file of the dataset, in name order; object storage
    is downloaded into the data cache first (once: a cached file of the object's length is used again)."""
    from .objstore import parse_uri, shared_store
    from .shards import cache_root

    if dataset.path is not None:
        root = Path(dataset.path)
        if root.is_file():
            return [(str(root), root)]
        if not root.is_dir():
            raise LoadError(f"spec.dataset.path: {root}: no such file or directory")
        found = [(str(p), p) for p in sorted(root.iterdir()) if p.is_file() and p.name.endswith(TEXT_SUFFIXES)]
        where = f"spec.dataset.path: {root}"
    else:
        assert dataset.uri is not None
        store = shared_store()
        uri = parse_uri(dataset.uri, "spec.dataset.uri")
        store.check_bucket(uri)
        if uri.is_prefix:
            objects = [info for info in store.list(uri) if info.uri.key.endswith(TEXT_SUFFIXES)]
        else:
            info = store.head(uri)
            if info is None:
                raise LoadError(f"spec.dataset.uri: {uri}: no such object")
            objects = [info]
        if len(objects) > MAX_TEXT_FILES:
            raise LoadError(f"spec.dataset.uri: {uri}: {len(objects)} text objects, more than {MAX_TEXT_FILES}")
        cache = cache_root() / "text" / hashlib.sha256(str(uri).encode()).hexdigest()[:16]
        found = []
        for info in objects:
            local = cache / info.uri.key.replace("/", "%2F")
            if not (local.is_file() and local.stat().st_size == info.size):
                local.parent.mkdir(parents=True, exist_ok=True)
                store.download(info.uri, local, size=info.size)
            found.append((str(info.uri), local))
        where = f"spec.dataset.uri: {uri}"
    if not found:
        raise LoadError(f"{where}: no text files ({', '.join(TEXT_SUFFIXES)})")
    total = sum(p.stat().st_size for _, p in found)
    if total > MAX_TEXT_BYTES:
        raise LoadError(f"{where}: {total} bytes of text, more than the {MAX_TEXT_BYTES} format text reads into "
                        "memory")
    return found


def _records(name: str, path: Path, column: str) -> Iterator[str]:
    """The text records of one file: a JSON Lines line's `column`, a Parquet row's, or a whole plain file."""
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path, columns=[column])
        except Exception as err:  # noqa: BLE001 - pyarrow raises many kinds for a bad file or a missing column
            raise LoadError(f"{name}: not a Parquet file with a {column!r} column ({type(err).__name__}: "
                            f"{str(err).splitlines()[0] if str(err) else ''})") from None
        for value in table.column(column).to_pylist():
            if not isinstance(value, str):
                raise LoadError(f"{name}: column {column!r} holds {type(value).__name__} values; expected text")
            yield value
        return
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise LoadError(f"{name}: not UTF-8 text ({err})") from None
    if not name.endswith(".jsonl"):
        yield text
        return
    for number, record in json_lines(name, text):
        value = record.get(column) if isinstance(record, dict) else None
        if not isinstance(value, str):
            raise LoadError(f"{name}: line {number}: no text field {column!r} (dataset.textColumn)")
        yield value


def token_samples(ids: list[list[int]] | list[np.ndarray], length: int, packing: bool,
                  eos: int | None) -> np.ndarray:
    """Samples of `length` token ids (PAD where none) from the records' token ids: packed, or one per record."""
    if packing:
        end = [np.asarray([eos], dtype=np.int64)] if eos is not None else []
        pieces = [piece for record in ids for piece in (np.asarray(record, dtype=np.int64), *end)]
        stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
        count = math.ceil(len(stream) / length)
        out = np.full(count * length, PAD, dtype=np.int64)
        out[: len(stream)] = stream
        return out.reshape(count, length)
    out = np.full((len(ids), length), PAD, dtype=np.int64)
    for row, record in enumerate(ids):
        tokens = [*record, *([eos] if eos is not None else [])][:length]  # type: ignore[misc]  # a record is a list of ids
        out[row, : len(tokens)] = tokens
    return out


def tokenize(tokenizer: Any, records: list[str]) -> list[np.ndarray]:
    """Every record's token ids, as a compact array each: tokenized TOKENIZE_RECORDS at a time, so that the
    tokenizer's Python lists (about 30 bytes a token) exist for one batch only."""
    out: list[np.ndarray] = []
    for start in range(0, len(records), TOKENIZE_RECORDS):
        batch = tokenizer(records[start:start + TOKENIZE_RECORDS], add_special_tokens=False, verbose=False,
                          return_attention_mask=False)["input_ids"]
        out += [np.asarray(ids, dtype=np.int32) for ids in batch]
    return out


def load_text(dataset: Dataset, model_dir: Path, config: dict[str, Any]) -> Any:
    """The job's text as Data: samples of token ids, the last evalFraction held out."""
    from transformers import AutoTokenizer

    from .data import Data

    limit = config.get("max_position_embeddings")
    if isinstance(limit, int) and dataset.sequence_length > limit:
        raise ConfigError(f"spec.dataset.sequenceLength: {dataset.sequence_length} is more than the pretrained "
                          f"model's max_position_embeddings ({limit})")
    files = _text_files(dataset)
    if dataset.format != "text":
        return load_answers(dataset, model_dir, config, files, TOKENIZE_RECORDS)
    records = [text for name, path in files for text in _records(name, path, dataset.text_column)]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenize(tokenizer, records)
    record_count = len(records)
    del records
    samples = token_samples(ids, dataset.sequence_length, dataset.packing, tokenizer.eos_token_id)
    del ids
    vocab = int(config.get("vocab_size") or 0)
    if vocab and samples.size and int(samples.max()) >= vocab:
        raise LoadError(f"spec.model.pretrained: its tokenizer gives token {int(samples.max())}, past the model's "
                        f"vocab_size {vocab}")
    held = math.ceil(len(samples) * dataset.eval_fraction) if dataset.eval_fraction else 0
    if len(samples) - held < 1:
        where = dataset.uri or dataset.path
        raise LoadError(f"spec.dataset: {where}: {len(samples)} sample(s) of {dataset.sequence_length} tokens, none "
                        f"left to train on after evalFraction {dataset.eval_fraction}")
    x = torch.from_numpy(samples)
    y = x.masked_fill(x == PAD, IGNORE_INDEX)
    cut = len(x) - held
    log.info("text: %d records from %d file(s), %d tokens, %d samples of %d (%d held out)", record_count,
             len(files), int((x != PAD).sum()), len(x), dataset.sequence_length, held)
    return Data(train_x=x[:cut], train_y=y[:cut], eval_x=x[cut:], eval_y=y[cut:],
                input_shape=(dataset.sequence_length,), num_classes=None, target_shape=(dataset.sequence_length,),
                objective=NEXT_TOKEN)


# --- the model -----------------------------------------------------------------------------------------------


def hf_name(name: str) -> str:
    """The pretrained file's name of a parameter of CausalLM (`hf.` and peft's wrapping taken off)."""
    name = name.removeprefix("hf.").removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


def is_adapter(name: str) -> bool:
    return ".lora_" in name


class CausalLM(nn.Module):
    """A pretrained causal LM as a built-in model: (N, L) token ids (PAD where none) in, (N, L, V) logits out."""

    def __init__(self, model_dir: Path, lora: Lora | None, seed: int):
        super().__init__()
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        self.model_dir, self.seed = model_dir, seed
        self.config = AutoConfig.from_pretrained(model_dir)
        # Parameters on the meta device; buffers (rotary frequencies: computed, not stored) real and small.
        with init_empty_weights(include_buffers=False):
            hf = AutoModelForCausalLM.from_config(self.config, dtype=torch.float32)
        self.lora = lora
        if lora is not None:
            hf = _with_adapters(hf, lora)
        self.hf = hf
        self.materialized = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3:
            # Packed records (conversations.py): token ids over each token's position in its own record. Position
            # ids that start again at 0 are the model's padding-free path: transformers' mask builder
            # (masking_utils.find_packed_sequence_indices) then lets a token attend only within its record, and
            # no attention mask is given, or it would take that instead. tests/trainer/test_conversations.py holds
            # a packed batch's per-token loss equal to its records' run one by one.
            return self.hf(input_ids=x[:, 0].clamp(min=0), position_ids=x[:, 1], use_cache=False).logits
        padded = x == PAD
        mask = (~padded).long() if bool(padded.any()) else None
        return self.hf(input_ids=x.clamp(min=0), attention_mask=mask, use_cache=False).logits

    def shard_units(self) -> list[nn.Module]:
        """The modules FSDP shards one by one (the decoder layers: the classes the model says not to split)."""
        classes = set(getattr(self.hf, "_no_split_modules", None) or [])
        return [m for m in self.hf.modules() if type(m).__name__ in classes]

    def materialize(self, device: torch.device) -> None:
        """Give the meta parameters memory on `device` and their values: the pretrained weights, each process
        reading only the rows it holds (FSDP: its shard), and the adapters' initial values (seeded).

        The weights are read file by file, each file opened (memory-mapped) only while its tensors are copied
        out: what a rank maps at once is one file's rows of its own, never the whole model."""
        from safetensors import safe_open

        from .pretrained import INDEX, SINGLE_WEIGHTS

        computed = {name: b.detach().clone() for name, b in self.named_buffers() if b.device.type != "meta"}
        self.to_empty(device=device)
        index = self.model_dir / INDEX
        weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else None
        persistent = set(self.state_dict(keep_vars=True))
        # file -> (key, tensor, is a buffer, its value at init): what to read from each file
        targets: dict[str, list[tuple[str, torch.Tensor, bool, torch.Tensor | None]]] = {}
        with torch.no_grad():
            for position, (name, param) in enumerate(self.named_parameters()):
                if is_adapter(name):
                    init = _adapter_init(name, param.shape, position, self.seed)
                    _fill_rows(param, lambda rows, t=init: t[rows[0]:rows[1]])
                    continue
                key = hf_name(name)
                file = weight_map.get(key) if weight_map is not None else SINGLE_WEIGHTS
                if file is None:
                    raise LoadError(f"spec.model.pretrained: {self.model_dir}: no weights for {key}")
                targets.setdefault(file, []).append((key, param, False, None))
            for name, buffer in self.named_buffers():
                key = hf_name(name)
                file = weight_map.get(key) if weight_map is not None else SINGLE_WEIGHTS
                if name in persistent and not is_adapter(name) and file is not None:
                    targets.setdefault(file, []).append((key, buffer, True, computed.get(name)))
                elif name in computed:
                    buffer.copy_(computed[name])
            for file, tensors in targets.items():
                with safe_open(str(self.model_dir / file), framework="pt") as weights:
                    held = set(weights.keys())
                    for key, tensor, is_buffer, initial in tensors:
                        if key not in held:
                            if is_buffer:  # a persistent buffer the file does not store: as computed at init
                                if initial is not None:
                                    tensor.copy_(initial)
                                continue
                            raise LoadError(f"spec.model.pretrained: {self.model_dir}: no weights for {key} in "
                                            f"{file}")
                        piece = weights.get_slice(key)
                        if is_buffer:
                            tensor.copy_(piece[:])
                        else:
                            _fill_rows(tensor, lambda rows, piece=piece: piece[rows[0]:rows[1]])
        self.materialized = True

    def trainable_state(self) -> dict[str, torch.Tensor] | None:
        """What a checkpoint holds of the model: None (the whole state_dict), or with LoRA the adapters only."""
        if self.lora is None:
            return None
        return {name: p for name, p in self.named_parameters() if p.requires_grad}


def _with_adapters(hf: nn.Module, lora: Lora) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,  # type: ignore[arg-type]  # peft takes a float alpha
                        target_modules=list(lora.target_modules) or None, task_type="CAUSAL_LM")
    try:
        return get_peft_model(hf, config)
    except ValueError as err:
        raise ConfigError(f"spec.training.lora.targetModules: {err}") from None


def _rows(param: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """(first row, end row, local tensor) of what this process holds of `param`: all of it, or its FSDP shard
    (FSDP2 shards dim 0 as torch.chunk does: ceil(rows / world) each, the last ones shorter or empty)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return 0, param.shape[0] if param.dim() else 0, param
    local = param.to_local()
    placements = param.placements
    if len(placements) != 1 or not isinstance(placements[0], Shard) or placements[0].dim != 0:
        raise ConfigError(f"causal-lm: a parameter placed as {placements}; kubetrain loads dim-0 shards only")
    rows = param.shape[0]
    world, rank = param.device_mesh.size(), param.device_mesh.get_local_rank()
    chunk = math.ceil(rows / world)
    start = min(rank * chunk, rows)
    end = min(start + chunk, rows)
    if local.shape[0] != end - start:
        raise ConfigError(f"causal-lm: a shard of {local.shape[0]} rows where {end - start} were expected")
    return start, end, local


def _fill_rows(param: torch.Tensor, read: Any) -> None:
    start, end, local = _rows(param)
    if param.dim() == 0:
        local.copy_(read((None, None)))
        return
    if end > start:
        local.copy_(read((start, end)).to(local.dtype))


def _adapter_init(name: str, shape: torch.Size, position: int, seed: int) -> torch.Tensor:
    """An adapter's initial value, as peft initialises it (A: Kaiming-uniform with a = sqrt(5); B: zeros), the
    same on every process for the job's seed (whole: rank x features is small)."""
    if ".lora_B" in name:
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + position)
    fan_in = shape[1] if len(shape) > 1 else shape[0]
    bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_ with a = sqrt(5): gain sqrt(2 / 6), bound gain*sqrt(3/fan_in)
    return (torch.rand(shape, generator=generator) * 2 - 1) * bound


def build(spec: Spec, model_dir: Path, meta: bool = False) -> CausalLM:
    """The job's causal LM; with `meta` its parameters stay on the meta device until `materialize` (FSDP shards
    it first), otherwise it is materialized on the CPU now."""
    assert spec.training is not None
    model = CausalLM(model_dir, spec.training.lora, spec.training.seed)
    if spec.training.lora is not None:
        for name, param in model.named_parameters():
            param.requires_grad_(is_adapter(name))
    if not meta:
        model.materialize(torch.device("cpu"))
    return model


def model_and_data(spec: Spec, meta: bool = False) -> tuple[CausalLM, Any]:
    from .pretrained import read_json, model_dir

    assert spec.dataset is not None and spec.model is not None
    where = model_dir(spec.model.pretrained)
    config = read_json(where / "config.json", spec.model.pretrained or str(where))
    data = load_text(spec.dataset, where, config)
    return build(spec, where, meta), data
