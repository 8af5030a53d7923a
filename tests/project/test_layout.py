"""The package's layout rules, read from the source with ast: no module uses another module's private name.

A private name (``_name``, not ``__dunder__``) belongs to the module that defines it. Another module of preflight
that imports it (``from preflight.transport.base import _LocalCommand``, ``from .proc import _x``) or reaches it
through a module (``transport._JUMPS``, ``getattr(rep, "_x")``) is flagged: a shared piece gets a public name.
Tests may keep using private names; this walks preflight/ only.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set, Tuple

import preflight

PACKAGE = Path(preflight.__file__).resolve().parent


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules(root: Path = PACKAGE) -> Dict[str, Path]:
    """{dotted module name: file} of every module and package under root."""
    return {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _resolve_from(node: ast.ImportFrom, current: str, is_package: bool) -> str:
    """The absolute module an ``ImportFrom`` reads from (relative levels resolved against current)."""
    if not node.level:
        return node.module or ""
    base = current.split(".")
    drop = node.level - 1 if is_package else node.level
    base = base[:len(base) - drop] if drop else base
    return ".".join(base + ([node.module] if node.module else []))


def _dotted(node: ast.expr, bound: Dict[str, str]) -> Optional[str]:
    """The module name an expression like ``rep`` or ``preflight.transport`` stands for, if it names one."""
    if isinstance(node, ast.Name):
        return bound.get(node.id)
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value, bound)
        return f"{inner}.{node.attr}" if inner is not None else None
    return None


def private_uses(source: str, current: str, modules: Set[str], is_package: bool = False) -> List[str]:
    """Each use in source (the module ``current``) of a private name of another module in ``modules``, as
    'line N: what', in line order. Bindings are per file, not per scope: a local variable that shadows a module
    alias is rare."""
    found = sorted(_private_uses(ast.parse(source), current, modules, is_package), key=lambda u: u[0])
    return [f"line {line}: {what}" for line, what in found]


def _private_uses(tree: ast.AST, current: str, modules: Set[str], is_package: bool) -> Iterator[Tuple[int, str]]:
    bound: Dict[str, str] = {}  # local name -> the preflight module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] not in {m.split(".")[0] for m in modules}:
                    continue
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:  # `import preflight.x.y` binds `preflight`
                    bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            source_module = _resolve_from(node, current, is_package)
            if source_module not in modules:
                continue
            for alias in node.names:
                if f"{source_module}.{alias.name}" in modules:  # a submodule: `from preflight import report`
                    bound[alias.asname or alias.name] = f"{source_module}.{alias.name}"
                if _is_private(alias.name) and source_module != current:
                    yield node.lineno, f"from {source_module} import {alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            owner = _dotted(node.value, bound)
            if owner in modules and owner != current:
                yield node.lineno, f"{owner}.{node.attr}"
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and _is_private(node.args[1].value)):
            owner = _dotted(node.args[0], bound)
            if owner in modules and owner != current:
                yield node.lineno, f"{node.func.id}({owner}, {node.args[1].value!r})"


def test_no_module_under_preflight_uses_another_modules_private_name():
    modules = package_modules()
    names = set(modules)
    found: List[str] = []
    for name, path in modules.items():
        for use in private_uses(path.read_text(), name, names, path.name == "__init__.py"):
            found.append(f"{path.relative_to(PACKAGE.parent)}: {use}")
    assert not found, "private names used across modules (give the shared piece a public name):\n" + "\n".join(found)


def test_the_rule_flags_cross_module_private_imports_and_attributes_but_not_own_or_dunder_names():
    modules = {"preflight", "preflight.transport", "preflight.transport.base", "preflight.transport.srun",
               "preflight.report", "preflight.hostside", "preflight.hostside.proc", "preflight.hostside.agent"}
    bad = """
from preflight.transport.base import RunningCommand, _LocalCommand
from .proc import _spawn
import preflight.transport.base
import preflight.report as rep
from preflight import report
rep._width(1)
report._width(2)
preflight.transport.base._JUMPS.open_count()
getattr(rep, "_plain")
"""
    uses = private_uses(bad, "preflight.hostside.agent", modules)
    assert uses == ["line 2: from preflight.transport.base import _LocalCommand",
                    "line 3: from preflight.hostside.proc import _spawn",
                    "line 7: preflight.report._width", "line 8: preflight.report._width",
                    "line 9: preflight.transport.base._JUMPS", "line 10: getattr(preflight.report, '_plain')"], uses
    fine = """
from preflight.transport.base import RunningCommand, __version__
from paramiko.common import _private_to_paramiko
import preflight.transport.srun as srun
from . import _helpers_of_this_package
srun.SharedStep.__init__
obj._feed(b"")
_own_helper()
"""
    # __init__ of preflight.transport: `from . import _x` reads the package's own name.
    assert private_uses(fine, "preflight.transport", modules, is_package=True) == []
    assert private_uses("from . import _x\n", "preflight.transport.srun", modules) == [
        "line 1: from preflight.transport import _x"]
