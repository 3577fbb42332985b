"""The import names of the layout before the one package, kept for one release: each old module is the new
one, the same object, with a DeprecationWarning that names where it went.

Before, the folders were mapped onto packages of their own (`kubetrain_operator`, `kubetrain_trainer`,
`kubetrain_contract`, `kubetrain_cli`); now everything is the one package `kubetrain` (docs/internals.md, The
layout). The modules at the repository's root (`kubetrain_trainer.py`, ...) call `alias`, so that
`import kubetrain_trainer.export`, `from kubetrain_operator.report import build_report` and
`python -m kubetrain_trainer ROLE` keep working. An old name is resolved by `RENAMES`, longest prefix
first: the old module `kubetrain_operator.client.local` is the new `kubetrain.client.rundir_backend`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import runpy
import sys
import warnings
from types import ModuleType

RENAMES = {
    "kubetrain_contract": "kubetrain.shared",
    "kubetrain_trainer": "kubetrain.trainer",
    "kubetrain_trainer.contract": "kubetrain.trainer.session",
    "kubetrain_trainer.slowdown": "kubetrain.trainer.testhooks",
    "kubetrain_trainer.ps.client": "kubetrain.trainer.ps.psclient",
    "kubetrain_cli": "kubetrain.cli",
    "kubetrain_operator": "kubetrain",
    "kubetrain_operator.api": "kubetrain.api",
    "kubetrain_operator.core": "kubetrain.engine",
    "kubetrain_operator.controller": "kubetrain.drivers.cluster",
    "kubetrain_operator.local": "kubetrain.drivers.local",
    "kubetrain_operator.local.backend": "kubetrain.drivers.local.runner",
    "kubetrain_operator.client": "kubetrain.client",
    "kubetrain_operator.client.local": "kubetrain.client.rundir_backend",
    "kubetrain_operator.client.cluster": "kubetrain.client.cluster_backend",
    "kubetrain_operator.report": "kubetrain.reports",
    "kubetrain_operator.report.cluster": "kubetrain.reports.from_cluster",
}
"""Old module -> new module; a submodule not named here keeps its name under its parent's new name."""


def new_name(old: str) -> str:
    """The module an old import name is now (`kubetrain_trainer.ps.worker` -> `kubetrain.trainer.ps.worker`)."""
    parts = old.split(".")
    for cut in range(len(parts), 0, -1):
        head = ".".join(parts[:cut])
        if head in RENAMES:
            return ".".join([RENAMES[head], *parts[cut:]])
    raise ModuleNotFoundError(f"{old} is no module of kubetrain's old layout")


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `<root>.<anything>` and loads it as the new module itself (one module object, one state)."""

    def __init__(self, root: str):
        self.root = root

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(self.root + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(new_name(spec.name))

    def exec_module(self, module: ModuleType) -> None:
        pass  # the new module ran when it was imported


def alias(old: str) -> None:
    """Make the top-level name `old` (the calling shim's own module) the new package, and its submodules the new
    modules; warn that the name is deprecated."""
    new = new_name(old)
    _warn(old, new, stacklevel=4)
    if not any(isinstance(f, _Alias) and f.root == old for f in sys.meta_path):
        sys.meta_path.insert(0, _Alias(old))  # before the path finder, which would import a second copy
    sys.modules[old] = importlib.import_module(new)  # what `import <old>` returns


def run_main(old: str) -> None:
    """`python -m <old> ...`: the new module's `python -m`."""
    _warn(old, new_name(old), stacklevel=3)
    runpy.run_module(new_name(old), run_name="__main__", alter_sys=True)


def _warn(old: str, new: str, stacklevel: int) -> None:
    warnings.warn(f"{old} is {new} now (docs/internals.md, The layout); the old name is kept for one release",
                  DeprecationWarning, stacklevel=stacklevel)
