"""The test suite's layout holds: every test module lives in unit/ (in one process), integration/ (multi-process
launches, trainer runs, tools run end to end) or gpu/ (CUDA only); what the tests share lives in helpers/ and
nowhere else; no module under tests/ imports a test module or conftest (the shared code is in helpers/), and none
edits sys.path (the package is installed; tests is importable from the repository root, pytest's rootdir)."""
import ast
import pathlib
import re

from tests.helpers import REPO_ROOT

TESTS = pathlib.Path(REPO_ROOT) / "tests"
TEST_FOLDERS = ("unit", "integration", "gpu")
HELPERS = "helpers"
# an import of a test module or conftest written as code inside a string (a subprocess's `python -c`)
IMPORT_IN_TEXT = re.compile(r"\b(?:from|import)\s+tests(?:\.\w+)*\.(?:test_\w+|conftest)\b|"
                            r"\bfrom\s+tests(?:\.\w+)*\s+import\s+[^\n]*\b(?:test_\w+|conftest)\b")


def _imports_a_test_module(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        names = [f"{node.module or ''}.{a.name}" for a in node.names]
    else:
        return False
    return any(part.startswith("test_") or part == "conftest" for name in names for part in name.split("."))


def layout_violations(tests: pathlib.Path) -> list[str]:
    """'path: what is wrong' for every file of the suite rooted at ``tests`` that breaks the layout."""
    bad = []
    for path in sorted(tests.rglob("*.py")):
        rel = path.relative_to(tests)
        where, name = rel.parts[0] if len(rel.parts) > 1 else "", path.name
        if "__pycache__" in rel.parts:
            continue
        if name.startswith("test_") and where not in TEST_FOLDERS:
            bad.append(f"{rel}: a test module outside {'/, '.join(TEST_FOLDERS)}/")
        elif not name.startswith("test_") and name not in ("__init__.py", "conftest.py") and where != HELPERS:
            bad.append(f"{rel}: shared code outside {HELPERS}/")
        elif name == "conftest.py" and where == HELPERS:
            bad.append(f"{rel}: a conftest in {HELPERS}/")
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if _imports_a_test_module(node):
                bad.append(f"{rel}:{node.lineno}: imports a test module or conftest")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and IMPORT_IN_TEXT.search(node.value):
                bad.append(f"{rel}:{node.lineno}: runs code that imports a test module or conftest")
            elif (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                  and node.value.id == "sys"):
                bad.append(f"{rel}:{node.lineno}: uses sys.path")
    for folder in TEST_FOLDERS + (HELPERS,):
        if not (tests / folder / "__init__.py").is_file():
            bad.append(f"{folder}/: no __init__.py (test modules of the same name in two folders would clash)")
    return bad


def test_the_suite_keeps_its_layout():
    assert layout_violations(TESTS) == []


def test_the_layout_check_sees_each_kind_of_violation(tmp_path):
    """A planted file of each kind is reported, and a clean tree is not."""
    for folder in TEST_FOLDERS + (HELPERS,):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "conftest.py").write_text("import pytest\n")
    (tmp_path / "unit" / "test_a.py").write_text("from tests.helpers.flags import tiny\n")
    (tmp_path / "helpers" / "flags.py").write_text("import sys\n")
    (tmp_path / "gpu" / "conftest.py").write_text("")
    assert layout_violations(tmp_path) == []
    test, conftest = "test_", "conftest"  # spelled apart, or this module's own text would be a violation
    planted = {
        "test_top.py": "x = 1\n",
        "unit/shared.py": "x = 1\n",
        "helpers/conftest.py": "",
        "unit/test_b.py": f"from tests.unit.{test}a import x\n",
        "integration/test_c.py": f"def f():\n    from tests.unit import {test}a\n",
        "gpu/test_d.py": f"from tests.{conftest} import PP4\n",
        "helpers/runner.py": f"CODE = 'from tests.unit.{test}a import x; x()'\n",
        "helpers/paths.py": "import os, sys\nsys.path.insert(0, os.getcwd())\n",
    }
    for rel, text in planted.items():
        (tmp_path / rel).write_text(text)
    (tmp_path / "helpers" / "__init__.py").unlink()
    assert layout_violations(tmp_path) == [
        "gpu/test_d.py:1: imports a test module or conftest",
        "helpers/conftest.py: a conftest in helpers/",
        "helpers/paths.py:2: uses sys.path",
        "helpers/runner.py:1: runs code that imports a test module or conftest",
        "integration/test_c.py:2: imports a test module or conftest",
        "test_top.py: a test module outside unit/, integration/, gpu/",
        "unit/shared.py: shared code outside helpers/",
        "unit/test_b.py:1: imports a test module or conftest",
        "helpers/: no __init__.py (test modules of the same name in two folders would clash)",
    ]


def test_every_helper_is_in_the_helpers_index():
    """tests/helpers/__init__.py's docstring names each helper module (the list a reader opens first)."""
    doc = ast.get_docstring(ast.parse((TESTS / HELPERS / "__init__.py").read_text())) or ""
    listed = re.findall(r"^  (\w+) +- ", doc, flags=re.M)
    assert len(set(listed)) == len(listed), listed
    assert set(listed) == {p.stem for p in (TESTS / HELPERS).glob("*.py") if p.stem != "__init__"}
