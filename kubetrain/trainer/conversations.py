"""The answer-only data of model causal-lm: `dataset.format: chat` and `dataset.format: prompt-completion`.

A chat record is a conversation (a list of {role, content} turns), rendered with the pretrained tokenizer's
chat template (or dataset.chatTemplate, or the model directory's chat_template.jinja); a prompt-completion
record is two texts, the completion followed by the end-of-sequence token. Each record becomes token ids and
a flag per token: whether it carries the loss (`trainOn: assistant`: an assistant turn as the template renders
it, with the template's end of that turn, or the completion and its end token; `trainOn: all`: every token).

Where an answer lies is read from the template's own rendering, never guessed from its text: the
conversation is rendered prefix by prefix (the turns before an assistant turn with the generation prompt,
then through that turn), and the answer is the characters between the two; the whole conversation is
tokenized once with the tokenizer's character offsets, and a token carries the loss when it starts inside an
answer. A template that renders a conversation's beginning differently once later turns follow (so that the
prefixes are not prefixes of the whole) is refused, naming the record: its answers cannot be found.

Samples: a record longer than sequenceLength keeps its start; one with no answer token left to predict is
dropped and counted. Packed (dataset.packing), whole records lie side by side in a sample while they fit,
none split, each with its own position ids starting at 0; the model (causal_lm.CausalLM) then gives the
attention no path across a record's boundary, so a packed sample computes what its records would alone.
A packed sample is (2, L): token ids (PAD where none) over position ids; an unpacked one (L,) as format text's.
The targets are the token ids where a token carries the loss, IGNORE_INDEX elsewhere, and at each record's
first position (nothing of the record precedes it): the training and the held-out loss count answers only.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kubetrain.api.spec import Dataset

from .errors import ConfigError, LoadError
from .objectives import IGNORE_INDEX, NEXT_TOKEN, PAD

log = logging.getLogger(__name__)

SUFFIXES = (".jsonl", ".parquet")
TEMPLATE_FILE = "chat_template.jinja"
"""A Hugging Face model directory's chat template beside its tokenizer (transformers 4.43+ writes it there)."""


@dataclass(frozen=True)
class Encoded:
    """One record as tokens: its ids and, per token, whether it carries the loss."""

    ids: np.ndarray
    answer: np.ndarray


# --- reading ---------------------------------------------------------------------------------------------------


def json_lines(name: str, text: str) -> Iterator[tuple[int, Any]]:
    """The values of a JSON Lines file's text, a non-blank line each, with their line numbers; LoadError naming
    the file and the line for one that is not JSON (format text's reader, causal_lm._records, takes them too)."""
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as err:
            raise LoadError(f"{name}: line {number}: not JSON ({err})") from None


def _rows(name: str, path: Path, columns: tuple[str, ...], fields: tuple[str, ...]) -> Iterator[tuple[Any, ...]]:
    """The values of `columns` of every record of one JSON Lines or Parquet file; `fields` are the columns'
    spec names (dataset.messagesColumn), for the errors."""
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path, columns=list(columns))
        except Exception as err:  # noqa: BLE001 - pyarrow raises many kinds for a bad file or a missing column
            raise LoadError(f"{name}: not a Parquet file with the column(s) {', '.join(map(repr, columns))} "
                            f"({' and '.join(fields)}; {type(err).__name__}: "
                            f"{str(err).splitlines()[0] if str(err) else ''})") from None
        yield from zip(*(table.column(c).to_pylist() for c in columns))
        return
    if not name.endswith(".jsonl"):
        raise LoadError(f"{name}: chat and prompt-completion read JSON Lines (.jsonl) or Parquet (.parquet) files")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise LoadError(f"{name}: not UTF-8 text ({err})") from None
    for number, record in json_lines(name, text):
        if not isinstance(record, dict):
            raise LoadError(f"{name}: line {number}: not a JSON object")
        for column, field in zip(columns, fields):
            if column not in record:
                raise LoadError(f"{name}: line {number}: no field {column!r} ({field})")
        yield tuple(record[c] for c in columns)


def _conversation(value: Any, where: str) -> list[dict[str, Any]]:
    """A record's messages, checked: a non-empty list of objects with a string role and string content."""
    if not isinstance(value, list) or not value:
        raise LoadError(f"{where}: expected a non-empty list of turns ({{role, content}}), got "
                        f"{type(value).__name__}")
    for turn, message in enumerate(value, 1):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise LoadError(f"{where}: turn {turn}: expected {{role: text, content: text}}, got {message!r:.120}")
    return value


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise LoadError(f"{where}: expected text, got {type(value).__name__}")
    return value


def read_records(dataset: Dataset, files: list[tuple[str, Path]]) -> list[Any]:
    """Every record of the files, in order: a conversation (chat) or a (prompt, completion) pair."""
    out: list[Any] = []
    for name, path in files:
        if dataset.format == "chat":
            rows = _rows(name, path, (dataset.messages_column,), ("dataset.messagesColumn",))
            out += [_conversation(messages, f"{name}: record {n} {dataset.messages_column!r}")
                    for n, (messages,) in enumerate(rows, 1)]
        else:
            rows = _rows(name, path, (dataset.prompt_column, dataset.completion_column),
                         ("dataset.promptColumn", "dataset.completionColumn"))
            out += [(_text(prompt, f"{name}: record {n} {dataset.prompt_column!r}"),
                     _text(completion, f"{name}: record {n} {dataset.completion_column!r}"))
                    for n, (prompt, completion) in enumerate(rows, 1)]
    return out


# --- the chat template -----------------------------------------------------------------------------------------


def use_chat_template(tokenizer: Any, dataset: Dataset, model_dir: Path) -> None:
    """Give `tokenizer` the template chat renders with: dataset.chatTemplate, else the tokenizer's own, else the
    model directory's chat_template.jinja; ConfigError naming the field when there is none."""
    if dataset.chat_template:
        tokenizer.chat_template = dataset.chat_template
    elif not getattr(tokenizer, "chat_template", None):
        file = model_dir / TEMPLATE_FILE
        if not file.is_file():
            raise ConfigError(f"spec.dataset.chatTemplate: format chat renders conversations with a chat template, "
                              f"and the tokenizer of spec.model.pretrained ({model_dir}) has none (no chat_template "
                              f"in tokenizer_config.json, no {TEMPLATE_FILE}): set chatTemplate to a Jinja template")
        tokenizer.chat_template = file.read_text(encoding="utf-8")


def _render(tokenizer: Any, messages: list[dict[str, Any]], generation: bool, where: str) -> str:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    except Exception as err:  # noqa: BLE001 - a template's own failure (jinja raises many kinds)
        raise LoadError(f"{where}: the chat template fails on it ({type(err).__name__}: {err})") from None
    if not isinstance(text, str):
        raise LoadError(f"{where}: the chat template rendered {type(text).__name__}, not text")
    return text


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], where: str = "a conversation",
                ) -> tuple[str, list[tuple[int, int]]]:
    """The conversation as its template renders it, and the character spans of its assistant turns: from the
    end of the turns before with the generation prompt to the end of the turns through it."""
    whole = _render(tokenizer, messages, False, where)
    spans = []
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:turn], True, where)
        through = _render(tokenizer, messages[:turn + 1], False, where)
        if not (through.startswith(before) and whole.startswith(through)):
            raise LoadError(f"{where}: the chat template does not render turn {turn + 1} (assistant) after the "
                            "turns before it as it renders them alone, so its answer cannot be found (a "
                            "template that rewrites earlier turns, e.g. dropping past reasoning): give "
                            "spec.dataset.chatTemplate a template that renders each turn once")
        spans.append((len(before), len(through)))
    return whole, spans


# --- tokens ----------------------------------------------------------------------------------------------------


def encode_chat(tokenizer: Any, conversations: list[list[dict[str, Any]]], train_on: str,
                batch: int) -> list[Encoded]:
    """Every conversation's tokens and answer flags, tokenized `batch` conversations at a time (the tokenizer's
    Python lists, ids and offsets, exist for one batch only)."""
    out: list[Encoded] = []
    for start in range(0, len(conversations), batch):
        rendered = [render_chat(tokenizer, messages, f"record {start + n + 1}")
                    for n, messages in enumerate(conversations[start:start + batch])]
        tokens = tokenizer([text for text, _ in rendered], add_special_tokens=False, verbose=False,
                           return_attention_mask=False, return_offsets_mapping=True)
        for (_, spans), ids, offsets in zip(rendered, tokens["input_ids"], tokens["offset_mapping"]):
            starts = np.asarray([s for s, _ in offsets], dtype=np.int64)
            answer = np.zeros(len(ids), dtype=bool)
            for first, end in spans:
                answer |= (starts >= first) & (starts < end)
            if train_on == "all":
                answer[:] = True
            out.append(Encoded(np.asarray(ids, dtype=np.int32), answer))
    return out


def encode_pairs(tokenizer: Any, pairs: list[tuple[str, str]], train_on: str, batch: int) -> list[Encoded]:
    """Every (prompt, completion)'s tokens: the prompt's, the completion's, the end-of-sequence token; the
    completion and the end token carry the loss."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    out: list[Encoded] = []
    for start in range(0, len(pairs), batch):
        chunk = pairs[start:start + batch]
        kwargs = {"add_special_tokens": False, "verbose": False, "return_attention_mask": False}
        prompts = tokenizer([p for p, _ in chunk], **kwargs)["input_ids"]
        completions = tokenizer([c for _, c in chunk], **kwargs)["input_ids"]
        for prompt, completion in zip(prompts, completions):
            ids = np.asarray([*prompt, *completion, *eos], dtype=np.int32)
            answer = np.ones(len(ids), dtype=bool)
            if train_on != "all":
                answer[: len(prompt)] = False
            out.append(Encoded(ids, answer))
    return out


# --- samples ---------------------------------------------------------------------------------------------------


def answer_samples(records: list[Encoded], length: int, packing: bool,
                   ) -> tuple[np.ndarray, np.ndarray, int]:
    """(x, y, dropped): the samples of `length` tokens and their targets, and how many records were dropped
    for having no answer token left to predict within `length` (a record's first token is never predicted).
    Packed: x is (N, 2, length), token ids (PAD where none) over each token's position in its record; whole
    records fill a sample in order while they fit (next fit: none is split, so a record's tokens see only its
    own), and the padding at a sample's end is a record of its own (positions from 0), trained on by nothing.
    Unpacked: x is (N, length), one record each, PAD after it."""
    kept: list[tuple[np.ndarray, np.ndarray]] = []
    dropped = 0
    for record in records:
        ids, answer = record.ids[:length].astype(np.int64), record.answer[:length]
        labels = np.where(answer, ids, IGNORE_INDEX)
        labels[:1] = IGNORE_INDEX
        if not (labels != IGNORE_INDEX).any():
            dropped += 1
            continue
        kept.append((ids, labels))
    rows: list[list[tuple[np.ndarray, np.ndarray]]] = []
    used = length
    for ids, labels in kept:
        if not packing or used + len(ids) > length:
            rows.append([])
            used = 0
        rows[-1].append((ids, labels))
        used += len(ids)
    x = np.full((len(rows), 2, length) if packing else (len(rows), length), PAD, dtype=np.int64)
    y = np.full((len(rows), length), IGNORE_INDEX, dtype=np.int64)
    for row, records_in_row in enumerate(rows):
        at = 0
        for ids, labels in records_in_row:
            if packing:
                x[row, 0, at:at + len(ids)] = ids
                x[row, 1, at:at + len(ids)] = np.arange(len(ids))
            else:
                x[row, at:at + len(ids)] = ids
            y[row, at:at + len(ids)] = labels
            at += len(ids)
        if packing:
            x[row, 1, at:] = np.arange(length - at)
    return x, y, dropped


def load_answers(dataset: Dataset, model_dir: Path, config: dict[str, Any], files: list[tuple[str, Path]],
                 batch: int) -> Any:
    """The job's chat or prompt-completion records as Data: answer-only targets, the last evalFraction of the
    samples held out."""
    from transformers import AutoTokenizer

    from .data import Data

    records = read_records(dataset, files)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if dataset.format == "chat":
        use_chat_template(tokenizer, dataset, model_dir)
        encoded = encode_chat(tokenizer, records, dataset.train_on, batch)
    else:
        encoded = encode_pairs(tokenizer, records, dataset.train_on, batch)
    record_count = len(records)
    del records
    tokens = sum(len(e.ids) for e in encoded)
    x, y, dropped = answer_samples(encoded, dataset.sequence_length, dataset.packing)
    del encoded
    where = dataset.uri or dataset.path
    vocab = int(config.get("vocab_size") or 0)
    if vocab and x.size and int(x.max()) >= vocab:
        raise LoadError(f"spec.model.pretrained: its tokenizer gives token {int(x.max())}, past the model's "
                        f"vocab_size {vocab}")
    if dropped:
        log.warning("%s: %d of %d records dropped: no answer token within sequenceLength %d", dataset.format,
                    dropped, record_count, dataset.sequence_length)
    held = math.ceil(len(x) * dataset.eval_fraction) if dataset.eval_fraction else 0
    if len(x) - held < 1:
        raise LoadError(f"spec.dataset: {where}: {len(x)} sample(s) of {dataset.sequence_length} tokens ("
                        f"{dropped} record(s) of {record_count} dropped without an answer token), none left to "
                        f"train on after evalFraction {dataset.eval_fraction}")
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    cut = len(xt) - held
    log.info("%s: %d records from %d file(s), %d tokens (%d trained on), %d samples of %d (%d held out, "
             "packing %s), %d records dropped without an answer token", dataset.format, record_count, len(files),
             tokens, int((yt != IGNORE_INDEX).sum()), len(xt), dataset.sequence_length, held,
             "on" if dataset.packing else "off", dropped)
    return Data(train_x=xt[:cut], train_y=yt[:cut], eval_x=xt[cut:], eval_y=yt[cut:],
                input_shape=tuple(x.shape[1:]), num_classes=None, target_shape=(dataset.sequence_length,),
                objective=NEXT_TOKEN)
