"""The manifests of the benchmarks' jobs."""

from __future__ import annotations

from typing import Any

from kubetrain.api import API_VERSION, KIND


def manifest(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The TrainingJob manifest of a benchmark's job (a dict, as its YAML file would hold it)."""
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name}, "spec": spec}
