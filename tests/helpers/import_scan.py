"""The imports of megatron_delta's modules, read from their source (module level and inside functions): what the
import-direction and perf-package tests check."""
import ast
import pathlib

from tests.helpers import REPO_ROOT

PACKAGE = pathlib.Path(REPO_ROOT) / "megatron_delta"


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
