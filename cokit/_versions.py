"""The torch and triton versions cokit supports, checked once at ``import cokit``.

The floor is the oldest image we run on: torch 2.11 with triton 3.6 (the GPU machine's);
CI also runs triton 3.9 with torch 2.13. Versions are read from the installed
distributions' metadata, so the check costs no torch or triton import.
"""

from __future__ import annotations

import re
from importlib import metadata

MIN_VERSIONS = {"torch": (2, 11), "triton": (3, 6)}
# distributions that provide the ``triton`` module (PyPI, ROCm wheels, PyTorch nightlies)
_DISTRIBUTIONS = {
    "torch": ("torch",),
    "triton": ("triton", "pytorch-triton-rocm", "pytorch-triton", "triton-rocm"),
}


def parse_version(text: str) -> tuple[int, ...]:
    """``'2.11.0+cu130'`` -> ``(2, 11, 0)``; pre-release tails are ignored."""
    match = re.match(r"\d+(\.\d+)*", text.strip())
    if match is None:
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(part) for part in match.group(0).split("."))


def installed_version(module: str) -> str | None:
    """Version of the distribution that provides ``module``, or None when none is found."""
    for name in _DISTRIBUTIONS[module]:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def version_problem(found: dict[str, str | None]) -> str | None:
    """One sentence naming what is too old, or None when every found version is supported."""
    old = {
        name: version
        for name, version in found.items()
        if version is not None and parse_version(version)[:2] < MIN_VERSIONS[name]
    }
    if not old:
        return None
    have = ", ".join(f"{name} {version}" for name, version in found.items() if version is not None)
    need = ", ".join(f"{name} >= {'.'.join(map(str, v))}" for name, v in MIN_VERSIONS.items())
    return f"cokit needs {need}; found {have}: upgrade {' and '.join(old)}"


def check_versions() -> None:
    """Raise ImportError with one line when the installed torch or triton is too old."""
    problem = version_problem({name: installed_version(name) for name in MIN_VERSIONS})
    if problem is not None:
        raise ImportError(problem)
