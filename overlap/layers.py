"""Layers on cokit's Triton kernels: :class:`Linear`, a drop-in for ``torch.nn.Linear`` whose
forward runs the Triton GEMM (and plain ``F.linear`` where the GEMM would run torch code
anyway: CPU tensors without ``TRITON_INTERPRET``). :func:`cokit.overlap.training.apply_overlap`
puts a model's linear layers on it and tunes their GEMM configs while the model trains; the
tensor-parallel layers are in :mod:`cokit.overlap.tensor_parallel`."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from cokit.triton_kernels.backend import INTERPRET_OFF, read_interpret_setting
from cokit.triton_kernels.gemm_config import GemmConfig
from cokit.triton_kernels.linear import KERNEL_DTYPES, check_options, explain_refusal, linear

__all__ = ["Linear"]


class Linear(nn.Module):
    """``torch.nn.Linear`` whose forward runs the Triton GEMM (op ``cokit::linear``).

    Same constructor, parameters (``weight`` ``(out_features, in_features)``, ``bias``
    ``(out_features,)`` or None), initialization and state dict as ``nn.Linear``, so the two
    load each other's checkpoints and, from the same seed, start from equal weights. The
    keywords after ``*`` are :func:`cokit.triton_kernels.linear.linear`'s: ``config`` fixes
    every GEMM knob (None: the tuned config), ``precision`` ('ieee' or 'tf32') applies to
    fp32, ``persistent`` picks the persistent GEMM form when no config is given.

    On CPU tensors without ``TRITON_INTERPRET`` the GEMM would run torch code whatever the
    config, so the forward is ``F.linear`` itself (torch's autograd too): the same cost as
    ``nn.Linear``. The options are checked when they are set (a bad config still raises, at
    the first forward), not on every call.
    """

    __constants__: ClassVar[list[str]] = ["in_features", "out_features"]
    in_features: int
    out_features: int
    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        config: GemmConfig | None = None,
        precision: str = "ieee",
        persistent: bool = False,
    ) -> None:
        super().__init__()
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.in_features = in_features
        self.out_features = out_features
        self._config, self._precision, self._persistent = config, precision, persistent
        self._options_ok = False  # valid for the torch path (set by _recheck)
        self._recheck()
        self.weight = nn.Parameter(torch.empty((out_features, in_features), **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s init: weight kaiming-uniform with ``a=sqrt(5)`` (uniform in
        ``+-1/sqrt(in_features)``), bias uniform in ``+-1/sqrt(in_features)``; same draws in
        the same order, so a seeded run equals ``nn.Linear``'s."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in = self.weight.shape[1]
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
            nn.init.uniform_(self.bias, -bound, bound)

    # The GEMM options: setting one re-checks them once, so that the forward's fast path
    # needs one flag instead of the checks.
    @property
    def config(self) -> GemmConfig | None:
        """The GEMM config of every product (forward, both backward ones); None: the tuned one."""
        return self._config

    @config.setter
    def config(self, value: GemmConfig | None) -> None:
        self._config = value
        self._recheck()

    @property
    def precision(self) -> str:
        """fp32 dot precision, 'ieee' or 'tf32'."""
        return self._precision

    @precision.setter
    def precision(self, value: str) -> None:
        self._precision = value
        self._recheck()

    @property
    def persistent(self) -> bool:
        """The persistent GEMM form when no config is given."""
        return self._persistent

    @persistent.setter
    def persistent(self, value: bool) -> None:
        self._persistent = value
        self._recheck()

    def _recheck(self) -> None:
        """Whether the options are valid on the torch path; invalid ones leave the fast path
        off, so :func:`linear` raises their error at the next forward."""
        try:
            check_options(self._config, self._precision, self._persistent)
        except (TypeError, ValueError):
            self._options_ok = False
        else:
            self._options_ok = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``input @ weight.T (+ bias)`` for ``input`` of shape ``(*, in_features)``."""
        # Per call, this test costs about 0.2 us (the order puts the cheapest first); the
        # interpreter setting is read each time, as kernel_path reads it (tests switch it).
        weight = self.weight
        if (
            self._options_ok
            and isinstance(input, torch.Tensor)
            and input.is_cpu
            and weight.is_cpu
            and ((dtype := input.dtype) is torch.float32 or dtype in KERNEL_DTYPES)
            and read_interpret_setting() in INTERPRET_OFF
        ):  # the GEMM would run torch code: F.linear, as nn.Linear's forward
            try:
                return F.linear(input, weight, self.bias)
            except RuntimeError:  # bad operands: linear's error, else torch's
                explain_refusal(input, weight, self.bias)
                raise
        return linear(
            input,
            self.weight,
            self.bias,
            config=self.config,
            precision=self.precision,
            persistent=self.persistent,
        )

    def extra_repr(self) -> str:
        """``nn.Linear``'s fields, then the GEMM options that differ from the defaults."""
        parts = [f"in_features={self.in_features}", f"out_features={self.out_features}"]
        parts.append(f"bias={self.bias is not None}")
        if self.config is not None:
            parts.append(f"config={self.config.spec()!r}")
        if self.precision != "ieee":
            parts.append(f"precision={self.precision!r}")
        if self.persistent:
            parts.append("persistent=True")
        return ", ".join(parts)

    @classmethod
    def from_linear(
        cls,
        module: nn.Linear,
        *,
        config: GemmConfig | None = None,
        precision: str = "ieee",
        persistent: bool = False,
    ) -> Linear:
        """A :class:`Linear` that shares ``module``'s parameters (no copy: training either
        trains both); the keywords are the GEMM options of the constructor."""
        if not isinstance(module, nn.Linear):
            raise TypeError(f"module must be a torch.nn.Linear, got {type(module).__name__}")
        new = cls(
            module.in_features,
            module.out_features,
            bias=module.bias is not None,
            device="meta",  # placeholders, replaced by module's parameters below
            config=config,
            precision=precision,
            persistent=persistent,
        )
        new.weight = module.weight
        new.bias = module.bias
        return new
