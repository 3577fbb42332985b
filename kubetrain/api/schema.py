"""Typed configuration dataclasses described once, read and checked from plain data.

A field is declared with :func:`field` (its docs, range, pattern and YAML name);
a class may carry ``__rules__`` (cross-field constraints such as "exactly one
of"). From that one description this module parses YAML-shaped dicts into
dataclasses, collects *every* problem with its field path, and serialises the
dataclasses back. ``crd.py`` turns the same description into the CRD's OpenAPI
schema and CEL rules, and ``docs.py`` into the reference page.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from dataclasses import MISSING as MISSING  # re-exported: the readers of parse() compare with it
from typing import Any, Literal, Union


@dataclasses.dataclass(frozen=True)
class Meta:
    """What the schema knows of one field beyond its Python type."""

    doc: str
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    exclusive_maximum: bool = False
    pattern: str | None = None
    pattern_hint: str = ""
    max_length: int | None = None
    min_items: int | None = None  # lists
    max_items: int | None = None  # lists
    yaml_name: str | None = None
    immutable: bool = False
    free_form: bool = False  # any JSON object (preserved unknown fields)
    since: str | None = None
    """The release that added the field, when it came after the API's first (0.1.0). The CRD then carries no
    default for it (the model applies it): the API server adds a CRD default to every stored object it reads,
    and the operator of the release before, which runs beside the new CRD during an upgrade (the CRD is applied
    first) and after a rollback, refuses a field it does not know, failing the job (docs/operating.md#upgrades;
    tests/api/test_crd_compat.py holds it)."""


def field(
    doc: str,
    default: Any = MISSING,
    *,
    default_factory: Any = MISSING,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
    exclusive_maximum: bool = False,
    pattern: str | None = None,
    pattern_hint: str = "",
    max_length: int | None = None,
    min_items: int | None = None,
    max_items: int | None = None,
    name: str | None = None,
    immutable: bool = False,
    since: str | None = None,
) -> Any:
    meta = Meta(
        doc=doc,
        minimum=minimum,
        maximum=maximum,
        exclusive_minimum=exclusive_minimum,
        exclusive_maximum=exclusive_maximum,
        pattern=pattern,
        pattern_hint=pattern_hint,
        max_length=max_length,
        min_items=min_items,
        max_items=max_items,
        yaml_name=name,
        immutable=immutable,
        since=since,
    )
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"kt": meta})


# --- cross-field rules -------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ExactlyOne:
    """Exactly one of these fields must be set."""

    fields: tuple[str, ...]

    def check(self, present: set[str], values: dict[str, Any], names: dict[str, str]) -> str | None:
        n = sum(1 for f in self.fields if f in present)
        if n == 1:
            return None
        listed = ", ".join(names[f] for f in self.fields)
        if n == 0:
            return f"one of {listed} must be set"
        return f"only one of {listed} may be set"


@dataclasses.dataclass(frozen=True)
class AtMostOne:
    """At most one of these fields may be set."""

    fields: tuple[str, ...]

    def check(self, present: set[str], values: dict[str, Any], names: dict[str, str]) -> str | None:
        if sum(1 for f in self.fields if f in present) <= 1:
            return None
        return f"only one of {', '.join(names[f] for f in self.fields)} may be set"


@dataclasses.dataclass(frozen=True)
class OnlyWhen:
    """Field ``name`` may be set only when field ``when`` equals ``value``."""

    name: str
    when: str
    value: str

    def check(self, present: set[str], values: dict[str, Any], names: dict[str, str]) -> str | None:
        if self.name in present and self.when in values and values[self.when] != self.value:
            return f"{names[self.name]} may be set only when {names[self.when]} is {self.value}"
        return None


@dataclasses.dataclass(frozen=True)
class Excludes:
    """When field ``name`` is set, none of ``fields`` may be set."""

    name: str
    fields: tuple[str, ...]

    def check(self, present: set[str], values: dict[str, Any], names: dict[str, str]) -> str | None:
        clash = [names[f] for f in self.fields if f in present]
        if self.name in present and clash:
            return f"{', '.join(clash)} {'does' if len(clash) == 1 else 'do'} not apply when {names[self.name]} is set"
        return None


# --- problems ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True, order=True)
class Problem:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


MAX_SHOWN_PROBLEMS = 50
"""Problems shown of one file or job (printed by `kubetrain validate`, written to a job's status): a
manifest of 140,000 empty documents once printed 700,000 lines. The rest are counted."""


class InvalidSpec(Exception):
    """Raised with every problem found in a document, each with its field path."""

    def __init__(self, problems: list[Problem], source: str = ""):
        self.problems = problems
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(where + "; ".join(self.shown()))

    def shown(self, limit: int = MAX_SHOWN_PROBLEMS) -> list[str]:
        """The first `limit` problems as "path: message", and a last line counting the rest."""
        lines = [str(p) for p in self.problems[:limit]]
        if len(self.problems) > limit:
            lines.append(f"... and {len(self.problems) - limit} more problems")
        return lines


# --- names -------------------------------------------------------------------


def camel(attr: str) -> str:
    head, *rest = attr.split("_")
    return head + "".join(w[:1].upper() + w[1:] for w in rest)


def yaml_name(f: dataclasses.Field[Any]) -> str:
    meta: Meta | None = f.metadata.get("kt")
    if meta and meta.yaml_name:
        return meta.yaml_name
    return camel(f.name)


def meta_of(f: dataclasses.Field[Any]) -> Meta:
    meta: Meta | None = f.metadata.get("kt")
    if meta is None:
        raise TypeError(f"field {f.name} was not declared with schema.field()")
    return meta


# --- type introspection ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TypeInfo:
    kind: str  # int | float | bool | str | enum | object | map | list | any
    nullable: bool = False
    choices: tuple[str, ...] = ()
    cls: type | None = None  # for object
    value: "TypeInfo | None" = None  # for map and list: the type of each value or item


def type_info(tp: Any) -> TypeInfo:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported union {tp}")
        return dataclasses.replace(type_info(args[0]), nullable=True)
    if origin is Literal:
        return TypeInfo("enum", choices=tuple(typing.get_args(tp)))
    if origin is dict:
        _, value = typing.get_args(tp)
        return TypeInfo("map", value=type_info(value))
    if origin is list:
        (item,) = typing.get_args(tp)
        return TypeInfo("list", value=type_info(item))
    if tp is Any:
        return TypeInfo("any")
    if dataclasses.is_dataclass(tp):
        return TypeInfo("object", cls=typing.cast(type, tp))
    if tp in (int, float, bool, str):
        return TypeInfo(tp.__name__)
    raise TypeError(f"unsupported type {tp}")


def fields_of(cls: type) -> list[tuple[dataclasses.Field[Any], TypeInfo]]:
    hints = typing.get_type_hints(cls)
    return [(f, type_info(hints[f.name])) for f in dataclasses.fields(cls)]


# --- parsing -----------------------------------------------------------------


JSON_TYPE_NAMES = ((type(None), "null"), (bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                   (list, "list"), (dict, "object"))
"""The names errors give a value's type, tested in this order (a bool is an int too)."""


def type_name(value: Any) -> str:
    return next((name for tp, name in JSON_TYPE_NAMES if isinstance(value, tp)), type(value).__name__)


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def _check_scalar(value: Any, info: TypeInfo, meta: Meta, path: str, out: list[Problem]) -> Any:
    kind = info.kind
    if kind == "bool":
        if not isinstance(value, bool):
            out.append(Problem(path, f"must be true or false, got {type_name(value)} {_show(value)}"))
            return MISSING
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                out.append(Problem(path, f"must be an integer, got {type_name(value)} {_show(value)}"))
                return MISSING
        if not INT64_MIN <= value <= INT64_MAX:
            # The API server stores int64; a seed past it also overflows torch's generators.
            out.append(Problem(path, f"must be a 64-bit integer (at most {INT64_MAX}), got {short_repr(value)}"))
            return MISSING
    elif kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            out.append(Problem(path, f"must be a number, got {type_name(value)} {_show(value)}"))
            return MISSING
        try:
            value = float(value)
        except OverflowError:
            value = math.inf
        if not math.isfinite(value):
            out.append(Problem(path, f"must be a finite number, got {short_repr(value)}"))
            return MISSING
    elif kind == "str":
        if not isinstance(value, str):
            out.append(Problem(path, f"must be a string, got {type_name(value)} {_show(value)}"))
            return MISSING
        if meta.max_length is not None and len(value) > meta.max_length:
            out.append(Problem(path, f"must be at most {meta.max_length} characters, got {len(value)}"))
            return MISSING
        if meta.pattern and value and not re.fullmatch(meta.pattern, value):
            hint = f" ({meta.pattern_hint})" if meta.pattern_hint else ""
            out.append(Problem(path, f"{value!r} is not valid{hint}"))
            return MISSING
        return value
    elif kind == "enum":
        if value not in info.choices:
            choices = ", ".join(info.choices)
            msg = f"must be one of {choices}, got {_show(value)}"
            if isinstance(value, str):
                lowered = {c.lower(): c for c in info.choices}
                guess = lowered.get(value.lower()) or next(
                    iter(difflib.get_close_matches(value, info.choices, n=1)), None
                )
                if guess:
                    msg += f"; did you mean {guess!r}?"
            out.append(Problem(path, msg))
            return MISSING
        return value
    # int and float ranges
    if meta.minimum is not None:
        low = meta.minimum
        if value < low or (meta.exclusive_minimum and value == low):
            word = "greater than" if meta.exclusive_minimum else "at least"
            out.append(Problem(path, f"must be {word} {_num(low)}, got {_num(value)}"))
            return MISSING
    if meta.maximum is not None:
        high = meta.maximum
        if value > high or (meta.exclusive_maximum and value == high):
            word = "less than" if meta.exclusive_maximum else "at most"
            out.append(Problem(path, f"must be {word} {_num(high)}, got {_num(value)}"))
            return MISSING
    return value


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def short_repr(value: Any) -> str:
    """A value for a message: a number of hundreds of digits is shown by its size, not in full."""
    text = str(value)
    return text if len(text) <= 40 else f"a number of {len(text)} digits"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def parse_value(value: Any, info: TypeInfo, meta: Meta, path: str, out: list[Problem]) -> Any:
    """One field's value parsed as `info` and `meta` describe it (`fields_of`); its problems appended to
    `out` under `path`. MISSING when it cannot be used."""
    if value is None:
        if info.nullable:
            return None
        out.append(Problem(path, "must not be null"))
        return MISSING
    if info.kind == "object":
        assert info.cls is not None
        return parse(info.cls, value, path, out)
    if info.kind == "map":
        if not isinstance(value, dict):
            out.append(Problem(path, f"must be an object, got {type_name(value)}"))
            return MISSING
        assert info.value is not None  # type_info gives every map its value type
        if info.value.kind == "any":
            return value
        result = {}
        for k, v in value.items():
            parsed = parse_value(v, info.value, meta, f"{path}.{k}", out)
            if parsed is not MISSING:
                result[str(k)] = parsed
        return result
    if info.kind == "list":
        return _parse_list(value, info, meta, path, out)
    if info.kind == "any":
        return value
    return _check_scalar(value, info, meta, path, out)


def _parse_list(value: Any, info: TypeInfo, meta: Meta, path: str, out: list[Problem]) -> Any:
    """A list of scalars: its length within min_items..max_items, each item checked (pattern, length)."""
    if not isinstance(value, list):
        out.append(Problem(path, f"must be a list, got {type_name(value)}"))
        return MISSING
    if meta.min_items is not None and len(value) < meta.min_items:
        out.append(Problem(path, f"must have at least {meta.min_items} item{'s' if meta.min_items > 1 else ''}, "
                                 f"got {len(value)}"))
        return MISSING
    if meta.max_items is not None and len(value) > meta.max_items:
        out.append(Problem(path, f"must have at most {meta.max_items} items, got {len(value)}"))
        return MISSING
    assert info.value is not None
    before = len(out)
    items = [parse_value(v, info.value, meta, f"{path}[{i}]", out) for i, v in enumerate(value)]
    return MISSING if len(out) > before else items


def parse(cls: type, data: Any, path: str, out: list[Problem]) -> Any:
    """Build ``cls`` from ``data``; append every problem to ``out``.

    Returns MISSING when the object could not be built (its problems are in
    ``out``). Absent fields take the dataclass defaults.
    """
    if not isinstance(data, dict):
        out.append(Problem(path, f"must be an object, got {type_name(data)}"))
        return MISSING
    specs = fields_of(cls)
    by_yaml = {yaml_name(f): (f, info) for f, info in specs}
    before = len(out)
    for key in data:
        if key not in by_yaml:
            msg = "unknown field"
            guess = difflib.get_close_matches(str(key), list(by_yaml), n=1, cutoff=0.6)
            if guess:
                msg += f"; did you mean {guess[0]!r}?"
            else:
                msg += f" (known: {', '.join(by_yaml)})"
            out.append(Problem(f"{path}.{key}", msg))
    kwargs: dict[str, Any] = {}
    present: set[str] = set()
    for name, (f, info) in by_yaml.items():
        sub = f"{path}.{name}"
        if name in data:
            if data[name] is not None:
                present.add(f.name)
            parsed = parse_value(data[name], info, meta_of(f), sub, out)
            if parsed is not MISSING:
                kwargs[f.name] = parsed
        elif f.default is MISSING and f.default_factory is MISSING:
            out.append(Problem(sub, "is required"))
    names = {f.name: yaml_name(f) for f, _ in specs}
    for rule in getattr(cls, "__rules__", ()):
        msg = rule.check(present, kwargs, names)
        if msg:
            out.append(Problem(path, msg))
    if len(out) > before:
        return MISSING
    obj = cls(**kwargs)
    check = getattr(obj, "check", None)
    if check is not None:
        for sub, msg in check():
            out.append(Problem(f"{path}.{sub}" if sub else path, msg))
        if len(out) > before:
            return MISSING
    return obj


# --- serialising -------------------------------------------------------------


def _default_of(f: dataclasses.Field[Any]) -> Any:
    """A field's default value (MISSING when it has none)."""
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def to_dict(obj: Any) -> Any:
    """The YAML shape of a schema dataclass: camelCase keys, unset optionals left out, and so are fields newer
    than the API's first release (Meta.since) at their default: the job file the operator writes is read by
    the trainer of the release before too (a job's pods keep their trainer across an upgrade), which refuses
    a field it does not know; at its default the field says nothing that leaving it out does not."""
    if dataclasses.is_dataclass(obj):
        result = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if value is None:
                continue
            meta = f.metadata.get("kt")
            if isinstance(meta, Meta) and meta.since is not None and value == _default_of(f):
                continue
            result[yaml_name(f)] = to_dict(value)
        return result
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_dict(v) for v in obj]
    return obj
