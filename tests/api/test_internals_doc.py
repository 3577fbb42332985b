"""docs/internals.md says what is true today: its tree is `ls`, its map names every module and no other,
and every path a doc names exists.

- The tree (## The layout): every folder it shows exists, and every package folder of kubetrain/ is shown.
- The map (## The map of modules): under each `### \\`kubetrain/...\\`` heading, the modules named are the
  folder's modules, all of them and no other.
- Every `kubetrain/...` path in README.md and docs/*.md (but the dated logs of docs/benchmarks-history.md)
  names a file or folder that exists: a renamed or deleted module fails here until its docs follow.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
INTERNALS = ROOT / "docs" / "internals.md"
SKIP = {"__pycache__"}


def section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def tree_folders(text: str) -> set[str]:
    """The folders of the first indented block of ## The layout, as paths (nesting by indentation)."""
    lines = []
    for line in section(text, "The layout").splitlines():
        if line.startswith("    ") and line.strip():
            lines.append(line)
        elif lines:
            break
    folders, stack = set(), []
    for line in lines:
        depth = (len(line) - len(line.lstrip()) - 4) // 2
        name = line.split()[0]
        if not name.endswith("/"):
            continue
        stack[depth:] = [name.rstrip("/")]
        folders.add("/".join(stack))
    return folders


def package_folders() -> set[str]:
    return {str(p.parent.relative_to(ROOT)) for p in (ROOT / "kubetrain").rglob("__init__.py")
            if not SKIP & set(p.parts)}


def map_modules(text: str) -> dict[str, set[str]]:
    """{folder: modules named} from ## The map of modules: the leading backticked names of each line."""
    found: dict[str, set[str]] = {}
    folder = None
    for line in section(text, "The map of modules").splitlines():
        heading = re.fullmatch(r"### `(kubetrain/[\w/]*)`", line.strip())
        if heading:
            folder = heading.group(1).rstrip("/")
            found[folder] = set()
        elif folder:
            found[folder] |= set(re.findall(r"`(\w+\.py)`", line))
    return found


def disk_modules(folder: str) -> set[str]:
    return {p.name for p in (ROOT / folder).glob("*.py")}


def test_the_tree_is_ls():
    text = INTERNALS.read_text()
    shown = tree_folders(text)
    missing = sorted(f for f in shown if not (ROOT / f).is_dir())
    assert not missing, f"docs/internals.md's tree shows folders that do not exist: {missing}"
    unshown = sorted(package_folders() - shown)
    assert not unshown, f"packages missing from docs/internals.md's tree: {unshown}"
    assert {"operator", "trainer", "protos", "deploy", "charts", "tests"} <= shown


def test_the_map_names_every_module_and_no_other():
    found = map_modules(INTERNALS.read_text())
    assert set(found) == package_folders(), sorted(set(found) ^ package_folders())
    wrong = {folder: {"not in the map": sorted(disk_modules(folder) - named),
                      "not on disk": sorted(named - disk_modules(folder))}
             for folder, named in found.items() if named != disk_modules(folder)}
    assert not wrong, wrong


def test_every_kubetrain_path_in_the_docs_exists():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = {}
    for doc in docs:
        if doc.name == "benchmarks-history.md":
            continue
        text = doc.read_text()
        for match in re.finditer(r"(?<![\w/.-])kubetrain/[\w/.-]+", text):
            path, after = match.group().rstrip("."), text[match.end():match.end() + 1]
            # not an image (`kubetrain/trainer:0.1.0`, `kubetrain/custom-example`) nor a label (`kubetrain/node=real`)
            if "-" in path or (after in ":=" and "." not in path.rsplit("/", 1)[-1]):
                continue
            if not (ROOT / path.rstrip("/")).exists():
                missing.setdefault(doc.name, []).append(path)
    assert not missing, missing


def test_the_checks_see_a_wrong_tree_and_a_wrong_map(tmp_path):
    text = ("# x\n\n## The layout\n\n    kubetrain/     pkg\n      gone/        no such folder\n    tests/\n\n"
            "## The map of modules\n\n### `kubetrain/api/`\n- `spec.py`: x. `nothere.py`: y.\n")
    assert tree_folders(text) == {"kubetrain", "kubetrain/gone", "tests"}
    assert map_modules(text) == {"kubetrain/api": {"spec.py", "nothere.py"}}
