"""Test modules need unique basenames: pytest imports them by basename (rootdir-less prepend mode)."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).parents[1]


def test_test_module_basenames_are_unique():
    names = Counter(p.name for p in TESTS.rglob("*.py") if p.name not in ("conftest.py", "__init__.py"))
    assert [n for n, c in names.items() if c > 1] == []
