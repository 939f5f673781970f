"""kasoku's layout is its architecture: one folder per layer, and dependencies that run one way (docs/DESIGN.md).

A module's layer is the folder it sits in under src/kasoku (`core/`, `architectures/`, ... `tools/`; `cli/`,
`batch/` and `serve/` are the apps); a module outside every layer folder fails. The import graph is built from
the source: every import counts, the ones inside functions too (a local import is for a heavy optional
dependency, never to hide a cycle); only imports under `if TYPE_CHECKING:` are left out, since they never run.
Importing a module also runs the `__init__` of each package it sits in, so an import of `kasoku.backends.base`
from outside `kasoku.backends` is an edge to `kasoku.backends` as well. The checks run on a copy of the package
with a planted upward import and a planted loose module too, to show that they fail.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

import kasoku

ROOT = Path(kasoku.__file__).parent

# The layers, lowest first: a module may import its own layer and the layers below it, never one above. Each is a
# folder of the same name under src/kasoku, but the apps, which are three.
LAYERS = ("core", "architectures", "families", "model", "backends", "build", "runtime", "policies", "pipeline",
          "tools", "apps")
APPS = ("cli", "batch", "serve")
# Beside the layer folders: the root package (it imports nothing of its own) and `python -m kasoku` (the CLI's).
ENTRY_POINTS = {"kasoku": None, "kasoku.__main__": "apps"}
# Stricter than the order: what these layers may import besides themselves.
ONLY = {"backends": {"core"}, "architectures": {"core"}}


class OutsideTheLayers(AssertionError):
    pass


def module_files(root: Path = ROOT) -> dict[str, Path]:
    files = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
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


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    files = module_files(root)
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


def layer_of(module: str, files: dict[str, Path] | None = None) -> str | None:
    """The layer of `module`: the folder it sits in (None for the root package)."""
    if module in ENTRY_POINTS:
        return ENTRY_POINTS[module]
    files = module_files() if files is None else files
    folder = module.split(".")[1]
    is_loose = files[module].parent.name == "kasoku"  # a module file beside the layer folders
    if not is_loose and folder in APPS:
        return "apps"
    if not is_loose and folder in LAYERS:
        return folder
    raise OutsideTheLayers(f"{module} sits outside every layer folder: move it into its layer's folder under "
                           f"src/kasoku ({', '.join(LAYERS[:-1] + APPS)}) and name it in docs/DESIGN.md's map")


def upward_imports(graph: dict[str, set[str]], files: dict[str, Path]) -> list[str]:
    """Each import that points to a layer above the importer's (or, for `ONLY`'s layers, outside what they may)."""
    wrong = []
    for module, targets in sorted(graph.items()):
        layer = layer_of(module, files)
        if layer is None:
            continue
        allowed = ONLY.get(layer, set(LAYERS[:LAYERS.index(layer)])) | {layer}
        wrong += [f"{module} ({layer}) imports {target} ({layer_of(target, files)})" for target in sorted(targets)
                  if layer_of(target, files) not in allowed]
    return wrong


def test_the_graph_reads_function_local_imports():
    # the compiler imports the backends at its top and nothing of the policies: the graph must see both facts
    graph = import_graph()
    assert "kasoku.backends" in graph["kasoku.build.compiler"]
    assert "kasoku.pipeline.compiling" not in graph["kasoku.build.compiler"]
    # cli/build.py imports the library inside its commands only (a fast `kasoku --help`)
    assert "kasoku.pipeline.compiling" in graph["kasoku.cli.build"]


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_package_root_holds_only_the_layer_folders():
    beside = sorted(p.name for p in ROOT.iterdir() if p.name != "__pycache__")
    assert beside == sorted(["__init__.py", "__main__.py", *LAYERS[:-1], *APPS])


def test_every_module_sits_in_a_layer_folder():
    files = module_files()
    for module in files:
        layer_of(module, files)


def test_every_layer_folder_says_what_it_is_and_may_import():
    for folder in (*LAYERS[:-1], *APPS):
        doc = ast.get_docstring(ast.parse((ROOT / folder / "__init__.py").read_text())) or ""
        assert "May import:" in doc, f"src/kasoku/{folder}/__init__.py: its docstring says what it may import"


@pytest.mark.parametrize("layer", LAYERS)
def test_dependencies_run_one_way(layer):
    files = module_files()
    assert [line for line in upward_imports(import_graph(), files) if f" ({layer}) imports " in line] == []


def _planted_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "kasoku"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def test_a_planted_upward_import_fails(tmp_path):
    copy = _planted_copy(tmp_path)
    errors = copy / "core" / "errors.py"
    # inside a function, as a lazy import would hide it
    errors.write_text(errors.read_text() + "\n\ndef planted():\n    from ..pipeline.kasoku_pipeline import compile\n")
    files = module_files(copy)
    assert upward_imports(import_graph(copy), files) == [
        "kasoku.core.errors (core) imports kasoku.pipeline (pipeline)",
        "kasoku.core.errors (core) imports kasoku.pipeline.kasoku_pipeline (pipeline)"]
    assert upward_imports(import_graph(), module_files()) == []  # the real package, unchanged


def test_a_planted_import_of_a_higher_backend_layer_fails(tmp_path):
    copy = _planted_copy(tmp_path)
    onnxruntime = copy / "backends" / "onnxruntime.py"  # backends see the core only, not the families below them
    onnxruntime.write_text(onnxruntime.read_text() + "\nfrom ..families import FAMILIES  # planted\n")
    assert upward_imports(import_graph(copy), module_files(copy)) == [
        "kasoku.backends.onnxruntime (backends) imports kasoku.families (families)"]


def test_a_planted_loose_module_fails(tmp_path):
    copy = _planted_copy(tmp_path)
    (copy / "helpers.py").write_text("from .core.errors import KasokuError\n")
    files = module_files(copy)
    with pytest.raises(OutsideTheLayers, match="kasoku.helpers sits outside every layer folder"):
        for module in files:
            layer_of(module, files)


def test_the_root_package_imports_nothing_of_its_own():
    # `import kasoku` stays fast: the public names are looked up on first use
    assert import_graph()["kasoku"] == set()


def test_public_names_resolve():
    for name in kasoku.__all__:
        assert getattr(kasoku, name) is not None
