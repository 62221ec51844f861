"""Parameter shapes of a model, by name or from an importable factory, built on the meta device.

``cokit plan`` and the exchange-scaling benchmark count bytes from shapes alone: no memory is
allocated and no weights are initialized.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable
from typing import Any

import torch

from cokit.plan_limits import check_input

# name -> (CharTransformer sizes, vocabulary size, note)
MODELS: dict[str, tuple[dict[str, Any], int, str]] = {
    "gpt-50m": (
        {"d_model": 512, "n_layers": 10, "n_heads": 8, "max_seq_len": 1024},
        16384,
        "GPT-like: d_model 512, 10 blocks, vocab 16384, context 1024, untied head",
    ),
    "gpt2-124m": (
        {"d_model": 768, "n_layers": 12, "n_heads": 12, "max_seq_len": 1024, "tied_head": True},
        50257,
        "GPT-2 small shapes: d_model 768, 12 blocks, vocab 50257, context 1024, tied head",
    ),
}


@dataclasses.dataclass(frozen=True)
class Model:
    """A model given by its parameter shapes, in parameter order."""

    name: str
    description: str
    shapes: tuple[tuple[int, ...], ...]

    @property
    def params(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


def model_names() -> tuple[str, ...]:
    """Names ``--model`` accepts: the GPT-like shapes and the demo's presets."""
    from cokit.workloads.model import MODEL_PRESETS

    return (*MODELS, *MODEL_PRESETS)


def named_model(name: str) -> Model:
    """The parameter shapes of a named model (built on the meta device: no memory, no init)."""
    from cokit.workloads.model import MODEL_PRESETS, CharTransformer, ModelConfig

    if name in MODELS:
        sizes, vocab, note = MODELS[name]
        cfg = ModelConfig(vocab_size=vocab, **sizes)
    elif name in MODEL_PRESETS:
        from cokit.workloads.text import VOCAB_SIZE

        cfg = ModelConfig.preset(name, VOCAB_SIZE)
        note = f"the demo's {name!r} CharTransformer (d_model {cfg.d_model}, {cfg.n_layers} blocks)"
    else:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(model_names())} (or give --shapes)")
    with torch.device("meta"):
        module = CharTransformer(cfg)
    return Model(name, note, tuple(tuple(p.shape) for p in module.parameters()))


def parse_shape(text: str) -> tuple[int, ...]:
    """``"512x2048"`` -> ``(512, 2048)``; ``"scalar"`` -> ``()``; positive sizes only."""
    if text == "scalar":
        return ()
    parts = text.lower().split("x")
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(
            f"shape {text!r} is not sizes joined by 'x' (e.g. 512x2048, 768, or 'scalar' for a 0-D tensor)"
        )
    return tuple(int(p) for p in parts)


def import_callable(spec: str, what: str) -> Callable[..., Any]:
    """The callable ``module:name`` names (``what`` starts each error: ``"model"``, ``"--on"``)."""
    module_name, sep, attr = str(spec).partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {spec!r}: give an importable factory as 'module:function'")
    try:
        found = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{what} {spec!r}: cannot import {attr!r} from {module_name!r}: {exc}") from None
    if not callable(found):
        raise ValueError(f"{what} {spec!r}: {attr!r} is not callable")
    return found


def factory_model(spec: str) -> Model:
    """The parameter shapes of ``module:factory``'s model, built on the meta device.

    ``factory()`` may return an ``nn.Module``, or a tuple/list whose first ``nn.Module`` is the
    model (the ``(model, batches, loss)`` form of a workload factory).
    """
    factory = import_callable(spec, "model")
    with torch.device("meta"):
        made = factory()
    items = made if isinstance(made, (tuple, list)) else (made,)
    module = next((m for m in items if isinstance(m, torch.nn.Module)), None)
    if module is None:
        raise ValueError(
            f"model {spec!r}: the factory returned no torch.nn.Module (got {type(made).__name__})"
        )
    shapes = tuple(tuple(p.shape) for p in module.parameters() if p.requires_grad)
    return Model(spec, f"{type(module).__name__} from {spec}", shapes)


#: the matrix side a bare parameter count is laid out in (a 4096-wide transformer's blocks)
COUNT_WIDTH = 4096


def counted_model(params: int) -> Model:
    """A bare parameter count, laid out as ``COUNT_WIDTH``-square matrices and a remainder.
    The count must be in :data:`cokit.plan_limits.LIMITS`' range (1 to 10**13; a
    :class:`cokit.plan_limits.PlanInputError` otherwise)."""
    check_input("counted_model", "params", params)
    square = COUNT_WIDTH * COUNT_WIDTH
    full, rest = divmod(params, square)
    shapes: list[tuple[int, ...]] = [(COUNT_WIDTH, COUNT_WIDTH)] * full
    rows, tail = divmod(rest, COUNT_WIDTH)
    if rows:
        shapes.append((rows, COUNT_WIDTH))
    if tail:
        shapes.append((tail,))
    note = f"{params:,} parameters as {COUNT_WIDTH}x{COUNT_WIDTH} matrices (a count alone: shapes assumed)"
    return Model(f"{params:,} params", note, tuple(shapes))


def parse_count(text: str) -> int:
    """``"124M"``, ``"7B"``, ``"1.8T"``, ``"350k"`` or ``"1200000"`` -> a parameter count."""
    scale = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
    t = text.strip().lower().replace("_", "").replace(",", "")
    mult = scale.get(t[-1:], 1)
    body = t[:-1] if t[-1:] in scale else t
    try:
        value = float(body) * mult
    except ValueError:
        raise ValueError(f"parameter count {text!r} is not a number like 124M, 7B or 350000") from None
    if not math.isfinite(value):
        raise ValueError(f"parameter count {text!r} is not a finite number; give one like 124M, 7B or 350000")
    if value < 1:
        raise ValueError(f"parameter count {text!r} must be at least 1")
    return int(round(value))
