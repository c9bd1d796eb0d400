"""The core never imports the training side: every import in megatron_delta/core/ (module level or inside a
function) names the standard library, torch, megatron.core, einops/fla (the GPU kernel) or megatron_delta.core
itself. megatron_delta/hf/ imports no Megatron (an exported model runs with transformers alone), only the mode
rules of megatron_delta/core/modes.py, which import nothing."""
import ast
import pathlib
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "megatron_delta"


def imported_modules(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) for every import statement of a file; relative imports resolved against the package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[:len(parts) - node.level]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            if mod == "megatron_delta":  # `from megatron_delta import data`: the names are the modules
                out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, mod))
    return out


def violations(folder: str, allowed) -> list[str]:
    bad = []
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        for line, mod in imported_modules(path):
            if not allowed(mod):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {mod}")
    return bad


def core_may_import(mod: str) -> bool:
    if mod == "megatron_delta" or mod.startswith("megatron_delta."):
        return mod == "megatron_delta.core" or mod.startswith("megatron_delta.core.")
    return not (mod == "megatron.training" or mod.startswith("megatron.training."))


def hf_may_import(mod: str) -> bool:
    """The HF side may read the mode rules (core/modes.py, which imports nothing) and nothing else of Megatron."""
    if mod.startswith("megatron"):
        return mod in ("megatron_delta.core.modes",) or mod == "megatron_delta.hf" or mod.startswith("megatron_delta.hf.")
    return True


def test_core_imports_nothing_of_the_training_side():
    assert violations("core", core_may_import) == []


def test_hf_model_imports_no_megatron():
    assert violations("hf", hf_may_import) == []


@pytest.mark.parametrize("source, bad", [
    ("from megatron_delta.model_config import model_config\n", "megatron_delta.model_config"),
    ("def f():\n    from megatron_delta import data\n", "megatron_delta.data"),
    ("from .. import checkpointing\n", "megatron_delta.checkpointing"),
    ("import megatron.training.arguments\n", "megatron.training.arguments"),
])
def test_the_check_sees_each_kind_of_import(tmp_path, monkeypatch, source, bad):
    """The scan catches module-level, function-local, relative and megatron.training imports."""
    fake = tmp_path / "megatron_delta"
    (fake / "core").mkdir(parents=True)
    (fake / "core" / "x.py").write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert [v.split(" imports ")[1] for v in violations("core", core_may_import)] == [bad]
