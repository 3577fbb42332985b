"""Reading the replicas' event logs (metrics/<replica>.jsonl), also while a live process appends to them.

A reader polling a log that a trainer is writing can find its last line half
written: json.loads of that fragment fails, and a test that read every line
strictly failed at random with a JSONDecodeError. A line is whole once it
ends in a newline; only the unterminated tail is left for the next read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every whole line of a JSON-lines file, parsed; [] while the file does not exist.

    An unterminated last line is still being written (or was cut by a kill) and
    is left out. A whole line that is not JSON is a broken log: that fails,
    naming the file and the line.
    """
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    lines = text.split("\n")[:-1]  # what follows the last newline is not whole yet
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise AssertionError(f"{path}:{number}: not JSON ({err}): {line[:200]!r}") from None
    return records


def read_events(path: Path, event: str | None = None) -> list[dict[str, Any]]:
    """The records of an event log, only those of kind `event` when it is given."""
    return [r for r in read_jsonl(path) if event is None or r["event"] == event]


def json_objects(text: str) -> list[dict[str, Any]]:
    """The JSON objects written one after another in text (files `cat` printed together, in a pod)."""
    decoder, objs, text = json.JSONDecoder(), [], text.strip()
    while text:
        obj, end = decoder.raw_decode(text)
        objs.append(obj)
        text = text[end:].strip()
    return objs
