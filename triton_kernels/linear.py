"""``y = x @ W^T (+ b)`` on the project's GEMM: a drop-in for ``torch.nn.functional.linear``.

Liger-Kernel layout: the functional front end (:func:`linear`: ``F.linear``'s shapes, dtype
and autocast rules, argument checks before any work) and the ``cokit::linear`` op (2-D,
autograd through the same kernel). The op is a ``torch.library.triton_op`` running
:func:`cokit.triton_kernels.gemm.gemm_in_graph` with ``b = weight.t()`` (a transposed view:
the kernel takes any strides, nothing is copied): on a GPU ``torch.compile`` sees the Triton
kernel itself. A fixed :class:`GemmConfig` travels through the op as its ``spec()`` string,
since op schemas take no Python objects.

Where the op would run the pure-torch path anyway (CPU tensors without ``TRITON_INTERPRET``,
or GPU tensors without Triton: :func:`~cokit.triton_kernels.backend.kernel_path` is
``'torch'``), :func:`linear` calls ``torch.nn.functional.linear`` itself: the op's dispatch,
its custom autograd and the reference's fp32 copies would cost up to 7x ``F.linear`` there
and buy nothing. The arguments are checked the same way (the same errors), and a config is
still validated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import interpreter_enabled, triton_available
from .gemm import PRECISIONS, gemm_in_graph
from .gemm_config import DTYPES, GemmConfig

__all__ = [
    "KERNEL_DTYPES",
    "check_options",
    "explain_refusal",
    "linear",
    "linear_reference",
    "takes_torch_path",
    "torch_linear",
]

#: the dtypes the GEMM takes (fp16, bf16, fp32)
KERNEL_DTYPES = frozenset(DTYPES.values())


def linear_reference(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Pure-torch linear with the kernel's semantics: fp32 accumulation, output in input's dtype."""
    out = input.float() @ weight.float().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(input.dtype)


# ---------------------------------------------------------------------- op
@torch.library.triton_op("cokit::linear", mutates_args=())
def _linear_op(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: str,
    precision: str,
    persistent: bool,
) -> torch.Tensor:
    """``cokit::linear``: ``input @ weight.t() (+ bias)`` for 2-D operands.

    * ``input`` -- ``(M, K)``; ``weight`` -- ``(N, K)``; ``bias`` -- ``(N,)`` or None; one
      dtype (fp16/bf16/fp32) and device for all three; any strides.
    * ``config`` -- a :meth:`GemmConfig.spec` string fixing every launch knob, or ``''`` for
      the tuned config (:func:`cokit.triton_kernels.gemm.select_config`).
    * ``precision`` -- fp32 dot precision, 'ieee' or 'tf32' (ignored for 16-bit inputs).
    * ``persistent`` -- the persistent GEMM form when no config is given (a config's own
      ``persistent`` field decides otherwise).

    Returns a new ``(M, N)`` tensor in input's dtype.
    """
    return gemm_in_graph(input, weight.t(), bias, config, precision, persistent)


def _linear_setup(ctx, inputs, output) -> None:
    input, weight, bias, config, precision, persistent = inputs
    ctx.save_for_backward(input, weight)
    ctx.has_bias = bias is not None
    ctx.config = config
    ctx.precision = precision
    ctx.persistent = persistent


def _linear_backward(ctx, grad):
    """dX = dY W and dW = dY^T X, both through ``cokit::linear`` (same config); db = sum dY."""
    input, weight = ctx.saved_tensors
    grad_input = grad_weight = grad_bias = None
    opts = (ctx.config, ctx.precision, ctx.persistent)
    if ctx.needs_input_grad[0]:
        grad_input = _linear_op(grad, weight.t(), None, *opts)  # (M, N) @ (N, K)
    if ctx.needs_input_grad[1]:
        grad_weight = _linear_op(grad.t(), input.t(), None, *opts)  # (N, M) @ (M, K)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_bias = grad.float().sum(0).to(grad.dtype)
    return grad_input, grad_weight, grad_bias, None, None, None


_linear_op.register_autograd(_linear_backward, setup_context=_linear_setup)


# ---------------------------------------------------------------------- front end
def _autocast(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Cast as autocast casts ``F.linear`` (a lower-precision op on CUDA and CPU): floating
    tensors other than float64 go to the autocast dtype of input's device type."""
    device_type = input.device.type
    if device_type not in ("cuda", "cpu") or not torch.is_autocast_enabled(device_type):
        return input, weight, bias
    dtype = torch.get_autocast_dtype(device_type)

    def cast(t: torch.Tensor) -> torch.Tensor:
        eligible = isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
        return t.to(dtype) if eligible else t  # non-tensors are left for _check_inputs

    return cast(input), cast(weight), cast(bias) if bias is not None else None


def _check_inputs(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemmConfig | None,
    precision: str,
    persistent: bool,
) -> None:
    for name, t in (("input", input), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
    _check_config_type(config)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (out_features, in_features); got shape {tuple(weight.shape)}")
    if input.dim() < 1:
        raise ValueError("input must have at least 1 dimension (*, in_features); got a 0-D tensor")
    out_features, in_features = weight.shape
    if input.shape[-1] != in_features:
        raise ValueError(
            f"input is {tuple(input.shape)} and weight is {tuple(weight.shape)}: "
            f"input.shape[-1] must equal in_features={in_features}"
        )
    if bias is not None and bias.shape != (out_features,):
        raise ValueError(f"bias must have shape ({out_features},) (got {tuple(bias.shape)})")
    tensors = [("weight", weight)] + ([("bias", bias)] if bias is not None else [])
    for name, t in tensors:
        if t.dtype != input.dtype:
            raise ValueError(f"input and {name} must have the same dtype (got {input.dtype} and {t.dtype})")
    for name, t in tensors:
        if t.device != input.device:
            raise ValueError(
                f"input and {name} must be on the same device (got {input.device} and {t.device})"
            )
    if input.dtype not in DTYPES.values():
        raise ValueError(f"dtype {input.dtype} is not supported; allowed: {', '.join(DTYPES)}")
    _check_precision_and_form(config, precision, persistent)


def _check_config_type(config: GemmConfig | None) -> None:
    if config is not None and not isinstance(config, GemmConfig):
        raise TypeError(f"config must be a GemmConfig or None, got {type(config).__name__}")


def _check_precision_and_form(config: GemmConfig | None, precision: str, persistent: bool) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is invalid; allowed: {', '.join(PRECISIONS)}")
    if config is not None and persistent and not config.persistent:
        raise ValueError("persistent=True contradicts config.persistent=False; pass one of them")


def check_options(config: GemmConfig | None, precision: str, persistent: bool) -> None:
    """Raise what :func:`linear` raises for bad GEMM options on the torch path: a config that
    is not a :class:`GemmConfig` (``TypeError``) or is invalid (``ValueError`` naming the
    field, as the launcher's check on CPU tensors), a precision other than 'ieee'/'tf32', or
    ``persistent=True`` against a config's ``persistent=False``."""
    _check_config_type(config)
    _check_precision_and_form(config, precision, persistent)
    if config is not None:
        config.validate("interpreter")


def takes_torch_path(input: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when ``cokit::linear`` on these tensors would run the pure-torch path: both on the
    CPU without the interpreter, or both on one GPU without Triton. About 0.1 us: cheap
    enough to decide per call."""
    if input.is_cpu:
        return weight.is_cpu and not interpreter_enabled()
    return not triton_available() and input.is_cuda and weight.device == input.device


def explain_refusal(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemmConfig | None = None,
    precision: str = "ieee",
    persistent: bool = False,
) -> None:
    """After ``F.linear`` refused the operands (a ``RuntimeError``), check them as
    :func:`linear` checks them: a bad shape, dtype or device raises the same ``ValueError``
    as on the kernel path; returns when the check finds nothing (re-raise torch's error)."""
    _check_inputs(*_autocast(input, weight, bias), config, precision, persistent)


def torch_linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemmConfig | None = None,
    precision: str = "ieee",
    persistent: bool = False,
) -> torch.Tensor:
    """``F.linear`` with :func:`linear`'s errors (:func:`explain_refusal`)."""
    try:
        return F.linear(input, weight, bias)
    except RuntimeError:
        explain_refusal(input, weight, bias, config, precision, persistent)
        raise


def linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: GemmConfig | None = None,
    precision: str = "ieee",
    persistent: bool = False,
) -> torch.Tensor:
    """``torch.nn.functional.linear`` on the Triton GEMM: ``input @ weight.T (+ bias)``.

    ``input`` is ``(*, in_features)`` (1-D gives ``(out_features,)``), ``weight``
    ``(out_features, in_features)``, ``bias`` ``(out_features,)`` or None; all of one dtype
    (fp16, bf16 or fp32) and device, the output in that dtype. Under ``torch.autocast``
    (CUDA, CPU) the tensors are first cast to the autocast dtype, as for ``F.linear``.
    Differentiable and ``torch.compile(fullgraph=True)``-able (op ``cokit::linear``).

    ``config`` fixes every GEMM knob, for the forward and both backward products (its
    ``persistent`` field picks the form); without it the tuned config is used and
    ``persistent`` picks the form. ``precision`` ('ieee' or 'tf32') applies to fp32 inputs.
    Bad shapes, dtypes or devices raise ``ValueError`` (non-tensors ``TypeError``) before any
    work.

    Where the op would run the torch reference (CPU tensors without ``TRITON_INTERPRET``; GPU
    tensors without Triton), this is ``F.linear`` (torch's product and autograd, fp32
    accumulation as the kernel's) after the same checks: no per-call overhead over torch.
    """
    if (
        isinstance(input, torch.Tensor)
        and isinstance(weight, torch.Tensor)
        and input.dtype in KERNEL_DTYPES
        and weight.dim() == 2
        and (bias is None or (isinstance(bias, torch.Tensor) and bias.shape == weight.shape[:1]))
        and takes_torch_path(input, weight)
    ):
        # the op would run the torch reference: F.linear is the same product at its cost
        if config is not None or precision != "ieee" or persistent:
            check_options(config, precision, persistent)
        return torch_linear(input, weight, bias, config, precision, persistent)
    if isinstance(input, torch.Tensor):
        input, weight, bias = _autocast(input, weight, bias)
    _check_inputs(input, weight, bias, config, precision, persistent)
    spec = config.spec() if config is not None else ""
    form = config.persistent if config is not None else bool(persistent)
    rows = 1
    for d in input.shape[:-1]:  # not reshape(-1, K): K may be 0
        rows *= d
    out = _linear_op(input.reshape(rows, weight.shape[1]), weight, bias, spec, precision, form)
    return out.reshape(*input.shape[:-1], weight.shape[0])
