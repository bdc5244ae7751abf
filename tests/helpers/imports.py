"""Every import statement of a module's source, for the layer tests (tests/engine/test_layers.py,
tests/test_import_layers.py)."""

from __future__ import annotations

import ast


def import_statements(tree: ast.AST, package: str) -> list[tuple[int, str, list[str]]]:
    """``(line, module, names)`` of every import in ``tree``, wherever it stands (module level, in a function,
    under ``TYPE_CHECKING``): ``import a.b`` gives ``("a.b", [])``; ``from a import b, c`` gives
    ``("a", ["b", "c"])``, relative imports made absolute against ``package`` (the package the module is in);
    ``importlib.import_module("a.b")`` and ``__import__("a.b")`` with a literal name give ``("a.b", [])``."""
    found: list[tuple[int, str, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            found.append((node.lineno, base, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value, []))
    return found
