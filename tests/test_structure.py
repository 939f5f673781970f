"""kasoku's import graph, built from the source: no cycle, and dependencies run one way (docs/DESIGN.md).

Every import counts, the ones inside functions too (a local import is for a heavy optional dependency, never
to hide a cycle); only imports under `if TYPE_CHECKING:` are left out, since they never run. Importing a
module also runs the `__init__` of each package it sits in, so an import of `kasoku.backends.base` from
outside `kasoku.backends` is an edge to `kasoku.backends` as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kasoku

ROOT = Path(kasoku.__file__).parent

# The layers, lowest first: a module may import its own layer and the layers below it, never one above.
LAYERS = ("core", "architectures", "families", "model", "backends", "build", "runtime", "policies", "pipeline",
          "tools", "apps")
# Where each module sits (a package's name places every module in it).
PLACES = {
    "core": ("errors", "extras", "choices", "precision", "console", "cache", "attention", "weights", "parity",
             "memory", "schedulers", "options", "components", "step_cache", "standins"),
    "architectures": ("architectures",),
    "families": ("families",),
    "model": ("loading", "fingerprint", "model"),
    "backends": ("backends",),
    "build": ("export", "optimize", "build"),
    "runtime": ("runtime", "lora", "image_prompts"),
    "policies": ("fidelity", "calibration", "fastest", "recipes"),
    "pipeline": ("signature", "checks", "compiling", "pipeline"),
    "tools": ("verification", "benchmark", "demo", "info", "tiny", "tune"),
    "apps": ("cli", "batch", "serve"),
}
# Stricter than the order: what these layers may import besides themselves.
ONLY = {"backends": {"core"}, "architectures": {"core"}}


def module_files() -> dict[str, Path]:
    files = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imported(module: str, is_package: bool, node: ast.AST, known: set[str]) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in known}
    base = module.split(".") if is_package else module.split(".")[:-1]
    if node.level:
        base = base[:len(base) - (node.level - 1)]
        name = ".".join(base + ([node.module] if node.module else []))
    else:
        name = node.module or ""
    targets = {name} if name in known else set()
    targets |= {f"{name}.{alias.name}" for alias in node.names if f"{name}.{alias.name}" in known}
    return targets


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text())
        skipped = _type_checking_lines(tree)
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and node.lineno not in skipped:
                edges |= _imported(module, path.name == "__init__.py", node, known)
        for target in list(edges):  # the packages the target sits in run first, unless this module is inside them
            parts = target.split(".")
            for depth in range(2, len(parts)):
                package = ".".join(parts[:depth])
                if package in known and not module.startswith(package + "."):
                    edges.add(package)
        graph[module] = edges - {module, "kasoku"}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def layer_of(module: str) -> str:
    name = module.split(".")[1] if "." in module else ""
    for layer, names in PLACES.items():
        if name in names:
            return layer
    raise AssertionError(f"{module} sits in no layer: add it to PLACES in tests/test_structure.py and to the "
                         "map in docs/DESIGN.md")


def test_the_graph_reads_function_local_imports():
    # build.py imports the backends at its top and nothing of the policies: the graph must see both facts
    graph = import_graph()
    assert "kasoku.backends" in graph["kasoku.build"]
    assert "kasoku.compiling" not in graph["kasoku.build"]
    # cli/build.py imports the library inside its commands only (a fast `kasoku --help`)
    assert "kasoku.compiling" in graph["kasoku.cli.build"]


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_module_has_a_layer():
    for module in import_graph():
        if module != "kasoku":
            layer_of(module)


@pytest.mark.parametrize("layer", LAYERS)
def test_dependencies_run_one_way(layer):
    graph = import_graph()
    wrong = []
    for module, targets in graph.items():
        if module == "kasoku" or layer_of(module) != layer:
            continue
        for target in targets:
            allowed = ONLY.get(layer, set(LAYERS[:LAYERS.index(layer)])) | {layer}
            if layer_of(target) not in allowed:
                wrong.append(f"{module} ({layer}) imports {target} ({layer_of(target)})")
    assert wrong == []


def test_the_root_package_imports_nothing_of_its_own():
    # `import kasoku` stays fast: the public names are looked up on first use
    assert import_graph()["kasoku"] == set()


def test_public_names_resolve():
    for name in kasoku.__all__:
        assert getattr(kasoku, name) is not None
