"""Read TrainingJob documents from YAML text, files or API objects into validated specs."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from . import podtemplate, schema
from .names import annotations_problems, labels_problems, namespace_problems
from .schema import INT64_MAX, INT64_MIN, InvalidSpec, Problem, short_repr
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
    """Validate one TrainingJob document (a dict); raise InvalidSpec with every problem.

    The document may come from a file or from the API server (the operator): its depth is
    checked first, without recursion, and every integer in it must fit int64, whichever field
    holds it (a free-form one such as podTemplate included)."""
    problems: list[Problem] = []
    if not isinstance(doc, dict):
        raise InvalidSpec([Problem("(document)", "must be a TrainingJob object")], source)
    deep = depth_problem(doc)
    if deep is not None:
        raise InvalidSpec([deep], source)
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
    problems += metadata_problems(meta)
    namespace = meta.get("namespace", "default")
    spec_doc = doc.get("spec")
    spec: Any = schema.MISSING  # a Spec once parsed without problems
    if spec_doc is None:
        problems.append(Problem("spec", "is required"))
    else:
        spec = schema.parse(Spec, spec_doc, "spec", problems)
    reported = {p.path for p in problems}
    problems += [p for p in huge_integers(spec_doc, "spec") if p.path not in reported]
    problems += [p for p in null_problems(spec_doc) if p.path not in reported]
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


def metadata_problems(meta: dict[str, Any]) -> list[Problem]:
    """The job's name (kubetrain's own bound), namespace, labels and annotations, as the API server
    judges them (names.py)."""
    problems = check_name(meta.get("name"))
    if "namespace" in meta:
        problems += namespace_problems(meta["namespace"])
    problems += labels_problems(meta.get("labels"), "metadata.labels")
    problems += annotations_problems(meta.get("annotations"), "metadata.annotations")
    return problems


def depth_problem(doc: Any) -> Problem | None:
    """Why `doc` nests deeper than MAX_NESTING (a dict or list is a level, the document the first),
    found with a stack of its own, stopping at the first level too deep; None when it does not."""
    stack = [(doc, 1, "")]
    while stack:
        node, depth, path = stack.pop()
        children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, child in children:
            if isinstance(child, (dict, list)):
                where = f"{path}[{key}]" if isinstance(node, list) else (f"{path}.{key}" if path else str(key))
                if depth + 1 > MAX_NESTING:
                    return Problem(where, f"nests deeper than {MAX_NESTING} levels (the limit of a TrainingJob)")
                stack.append((child, depth + 1, where))
    return None


def huge_integers(value: Any, path: str) -> list[Problem]:
    """An integer outside int64 anywhere in `value` (the API server stores int64; a free-form field
    such as podTemplate would carry it to a pod the API server refuses, or to the trainer)."""
    found = []
    stack = [(value, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, dict):
            stack += [(v, f"{where}.{k}") for k, v in node.items()]
        elif isinstance(node, list):
            stack += [(v, f"{where}[{i}]") for i, v in enumerate(node)]
        elif isinstance(node, int) and not isinstance(node, bool) and not INT64_MIN <= node <= INT64_MAX:
            found.append(Problem(where, f"must be a 64-bit integer (at most {INT64_MAX}), got {short_repr(node)}"))
    return found


NULL_MESSAGE = "must not be null: leave the field out"


def null_problems(spec_doc: Any) -> list[Problem]:
    """A null inside a free-form field of the spec (podTemplate, model.args, dataset.args, the resources,
    minResources), each named by its path. A typed field's null is `schema.parse`'s to judge (an optional
    field's is its "unset"; any other's is refused there); a free-form field holds whatever was written,
    and passed a null on to the pods, the merge or the user's code: the API server keeps a null where its
    schema preserves unknown fields, and drops (or, in a server-side apply, refuses) one where it declares
    the field. podTemplate's say why they matter most (podtemplate.NULL_MESSAGE)."""
    found = []
    stack: list[tuple[type, Any, str]] = [(Spec, spec_doc, "spec")]
    while stack:
        cls, data, path = stack.pop()
        if not isinstance(data, dict):
            continue  # refused by schema.parse
        for f, info in schema.fields_of(cls):
            name = schema.yaml_name(f)
            value, where = data.get(name), f"{path}.{name}"
            if value is None:
                continue
            if info.kind == "object" and info.cls is not None:
                stack.append((info.cls, value, where))
            elif info.kind == "any" or (info.kind in ("map", "list") and info.value is not None
                                        and info.value.kind == "any"):
                message = podtemplate.NULL_MESSAGE if (cls is Spec and name == "podTemplate") else NULL_MESSAGE
                found += [Problem(p, message) for p in podtemplate.null_paths(value, where)]
    return found


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
# Nesting: the deepest real manifest (a podTemplate's affinity) nests about 15
# levels. A file past this is refused while it is read (PyYAML's own builder
# recursed: a few thousand '[' exhausted Python's stack); a spec from the API
# server (which accepts far deeper objects) is refused by `depth_problem` before
# anything walks it recursively (hundreds of levels once raised RecursionError
# in the operator, in every round of that job).
MAX_NESTING = 64

_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's parser when PyYAML has it (the pure-Python one took 31 s of CPU for a 1 MiB flow list)."""
_RESOLVER = yaml.resolver.Resolver()
_CONSTRUCTOR = yaml.constructor.SafeConstructor()
_MAP, _SEQ = "tag:yaml.org,2002:map", "tag:yaml.org,2002:seq"


class _Refused(Exception):
    """A document that is not built at all (an alias, nesting past MAX_NESTING)."""


def _where(path: str, mark: Any) -> str:
    return f"{path or '(document)'} (line {mark.line + 1})"


def _line(event: Any) -> int:
    """The 1-based line a YAML event starts at (PyYAML's parser marks every event)."""
    return int(event.start_mark.line) + 1


class _Builder:
    """Builds the documents of a YAML stream from its events, in one pass of libyaml's parser and
    without recursion: the event stream is flat, and the builder keeps its own stack. On the way it
    refuses what PyYAML's loader let through or could not say: aliases (a 1 KB alias bomb once grew
    `kubetrain run` past 2.4 GB), nesting past MAX_NESTING, a key given twice (YAML keeps the last:
    `privileged: true` then `privileged: false` read as false), and a value that cannot be read (an
    integer of 6,000 digits), each named by its field path."""

    def __init__(self) -> None:
        self.docs: list[Any] = []
        self.problems: list[tuple[int, Problem]] = []  # (the document's number, from 1; the problem)
        self._stack: list[list[Any]] = []  # [container, path, pending key or _NO_KEY, key lines]

    def _problem(self, path: str, message: str) -> None:
        self.problems.append((len(self.docs) + 1, Problem(path or "(document)", message)))

    def feed(self, event: Any) -> None:
        if isinstance(event, yaml.AliasEvent):
            raise _Refused(f"YAML aliases (*{event.anchor}) are not allowed in a TrainingJob, at line "
                           f"{_line(event)}: write the value out")
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            if len(self._stack) >= MAX_NESTING:
                raise _Refused(f"nests deeper than {MAX_NESTING} levels at line {_line(event)}")
            mapping = isinstance(event, yaml.MappingStartEvent)
            path = self._child_path(event)
            if event.tag not in (None, "!", _MAP if mapping else _SEQ):
                self._problem(path, f"the YAML tag {event.tag} is not allowed in a TrainingJob "
                                    f"(line {_line(event)})")
            self._stack.append([{} if mapping else [], path, _NO_KEY, {}])
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            value = self._stack.pop()[0]
            self._add(value, event)
        elif isinstance(event, yaml.ScalarEvent):
            self._add(self._scalar(event), event, scalar=True)

    def _child_path(self, event: Any) -> str:
        if not self._stack:
            return ""
        container, path, key, _ = self._stack[-1]
        path = str(path)
        if isinstance(container, list):
            return f"{path}[{len(container)}]"
        if key is _NO_KEY:  # a mapping or a list as a key
            self._problem(path, f"a key must be a plain value, not a mapping or a list (line "
                                f"{_line(event)})")
            return path
        if key is _BAD_KEY:
            return path
        return f"{path}.{key}" if path else str(key)

    def _scalar(self, event: Any) -> Any:
        tag = event.tag
        if tag in (None, "!"):
            tag = _RESOLVER.resolve(yaml.ScalarNode, event.value, event.implicit)  # type: ignore[no-untyped-call]
        if tag == "tag:yaml.org,2002:merge":
            raise _Refused(f"YAML merge keys (<<) are not allowed in a TrainingJob, at line "
                           f"{_line(event)}: write the values out")
        construct = _CONSTRUCTOR.yaml_constructors.get(tag)
        if construct is None or tag in (_MAP, _SEQ) or tag.startswith("tag:yaml.org,2002:python/"):
            self._problem(self._child_path(event), f"the YAML tag {tag} is not allowed in a TrainingJob (line "
                                                   f"{_line(event)})")
            return event.value
        node = yaml.ScalarNode(tag, event.value, event.start_mark, event.end_mark, event.style)
        try:
            return construct(_CONSTRUCTOR, node)
        except (ValueError, OverflowError, yaml.YAMLError) as err:
            digits = sum(c.isdigit() for c in event.value)
            if tag == "tag:yaml.org,2002:int" and digits > 18:
                message = (f"must be a 64-bit integer (at most {INT64_MAX}), got a number of {digits} digits "
                           f"(line {_line(event)})")
            else:
                message = f"{event.value[:40]!r} cannot be read as {tag.rsplit(':', 1)[-1]}: {str(err)[:120]}"
            self._problem(self._child_path(event), message)
            return event.value

    def _add(self, value: Any, event: Any, scalar: bool = False) -> None:
        if not self._stack:
            self.docs.append(value)
            return
        frame = self._stack[-1]
        container, path, key, lines = frame
        if isinstance(container, list):
            container.append(value)
        elif key is _NO_KEY:
            if not scalar or isinstance(value, (dict, list)):
                frame[2] = _BAD_KEY
                return
            try:
                hash(value)
            except TypeError:
                value = str(value)
            frame[2] = value
            if value in container:
                self._problem(f"{path}.{value}" if path else str(value),
                              f"is given twice (lines {lines[value]} and {_line(event)}); YAML would "
                              "silently keep the last: give it once")
            lines.setdefault(value, event.start_mark.line + 1)
        else:
            if key is not _BAD_KEY and key not in container:
                container[key] = value
            frame[2] = _NO_KEY


_NO_KEY, _BAD_KEY = object(), object()


def documents(text: str, source: str) -> list[Any]:
    """The documents of a YAML text, built in one pass (_Builder); InvalidSpec names the file and each
    problem's field path."""
    builder = _Builder()
    try:
        for event in yaml.parse(text, Loader=_LOADER):
            builder.feed(event)
    except _Refused as err:
        raise InvalidSpec([Problem("(file)", str(err))], source) from None
    except yaml.YAMLError as err:
        raise InvalidSpec([Problem("(file)", _yaml_error(err))], source) from None
    docs = [d for d in builder.docs if d is not None]
    if builder.problems:
        several = len(builder.docs) > 1  # each problem's document, as load_file names them
        raise InvalidSpec([Problem(f"document {n}: {p.path}", p.message) if several else p
                           for n, p in builder.problems], source)
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


_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
"""libyaml's dumper when PyYAML has it (its wheels do): the same text as the pure-Python SafeDumper
(tests/api/test_load.py), 3-4 times faster. The operator renders the job file in every round that
renders the job's children: with the pure-Python dumper that was 80 % of a round's CPU."""


def dump_manifest(job: TrainingJob) -> str:
    text: str = yaml.dump(to_manifest(job), Dumper=_DUMPER, sort_keys=False)
    return text
