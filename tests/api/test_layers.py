"""What the import contracts cannot see: which imports wait until they are needed (not at module level).

The layers themselves (which package may import which) are pyproject.toml's
import-linter contracts, checked by test_import_contracts.py. import-linter
sees every import, wherever it is in a module; these rules are about where:

- The command line (kubetrain.cli) loads the trainer, torch and the
  benchmarks inside the commands that need them (checkpoints, export,
  bench), never at module level: `kubetrain operator` runs in an image
  without torch, and every command starts without loading it.
- The benchmarks' package (kubetrain.bench) loads the benchmarks that need
  torch inside `run_bench`, so that the others run without it.
- The public API (kubetrain) loads kubetrain.Client's facade (kubetrain.client,
  and the client behind it) only when a user asks for it: a training script's
  `import kubetrain` never does.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PACKAGES = {"kubetrain": "kubetrain"}  # folder -> package: the one package, its folders its subpackages
# module (or package, with its modules) -> what it may import only inside a function
LAZY = {
    "kubetrain.cli": ("kubetrain.trainer", "kubetrain.bench", "torch"),
    "kubetrain.bench.__init__": ("kubetrain.trainer", "torch", "kubetrain.bench.transport", "kubetrain.bench.script_calls",
                                 "kubetrain.bench.checkpoint", "kubetrain.bench.sharded", "kubetrain.bench.finetune"),
    "kubetrain.__init__": ("kubetrain.client", "kubetrain.api", "kubetrain.engine", "kubetrain.drivers",
                           "kubetrain.reports", "kubetrain.trainer"),
}


def modules():
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            yield ".".join((package, *parts)), path


def imports(name: str, path: Path) -> list[tuple[str, bool]]:
    """(imported module, at module level?) of every import in the file, relative ones resolved.

    `name` is the module's dotted name, `a.b.__init__` for a package's own module.
    """
    tree = ast.parse(path.read_text(), str(path))
    package = name.rpartition(".")[0]
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
                # `from . import x`: x may be a module of the package
                found += [(f"{module}.{alias.name}", id(node) in top_level) for alias in node.names
                          if not node.module]
            else:
                module = node.module or ""
            found.append((module, id(node) in top_level))
    return found


def within(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def lazy_rules(name: str) -> tuple[str, ...]:
    return tuple(m for owner, lazy in LAZY.items() if within(name, [owner]) for m in lazy)


ALL = [(name, path) for name, path in modules() if lazy_rules(name)]


@pytest.mark.parametrize("name,path", ALL, ids=[n for n, _ in ALL])
def test_each_module_loads_what_it_may_only_when_needed(name, path):
    lazy = lazy_rules(name)
    wrong = [module for module, top in imports(name, path) if top and within(module, lazy)]
    assert not wrong, (f"{path.relative_to(ROOT)} imports {', '.join(wrong)} at module level: "
                       f"it may import {', '.join(lazy)} only inside the functions that need them")


def test_every_rule_names_modules_that_exist():
    names = {name for name, _ in modules()}
    assert all(any(within(n, [owner]) for n in names) for owner in LAZY), sorted(LAZY)
    assert {n for n, _ in ALL} >= {"kubetrain.cli.__init__", "kubetrain.cli.commands", "kubetrain.cli.parser",
                                    "kubetrain.bench.__init__", "kubetrain.__init__"}


def test_the_check_sees_an_import_at_module_level(tmp_path):
    bad = tmp_path / "commands.py"
    bad.write_text("import os\nfrom kubetrain.trainer.ddp import run_ddp\nfrom . import parser\n"
                   "def f():\n    from kubetrain.bench import run_bench\n")
    found = imports("kubetrain.cli.commands", bad)
    assert ("kubetrain.trainer.ddp", True) in found and ("kubetrain.bench", False) in found
    assert ("kubetrain.cli.parser", True) in found


def test_the_command_line_starts_without_torch():
    """What the rules above are for, as it runs: `kubetrain --help` and every module of kubetrain.cli load no torch."""
    code = ("import sys, kubetrain.cli, kubetrain.cli.commands, kubetrain.cli.parser, kubetrain.bench\n"
            "kubetrain.cli.build_parser().format_help()\n"
            "assert 'torch' not in sys.modules and 'kubetrain.trainer' not in sys.modules, sorted(sys.modules)\n"
            "print('ok')")
    done = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_no_subpackage_takes_the_name_of_a_public_call():
    """Importing `kubetrain.X` sets the attribute X of the package: a subpackage named like one of the calls of
    `import kubetrain` (restore, save, report, ...) would replace the call once anything imported it."""
    import kubetrain

    subs = {p.stem for p in (ROOT / "kubetrain").iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    assert set(kubetrain.__all__) & subs == set(), sorted(set(kubetrain.__all__) & subs)
