"""Make a small pretrained Hugging Face causal language model, from nothing, for kubetrain's fine-tuning.

kubetrain's examples/finetune and its tests need a real Hugging Face model
directory to fine-tune, and nothing can be downloaded. This script makes one:
a byte-level BPE tokenizer trained with `tokenizers` on the Python standard
library's own source (its top-level *.py files in sorted order, the first
2,000,000 bytes), and a `LlamaForCausalLM` briefly pretrained on the same text
(200 AdamW steps by default; 0 leaves it randomly initialised). With the
defaults (vocabulary 512, hidden 64, 2 layers, 4 heads) it has 196,928
parameters and trains in seconds on a CPU. OUT_DIR then holds the tokenizer,
the config, float32 safetensors weights (sharded with --shard-size) and a
SHA256SUMS file that `sha256sum -c SHA256SUMS` checks.

--corpus writes a fine-tuning corpus as JSON Lines, {"text": ...} per record:
the standard library's json/, email/ and http/ modules (text the model was not
pretrained on), each cut to its first 4,000 characters. --chat writes a
conversation set ({"messages": [...]} per record, examples/finetune/chat.yaml):
questions about standard library modules answered from their docstrings.

    python make_model.py /tmp/base-model --corpus /tmp/finetune.jsonl
    python make_model.py /tmp/sharded --pretrain-steps 0 --shard-size 200000
"""

import argparse
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging

STDLIB = Path(sysconfig.get_paths()["stdlib"])
CORPUS_BYTES = 2_000_000  # of the pretraining corpus
SPECIAL = {"pad_token": "<|pad|>", "bos_token": "<|bos|>", "eos_token": "<|eos|>"}
CONTEXT = 512  # max_position_embeddings, and the tokenizer's model_max_length
SUMS = "SHA256SUMS"


def pretraining_texts(limit: int = CORPUS_BYTES) -> list[str]:
    """The standard library's top-level *.py files in sorted order, up to `limit` bytes in all."""
    texts, size = [], 0
    for path in sorted(STDLIB.glob("*.py")):
        if size >= limit:
            break
        data = path.read_bytes()[: limit - size]
        size += len(data)
        texts.append(data.decode("utf-8", errors="replace"))  # a cut may split the last character
    return texts


def build_tokenizer(out_dir: str | Path, vocab: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer of `vocab` tokens on the pretraining corpus; save it in `out_dir`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIAL.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(pretraining_texts(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=CONTEXT, **SPECIAL)
    fast.save_pretrained(out_dir)
    return fast


def build_model(tokenizer: PreTrainedTokenizerFast, hidden: int, layers: int, heads: int,
                seed: int) -> LlamaForCausalLM:
    """A randomly initialised float32 Llama decoder (initialised from `seed`) over the tokenizer's vocabulary."""
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden,
                         intermediate_size=-(-4 * hidden // 32) * 32,  # 4 * hidden, up to a multiple of 32
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=CONTEXT, tie_word_embeddings=False,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(torch.float32)


def pretrain(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, steps: int, seed: int) -> float:
    """`steps` AdamW steps on random 128-token windows of the tokenized corpus; the last loss (nan if none)."""
    if steps <= 0:
        return float("nan")
    # The files end to end, each closed by <|eos|>. The backend tokenizer directly: through the
    # transformers wrapper every file longer than model_max_length would bring a warning.
    encodings = tokenizer.backend_tokenizer.encode_batch(pretraining_texts(), add_special_tokens=False)
    data = torch.tensor([i for e in encodings for i in e.ids + [tokenizer.eos_token_id]])
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    loss = torch.tensor(float("nan"))
    for step in range(1, steps + 1):
        starts = torch.randint(0, len(data) - 128, (16,), generator=generator)
        batch = torch.stack([data[s : s + 128] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 25 == 0:
            print(f"step {step}/{steps}  loss {loss.item():.4f}", flush=True)
    model.eval()
    print(f"pretrained {steps} steps on {len(data):,} tokens: final loss {loss.item():.4f}", flush=True)
    return loss.item()


def save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out_dir: str | Path,
         shard_size: int | None = None) -> None:
    """Save the model in float32 safetensors, in shards of at most `shard_size` bytes if given, and the tokenizer."""
    out = Path(out_dir)
    # transformers 5 always writes safetensors: save_pretrained has no safe_serialization any more.
    model.to(torch.float32).save_pretrained(out, max_shard_size=shard_size if shard_size else "50GB")
    tokenizer.save_pretrained(out)
    for p in out.glob("*.safetensors"):
        p.chmod(0o644)  # safetensors 0.8 writes 0600 files: unreadable to a non-root user once copied into an image
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    index = (out / "model.safetensors.index.json").exists()
    single = (out / "model.safetensors").exists()
    if shard_size and not (len(shards) > 1 and index and not single):
        raise RuntimeError(f"asked for shards of {shard_size} bytes, got {[p.name for p in out.iterdir()]}")
    if not shard_size and not (single and not shards and not index):
        raise RuntimeError(f"asked for one model.safetensors, got {[p.name for p in out.iterdir()]}")
    if list(out.glob("*.bin")):
        raise RuntimeError(f"pickled weights written in {out}")


def write_sums(out_dir: str | Path) -> None:
    """SHA256SUMS in `out_dir`, as `sha256sum` writes it, for every other file there, sorted by name."""
    out = Path(out_dir)
    lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(out).as_posix()}\n"
             for p in sorted(out.rglob("*")) if p.is_file() and p.name != SUMS]
    (out / SUMS).write_text("".join(lines))


def write_corpus(path: str | Path) -> int:
    """The fine-tuning corpus as JSON Lines: one {"text": ...} per module of json/, email/, http/. The count."""
    files = sorted(p for package in ("json", "email", "http") for p in (STDLIB / package).glob("*.py"))
    with open(path, "w", encoding="utf-8") as f:
        for p in files:
            f.write(json.dumps({"text": p.read_text(encoding="utf-8")[:4000]}) + "\n")
    return len(files)


CHAT_PACKAGES = ("json", "email", "http", "urllib", "xml/dom", "logging", "concurrent/futures", "importlib")


def _summary(path: Path) -> str | None:
    """The first paragraph of a module's docstring, on one line (None when it has none)."""
    import ast

    try:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    except (SyntaxError, UnicodeDecodeError):
        return None
    first = (doc or "").strip().split("\n\n")[0]
    return " ".join(first.split())[:300] or None


def write_chat(path: str | Path) -> int:
    """A conversation set as JSON Lines, {"messages": [...]} per record, for `dataset.format: chat`: for each
    documented module of CHAT_PACKAGES, a user asks what it is for and the assistant answers with its
    docstring's first paragraph; every third conversation opens with a system turn, and every second has a
    second exchange (the module's first public function). The count."""
    import ast

    count = 0
    with open(path, "w", encoding="utf-8") as f:
        for p in sorted(q for package in CHAT_PACKAGES for q in (STDLIB / package).glob("*.py")):
            summary = _summary(p)
            if summary is None:
                continue
            name = p.relative_to(STDLIB).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__")
            messages = [{"role": "user", "content": f"What is the Python module {name} for?"},
                        {"role": "assistant", "content": summary}]
            if count % 3 == 0:
                messages.insert(0, {"role": "system", "content": "You answer questions about Python's library."})
            functions = [node.name for node in ast.parse(p.read_text(encoding="utf-8")).body
                         if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")]
            if count % 2 == 0 and functions:
                messages += [{"role": "user", "content": "Name one of its functions."},
                             {"role": "assistant", "content": f"{name}.{functions[0]}()"}]
            f.write(json.dumps({"messages": messages}) + "\n")
            count += 1
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", metavar="OUT_DIR", help="where to write the model (new or empty)")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--pretrain-steps", type=int, default=200, help="0: random initialisation")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-size", type=int, help="bytes per safetensors shard (default: one file)")
    parser.add_argument("--corpus", metavar="OUT.jsonl", help="also write the fine-tuning corpus here")
    parser.add_argument("--chat", metavar="OUT.jsonl", help="also write a conversation set here (format chat)")
    args = parser.parse_args(argv)
    if args.vocab < 256 + len(SPECIAL):
        parser.error(f"--vocab must be at least {256 + len(SPECIAL)} (the 256 bytes and the special tokens)")
    if args.hidden % args.heads:
        parser.error("--hidden must be a multiple of --heads")
    out = Path(args.out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        print(f"{parser.prog}: {out} exists and is not an empty directory", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bar

    tokenizer = build_tokenizer(out, args.vocab)
    model = build_model(tokenizer, args.hidden, args.layers, args.heads, args.seed)
    print(f"tokenizer: {len(tokenizer)} tokens; model: {model.num_parameters():,} parameters", flush=True)
    pretrain(model, tokenizer, args.pretrain_steps, args.seed)
    save(model, tokenizer, out, args.shard_size)
    write_sums(out)
    print(f"wrote {', '.join(sorted(p.name for p in out.iterdir()))} in {out}")
    if args.corpus:
        count = write_corpus(args.corpus)
        print(f"wrote {count} records, {Path(args.corpus).stat().st_size:,} bytes, to {args.corpus}")
    if args.chat:
        count = write_chat(args.chat)
        print(f"wrote {count} conversations, {Path(args.chat).stat().st_size:,} bytes, to {args.chat}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
