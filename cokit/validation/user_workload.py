"""Your own model and data in the validation study: ``cokit bench validate --on module:factory``.

``factory()`` (no arguments; imported in every rank's process) returns a dict:

    def make_workload():
        data = ...                                    # load once per process
        return {
            "model": lambda: MyNet(),                 # built after torch.manual_seed(seed): same on every rank
            "batch": lambda gen: sample(data, gen),   # one training batch, from this rank's torch.Generator
            "heldout": [batch1, batch2, ...],         # fixed held-out batches (the loss is averaged over them)
            "loss": lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]),
        }

Batches are whatever ``loss`` takes (tensors, tuples or dicts of tensors); they are moved to
the run's device. Each rank draws its batches from its own generator, seeded by the run's seed,
the step and the rank, so every method sees the same data.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import pathlib
from typing import Any

import torch
from torch import nn

from cokit.model_shapes import import_callable

__all__ = ["REQUIRED", "UserWorkload", "UserWorkloadFactory", "load_factory"]

REQUIRED = ("model", "batch", "heldout", "loss")


def load_factory(spec: str) -> dict[str, Any]:
    """Import ``module:factory``, call it and check what it returned (ValueError says what to fix)."""
    factory = import_callable(spec, "--on")
    attr = spec.partition(":")[2]
    try:
        made = factory()
    except Exception as exc:
        raise ValueError(f"--on {spec!r}: {attr}() raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(made, dict):
        raise ValueError(
            f"--on {spec!r}: the factory must return a dict with {REQUIRED}, got {type(made).__name__}"
        )
    missing = [k for k in REQUIRED if k not in made]
    if missing:
        raise ValueError(f"--on {spec!r}: the factory's dict lacks {missing}; it needs {REQUIRED}")
    for key in ("model", "batch", "loss"):
        if not callable(made[key]):
            raise ValueError(f"--on {spec!r}: {key!r} must be callable, got {type(made[key]).__name__}")
    heldout = made["heldout"]
    if isinstance(heldout, (str, bytes)) or not hasattr(heldout, "__len__") or len(heldout) == 0:
        raise ValueError(f"--on {spec!r}: 'heldout' must be a non-empty list of batches")
    return made


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    return batch


@dataclasses.dataclass
class UserWorkload:
    """A :class:`cokit.train.Workload` over the factory's callables."""

    spec: str
    parts: dict[str, Any]
    device: torch.device

    def build_model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        model = self.parts["model"]()
        if not isinstance(model, nn.Module):
            raise ValueError(f"--on {self.spec!r}: 'model' returned {type(model).__name__}, not an nn.Module")
        return model.to(self.device)

    def train_batch(self, seed: int, step: int, rank: int, world_size: int) -> Any:
        gen = torch.Generator().manual_seed(((seed * 1_000_003 + step) * 1_009 + rank) % 2**63)
        return _to(self.parts["batch"](gen), self.device)

    def heldout_batches(self) -> list[Any]:
        return [_to(b, self.device) for b in self.parts["heldout"]]

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        value = self.parts["loss"](model, batch)
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            raise ValueError(f"--on {self.spec!r}: 'loss' must return a 0-d tensor, got {value!r:.80}")
        return value

    def info(self) -> dict:
        return {
            "task": f"your workload ({self.spec})",
            "factory": self.spec,
            "heldout_batches": len(self.parts["heldout"]),
            "uniform_loss": None,
            "baseline_label": "no uniform-guess baseline",
        }


@dataclasses.dataclass(frozen=True)
class UserWorkloadFactory:
    """Picklable: each rank imports the factory and builds its :class:`UserWorkload`.
    ``source_sha`` (of the factory's module file) is part of the study's run keys, so runs of
    an edited factory are not taken for finished ones."""

    spec: str
    source_sha: str = ""

    @classmethod
    def checked(cls, spec: str) -> UserWorkloadFactory:
        """Load the factory once here (errors before any rank starts) and hash its source."""
        load_factory(spec)
        module = importlib.import_module(spec.partition(":")[0])
        path = getattr(module, "__file__", None)
        sha = hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()[:16] if path else ""
        return cls(spec, sha)

    def build(self, device: torch.device | str) -> UserWorkload:
        return UserWorkload(self.spec, load_factory(self.spec), torch.device(device))
