"""Read TrainingJob documents from YAML text, files or API objects into validated specs."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from . import schema
from .schema import InvalidSpec, Problem
from .spec import API_VERSION, KIND, Metadata, Spec, TrainingJob

# Child objects are named <job>-<role>-<index> (e.g. "<job>-worker-1023") and
# Services must be DNS-1035 labels of at most 63 characters.
MAX_NAME_LENGTH = 45
DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def check_name(name: Any, path: str = "metadata.name") -> list[Problem]:
    if name is None:
        return [Problem(path, "is required")]
    if not isinstance(name, str):
        return [Problem(path, f"must be a string, got {name!r}")]
    if len(name) > MAX_NAME_LENGTH:
        return [
            Problem(
                path,
                f"must be at most {MAX_NAME_LENGTH} characters so that child names such as "
                f"'<name>-worker-1023' stay valid, got {len(name)}",
            )
        ]
    if not DNS1035.fullmatch(name):
        return [
            Problem(
                path,
                f"{name!r} is not a DNS-1035 label (lower-case letters, digits and '-', "
                "starting with a letter, ending with a letter or digit)",
            )
        ]
    return []


def from_object(doc: Any, source: str = "") -> TrainingJob:
    """Validate one TrainingJob document (a dict); raise InvalidSpec with every problem."""
    problems: list[Problem] = []
    if not isinstance(doc, dict):
        raise InvalidSpec([Problem("(document)", "must be a TrainingJob object")], source)
    api_version = doc.get("apiVersion")
    if api_version != API_VERSION:
        problems.append(Problem("apiVersion", f"must be {API_VERSION}, got {api_version!r}"))
    kind = doc.get("kind")
    if kind != KIND:
        problems.append(Problem("kind", f"must be {KIND}, got {kind!r}"))
    for key in doc:
        if key not in ("apiVersion", "kind", "metadata", "spec", "status"):
            problems.append(Problem(str(key), "unknown field; expected apiVersion, kind, metadata, spec"))
    meta = doc.get("metadata")
    if not isinstance(meta, dict):
        problems.append(Problem("metadata", "must be an object with a name"))
        meta = {}
    problems += check_name(meta.get("name"))
    namespace = meta.get("namespace", "default")
    if not isinstance(namespace, str) or not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", namespace):
        problems.append(Problem("metadata.namespace", f"{namespace!r} is not a valid namespace name"))
    spec_doc = doc.get("spec")
    spec = schema.MISSING
    if spec_doc is None:
        problems.append(Problem("spec", "is required"))
    else:
        spec = schema.parse(Spec, spec_doc, "spec", problems)
    if problems:
        raise InvalidSpec(sorted(set(problems), key=lambda p: (p.path, p.message)), source)
    metadata = Metadata(
        name=meta["name"],
        namespace=namespace,
        labels=meta.get("labels"),
        annotations=meta.get("annotations"),
        uid=meta.get("uid", ""),
        generation=meta.get("generation", 0),
    )
    return TrainingJob(metadata=metadata, spec=spec.complete())


def from_spec_dict(name: str, spec_doc: dict[str, Any], namespace: str = "default") -> TrainingJob:
    """Validate the spec of an object the API server handed us (operator side)."""
    return from_object(
        {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "namespace": namespace}, "spec": spec_doc},
        f"{namespace}/{name}",
    )


def _yaml_error(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err)
    if mark is not None:
        return f"YAML syntax error at line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return f"YAML syntax error: {problem}"


# A TrainingJob is a small document; these bound what reading one may cost.
# The API server refuses objects past about 1.5 MiB (etcd's request limit), so
# a manifest past 1 MiB is a mistake or an attack, not a job.
MAX_MANIFEST_BYTES = 1 << 20
# PyYAML builds nested collections recursively: a few thousand '[' exhaust
# Python's stack. The deepest real manifest (a podTemplate's affinity) nests
# about 15 levels.
MAX_NESTING = 64


def _shape_problem(text: str) -> str | None:
    """Why the YAML must not be built at all: an alias (a 1 KB alias bomb expands past
    gigabytes once walked), or nesting past MAX_NESTING. Read from the event stream,
    which PyYAML produces without recursion."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.AliasEvent):
            return (f"YAML aliases (*{event.anchor}) are not allowed in a TrainingJob, at line "
                    f"{event.start_mark.line + 1}: write the value out")
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_NESTING:
                return f"nests deeper than {MAX_NESTING} levels at line {event.start_mark.line + 1}"
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
    return None


def documents(text: str, source: str) -> list[Any]:
    try:
        problem = _shape_problem(text)
        if problem is not None:
            raise InvalidSpec([Problem("(file)", problem)], source)
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as err:
        raise InvalidSpec([Problem("(file)", _yaml_error(err))], source) from None
    except (ValueError, OverflowError) as err:  # an integer of thousands of digits, a date out of range
        raise InvalidSpec([Problem("(file)", f"a value cannot be read: {str(err)[:200]}")], source) from None
    if not docs:
        raise InvalidSpec([Problem("(file)", "holds no YAML document")], source)
    return docs


def load_file(path: str | Path) -> list[TrainingJob]:
    """Every TrainingJob of a YAML file; InvalidSpec names the file, document and field."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise InvalidSpec([Problem("(file)", "no such file")], str(path)) from None
    except OSError as err:  # a directory, no permission
        raise InvalidSpec([Problem("(file)", f"cannot be read: {err.strerror or err}")], str(path)) from None
    if len(raw) > MAX_MANIFEST_BYTES:
        raise InvalidSpec([Problem("(file)", f"is larger than {MAX_MANIFEST_BYTES} bytes; a TrainingJob is "
                                             "a small document")], str(path))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InvalidSpec([Problem("(file)", f"is not UTF-8 text: byte 0x{raw[err.start]:02x} at offset "
                                             f"{err.start}")], str(path)) from None
    docs = documents(text, str(path))
    jobs: list[TrainingJob] = []
    problems: list[Problem] = []
    for i, doc in enumerate(docs):
        source = str(path) if len(docs) == 1 else f"{path} (document {i + 1})"
        try:
            jobs.append(from_object(doc, source))
        except InvalidSpec as err:
            prefix = "" if len(docs) == 1 else f"document {i + 1}: "
            problems += [Problem(prefix + p.path, p.message) for p in err.problems]
    if problems:
        raise InvalidSpec(problems, str(path))
    return jobs


def load_one(path: str | Path) -> TrainingJob:
    jobs = load_file(path)
    if len(jobs) != 1:
        raise InvalidSpec([Problem("(file)", f"must hold exactly one TrainingJob, found {len(jobs)}")], str(path))
    return jobs[0]


def to_manifest(job: TrainingJob) -> dict[str, Any]:
    """The full manifest, defaults filled in (what the run directory's job.yaml holds)."""
    meta: dict[str, Any] = {"name": job.metadata.name}
    if job.metadata.namespace != "default":
        meta["namespace"] = job.metadata.namespace
    if job.metadata.labels:
        meta["labels"] = job.metadata.labels
    if job.metadata.annotations:
        meta["annotations"] = job.metadata.annotations
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": meta, "spec": schema.to_dict(job.spec)}


def dump_manifest(job: TrainingJob) -> str:
    return yaml.safe_dump(to_manifest(job), sort_keys=False)
