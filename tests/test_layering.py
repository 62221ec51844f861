"""Import layering, read from the source (nothing is imported).

* ``triton_kernels/`` is acyclic: no module imports, directly or through others, a module
  that imports it back. Top-level and function-level imports both count, and so do the
  modules :mod:`cokit.triton_kernels.compile_only` loads by name (``KERNEL_MODULES``).
* Data flows one way: ``triton_kernels/`` imports nothing else of cokit (not ``compress``,
  ``overlap``, nor the app), ``compress/`` and ``overlap/`` never import the app, and
  ``compress/`` never imports ``overlap/`` (which uses its accounting).
  These folders are checked as they are on disk (files move between them and the app).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: top-level folder -> the package it installs as (pyproject.toml package-dir)
FOLDERS = {"triton_kernels": "cokit.triton_kernels", "compress": "cokit.compress", "overlap": "cokit.overlap"}
APP = (
    "cokit.cli",
    "cokit.commands",
    "cokit.train",
    "cokit.validation",
    "cokit.workloads",
    "cokit.display",
    "cokit.train_report",
    "cokit.launch",
    "cokit.netbed",
    "cokit.sweeps",
    "cokit.cpu_demo",
    "cokit.files",
    "cokit.bench",
    "cokit.dashboard",
    "cokit.telemetry",
    "cokit.nn",
    "cokit.overlap_training",
    "cokit.integrations",
    "cokit.ops",
    "cokit.plan",
    "cokit.model_shapes",
)
#: the folders' bare names: importing them bare bypasses the one import root, ``cokit``
BARE = ("triton_kernels", "compress", "overlap", "benchmarks")


def _module_name(folder: str, path: Path) -> str:
    rel = path.relative_to(ROOT / folder).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join([FOLDERS[folder], *parts])


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def imports_of(folder: str, path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, at any depth. ``from X
    import name`` yields ``X.name`` too (it may be a submodule; callers filter)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(folder, path)
    if not _is_package(path):
        package = package.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            out.append((node.lineno, base))
            out.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names)
    return out


def _files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def kernel_graph() -> dict[str, set[str]]:
    """Module of triton_kernels -> the modules of triton_kernels it imports (any depth),
    plus compile_only -> every module of its KERNEL_MODULES (loaded by name)."""
    modules = {_module_name("triton_kernels", p): p for p in _files("triton_kernels")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for _, target in imports_of("triton_kernels", path):
            if target in modules and target != name and target != "cokit.triton_kernels":
                graph[name].add(target)
    compile_only = modules["cokit.triton_kernels.compile_only"]
    for node in ast.walk(ast.parse(compile_only.read_text())):
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) == "KERNEL_MODULES" for t in node.targets
        ):
            for short in ast.literal_eval(node.value):
                graph["cokit.triton_kernels.compile_only"].add(f"cokit.triton_kernels.{short}")
            break
    else:
        raise AssertionError("compile_only.py defines no KERNEL_MODULES tuple")
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (as a path that returns to its start), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def test_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_triton_kernels_import_graph_is_acyclic():
    graph = kernel_graph()
    assert "cokit.triton_kernels.gemm" in graph and graph["cokit.triton_kernels.compile_only"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in triton_kernels/: " + " -> ".join(
        c.rpartition(".")[2] for c in cycle
    )


def test_occupancy_is_pure_math():
    """occupancy.py imports no kernel family (the GEMM's occupancy lives in gemm.py)."""
    graph = kernel_graph()
    allowed = {"cokit.triton_kernels.backend", "cokit.triton_kernels.shaped_launch"}
    assert graph["cokit.triton_kernels.occupancy"] <= allowed


def test_kernel_modules_do_not_import_compile_only_at_top_level():
    """compile_only collects their specs; they must not need it to import."""
    for short in ("dct", "topk", "error_feedback", "sm_copy", "shaped_launch", "occupancy"):
        path = ROOT / "triton_kernels" / f"{short}.py"
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module and "compile_only" in node.module:
                pytest.fail(f"triton_kernels/{short}.py:{node.lineno} imports compile_only at top level")


def _violations(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    bad = []
    for path in _files(folder):
        for line, target in imports_of(folder, path):
            head = target.split(".")[0]
            if head in BARE:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target} bare; use cokit.{target}")
            elif any(target == f or target.startswith(f + ".") for f in forbidden):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    return sorted(set(bad))


def test_triton_kernels_imports_nothing_else_of_cokit():
    others = tuple(p for f, p in FOLDERS.items() if f != "triton_kernels") + APP + ("cokit.bench",)
    assert _violations("triton_kernels", others) == []
    # nor any other cokit module outside the package (cokit.X for X != triton_kernels)
    strays = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for path in _files("triton_kernels")
        for line, target in imports_of("triton_kernels", path)
        if target.startswith("cokit.") and not target.startswith("cokit.triton_kernels")
    ]
    assert strays == []


@pytest.mark.parametrize("folder", ["compress", "overlap"])
def test_compress_and_overlap_do_not_import_the_app(folder):
    """Checked on the files present: modules that move to the app leave this check."""
    if not (ROOT / folder).is_dir():
        pytest.skip(f"{folder}/ is not in this checkout")
    assert _violations(folder, APP) == []


def test_compress_does_not_import_overlap():
    """overlap uses compress's byte and time accounting; never the other way round."""
    assert _violations("compress", ("cokit.overlap",)) == []


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
