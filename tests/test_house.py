"""The house rules that code can check: layers, sizes, where argparse lives, the README's length.

The layers (``docs/design.md``, "Layers, and who may import whom"), from the bottom up;
an import may only go to its own layer or one below, the packages form no circle, and
neither do the modules (their imports at import time and those for types alike).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megaformer"
LAUNCHER = ROOT / "launcher"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("megaformer", "megaformer.errors", "megaformer.files", "megaformer.lazy", "megaformer.logs", "megaformer.cpuinfo"),
    ("megaformer.config",),
    ("megaformer.parallel",),
    ("megaformer.data", "megaformer.model", "megaformer.layout_cost"),
    ("megaformer.checkpoint",),
    (
        "megaformer.pipeline",
        "megaformer.train",
        "megaformer.decode",
        "megaformer.export",
        "megaformer.info",
        "megaformer.sim",
    ),
    ("megaformer.parity", "megaformer.demo", "megaformer.recipes", "megaformer.plan"),
    ("megaformer.commands", "megaformer.cli_args"),
    ("megaformer.cli", "megaformer.__main__"),
)
MAX_FILE_LINES, MAX_FUNCTION_LINES, MAX_README_LINES = 500, 60, 250


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str:
    """The layer entry a module belongs to (a package, or a top-level module): the longest that holds it."""
    units = [u for layer in LAYERS for u in layer if module == u or (u != "megaformer" and module.startswith(u + "."))]
    if units:
        return max(units, key=len)
    raise AssertionError(f"{module}: not in any layer of tests/test_house.py (add it where it belongs)")


def _layer(unit: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if unit in layer)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every megaformer import in a file, lazy imports inside functions included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("megaformer")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("megaformer"):
            if node.module == "megaformer":  # from megaformer import cli
                found += [(node.lineno, f"megaformer.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, node.module))
    return found


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _module_level_imports(tree: ast.Module, modules: set[str]) -> set[str]:
    """The modules of ``modules`` a file imports when it is imported or type-checked: its top level, ``if
    TYPE_CHECKING:`` and ``try:`` blocks and class bodies included, function bodies (imports on first use) not."""
    found: set[str] = set()
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for a in node.names:  # `from megaformer import checkpoint`: the submodule; else the module named
                sub = f"{node.module}.{a.name}"
                found |= {sub} if sub in modules else {node.module} & modules
        else:
            todo += list(ast.iter_child_nodes(node))
    return found


def test_the_modules_import_no_circle_type_only_imports_included():
    """Two modules that import each other (even one only for a type, under ``TYPE_CHECKING``) are one concept
    split in two, or a helper in the wrong one: the shared part goes to a third module that both import."""
    paths = {_module_name(p): p for p in [*_sources(), *sorted(LAUNCHER.rglob("*.py"))]}
    graph = {m: _module_level_imports(ast.parse(p.read_text(), str(p)), set(paths)) - {m} for m, p in paths.items()}
    circles = []
    for start in sorted(graph):
        path, seen, todo = {start: [start]}, set(), [start]
        while todo:  # breadth first: the shortest way back to ``start``
            here = todo.pop(0)
            for nxt in sorted(graph[here]):
                if nxt == start and min(path[here]) == start:  # each circle once, from its smallest module
                    circles.append(" -> ".join([*path[here], start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    path[nxt] = [*path[here], nxt]
                    todo.append(nxt)
    assert not circles, "\n".join(circles)


def test_imports_only_go_down_the_layers():
    upward = []
    for path in _sources():
        here = _unit(_module_name(path))
        for line, module in _imports(path):
            there = _unit(module)
            if _layer(there) > _layer(here):
                upward.append(f"{path.relative_to(ROOT)}:{line} imports {module} ({here} is below {there})")
    assert not upward, "\n".join(upward)


def test_the_packages_import_no_circle():
    graph: dict[str, set[str]] = defaultdict(set)
    for path in _sources():
        here = _unit(_module_name(path))
        for _, module in _imports(path):
            if (there := _unit(module)) != here:
                graph[here].add(there)

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    circles = sorted(f"{a} -> {b} -> ... -> {a}" for a in list(graph) for b in graph[a] if a in reach(b))
    assert not circles, "\n".join(circles)


def test_decode_export_and_checkpoint_never_import_train():
    offenders = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for sub in ("decode", "export", "checkpoint")
        for path in sorted((PACKAGE / sub).rglob("*.py"))
        for line, module in _imports(path)
        if module == "megaformer.train" or module.startswith("megaformer.train.")
    ]
    assert not offenders, "\n".join(offenders)


def test_argparse_lives_only_in_commands_and_the_cli():
    offenders = []
    for path in _sources():
        module = _module_name(path)
        if module.startswith("megaformer.commands") or module in ("megaformer.cli", "megaformer.cli_args"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            if "argparse" in names:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, "argparse outside megaformer/commands/: " + ", ".join(offenders)


def test_files_and_functions_stay_small():
    too_big = []
    for path in [*_sources(), *sorted(LAUNCHER.rglob("*.py"))]:
        text = path.read_text()
        if (lines := text.count("\n")) > MAX_FILE_LINES:
            too_big.append(f"{path.relative_to(ROOT)}: {lines} lines (at most {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    too_big.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    assert not too_big, "\n".join(too_big)


def test_the_readme_is_a_manual_of_at_most_250_lines():
    readme = (ROOT / "README.md").read_text()
    assert readme.count("\n") <= MAX_README_LINES
    wide = [
        f"README.md:{n}: {len(line)} characters" for n, line in enumerate(readme.splitlines(), 1) if len(line) > 120
    ]
    assert not wide, wide  # lines a person can read
    assert "make test" in readme  # the test command CI runs
    assert (ROOT / "docs" / "results.md").is_file()  # where the run logs went


def test_names_imported_on_first_use_resolve_and_come_from_their_layer_or_below():
    """``megaformer.parallel`` and ``megaformer.checkpoint`` import their names on first use (from strings the
    import check above cannot see): each must resolve, from a module no higher than its package."""
    import importlib.util

    wrong = []
    for package in ("megaformer.parallel", "megaformer.checkpoint"):
        module = importlib.import_module(package)
        for name in module.__all__:
            home = importlib.util.resolve_name(module._MODULE_OF[name], package)
            if _layer(_unit(home)) > _layer(_unit(package)):
                wrong.append(f"{package}.{name} comes from {home}, a higher layer")
            if getattr(module, name, None) is None:
                wrong.append(f"{package}.{name} does not resolve")
    assert not wrong, "\n".join(wrong)
