"""Make a source checkout import like the installed wheel.

The wheel installs one import root, ``cokit``: the repository's top-level folders
``triton_kernels/``, ``compress/``, ``overlap/`` and ``benchmarks/`` become
``cokit.triton_kernels``, ``cokit.compress``, ``cokit.overlap`` and ``cokit.bench``
(setuptools ``package-dir`` in ``pyproject.toml``). A plain checkout (the tests, a GPU
machine that gets the tree copied without an install) has those folders beside
``cokit/`` instead of inside it; :func:`install` adds a finder that maps exactly these
names, and nothing else, to them. Installed copies never need it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

# subpackage of cokit -> folder at the repository's top level (keep in sync with pyproject.toml)
SUBPACKAGE_FOLDERS = {
    "triton_kernels": "triton_kernels",
    "compress": "compress",
    "overlap": "overlap",
    "bench": "benchmarks",
}


class SourceTreeFinder(importlib.abc.MetaPathFinder):
    """Finds ``cokit.<name>`` in ``<checkout>/<folder>/`` for the names above."""

    def __init__(self, locations: dict[str, Path]) -> None:
        self.locations = locations

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        folder = self.locations.get(fullname)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


def install(package_dir: str) -> None:
    """Register the finder when ``package_dir`` (cokit's own folder) sits in a checkout."""
    here = Path(package_dir)
    root = here.parent
    locations = {
        f"cokit.{name}": root / folder
        for name, folder in SUBPACKAGE_FOLDERS.items()
        if not (here / name).exists() and (root / folder / "__init__.py").is_file()
    }
    if locations and not any(isinstance(f, SourceTreeFinder) for f in sys.meta_path):
        # first: the checkout whose cokit/ was imported decides where its subpackages come
        # from, even when another copy is installed (an editable install elsewhere, say)
        sys.meta_path.insert(0, SourceTreeFinder(locations))
