"""Griffe extension for the API reference: one import root, several folders.

The wheel installs ``compress/``, ``overlap/`` and ``triton_kernels/`` inside ``cokit``
(``package-dir`` in pyproject.toml; ``cokit/_source_tree.py`` does the same for a checkout). Griffe reads ``cokit/`` from disk and would not find ``cokit.compress``: this
extension loads those folders, statically (nothing is imported, no GPU needed), as
subpackages of ``cokit``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import griffe

ROOT = Path(__file__).resolve().parent.parent
# subpackage of cokit -> folder at the repository's top level (as in pyproject.toml)
FOLDERS = {"triton_kernels": "triton_kernels", "compress": "compress", "overlap": "overlap"}


class CokitLayout(griffe.Extension):
    """Attach the top-level folders to the ``cokit`` package griffe loaded."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name != "cokit":
            return
        for name, folder in FOLDERS.items():
            if name in pkg.members and pkg.members[name].is_module:
                continue
            sub = loader._load_module(name, ROOT / folder / "__init__.py", parent=pkg)
            pkg.set_member(name, sub)
            loader.expand_exports(sub)
            loader.expand_wildcards(sub, external=False)
