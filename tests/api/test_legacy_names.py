"""The import names of the layout before the one package keep working for one release (kubetrain/legacy.py):
each old module is the new module itself, with a DeprecationWarning naming where it went."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kubetrain.legacy import RENAMES, new_name


def python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-W", "always::DeprecationWarning", *args, "-c", code] if code else
                          [sys.executable, "-W", "always::DeprecationWarning", *args],
                          cwd="/", capture_output=True, text=True, timeout=120)


def test_old_modules_are_the_new_ones_and_say_where_they_went():
    code = "\n".join([
        "import kubetrain_trainer.export as old, kubetrain.trainer.export as new; assert old is new",
        "from kubetrain_operator.report import build_report; import kubetrain.reports as r",
        "assert build_report is r.build_report",
        "from kubetrain_operator.client.local import RunDirBackend; import kubetrain.client.rundir_backend as b",
        "assert RunDirBackend is b.RunDirBackend",
        "import kubetrain_contract.launch as l, kubetrain.shared.launch as l2; assert l is l2",
        "import kubetrain_trainer.ps.client as c; import kubetrain.trainer.ps.psclient as c2; assert c is c2",
        "import kubetrain_operator; print(kubetrain_operator.__version__)",
    ])
    done = python(code)
    assert done.returncode == 0, done.stderr
    assert "kubetrain_trainer is kubetrain.trainer now" in done.stderr, done.stderr
    assert "kubetrain_operator is kubetrain now" in done.stderr


def test_python_dash_m_of_an_old_name_runs_the_new_one():
    done = python("", "-m", "kubetrain_cli", "--version")
    assert done.returncode == 0 and done.stdout.startswith("kubetrain "), done.stdout + done.stderr
    assert "kubetrain_cli is kubetrain.cli now" in done.stderr


@pytest.mark.parametrize(("old", "new"), [
    ("kubetrain_operator.core.plan", "kubetrain.engine.plan"),
    ("kubetrain_operator.controller.kube", "kubetrain.drivers.cluster.kube"),
    ("kubetrain_operator.local.backend", "kubetrain.drivers.local.runner"),
    ("kubetrain_trainer.contract", "kubetrain.trainer.session"),
    ("kubetrain_trainer.ddp.ft", "kubetrain.trainer.ddp.ft"),
])
def test_names_map_by_the_longest_renamed_prefix(old, new):
    assert new_name(old) == new


def test_every_renamed_module_exists_and_a_name_that_never_was_is_refused():
    import importlib.util

    missing = [new for new in RENAMES.values() if importlib.util.find_spec(new) is None]
    assert missing == []
    with pytest.raises(ModuleNotFoundError, match="no module of kubetrain's old layout"):
        new_name("kubetrain_elsewhere")
    done = python("import kubetrain_operator.nothing_here")
    assert done.returncode == 1 and "ModuleNotFoundError: No module named 'kubetrain.nothing_here'" in done.stderr
