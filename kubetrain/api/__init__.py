"""The TrainingJob API model: typed spec, loading, validation (no torch, no Kubernetes I/O)."""

from .load import dump_manifest, from_object, from_spec_dict, load_file, load_one, to_manifest
from .schema import InvalidSpec, Problem
from .spec import API_VERSION, GROUP, KIND, MODES, PLURAL, VERSION, Spec, TrainingJob

__all__ = [
    "API_VERSION", "GROUP", "KIND", "MODES", "PLURAL", "VERSION",
    "InvalidSpec", "Problem", "Spec", "TrainingJob",
    "dump_manifest", "from_object", "from_spec_dict", "load_file", "load_one", "to_manifest",
]
