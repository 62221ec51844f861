"""Make a source checkout import like the installed wheel, and say what only a checkout has.

The wheel installs one import root, ``cokit``: the repository's top-level folders
``triton_kernels/``, ``compress/`` and ``overlap/`` become ``cokit.triton_kernels``,
``cokit.compress`` and ``cokit.overlap`` (setuptools ``package-dir`` in ``pyproject.toml``).
``benchmarks/`` is ``cokit.bench`` in a checkout only: the benchmarks, the network testbed and
the validation study's workloads and protocols stay out of the wheel. A plain checkout (the
tests, a GPU machine that gets the tree copied without an install) has these folders beside
``cokit/`` instead of inside it; :func:`install` adds a finder that maps exactly these names,
and nothing else, to them. :func:`checkout_module` imports a checkout-only module or says, in
one line, that the command needs a checkout.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

# subpackage of cokit -> folder at the repository's top level, in the wheel too (keep in sync
# with pyproject.toml's package-dir)
SUBPACKAGE_FOLDERS = {
    "triton_kernels": "triton_kernels",
    "compress": "compress",
    "overlap": "overlap",
}
# the same for a checkout only: not in pyproject.toml's packages, so not in the wheel
CHECKOUT_ONLY_FOLDERS = {"bench": "benchmarks"}


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


class CheckoutOnlyError(ImportError):
    """A part of cokit that only a source checkout has; the message says how to get one."""


def checkout_module(name: str, what: str) -> ModuleType:
    """Import ``name``, a module of a checkout-only folder; :class:`CheckoutOnlyError` (one line
    naming ``what``) when this cokit has no such folder (an installed wheel)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name not in {f"cokit.{sub}" for sub in CHECKOUT_ONLY_FOLDERS}:
            raise
        raise CheckoutOnlyError(
            f"{what} needs a source checkout of cokit (the wheel leaves out the benchmarks and the "
            "validation study): clone the cokit repository and run it from the clone "
            "(`pip install -e .` there, or `python -m cokit ...` from its root)",
            name=name,
        ) from None


def install(package_dir: str) -> None:
    """Register the finder when ``package_dir`` (cokit's own folder) sits in a checkout."""
    here = Path(package_dir)
    root = here.parent
    folders = dict(SUBPACKAGE_FOLDERS)
    if (root / "pyproject.toml").is_file():  # a checkout, not site-packages beside another "benchmarks"
        folders.update(CHECKOUT_ONLY_FOLDERS)
    locations = {
        f"cokit.{name}": root / folder
        for name, folder in folders.items()
        if not (here / name).exists() and (root / folder / "__init__.py").is_file()
    }
    if locations and not any(isinstance(f, SourceTreeFinder) for f in sys.meta_path):
        # first: the checkout whose cokit/ was imported decides where its subpackages come
        # from, even when another copy is installed (an editable install elsewhere, say)
        sys.meta_path.insert(0, SourceTreeFinder(locations))
