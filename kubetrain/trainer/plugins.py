"""User plug-ins: importing 'package.module:function' from the job's code directory, and calling factories.

Models, datasets and losses all take an entry point; this module is the one
place that imports the user's code and turns what goes wrong into errors that
name the field.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kubetrain.shared.launch import CODE_DIR_VAR

from .errors import ConfigError, LoadError, TrainerError

# Set by `kubetrain run` to the manifest's directory, so a user's modules next
# to the manifest import without PYTHONPATH. Unset in a cluster: the process's
# working directory (the image's WORKDIR) is used instead.
def code_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where user modules are imported from: $KUBETRAIN_CODE_DIR, else the working directory."""
    env = os.environ if environ is None else environ
    return Path(env.get(CODE_DIR_VAR) or os.getcwd()).resolve()


def _put_code_dir_first() -> None:
    # Trainers run with PYTHONSAFEPATH=1 (a kubetrain checkout's operator/
    # folder would otherwise shadow the standard library's `operator`), so not
    # even the working directory is on sys.path unless it is put there. First,
    # as `python train.py` would: the user's module wins over an installed one
    # of the same name.
    directory = str(code_dir())
    if sys.path[:1] != [directory]:
        with contextlib.suppress(ValueError):
            sys.path.remove(directory)
        sys.path.insert(0, directory)
        importlib.invalidate_caches()  # the directory may have gained files since the last import


def load_entrypoint(ref: str, path: str) -> Callable[..., Any]:
    """Import `package.module:function` from the code directory (or an installed package).

    LoadError names the field `path` and what went wrong.
    """
    module_name, _, attr = ref.partition(":")
    _put_code_dir_first()
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # a user module may fail with anything at import time
        raise LoadError(
            f"{path}: {ref}: cannot import {module_name!r}: {type(err).__name__}: {err} "
            f"(searched {code_dir()} and the installed packages)"
        ) from None
    if not hasattr(module, attr):
        raise LoadError(f"{path}: {ref}: module {module_name!r} has no attribute {attr!r}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise LoadError(f"{path}: {ref}: {attr!r} is a {type(fn).__name__}, not callable")
    return fn


def call_with_args(fn: Callable[..., Any], args: Mapping[str, Any], what: str, path: str) -> Any:
    """Call a factory with keyword arguments from the spec.

    Arguments the factory does not take are a configuration error (exit 2)
    naming `path`; anything the factory itself raises is a load error (exit 3).
    """
    try:
        inspect.signature(fn).bind(**args)
    except TypeError as err:
        raise ConfigError(f"{path}: {what} does not take these arguments: {err}") from None
    except ValueError:
        pass  # no introspectable signature (a C function): let the call decide
    try:
        return fn(**args)
    except TrainerError:
        raise
    except Exception as err:
        raise LoadError(f"{path}: {what} failed: {type(err).__name__}: {err}") from None
