"""The job file (dump_manifest) is the text the pure-Python SafeDumper writes, and reads back as the job."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from support import ROOT

from kubetrain.api import dump_manifest, from_object, load_file, to_manifest

EXAMPLES = sorted(p for p in (ROOT / "examples").rglob("*.yaml") if "kind: TrainingJob" in p.read_text())


def jobs_of(path: Path) -> list:
    found = load_file(path)
    return found if isinstance(found, list) else [found]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_job_file_is_what_the_pure_python_dumper_writes(path):
    for job in jobs_of(path):
        text = dump_manifest(job)
        assert text == yaml.safe_dump(to_manifest(job), sort_keys=False)
        assert from_object(yaml.safe_load(text)) == job


def test_odd_strings_survive_the_job_file():
    odd = {"a": "ünïcödé ✓", "b": "line\nbreak", "c": "x" * 300, "d": "yes", "e": "0x10", "f": "- dash", "g": "null"}
    [job] = jobs_of(EXAMPLES[0])[:1]
    job.metadata.labels = dict(odd)
    text = dump_manifest(job)
    assert text == yaml.safe_dump(to_manifest(job), sort_keys=False)
    assert yaml.safe_load(text)["metadata"]["labels"] == odd
