"""Everything that differs between the Triton versions cokit supports (3.6 to 3.9).

The rest of the package calls these helpers and never checks a Triton version itself. What
differs, and what each helper does about it:

* **Interpreter scalars** (:func:`fix_interpreter_scalar_index`): triton 3.6's interpreter
  converts a runtime scalar to a Python int with ``int(array_of_one_element)``, which NumPy 2
  rejects ("only 0-dimensional arrays can be converted to Python scalars"), so
  ``range(n)`` over a scalar kernel argument fails there; 3.9 squeezes the array first. The
  fix installs 3.9's conversion when the installed interpreter lacks it (probed, not
  version-matched). Applied when the package is imported.
* **Compile options** (:func:`compile_option_names`): each backend's option set changes
  between versions (e.g. CUDA's ``min_shared_mem`` exists from 3.9 on); Triton drops names
  it does not know without a word, so callers check them here first.
* **Compiled-kernel handles** (:func:`unloaded_copy`): 3.9 records which process loaded a
  kernel's module (``_module_pid``, used to unload it on deletion); 3.6 has no such field.

Importing this module never fails: without Triton the helpers say so when called.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import operator
from types import SimpleNamespace
from typing import Any, cast

__all__ = [
    "TRITON_VERSION_STRING",
    "compile_option_names",
    "fix_interpreter_scalar_index",
    "ptxas_path",
    "repack_metadata",
    "unloaded_copy",
]


try:
    import triton as _triton

    #: the installed Triton's version string ('3.6.0'), for messages; '' without Triton.
    TRITON_VERSION_STRING: str = _triton.__version__
except Exception:  # pragma: no cover - depends on the installation
    TRITON_VERSION_STRING = ""


# ---------------------------------------------------------------------- interpreter
def _scalar_index(self: Any) -> int:
    """3.9's ``tl.tensor.__index__`` under the interpreter: a scalar is a one-element array."""
    return int(self.handle.data.squeeze())


def _index_works(patch_lang_tensor: Any, scope_cls: Any) -> bool:
    """Whether the interpreter's own tensor patch turns a one-element array into an int."""
    import numpy as np

    class _Probe:
        pass

    scope = scope_cls()
    try:
        patch_lang_tensor(_Probe, scope)
        probe = _Probe()
        probe.handle = SimpleNamespace(data=np.array([3], dtype=np.int32))  # type: ignore[attr-defined]
        return operator.index(cast(Any, probe)) == 3
    except TypeError:
        return False
    finally:
        scope.restore()


@functools.cache
def fix_interpreter_scalar_index() -> bool:
    """Make ``range(scalar_argument)`` work in triton 3.6's interpreter under NumPy 2.

    Wraps the interpreter's per-launch patch of ``tl.tensor`` so that ``__index__`` squeezes
    the one-element array first, as triton 3.9 does. Does nothing (returns False) when the
    installed interpreter already converts scalars correctly or has another layout; returns
    True when the fix was installed. Idempotent.
    """
    try:
        from triton.runtime import interpreter
    except Exception:  # pragma: no cover - no Triton, or an interpreter without these names
        return False
    original = getattr(interpreter, "_patch_lang_tensor", None)
    scope_cls = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_cls is None or _index_works(original, scope_cls):
        return False

    def _patch_lang_tensor(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _scalar_index)

    interpreter._patch_lang_tensor = _patch_lang_tensor
    return True


# ---------------------------------------------------------------------- compiler
@functools.cache
def compile_option_names(backend: str, arch: int | str, warp_size: int) -> frozenset[str]:
    """The compile/launch options the installed Triton's ``backend`` ('cuda' or 'hip')
    accepts for ``arch`` (90, 'gfx942', ...): the fields of its options dataclass."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    options = make_backend(GPUTarget(backend, arch, warp_size)).parse_options({})
    return frozenset(f.name for f in dataclasses.fields(options))


def repack_metadata(compiled: Any) -> Any:
    """The launcher's packed metadata (num_warps, num_ctas, shared) of ``compiled.metadata``."""
    from triton.compiler.compiler import make_backend

    return make_backend(compiled.metadata.target).pack_metadata(compiled.metadata)


def unloaded_copy(compiled: Any) -> Any:
    """A shallow copy of a Triton ``CompiledKernel`` (same binary, same metadata object) with no
    module loaded: it loads its own on first launch and never unloads the original's."""
    out = copy.copy(compiled)
    out.module = None
    out.function = None
    out._run = None
    if hasattr(compiled, "_module_pid"):  # triton >= 3.9: the process that loaded the module
        out._module_pid = None
    return out


# ---------------------------------------------------------------------- ptxas
def ptxas_path(capability: int) -> str | None:
    """The ``ptxas`` Triton itself runs for an sm_``capability`` build (3.9 takes
    ``ptxas-blackwell`` from sm_90 on, 3.6 from sm_100 on), or None without the NVIDIA backend."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except Exception:  # pragma: no cover - depends on the installation
        return None
    return str(get_ptxas(capability).path)
