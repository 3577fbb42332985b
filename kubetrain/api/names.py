"""Kubernetes' rules for names, labels and annotations, as the API server applies them to metadata.

`kubetrain validate` and the operator judge a job's metadata (and its podTemplate's) by
these rules, so a manifest the API server would refuse is refused here first, naming the
field: a 300-character namespace, or `labels: [1, 2]`, used to pass `validate` and fail
only at `kubectl apply` (or, in a podTemplate, at every pod the operator tried to create).
The rules are apimachinery's (validation.IsQualifiedName, IsValidLabelValue, IsDNS1123Label,
ValidateAnnotations).
"""

from __future__ import annotations

import re
from typing import Any

from .schema import Problem, type_name

DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS1123_LABEL_MAX = 63
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
DNS1123_SUBDOMAIN_MAX = 253
QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
QUALIFIED_NAME_MAX = 63
LABEL_VALUE_MAX = 63
ANNOTATIONS_MAX_BYTES = 256 << 10
"""The API server's bound on a object's annotations, keys and values together (TotalAnnotationSizeLimitB)."""


def _show(text: str) -> str:
    return repr(text) if len(text) <= 80 else f"{text[:60]!r}... ({len(text)} characters)"


def namespace_problems(namespace: Any, path: str = "metadata.namespace") -> list[Problem]:
    """A namespace name: a DNS-1123 label of at most 63 characters."""
    if not isinstance(namespace, str):
        return [Problem(path, f"must be a string, got {type_name(namespace)}")]
    if len(namespace) > DNS1123_LABEL_MAX:
        return [Problem(path, f"must be at most {DNS1123_LABEL_MAX} characters, got {len(namespace)}")]
    if not DNS1123_LABEL.fullmatch(namespace):
        return [Problem(path, f"{_show(namespace)} is not a valid namespace name (a DNS-1123 label: lower-case "
                              "letters, digits and '-', starting and ending with a letter or digit)")]
    return []


def qualified_key_problem(key: Any) -> str | None:
    """Why `key` is no label or annotation key (an optional DNS-1123 subdomain prefix and '/', then a
    name of at most 63 characters), or None."""
    if not isinstance(key, str):
        return f"keys must be strings, got {type_name(key)} {key!r}"
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > DNS1123_SUBDOMAIN_MAX or not DNS1123_SUBDOMAIN.fullmatch(prefix)):
        return (f"key {_show(key)}: its prefix must be a DNS-1123 subdomain of at most {DNS1123_SUBDOMAIN_MAX} "
                "characters")
    if len(name) > QUALIFIED_NAME_MAX or not QUALIFIED_NAME.fullmatch(name):
        return (f"key {_show(key)}: its name must be at most {QUALIFIED_NAME_MAX} characters of letters, digits, "
                "'-', '_' and '.', starting and ending with a letter or digit")
    return None


def labels_problems(labels: Any, path: str) -> list[Problem]:
    """Labels: a map of qualified keys to values of at most 63 characters (empty, or letters, digits,
    '-', '_' and '.', starting and ending with a letter or digit)."""
    if labels is None:
        return []
    if not isinstance(labels, dict):
        return [Problem(path, f"must be a map of strings to strings, got {type_name(labels)}")]
    problems = []
    for key, value in labels.items():
        where = f"{path}.{key}"
        why = qualified_key_problem(key)
        if why is not None:
            problems.append(Problem(path, why))
        elif not isinstance(value, str):
            problems.append(Problem(where, f"must be a string, got {type_name(value)}"))
        elif len(value) > LABEL_VALUE_MAX or (value and not QUALIFIED_NAME.fullmatch(value)):
            problems.append(Problem(where, f"{_show(value)} is not a valid label value (at most {LABEL_VALUE_MAX} "
                                           "characters of letters, digits, '-', '_' and '.', starting and ending "
                                           "with a letter or digit)"))
    return problems


def annotations_problems(annotations: Any, path: str) -> list[Problem]:
    """Annotations: a map of qualified keys to strings, at most 256 KiB together."""
    if annotations is None:
        return []
    if not isinstance(annotations, dict):
        return [Problem(path, f"must be a map of strings to strings, got {type_name(annotations)}")]
    problems = []
    size = 0
    for key, value in annotations.items():
        why = qualified_key_problem(key)
        if why is not None:
            problems.append(Problem(path, why))
            continue
        if not isinstance(value, str):
            problems.append(Problem(f"{path}.{key}", f"must be a string, got {type_name(value)}"))
            continue
        size += len(key.encode()) + len(value.encode())
    if size > ANNOTATIONS_MAX_BYTES:
        problems.append(Problem(path, f"must be at most {ANNOTATIONS_MAX_BYTES} bytes together, got {size}"))
    return problems
