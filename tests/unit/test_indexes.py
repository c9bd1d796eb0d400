"""The indexes a reader relies on cannot go stale: every module of each sub-package of megatron_delta is named in
its package's docstring (the module list a reader opens first) and in README.md's repository layout table, and no
docstring or comment cites a tracker's issue or item number (which means nothing to a reader of the code)."""
import ast
import pathlib
import re

import pytest

from tests.helpers import REPO_ROOT

ROOT = pathlib.Path(REPO_ROOT)
PACKAGE = ROOT / "megatron_delta"
# Files whose comments and docstrings are read as the code's documentation.
SCANNED = ("megatron_delta", "tools", "tests", "examples", "pretrain_gpt.py")
SUFFIXES = {".py", ".c", ".sh", ".sbatch"}
# A tracker's citation (the word issue or item, then a number) is flagged; a public repository's, with its #, is not.
TRACKER_NUMBER = re.compile(r"\b(?:issues?|items?|tasks?) \d+", re.IGNORECASE)


def sub_packages(package: pathlib.Path) -> list[pathlib.Path]:
    """Every package under ``package`` (a folder with __init__.py), itself excluded, outermost first."""
    return sorted(p.parent for p in package.rglob("__init__.py") if p.parent != package)


def modules_of(package: pathlib.Path) -> list[str]:
    """The modules a reader of ``package`` should find in its index: its .py files (dunder files aside) and its
    sub-packages, by name."""
    files = [p.stem for p in package.glob("*.py") if not p.stem.startswith("__")]
    folders = [p.name for p in package.iterdir() if (p / "__init__.py").is_file()]
    return sorted(files + folders)


def missing_from_docstring(package: pathlib.Path) -> list[str]:
    """The modules of ``package`` its __init__.py docstring does not name (as a word)."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    return [m for m in modules_of(package) if not re.search(rf"(?<!\w){re.escape(m)}\b", doc)]


def layout_row(readme: str, package: pathlib.Path, root: pathlib.Path) -> str:
    """README.md's layout-table row of ``package`` (the row whose first cell is its path), or ''."""
    path = f"`{package.relative_to(root).as_posix()}/`"
    return next((line for line in readme.splitlines() if line.startswith(f"| {path} |")), "")


def missing_from_readme(readme: str, package: pathlib.Path, root: pathlib.Path) -> list[str]:
    """The modules of a top-level sub-package that its README layout row does not name as `name.py` or `name/`
    (every module, when the package has no row)."""
    row = layout_row(readme, package, root)
    return [m for m in modules_of(package) if f"`{m}.py`" not in row and f"`{m}/`" not in row]


def tracker_numbers(root: pathlib.Path) -> list[str]:
    """'file:line: text' for every citation of a tracker's issue or item number in the scanned files."""
    found = []
    for top in SCANNED:
        base = root / top
        for path in sorted([base] if base.is_file() else base.rglob("*")):
            if path.suffix not in SUFFIXES or not path.is_file():
                continue
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                hit = TRACKER_NUMBER.search(line)
                if hit:
                    found.append(f"{path.relative_to(root)}:{n}: {hit.group(0)}")
    return found


@pytest.mark.parametrize("package", sub_packages(PACKAGE), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_every_module_is_in_its_package_docstring(package):
    assert missing_from_docstring(package) == []


@pytest.mark.parametrize("package", [p for p in sub_packages(PACKAGE) if p.parent == PACKAGE], ids=lambda p: p.name)
def test_every_module_is_in_the_readme_layout(package):
    assert missing_from_readme((ROOT / "README.md").read_text(), package, ROOT) == []


def test_no_tracker_numbers_in_code_or_comments():
    assert tracker_numbers(ROOT) == []


def test_the_index_checks_see_an_omission_and_a_tracker_number(tmp_path):
    """A module its package docstring, or its README row, leaves out is reported (a name that only appears inside
    another word does not count), and so is a comment that cites an issue's item."""
    pkg = tmp_path / "megatron_delta" / "core"
    (pkg / "csrc").mkdir(parents=True)  # not a package: not a module
    (pkg / "ops").mkdir()
    (pkg / "ops" / "__init__.py").write_text('"""ops."""\n')
    (pkg / "__init__.py").write_text('"""Modules:\n  router - ...\n  ops/ - ...\n  the group_routers path\n"""\n')
    for name in ("router", "group_router", "plan", "__main__"):
        text = "x = 1  # see {} 12, {} 3\ny = 2  # Megatron-LM {} #1589\n".format("issue", "item", "issue")
        (pkg / f"{name}.py").write_text(text if name == "plan" else "")
    assert modules_of(pkg) == ["group_router", "ops", "plan", "router"]
    assert missing_from_docstring(pkg) == ["group_router", "plan"]
    readme = "| `megatron_delta/core/` | the core (`router.py`, `ops/`, `plan.py`) |\n"
    assert missing_from_readme(readme, pkg, tmp_path) == ["group_router"]
    assert missing_from_readme("", pkg, tmp_path) == ["group_router", "ops", "plan", "router"]
    assert [t.split(": ", 1)[1] for t in tracker_numbers(tmp_path)] == [" ".join(("issue", "12"))]  # a line's first
