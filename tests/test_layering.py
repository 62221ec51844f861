"""Import layering, read from the source (nothing is imported).

* No import cycle anywhere in the tree: ``triton_kernels/``, ``compress/``, ``overlap/``,
  ``benchmarks/`` and every module of ``cokit/``. Top-level and function-level imports both
  count (a cycle hidden in a function is still one); imports under ``if TYPE_CHECKING:`` do
  not (they never run), and neither does the implicit import of a module's parent package.
  The modules :mod:`cokit.triton_kernels.compile_only` loads by name (``KERNEL_MODULES``)
  count as its imports; other names computed at run time (the CLI's subcommands, ``cokit
  bench``'s modules) are not seen. A cycle found is named by its chain of modules and each
  import's line.
* Data flows one way: ``triton_kernels/`` imports nothing else of cokit (not ``compress``,
  ``overlap``, nor the app), ``compress/`` and ``overlap/`` never import the app (any module
  of ``cokit/``), and ``compress/`` never imports ``overlap/`` (which uses its accounting).
* Plots stay in the app: the library never imports matplotlib, no module imports it at
  module level, and nothing in the tree switches its backend.

These folders are checked as they are on disk (files move between them and the app).
"""

from __future__ import annotations

import ast
import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: library folder -> the package it installs as (pyproject.toml package-dir)
FOLDERS = {"triton_kernels": "cokit.triton_kernels", "compress": "cokit.compress", "overlap": "cokit.overlap"}
#: every folder of the tree -> its package: the libraries, the benchmarks and the app
TREE = {**FOLDERS, "benchmarks": "cokit.bench", "cokit": "cokit"}
#: the folders' bare names: importing them bare bypasses the one import root, ``cokit``
BARE = ("triton_kernels", "compress", "overlap", "benchmarks")


def _files(folder: str, root: Path = ROOT) -> list[Path]:
    return sorted((root / folder).rglob("*.py"))


def _module_name(folder: str, path: Path, root: Path = ROOT, tree: dict[str, str] = TREE) -> str:
    rel = path.relative_to(root / folder).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join([tree[folder], *parts])


def tree_modules(root: Path = ROOT, tree: dict[str, str] = TREE) -> dict[str, Path]:
    """Module name -> file, for every .py file of the tree's folders."""
    return {_module_name(folder, path, root, tree): path for folder in tree for path in _files(folder, root)}


#: the app: every module of cokit/ but the root package (which only sets up the import root)
APP = tuple(sorted(m for m in tree_modules(ROOT, {"cokit": "cokit"}) if m != "cokit"))


@dataclass(frozen=True)
class Import:
    """One imported module of a statement: ``import module`` (``names`` empty) or ``from
    module import names``; its line, and whether it runs in a function (at call time)."""

    line: int
    module: str
    names: tuple[str, ...]
    in_function: bool

    def dotted(self) -> list[str]:
        """Every dotted name the import mentions: ``module`` and each ``module.name``."""
        return [self.module, *(f"{self.module}.{n}" for n in self.names)]

    def targets(self, modules: dict[str, Path] | set[str]) -> set[str]:
        """The modules of ``modules`` it loads: ``module.name`` where that is a module (a
        submodule taken by ``from``), else ``module`` itself."""
        if not self.names:
            return {self.module} & set(modules)
        found = {f"{self.module}.{n}" if f"{self.module}.{n}" in modules else self.module for n in self.names}
        return found & set(modules)


def _is_type_checking(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` or ``if typing.TYPE_CHECKING:``."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, in_function: bool = False) -> Iterator[tuple[ast.AST, bool]]:
    """Every node below ``node`` and whether it sits in a function, leaving out the bodies of
    ``if TYPE_CHECKING:`` (their ``else`` runs, so it stays)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for other in child.orelse:
                yield other, in_function
                yield from _walk(other, in_function)
            continue
        yield child, in_function
        yield from _walk(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))


def imports_of(module: str, path: Path) -> list[Import]:
    """Every import of the file at any depth but under ``if TYPE_CHECKING:``, relative
    imports made absolute (``module`` is the file's own module name)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node, in_function in _walk(tree):
        if isinstance(node, ast.Import):
            out.extend(Import(node.lineno, alias.name, (), in_function) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            out.append(Import(node.lineno, base, tuple(a.name for a in node.names), in_function))
    return out


def _kernel_modules(modules: dict[str, Path]) -> list[str]:
    """The modules compile_only loads by name (its ``KERNEL_MODULES`` tuple)."""
    path = modules.get("cokit.triton_kernels.compile_only")
    if path is None:
        return []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) == "KERNEL_MODULES" for t in node.targets
        ):
            return [f"cokit.triton_kernels.{short}" for short in ast.literal_eval(node.value)]
    raise AssertionError("compile_only.py defines no KERNEL_MODULES tuple")


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, Import]]:
    """Module -> {module of ``modules`` it imports -> the first import of it}."""
    graph: dict[str, dict[str, Import]] = {name: {} for name in modules}
    for name, path in modules.items():
        for imp in imports_of(name, path):
            for target in sorted(imp.targets(modules) - {name}):
                graph[name].setdefault(target, imp)
    compile_only = "cokit.triton_kernels.compile_only"
    for kernel in _kernel_modules(modules):
        graph[compile_only].setdefault(kernel, Import(0, kernel, (), True))
    return graph


def cyclic_components(graph: dict[str, set[str]] | dict[str, dict[str, Import]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (each
    sorted; every import cycle lies in one), in the order of their first module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for start in sorted(graph):
        if start not in index:
            visit(start)
    return sorted(found)


def shortest_cycle(graph: dict[str, set[str]] | dict[str, dict[str, Import]], start: str) -> list[str]:
    """The shortest import chain from ``start`` back to itself (``[start, ..., start]``),
    or [] when there is none."""
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                chain = [node]
                while chain[-1] != start:
                    chain.append(came_from[chain[-1]])
                return [*reversed(chain), start]
            if nxt not in came_from:
                came_from[nxt] = node
                queue.append(nxt)
    return []


def describe_cycles(
    graph: dict[str, dict[str, Import]], modules: dict[str, Path], root: Path = ROOT
) -> list[str]:
    """One paragraph per cyclic component: a shortest cycle through its first module, as the
    chain of modules and the import (file:line) behind each step, and the component's other
    modules when it holds more than that cycle."""
    out = []
    for component in cyclic_components(graph):
        chain = shortest_cycle(graph, component[0])
        lines = ["import cycle: " + " -> ".join(chain)]
        for a, b in itertools.pairwise(chain):
            imp = graph[a][b]
            where = f"{modules[a].relative_to(root)}:{imp.line}"
            how = "loads by name" if imp.line == 0 else "imports"
            lines.append(f"  {where}{' (in a function)' if imp.in_function else ''} {how} {b}")
        rest = sorted(set(component) - set(chain))
        if rest:
            lines.append(f"  the same knot also holds: {', '.join(rest)}")
        out.append("\n".join(lines))
    return out


# ---------------------------------------------------------------------- the detector itself
def test_cycle_finder_on_graphs():
    assert cyclic_components({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    assert shortest_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}, "a") == ["a", "b", "c", "a"]
    assert cyclic_components({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
    two = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c", "e"}, "e": set()}
    assert cyclic_components(two) == [["a", "b"], ["c", "d"]]


def test_cycle_finder_on_a_synthetic_tree(tmp_path):
    """The whole pipeline (files -> imports -> graph -> named cycle) on a small tree: a cycle
    closed by a function-level import and a ``from pkg import submodule`` is found and named
    with its lines; one closed only under ``if TYPE_CHECKING:`` is not."""
    files = {
        "__init__.py": "",
        "a.py": "from pkg import b\n",
        "b.py": "import os\n\n\ndef f():\n    from .c import x\n    return x\n",
        "c.py": "import pkg.a\n\nx = 1\n",
        "d.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg.e import E\nelse:\n    import json\n",
        "e.py": "from pkg.d import TYPE_CHECKING as E\n",
    }
    (tmp_path / "src").mkdir()
    for name, text in files.items():
        (tmp_path / "src" / name).write_text(text)
    modules = tree_modules(tmp_path, {"src": "pkg"})
    assert sorted(modules) == ["pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.d", "pkg.e"]
    graph = import_graph(modules)
    assert set(graph["pkg.a"]) == {"pkg.b"}  # the submodule, not the package
    assert set(graph["pkg.d"]) == set() and set(graph["pkg.e"]) == {"pkg.d"}
    (message,) = describe_cycles(graph, modules, tmp_path)
    assert message.splitlines() == [
        "import cycle: pkg.a -> pkg.b -> pkg.c -> pkg.a",
        "  src/a.py:1 imports pkg.b",
        "  src/b.py:5 (in a function) imports pkg.c",
        "  src/c.py:1 imports pkg.a",
    ]
    (tmp_path / "src" / "c.py").write_text("x = 1\n")
    assert describe_cycles(import_graph(tree_modules(tmp_path, {"src": "pkg"})), modules, tmp_path) == []


# ---------------------------------------------------------------------- the tree
def test_no_import_cycle_anywhere():
    modules = tree_modules()
    graph = import_graph(modules)
    # the graph is the real one (a parser that found nothing would pass vacuously)
    assert len(modules) > 100 and sum(map(len, graph.values())) > 300
    assert "cokit.overlap.layers" in graph["cokit.overlap.training"]
    assert "cokit.triton_kernels.dct" in graph["cokit.triton_kernels.compile_only"]
    cycles = describe_cycles(graph, modules)
    assert not cycles, f"{len(cycles)} import cycle(s):\n" + "\n".join(cycles)


def test_triton_kernels_import_graph_is_acyclic():
    """The kernels' own graph, on its own: the lowest layer stays acyclic whatever the rest does."""
    modules = tree_modules(ROOT, {"triton_kernels": FOLDERS["triton_kernels"]})
    graph = import_graph(modules)
    assert graph["cokit.triton_kernels.compile_only"]
    cycles = describe_cycles(graph, modules)
    assert not cycles, "\n".join(cycles)


def test_occupancy_is_pure_math():
    """occupancy.py imports no kernel family (the GEMM's occupancy lives in gemm.py)."""
    graph = import_graph(tree_modules(ROOT, {"triton_kernels": FOLDERS["triton_kernels"]}))
    allowed = {"cokit.triton_kernels.backend", "cokit.triton_kernels.shaped_launch"}
    assert set(graph["cokit.triton_kernels.occupancy"]) <= allowed


def test_kernel_modules_do_not_import_compile_only_at_top_level():
    """compile_only collects their specs; they must not need it to import."""
    for short in ("dct", "topk", "error_feedback", "sm_copy", "shaped_launch", "occupancy"):
        path = ROOT / "triton_kernels" / f"{short}.py"
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module and "compile_only" in node.module:
                pytest.fail(f"triton_kernels/{short}.py:{node.lineno} imports compile_only at top level")


# ---------------------------------------------------------------------- one way
def _imports(folder: str) -> Iterator[tuple[Path, Import]]:
    for path in _files(folder):
        for imp in imports_of(_module_name(folder, path), path):
            yield path, imp


def _violations(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for path, imp in _imports(folder):
        for target in imp.dotted():
            head = target.split(".")[0]
            if head in BARE:
                bad.append(f"{path.relative_to(ROOT)}:{imp.line} imports {target} bare; use cokit.{target}")
            elif any(target == f or target.startswith(f + ".") for f in forbidden):
                bad.append(f"{path.relative_to(ROOT)}:{imp.line} imports {target}")
    return sorted(set(bad))


def test_the_app_list_is_the_app():
    """APP is read from cokit/: the shims of moved modules and the sweep's app side are in it,
    the library modules that replaced them are not."""
    assert {"cokit.cli", "cokit.sweeps", "cokit.nn", "cokit.ops", "cokit.overlap_training"} <= set(APP)
    assert not any(m.startswith(tuple(f"{p}." for p in FOLDERS.values())) for m in APP)


def test_triton_kernels_imports_nothing_else_of_cokit():
    others = tuple(p for f, p in FOLDERS.items() if f != "triton_kernels") + APP + ("cokit.bench",)
    assert _violations("triton_kernels", others) == []
    # nor any other cokit module outside the package (cokit.X for X != triton_kernels)
    strays = [
        f"{path.relative_to(ROOT)}:{imp.line} imports {target}"
        for path, imp in _imports("triton_kernels")
        for target in imp.dotted()
        if target.startswith("cokit.") and not target.startswith("cokit.triton_kernels")
    ]
    assert strays == []


@pytest.mark.parametrize("folder", ["compress", "overlap"])
def test_compress_and_overlap_do_not_import_the_app(folder):
    """Checked on the files present: modules that move to the app leave this check. The
    library never imports the benchmarks either."""
    if not (ROOT / folder).is_dir():
        pytest.skip(f"{folder}/ is not in this checkout")
    assert _violations(folder, (*APP, "cokit.bench")) == []


def test_compress_does_not_import_overlap():
    """overlap uses compress's byte and time accounting; never the other way round."""
    assert _violations("compress", ("cokit.overlap",)) == []


def test_overlap_holds_the_layers_and_their_tuning():
    """The layers and the training-time tuning are library modules, imported by the app,
    never the other way round (their old app paths only forward)."""
    modules = tree_modules()
    for name in ("cokit.overlap.layers", "cokit.overlap.training", "cokit.overlap.sweep"):
        assert name in modules
    graph = import_graph(modules)
    for shim in ("cokit.nn", "cokit.ops", "cokit.overlap_training"):
        assert set(graph[shim]) == {"cokit._moved"}, f"{shim} is a thin shim: {sorted(graph[shim])}"


# ---------------------------------------------------------------------- plots stay in the app
def _matplotlib_uses(folder: str) -> Iterator[tuple[Path, Import]]:
    for path, imp in _imports(folder):
        if imp.module.split(".")[0] == "matplotlib":
            yield path, imp


def test_the_library_never_imports_matplotlib():
    found = [f"{p.relative_to(ROOT)}:{i.line}" for folder in FOLDERS for p, i in _matplotlib_uses(folder)]
    assert found == []


def test_matplotlib_is_imported_only_inside_functions():
    """Importing any module of the tree loads no matplotlib; plots import it when they draw."""
    found = [
        f"{p.relative_to(ROOT)}:{i.line} imports {i.module} at module level"
        for folder in TREE
        for p, i in _matplotlib_uses(folder)
        if not i.in_function
    ]
    assert found == []


def test_nothing_switches_the_matplotlib_backend():
    """A backend is the user's choice (a notebook's inline plots): no ``matplotlib.use`` or
    ``pyplot.switch_backend``; the CLI's entry point only defaults MPLBACKEND when unset, and
    the library does not touch it."""
    found = []
    for folder in TREE:
        for path in _files(folder):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and node.attr in ("use", "switch_backend"):
                    owner = ast.unparse(node.value)
                    if owner in ("matplotlib", "mpl", "plt", "pyplot", "matplotlib.pyplot"):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno} {owner}.{node.attr}")
                if folder in FOLDERS and isinstance(node, ast.Constant) and node.value == "MPLBACKEND":
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} sets MPLBACKEND")
    assert found == []


# the object collectives of torch.distributed unpickle what peers send
_UNPICKLING = {
    "all_gather_object",
    "gather_object",
    "broadcast_object_list",
    "scatter_object_list",
    "recv_object_list",
    "send_object_list",
    "loads",
    "load",
}


def test_the_exchange_never_unpickles_peer_data():
    """Nothing under compress/ (the exchange and its front ends) calls an object collective or
    pickle: peers' reports travel as tensors or JSON bytes (docs/design.md, threat model)."""
    found = []
    for path in sorted((ROOT / "compress").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + (
                    [node.module] if isinstance(node, ast.ImportFrom) else []
                )
                if any(n and n.split(".")[0] in ("pickle", "cPickle", "dill") for n in names):
                    found.append(f"{path.name}:{node.lineno} imports pickle")
                if isinstance(node, ast.ImportFrom) and any(
                    a.name.endswith("_object") or a.name.endswith("_object_list") for a in node.names
                ):
                    found.append(f"{path.name}:{node.lineno} imports an object collective")
            if isinstance(node, ast.Attribute) and node.attr in _UNPICKLING:
                owner = ast.unparse(node.value)
                if owner in ("dist", "torch.distributed", "pickle", "torch") or node.attr.endswith("_object"):
                    found.append(f"{path.name}:{node.lineno} {owner}.{node.attr}")
    assert not found, found
