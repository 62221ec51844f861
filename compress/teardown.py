"""Process groups that outlive ``destroy_process_group``: released before the interpreter exits.

``torch.distributed.nn.functional`` gives its collectives ``group=group.WORLD`` defaults, and
those are evaluated when it is imported. The first torch optimizer a script builds imports it
(``Optimizer.add_param_group`` imports ``torch._dynamo``, which imports it), usually after
``init_process_group``: from then on ten function defaults hold the default group, so
``destroy_process_group()`` cannot free it. Its gloo worker threads then live on into
interpreter finalization, and one that needs the GIL there (to free a tensor Python made, or to
run a future's Python callback, after the collective's waiter has moved on) makes the thread
exit mid-unwind: the process ends in ``std::terminate`` ("terminate called without an active
exception", SIGABRT) after a run that finished correctly.

:func:`release_captured_groups` (run by ``atexit``, registered in :mod:`cokit.compress.comm`)
puts ``None`` in place of every process group held as a default by a loaded
``torch.distributed`` module; ``None`` means the default group there too. A destroyed group is
then freed while the interpreter still runs, and freeing it joins its threads (torch drops the
GIL for that). A group that was never destroyed stays alive, as before.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

__all__ = ["release_captured_groups"]

_PREFIX = "torch.distributed"


def release_captured_groups() -> int:
    """Replace each process group held as a function default (positional or keyword-only) in
    the loaded ``torch.distributed`` modules, their classes' methods included, with ``None``;
    return how many were replaced."""
    if not dist.is_available():
        return 0
    replaced = 0
    for name, module in list(sys.modules.items()):
        if module is None or not (name == _PREFIX or name.startswith(_PREFIX + ".")):
            continue
        for fn in _functions(module, name):
            replaced += _release(fn)
    return replaced


def _functions(module: Any, name: str) -> Iterator[Any]:
    """The functions ``module`` defines, and those of the classes it defines."""
    for obj in list(vars(module).values()):
        kind = type(obj)  # not isinstance: it would ask deprecated objects, which warn
        if kind is types.FunctionType and obj.__module__ == name:
            yield obj
        elif issubclass(kind, type) and obj.__module__ == name:
            for attr in list(vars(obj).values()):
                fn = attr.__func__ if type(attr) in (staticmethod, classmethod) else attr
                if type(fn) is types.FunctionType:
                    yield fn


def _release(fn: Any) -> int:
    """Put ``None`` in place of the process groups among ``fn``'s defaults; how many."""
    group_type = dist.ProcessGroup
    replaced = 0
    defaults = fn.__defaults__
    if defaults and any(isinstance(d, group_type) for d in defaults):
        replaced += sum(isinstance(d, group_type) for d in defaults)
        fn.__defaults__ = tuple(None if isinstance(d, group_type) else d for d in defaults)
    kwdefaults = fn.__kwdefaults__
    if kwdefaults and any(isinstance(d, group_type) for d in kwdefaults.values()):
        replaced += sum(isinstance(d, group_type) for d in kwdefaults.values())
        fn.__kwdefaults__ = {k: None if isinstance(d, group_type) else d for k, d in kwdefaults.items()}
    return replaced
