"""The `pretrained` fixture: a small pretrained Hugging Face causal LM (examples/finetune/make_model.py), made
once per test session, as one safetensors file and sharded with an index (the same weights), with the
fine-tuning corpus beside it; and what the fine-tuning tests read back from a job's checkpoints."""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from support import EXAMPLES

MAKE_MODEL = EXAMPLES / "finetune" / "make_model.py"
PRETRAIN_STEPS = 100
"""Enough for a model that predicts the standard library's Python clearly better than chance (loss about 3.9
against ln 512 = 6.2) and still has room to improve on the fine-tuning corpus."""


@dataclass(frozen=True)
class Pretrained:
    single: Path
    """model.safetensors."""
    sharded: Path
    """model-0000N-of-0000M.safetensors and model.safetensors.index.json: the same weights."""
    corpus: Path
    """JSON Lines {"text": ...}: the fine-tuning records."""


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Pretrained:
    root = tmp_path_factory.mktemp("pretrained")
    single, sharded, corpus = root / "single", root / "sharded", root / "finetune.jsonl"
    done = subprocess.run([sys.executable, str(MAKE_MODEL), str(single), "--pretrain-steps", str(PRETRAIN_STEPS),
                           "--corpus", str(corpus)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    reshard(single, sharded, SHARD_BYTES)
    assert (sharded / "model.safetensors.index.json").is_file() and (single / "model.safetensors").is_file()
    return Pretrained(single, sharded, corpus)


SHARD_BYTES = 200_000
"""About a fifth of the model per file: several shards and an index."""


def make_model() -> Any:
    """examples/finetune/make_model.py as a module (a script, not a package's module)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_model", MAKE_MODEL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reshard(source: Path, dest: Path, shard_bytes: int) -> None:
    """The model of `source` saved again as safetensors shards of at most `shard_bytes`, with its tokenizer and a
    SHA256SUMS of its own (make_model.py's)."""
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(source).save_pretrained(dest, max_shard_size=shard_bytes)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(source / name, dest / name)
    make_model().write_sums(dest)


def copy_model(source: Path, dest: Path) -> Path:
    shutil.copytree(source, dest)
    return dest
