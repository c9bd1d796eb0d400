"""The core never imports the training side: every import in megatron_delta/core/ (module level or inside a
function) names the standard library, torch, megatron.core, einops/fla (the GPU kernel) or megatron_delta.core
itself. megatron_delta/hf/ imports no Megatron (an exported model runs with transformers alone), only the mode
rules of megatron_delta/core/modes.py, which import nothing."""
import ast
import pathlib
import subprocess
import sys

import pytest

from tests.helpers import import_scan
from tests.helpers.import_scan import PACKAGE, imported_modules, violations


def core_may_import(mod: str) -> bool:
    if mod == "megatron_delta" or mod.startswith("megatron_delta."):
        return mod == "megatron_delta.core" or mod.startswith("megatron_delta.core.")
    return not (mod == "megatron.training" or mod.startswith("megatron.training."))


def hf_may_import(mod: str) -> bool:
    """The HF side may read the mode rules (core/modes.py, which imports nothing) and nothing else of Megatron."""
    if mod.startswith("megatron"):
        return (mod in ("megatron_delta.core.modes",) or mod == "megatron_delta.hf"
                or mod.startswith("megatron_delta.hf."))
    return True


def test_core_imports_nothing_of_the_training_side():
    assert violations("core", core_may_import) == []


def test_hf_model_imports_no_megatron():
    assert violations("hf", hf_may_import) == []


@pytest.mark.parametrize("source, bad", [
    ("from megatron_delta.checkpoint.model_config import model_config\n", "megatron_delta.checkpoint.model_config"),
    ("def f():\n    from megatron_delta import data\n", "megatron_delta.data"),
    ("from .. import checkpoint\n", "megatron_delta.checkpoint"),
    ("import megatron.training.arguments\n", "megatron.training.arguments"),
])
def test_the_check_sees_each_kind_of_import(tmp_path, monkeypatch, source, bad):
    """The scan catches module-level, function-local, relative and megatron.training imports."""
    fake = tmp_path / "megatron_delta"
    (fake / "core").mkdir(parents=True)
    (fake / "core" / "x.py").write_text(source)
    monkeypatch.setattr(import_scan, "PACKAGE", fake)
    assert [v.split(" imports ")[1] for v in violations("core", core_may_import)] == [bad]


# The package's layers, bottom up: a module imports only modules of its own layer or of a layer below
# (core/ and hf/ share the ground floor; evaluation/ sits below convert/, whose export loads through it;
# perf/, the memory and cost models and the benchmark harness, builds models from checkpoint/'s fields).
LAYERS = (("core", "hf"), ("platform",), ("data",), ("checkpoint",), ("evaluation", "perf"), ("convert",),
          ("trainer",))
LEVEL = {pkg: i for i, pkgs in enumerate(LAYERS) for pkg in pkgs}


def package_of(mod: str):
    """The sub-package of megatron_delta that `mod` names (None outside the package or for the package itself)."""
    parts = mod.split(".")
    return parts[1] if parts[0] == "megatron_delta" and len(parts) > 1 else None


def upward_imports() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = package_of(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        if here is None:
            continue
        for line, mod in imported_modules(path):
            there = package_of(mod)
            if there is not None and there in LEVEL and LEVEL[there] > LEVEL[here]:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({here}) imports {mod} ({there})")
    return bad


def test_every_sub_package_has_a_layer():
    found = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert found - set(LEVEL) == set()


def test_nothing_imports_a_layer_above_it():
    assert upward_imports() == []


def submodules_imported(path: pathlib.Path) -> list[tuple[int, str]]:
    """`from megatron_delta.platform import patches`: (line, "megatron_delta.platform.patches") for each name."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(parts[:len(parts) - node.level] + ([node.module] if node.module else [])) \
                if node.level else node.module
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def module_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (module level or inside a function)."""
    modules = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
               for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for _, mod in imported_modules(path) + submodules_imported(path):
            while mod and mod not in modules:  # `from pkg.mod import name` names the module pkg.mod
                mod = mod.rpartition(".")[0]
            # a module's own package (its face, __init__.py, already runs before it) is no edge: hf's remote code
            # imports `.modes`, which exists only in the exported directory
            if mod and mod != name and not name.startswith(mod + "."):
                targets.add(mod)
        graph[name] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of `graph` (strongly connected components of more than one module), Tarjan's way."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_circles():
    assert circles(module_graph()) == []


def test_the_layer_checks_see_an_upward_import_and_a_circle(tmp_path, monkeypatch):
    """A data module importing the trainer is reported, and two modules importing each other make a circle."""
    fake = tmp_path / "megatron_delta"
    for pkg in LEVEL:
        (fake / pkg).mkdir(parents=True)
        (fake / pkg / "__init__.py").write_text("")
    (fake / "data" / "a.py").write_text("from megatron_delta.trainer.b import f\n")
    (fake / "trainer" / "b.py").write_text("def f():\n    from megatron_delta.data import a\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    monkeypatch.setattr(import_scan, "PACKAGE", fake)  # imported_modules reads it there
    assert upward_imports() == ["megatron_delta/data/a.py:1 (data) imports megatron_delta.trainer.b (trainer)"]
    assert circles(module_graph()) == [["megatron_delta.data.a", "megatron_delta.trainer.b"]]



# Modules of pure arithmetic over counts: the plan is read, tested and priced without torch (core/group_plan.py).
TORCH_FREE = ("megatron_delta.core.group_plan",)


def beyond_the_standard_library(name: str) -> list[str]:
    """'line: module' for each import of module ``name`` (a TORCH_FREE one) outside the standard library."""
    path = PACKAGE.parent / (name.replace(".", "/") + ".py")
    return [f"{line}: {mod}" for line, mod in imported_modules(path)
            if mod.split(".")[0] not in sys.stdlib_module_names]


def test_the_planning_modules_import_only_the_standard_library():
    """Every import of a torch-free module names the standard library; and the module imports in a process where
    torch cannot be imported (so nothing it reaches through the package's __init__ files imports torch either)."""
    for name in TORCH_FREE:
        assert beyond_the_standard_library(name) == [], name
        code = f"import sys; sys.modules['torch'] = None; import {name}"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              cwd=PACKAGE.parent, timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]


def test_the_torch_free_check_sees_a_torch_import(tmp_path, monkeypatch):
    """A planning module that imports torch inside a function, or numpy at module level, is reported."""
    fake = tmp_path / "megatron_delta"
    (fake / "core").mkdir(parents=True)
    (fake / "core" / "group_plan.py").write_text("import functools\nimport numpy\ndef f():\n    import torch\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    monkeypatch.setattr(import_scan, "PACKAGE", fake)  # imported_modules reads it there
    assert beyond_the_standard_library("megatron_delta.core.group_plan") == ["2: numpy", "4: torch"]
