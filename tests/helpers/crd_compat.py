"""Whether a new CRD keeps every object the old one accepted readable and writable as it was.

`problems(old, new)` lists, with the field's path, what would break a stored TrainingJob (or a manifest a user
applies again) after an upgrade from `old` to `new`: a field removed (the API server prunes its value from
every stored object on its next write), a narrowed type (a type changed, an enum new or losing values, a
maximum lowered or a minimum raised, a length or count bound tightened, a pattern or format new or changed,
a field newly required, unknown fields no longer preserved, a list's type changed), a changed default (the
API server applies defaults when it reads a stored object too, so a default added to, changed on or taken off
an existing field changes what stored jobs say; and a new field with a default appears in every stored object
the previous release's operator reads, which refuses fields it does not know), the CRD's names or scope changed, a served API version no
longer served, a subresource gone. A change of schema is allowed only in a new API version, and then the CRD
must convert between its versions with a webhook (strategy None only rewrites apiVersion).

Not checked, on purpose: CEL rules (x-kubernetes-validations). Kubernetes 1.30+ (the chart's kubeVersion)
ratchets them: an update that leaves a field as it was is not refused by a rule the stored value breaks.
Descriptions and printer columns are documentation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

UPPER_BOUNDS = ("maximum", "maxLength", "maxItems", "maxProperties")
LOWER_BOUNDS = ("minimum", "minLength", "minItems", "minProperties")
WIDENINGS = {("integer", "number")}  # every integer is a number


@dataclass(frozen=True)
class Problem:
    path: str  # the field (spec.training.epochs), or the CRD's part (spec.names.plural)
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def problems(old: dict[str, Any], new: dict[str, Any]) -> list[Problem]:
    out: list[Problem] = []
    _identity(old["spec"], new["spec"], out)
    old_versions = {v["name"]: v for v in old["spec"]["versions"]}
    new_versions = {v["name"]: v for v in new["spec"]["versions"]}
    webhook = ((new["spec"].get("conversion") or {}).get("strategy") or "None") == "Webhook"
    schemas = {name: v["schema"]["openAPIV3Schema"] for name, v in new_versions.items()}
    if len({repr(s) for s in schemas.values()}) > 1 and not webhook:
        out.append(Problem("spec.conversion", f"versions {', '.join(sorted(schemas))} differ in schema without a "
                                              "Webhook conversion (strategy None converts only apiVersion)"))
    for name, version in old_versions.items():
        if not version.get("served"):
            continue
        now = new_versions.get(name)
        if now is None or not now.get("served"):
            out.append(Problem(f"spec.versions[{name}]", "served before, not served now: clients and manifests "
                                                         "of that version break"))
            continue
        for sub in version.get("subresources") or {}:
            if sub not in (now.get("subresources") or {}):
                out.append(Problem(f"spec.versions[{name}].subresources.{sub}", "removed"))
        old_scale = (version.get("subresources") or {}).get("scale")
        new_scale = (now.get("subresources") or {}).get("scale")
        if old_scale and new_scale and old_scale != new_scale:
            out.append(Problem(f"spec.versions[{name}].subresources.scale", f"changed: {old_scale} -> {new_scale}"))
        _schema("", version["schema"]["openAPIV3Schema"], now["schema"]["openAPIV3Schema"], out, existed=True)
    old_storage = next((n for n, v in old_versions.items() if v.get("storage")), None)
    new_storage = next((n for n, v in new_versions.items() if v.get("storage")), None)
    if old_storage != new_storage and not webhook:
        out.append(Problem("spec.versions", f"the storage version moved from {old_storage} to {new_storage} without "
                                            "a Webhook conversion"))
    return out


def _identity(old: dict[str, Any], new: dict[str, Any], out: list[Problem]) -> None:
    for key in ("group", "scope"):
        if old.get(key) != new.get(key):
            out.append(Problem(f"spec.{key}", f"changed: {old.get(key)} -> {new.get(key)}"))
    for key in ("kind", "plural", "singular", "listKind"):
        if old["names"].get(key) != new["names"].get(key):
            out.append(Problem(f"spec.names.{key}", f"changed: {old['names'].get(key)} -> {new['names'].get(key)}"))
    for key in ("shortNames", "categories"):
        gone = set(old["names"].get(key) or []) - set(new["names"].get(key) or [])
        if gone:
            out.append(Problem(f"spec.names.{key}", f"no longer has {', '.join(sorted(gone))}"))


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _schema(path: str, old: dict[str, Any], new: dict[str, Any], out: list[Problem], existed: bool) -> None:
    """Compare one node; `existed`: the field was in the old schema (every node here was: new nodes are not
    compared, but a default or requirement a new node brings to its existing parent is)."""
    where = path or "(root)"
    if old.get("x-kubernetes-preserve-unknown-fields") and not new.get("x-kubernetes-preserve-unknown-fields"):
        out.append(Problem(where, "no longer preserves unknown fields: the API server prunes stored values"))
    if old.get("x-kubernetes-int-or-string") and not new.get("x-kubernetes-int-or-string"):
        out.append(Problem(where, "no longer takes an integer or a string"))
    old_type, new_type = old.get("type"), new.get("type")
    if old_type != new_type and (old_type, new_type) not in WIDENINGS and not (new_type is None and old_type):
        out.append(Problem(where, f"type changed: {old_type} -> {new_type}"))
    if "enum" in new:
        if "enum" not in old:
            out.append(Problem(where, f"now restricted to {new['enum']}"))
        else:
            lost = [v for v in old["enum"] if v not in new["enum"]]
            if lost:
                out.append(Problem(where, f"no longer accepts {lost}"))
    for bound in UPPER_BOUNDS:
        if bound in new and (bound not in old or new[bound] < old[bound]):
            out.append(Problem(where, f"{bound} lowered: {old.get(bound, 'none')} -> {new[bound]}"))
    for bound in LOWER_BOUNDS:
        if bound in new and new[bound] > old.get(bound, float("-inf") if bound == "minimum" else 0):
            out.append(Problem(where, f"{bound} raised: {old.get(bound, 'none')} -> {new[bound]}"))
    for flag, bound in (("exclusiveMaximum", "maximum"), ("exclusiveMinimum", "minimum")):
        if new.get(flag) and not old.get(flag) and new.get(bound) == old.get(bound):
            out.append(Problem(where, f"{flag} now: {bound} {new.get(bound)} itself refused"))
    for key in ("pattern", "format"):
        if key in new and new[key] != old.get(key):
            out.append(Problem(where, f"{key} {'changed' if key in old else 'new'}: {old.get(key)!r} -> {new[key]!r}"))
    if old.get("nullable") and not new.get("nullable"):
        out.append(Problem(where, "no longer nullable"))
    if old_type == "array":  # atomic, set or map: a set or map refuses duplicates an atomic list held
        for key, unset in (("x-kubernetes-list-type", "atomic"), ("x-kubernetes-list-map-keys", None)):
            if old.get(key, unset) != new.get(key, unset):
                out.append(Problem(where, f"{key} changed: {old.get(key, unset)} -> {new.get(key, unset)}"))
    if existed:
        if "default" in old and "default" not in new:
            out.append(Problem(where, f"default {old['default']!r} removed"))
        elif "default" in old and new["default"] != old["default"]:
            out.append(Problem(where, f"default changed: {old['default']!r} -> {new['default']!r}"))
        elif "default" not in old and "default" in new and path:
            out.append(Problem(where, f"default {new['default']!r} added to an existing field: stored objects "
                                      "without it now read as that"))
    newly = sorted(set(new.get("required") or []) - set(old.get("required") or []))
    if newly:
        out.append(Problem(where, f"newly required: {', '.join(newly)}"))
    old_props, new_props = old.get("properties") or {}, new.get("properties") or {}
    for name, child in old_props.items():
        if name not in new_props:
            out.append(Problem(_join(path, name), "removed"))
        else:
            _schema(_join(path, name), child, new_props[name], out, existed=True)
    for name in new_props.keys() - old_props.keys():
        if "default" in new_props[name]:
            out.append(Problem(_join(path, name), f"a new field with a CRD default ({new_props[name]['default']!r}): "
                                                  "the API server adds it to every stored object it reads, and the "
                                                  "previous release's operator refuses a field it does not know "
                                                  "(during the upgrade and after a rollback); keep the default in "
                                                  "the model only (field(..., since=...), kubetrain/api/schema.py)"))
    for key, suffix in (("items", "[]"), ("additionalProperties", "[*]")):
        old_child, new_child = old.get(key), new.get(key)
        if isinstance(old_child, dict):
            if not isinstance(new_child, dict):
                out.append(Problem(f"{where}{suffix}", f"{key} removed"))
            else:
                _schema(f"{path}{suffix}", old_child, new_child, out, existed=True)
        elif old_child is True and new_child is not True and new_child is not None:
            out.append(Problem(f"{where}{suffix}", f"{key} narrowed from any value"))
