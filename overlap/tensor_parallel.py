"""Megatron-style tensor-parallel linear layers whose collectives overlap their GEMMs.

A pair of layers splits one MLP (or attention block) across the ranks of a process group so
that only one reduction per pass crosses the network (Shoeybi et al., Megatron-LM, 2019):

* :class:`ColumnParallelLinear` -- each rank holds ``out_features / world`` rows of the weight
  (output features). The input is replicated; the output is this rank's feature slice. Its
  backward sums ``grad_out @ W_shard`` over the ranks (an all-reduce), through
  :class:`~cokit.overlap.schedules.GemmCollective`: chunk i's all-reduce runs while chunk i+1's
  GEMM computes.
* :class:`RowParallelLinear` -- each rank holds ``in_features / world`` columns of the weight
  (input features) and takes the column layer's feature slice. Its forward sums the partial
  products over the ranks (all-reduce, through ``GemmCollective``), then adds the bias once.

With ``sequence_parallel=True`` (Korthikanti et al., 2022) the activations outside the pair are
sharded along dim 0 (the sequence of Megatron's ``[sequence, batch, hidden]`` layout): the
column layer all-gathers its input rows through :class:`~cokit.overlap.schedules.AllGatherGemm`
(chunk i's GEMM starts as soon as its gather lands) and reduce-scatters its input gradient; the
row layer reduce-scatters its output and all-gathers the incoming gradient (again
``AllGatherGemm``). The bytes on the wire are those of the all-reduce, split in two halves.

Weights initialize exactly as ``nn.Linear``'s would from the same seed, sliced (every rank
draws the full weight and keeps its part, so the ranks must share the seed); ``from_linear``
shards an existing ``nn.Linear`` and :meth:`dense_weight` gathers the full weight back.
Without ``torch.distributed`` initialized (and no group given) a layer is world 1: the same
GEMMs, no communication. GEMMs run on cokit's kernel (:func:`cokit.triton_kernels.gemm.gemm`,
``config``/``precision`` as there): Triton on a GPU, the interpreter or the torch reference on
the CPU. Gradients are those of the dense layer: ranks feeding a layer the same (replicated)
tensors get the same replicated gradients (row-layer bias included, also under sequence
parallelism: it is the sum over the gathered gradient rows).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from cokit.triton_kernels._checks import check_int
from cokit.triton_kernels.gemm import PRECISIONS, gemm
from cokit.triton_kernels.gemm_config import GemmConfig, dtype_name

from .measure import NULL_PROBE, Probe
from .schedules import AllGatherGemm, GemmCollective
from .streams import CommGroup, group_is_high_priority

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "TensorParallelComm"]

# torch 2.13 name (all_gather_into_tensor is deprecated there); older torch.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest d <= limit that divides n (at least 1)."""
    for d in range(min(limit, n), 0, -1):
        if n % d == 0:
            return d
    return 1


class _GatherKeepingGemm(AllGatherGemm):
    """``AllGatherGemm(operand='a')`` that also keeps the gathered rows of A in
    :attr:`gathered` (the backward's weight-gradient GEMM needs them; gathering them again
    would cost a second all-gather)."""

    gathered: torch.Tensor

    def run_overlapped(self, probe: Probe = NULL_PROBE) -> torch.Tensor:
        """The overlapped gather + GEMM; :attr:`gathered` is filled chunk by chunk."""
        if self.chunks > 1:  # one chunk: the gather buffer itself is kept (no copy)
            self.gathered = torch.empty((self.M, self.K), dtype=self.shard.dtype, device=self.device)
        return super().run_overlapped(probe)

    def _gemm_chunk(self, gathered: torch.Tensor, s: int, e: int, out: torch.Tensor) -> None:
        super()._gemm_chunk(gathered, s, e, out)
        W = self.world_size
        if self.chunks == 1:
            self.gathered = gathered  # the whole gather buffer: rows already in rank order
            return
        m = self.M // W
        self.gathered.view(W, m, self.K)[:, s:e].copy_(gathered.view(W, e - s, self.K))


class TensorParallelComm:
    """The communication side shared by the tensor-parallel layers: the group, its size and
    this rank, and the GEMM(+collective) primitives the layers' forward and backward use.

    ``process_group`` is a process group, a :class:`~cokit.overlap.streams.CommGroup` or None
    (the default group; world 1 without communication when ``torch.distributed`` is not
    initialized). ``chunks`` is the most chunks a schedule splits its rows into (fewer when
    the rows do not allow it: a reduce-scatter needs equal chunks of every rank's rows).
    ``config``/``precision`` go to every GEMM. ``priority`` is the collectives' stream priority
    (None: 'high' on a high-priority NCCL group, else 'normal', so a normal group does not warn).
    """

    def __init__(
        self,
        process_group: Any = None,
        *,
        chunks: int = 2,
        config: GemmConfig | None = None,
        precision: str = "ieee",
        priority: str | int | None = None,
    ) -> None:
        check_int("chunks", chunks)
        if config is not None and not isinstance(config, GemmConfig):
            raise TypeError(f"config must be a GemmConfig or None, got {type(config).__name__}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r} is invalid; allowed: {', '.join(PRECISIONS)}")
        self.chunks, self.config, self.precision = chunks, config, precision
        initialized = dist.is_available() and dist.is_initialized()
        if not initialized and process_group is not None:
            raise RuntimeError(
                "process_group was given but torch.distributed is not initialized; "
                "call dist.init_process_group first (or pass process_group=None for world 1)"
            )
        self.group = process_group.group if isinstance(process_group, CommGroup) else process_group
        #: False: world 1 without torch.distributed -- every collective is the identity
        self.distributed = initialized
        self.world_size = dist.get_world_size(self.group) if initialized else 1
        self.rank = dist.get_rank(self.group) if initialized else 0
        if self.rank < 0:
            raise ValueError(
                "this rank is not a member of process_group; build the layer on the group's ranks only "
                "(or pass the group this rank belongs to)"
            )
        if priority is None:
            priority = "high" if initialized and group_is_high_priority(process_group) else "normal"
        self.priority = priority

    def _schedule_kwargs(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "precision": self.precision,
            "priority": self.priority,
            "group": self.group,
        }

    def gemm(self, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``a @ b (+ bias)``, local."""
        return gemm(a, b, bias, config=self.config, precision=self.precision)

    def gemm_all_reduce(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``sum over ranks of a @ b`` (M, N), chunked GEMM -> all-reduce, overlapped."""
        if not self.distributed:
            return self.gemm(a, b)
        chunks = min(self.chunks, a.shape[0])
        return (
            GemmCollective(a, b, collective="all_reduce", chunks=chunks, **self._schedule_kwargs())
            .run()
            .output
        )

    def gemm_reduce_scatter(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """This rank's ``M / world`` rows of ``sum over ranks of a @ b``, chunked GEMM ->
        reduce-scatter, overlapped (M must be a multiple of the world size)."""
        if not self.distributed:
            return self.gemm(a, b)
        chunks = _largest_divisor_at_most(a.shape[0] // self.world_size, self.chunks)
        return (
            GemmCollective(a, b, collective="reduce_scatter", chunks=chunks, **self._schedule_kwargs())
            .run()
            .output
        )

    def all_gather_gemm(self, shard: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(all_gather(shard) @ b, all_gather(shard))``: the rows of every rank's shard in
        rank order, chunked gather -> GEMM, overlapped."""
        if not self.distributed:
            return self.gemm(shard, b), shard
        chunks = min(self.chunks, shard.shape[0])
        s = _GatherKeepingGemm(shard, b, operand="a", chunks=chunks, **self._schedule_kwargs())
        out = s.run_overlapped()
        return out, s.gathered

    def all_gather(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every rank's ``t`` concatenated along ``dim`` in rank order (blocking)."""
        if not self.distributed or self.world_size == 1:
            return t
        t = t.contiguous()
        buf = torch.empty((self.world_size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        _all_gather_single(buf, t, group=self.group)
        if dim % t.dim() == 0:
            return buf
        return torch.cat(buf.chunk(self.world_size, 0), dim=dim)

    def local_slice(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """This rank's ``1 / world`` part of ``t`` along ``dim`` (contiguous copy)."""
        if self.world_size == 1:
            return t
        return t.chunk(self.world_size, dim)[self.rank].contiguous()


# ---------------------------------------------------------------------- autograd functions
class _ColumnFn(torch.autograd.Function):
    """``y = x @ W_shard^T + b_shard``; sequence parallel: ``x`` = all-gathered rows.
    Backward: ``grad_x`` = all-reduce (sequence parallel: reduce-scatter) of ``g @ W_shard``,
    ``grad_W`` = ``g^T @ x`` and ``grad_b`` = ``sum(g)``, both local."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        comm: TensorParallelComm,
        sequence_parallel: bool,
    ) -> torch.Tensor:
        if sequence_parallel:
            y, x_full = comm.all_gather_gemm(x, weight.t())
            if bias is not None:
                y.add_(bias)
        else:
            y, x_full = comm.gemm(x, weight.t(), bias), x
        ctx.save_for_backward(x_full, weight)
        ctx.comm, ctx.sequence_parallel, ctx.has_bias = comm, sequence_parallel, bias is not None
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_full, weight = ctx.saved_tensors
        comm: TensorParallelComm = ctx.comm
        g = g.contiguous()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            if ctx.sequence_parallel:
                grad_x = comm.gemm_reduce_scatter(g, weight)
            else:
                grad_x = comm.gemm_all_reduce(g, weight)
        if ctx.needs_input_grad[1]:
            grad_w = comm.gemm(g.t(), x_full)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0, dtype=torch.float32).to(g.dtype)
        return grad_x, grad_w, grad_b, None, None


class _RowFn(torch.autograd.Function):
    """``y = sum over ranks of x_shard @ W_shard^T`` (all-reduce; sequence parallel:
    reduce-scatter of the rows) ``+ b``. Backward: ``g_full`` = ``g`` (sequence parallel: its
    rows all-gathered), ``grad_x = g_full @ W_shard``, ``grad_W = g_full^T @ x``,
    ``grad_b = sum(g_full)`` (the full gradient on every rank)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        comm: TensorParallelComm,
        sequence_parallel: bool,
    ) -> torch.Tensor:
        if sequence_parallel:
            y = comm.gemm_reduce_scatter(x, weight.t())
        else:
            y = comm.gemm_all_reduce(x, weight.t())
        if bias is not None:
            y.add_(bias)  # once, after the reduction
        ctx.save_for_backward(x, weight)
        ctx.comm, ctx.sequence_parallel, ctx.has_bias = comm, sequence_parallel, bias is not None
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        comm: TensorParallelComm = ctx.comm
        g = g.contiguous()
        grad_x = grad_w = grad_b = None
        if ctx.sequence_parallel:
            if ctx.needs_input_grad[0]:
                grad_x, g_full = comm.all_gather_gemm(g, weight)
            else:
                g_full = comm.all_gather(g, 0)
        else:
            g_full = g
            if ctx.needs_input_grad[0]:
                grad_x = comm.gemm(g, weight)
        if ctx.needs_input_grad[1]:
            grad_w = comm.gemm(g_full.t(), x)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g_full.sum(0, dtype=torch.float32).to(g.dtype)
        return grad_x, grad_w, grad_b, None, None


class _GatherLastFn(torch.autograd.Function):
    """Forward: every rank's feature slice concatenated along the last dim. Backward: this
    rank's slice of the (replicated) gradient."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, comm: TensorParallelComm) -> torch.Tensor:
        ctx.comm = comm
        return comm.all_gather(y, -1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        return ctx.comm.local_slice(g, -1), None


class _ScatterLastFn(torch.autograd.Function):
    """Forward: this rank's slice of a replicated input's last dim. Backward: every rank's
    slice of the gradient gathered back (the full input gradient, on every rank)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: TensorParallelComm) -> torch.Tensor:
        ctx.comm = comm
        return comm.local_slice(x, -1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        return ctx.comm.all_gather(g.contiguous(), -1), None


# ---------------------------------------------------------------------- modules
def _check_divisible(cls: str, dim_name: str, size: int, world: int) -> None:
    if size % world:
        up = -(-size // world) * world
        raise ValueError(
            f"{cls}: {dim_name}={size} is not divisible by the world size {world} (the tensor-parallel "
            f"group's ranks each hold {dim_name}/{world}); choose {dim_name} a multiple of {world} "
            f"(e.g. {up}) or a process group whose size divides {size}"
        )


class _ParallelLinear(nn.Module):
    """Shared constructor checks, initialization, input checks and gathers."""

    __constants__: ClassVar[list[str]] = ["in_features", "out_features"]
    in_features: int
    out_features: int
    weight: torch.Tensor
    bias: torch.Tensor | None
    #: which weight dim is sharded (0: output features, 1: input features)
    partition_dim: ClassVar[int]

    def _init_common(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        process_group: Any,
        sequence_parallel: bool,
        chunks: int,
        config: GemmConfig | None,
        precision: str,
        priority: str | int | None,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
    ) -> None:
        """Check the sizes, set up the communication, and make this rank's parameters (weight
        sharded on :attr:`partition_dim`) with ``nn.Linear``'s initialization."""
        name = type(self).__name__
        check_int("in_features", in_features, where=name)
        check_int("out_features", out_features, where=name)
        if dtype is not None:
            dtype_name(dtype)  # fp16 / bf16 / fp32: what the GEMM kernel takes
        self.comm = TensorParallelComm(
            process_group, chunks=chunks, config=config, precision=precision, priority=priority
        )
        W = self.comm.world_size
        sharded = ("out_features", out_features) if self.partition_dim == 0 else ("in_features", in_features)
        _check_divisible(name, sharded[0], sharded[1], W)  # before anything is allocated
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel = bool(sequence_parallel)
        self.world_size, self.rank = W, self.comm.rank
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        if self.partition_dim == 0:  # this rank's output features, and their bias
            shape, bias_size = (out_features // W, in_features), out_features // W
        else:  # this rank's input features; the bias is replicated
            shape, bias_size = (out_features, in_features // W), out_features
        self.weight = nn.Parameter(torch.empty(shape, **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(bias_size, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialization of the FULL weight and bias (weight kaiming-uniform
        with ``a=sqrt(5)``, bias uniform in ``+-1/sqrt(in_features)``; same draws in the same
        order), then this rank's slice: from the same seed on every rank, the layers equal a
        seeded ``nn.Linear`` sharded. Costs one full weight of temporary memory."""
        if self.weight.device.type == "meta":
            return
        with torch.no_grad():
            full = torch.empty(
                (self.out_features, self.in_features), dtype=self.weight.dtype, device=self.weight.device
            )
            nn.init.kaiming_uniform_(full, a=math.sqrt(5))
            self.weight.copy_(self.comm.local_slice(full, self.partition_dim))
            if self.bias is not None:
                bound = 1 / math.sqrt(self.in_features)
                full_bias = torch.empty(self.out_features, dtype=self.bias.dtype, device=self.bias.device)
                nn.init.uniform_(full_bias, -bound, bound)
                self.bias.copy_(full_bias if self.partition_dim == 1 else self.comm.local_slice(full_bias, 0))

    def _check_input(self, x: Any, features: int, what: str) -> None:
        name = type(self).__name__
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: input must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() == 0 or x.shape[-1] != features:
            raise ValueError(
                f"{name}: input of shape {tuple(x.shape)} must end in {what}={features} (shape (*, {features}))"
            )
        if x.dtype != self.weight.dtype:
            raise ValueError(f"{name}: input dtype {x.dtype} differs from the weight's {self.weight.dtype}")
        if x.device != self.weight.device:
            raise ValueError(f"{name}: input is on {x.device} but the weight is on {self.weight.device}")
        if x.numel() == 0:
            raise ValueError(f"{name}: input of shape {tuple(x.shape)} is empty")
        if self.sequence_parallel and x.dim() < 2:
            raise ValueError(
                f"{name}: with sequence_parallel=True the input is sharded along dim 0 and needs at "
                f"least 2 dims, (rows, ..., {features}); got shape {tuple(x.shape)}"
            )

    def dense_weight(self) -> torch.Tensor:
        """The full ``(out_features, in_features)`` weight, gathered from every rank
        (collective: every rank of the group calls it). Detached."""
        return self.comm.all_gather(self.weight.detach(), self.partition_dim)

    def dense_bias(self) -> torch.Tensor | None:
        """The full ``(out_features,)`` bias (collective for the column layer), or None."""
        if self.bias is None:
            return None
        b = self.bias.detach()
        return self.comm.all_gather(b, 0) if self.partition_dim == 0 else b

    def to_linear(self) -> nn.Linear:
        """A dense ``nn.Linear`` with the gathered weights (collective)."""
        w, b = self.dense_weight(), self.dense_bias()
        dense = nn.Linear(self.in_features, self.out_features, bias=b is not None, device="meta")
        dense.weight = nn.Parameter(w.clone())
        if b is not None:
            dense.bias = nn.Parameter(b.clone())
        return dense

    def extra_repr(self) -> str:
        """The dense shape, the shard, the group size and the options that are set."""
        parts = [
            f"in_features={self.in_features}",
            f"out_features={self.out_features}",
            f"bias={self.bias is not None}",
            f"shard={tuple(self.weight.shape)}",
            f"world_size={self.world_size}",
        ]
        if self.sequence_parallel:
            parts.append("sequence_parallel=True")
        if self.comm.chunks != 2:
            parts.append(f"chunks={self.comm.chunks}")
        if self.comm.config is not None:
            parts.append(f"config={self.comm.config.spec()!r}")
        return ", ".join(parts)

    @classmethod
    def _shard_linear(cls, linear: nn.Linear, process_group: Any, kw: dict[str, Any]) -> Any:
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be a torch.nn.Linear, got {type(linear).__name__}")
        for key in ("device", "dtype", "bias"):
            if key in kw:
                raise TypeError(f"from_linear takes {key} from the nn.Linear; do not pass {key}=")
        new = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            process_group=process_group,
            device="meta",  # placeholders, replaced by the copied slices below
            dtype=linear.weight.dtype,
            **kw,
        )
        with torch.no_grad():
            w = new.comm.local_slice(linear.weight.detach(), cls.partition_dim).clone()
            new.weight = nn.Parameter(w, requires_grad=linear.weight.requires_grad)
            if linear.bias is not None:
                b = linear.bias.detach()
                b = b.clone() if cls.partition_dim == 1 else new.comm.local_slice(b, 0).clone()
                new.bias = nn.Parameter(b, requires_grad=linear.bias.requires_grad)
        return new


class ColumnParallelLinear(_ParallelLinear):
    """A linear layer split by output features: this rank holds ``weight``
    ``(out_features / world, in_features)`` and ``bias`` ``(out_features / world,)``.

    Input ``(*, in_features)``, replicated on the ranks; output ``(*, out_features / world)``,
    this rank's features (``gather_output=True``: all ``out_features``, gathered, for use
    without a following :class:`RowParallelLinear`). With ``sequence_parallel=True`` the input
    is this rank's part of dim 0, ``(rows, ..., in_features)``; the rows of every rank are
    all-gathered (overlapped with the GEMM) and the output has ``world * rows`` in dim 0.
    Backward: the input gradient is summed over the ranks (all-reduce; sequence parallel:
    reduce-scatter, back to this rank's rows) overlapped with its GEMM; weight and bias
    gradients are local. ``chunks`` is the most pieces a schedule pipelines; ``config``,
    ``precision`` go to every GEMM; ``priority`` is the collectives' stream priority (see
    :class:`TensorParallelComm`).
    """

    partition_dim = 0

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        process_group: Any = None,
        sequence_parallel: bool = False,
        gather_output: bool = False,
        chunks: int = 2,
        config: GemmConfig | None = None,
        precision: str = "ieee",
        priority: str | int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self._init_common(
            in_features,
            out_features,
            bias,
            process_group,
            sequence_parallel,
            chunks,
            config,
            precision,
            priority,
            device,
            dtype,
        )
        self.gather_output = bool(gather_output)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``input @ weight.T + bias`` on this rank's output features (see the class)."""
        self._check_input(input, self.in_features, "in_features")
        lead = input.shape[:-1]
        y = _ColumnFn.apply(
            input.reshape(-1, self.in_features), self.weight, self.bias, self.comm, self.sequence_parallel
        )
        if self.sequence_parallel:
            lead = torch.Size((lead[0] * self.world_size, *lead[1:]))
        y = y.view(*lead, y.shape[-1])
        if self.gather_output:
            y = _GatherLastFn.apply(y, self.comm)
        return y

    def extra_repr(self) -> str:
        """See :meth:`_ParallelLinear.extra_repr`; plus ``gather_output``."""
        return super().extra_repr() + (", gather_output=True" if self.gather_output else "")

    @classmethod
    def from_linear(cls, linear: nn.Linear, process_group: Any = None, **kw: Any) -> ColumnParallelLinear:
        """This rank's rows of ``linear``'s weight and bias (copies) as a
        :class:`ColumnParallelLinear`; ``kw`` are the constructor's keywords (not device,
        dtype, bias: those of ``linear``). Collective only in that it reads the group's size."""
        out: ColumnParallelLinear = cls._shard_linear(linear, process_group, kw)
        return out


class RowParallelLinear(_ParallelLinear):
    """A linear layer split by input features: this rank holds ``weight``
    ``(out_features, in_features / world)``; ``bias`` ``(out_features,)`` is replicated.

    Input: this rank's ``in_features / world`` features, ``(*, in_features / world)`` (e.g. a
    :class:`ColumnParallelLinear`'s output); ``input_is_parallel=False`` takes the full
    replicated ``(*, in_features)`` and keeps this rank's slice. The partial products are
    summed over the ranks (all-reduce, overlapped with the chunked GEMM) and the bias added
    once: output ``(*, out_features)``, replicated. With ``sequence_parallel=True`` the sum is
    reduce-scattered along dim 0 (which must be a multiple of the world size): output
    ``(rows / world, ..., out_features)``, this rank's rows. Backward: input and weight
    gradients local (sequence parallel: the gradient rows are all-gathered first, overlapped
    with the input-gradient GEMM); the bias gradient is the sum of the full output gradient,
    the same on every rank. ``chunks``, ``config``, ``precision``, ``priority``: as in
    :class:`ColumnParallelLinear`.
    """

    partition_dim = 1

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        process_group: Any = None,
        sequence_parallel: bool = False,
        input_is_parallel: bool = True,
        chunks: int = 2,
        config: GemmConfig | None = None,
        precision: str = "ieee",
        priority: str | int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self._init_common(
            in_features,
            out_features,
            bias,
            process_group,
            sequence_parallel,
            chunks,
            config,
            precision,
            priority,
            device,
            dtype,
        )
        self.input_is_parallel = bool(input_is_parallel)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``sum over ranks of input_shard @ weight.T``, then ``+ bias`` (see the class)."""
        k = self.weight.shape[1]
        if self.input_is_parallel:
            self._check_input(input, k, "in_features / world_size")
        else:
            self._check_input(input, self.in_features, "in_features")
        W = self.world_size
        if self.sequence_parallel and input.shape[0] % W:
            raise ValueError(
                f"{type(self).__name__}: with sequence_parallel=True dim 0 of the input ({input.shape[0]} "
                f"rows, shape {tuple(input.shape)}) is reduce-scattered over {W} ranks and must be a "
                f"multiple of {W}; pad the sequence or choose a length divisible by {W}"
            )
        if not self.input_is_parallel:
            input = _ScatterLastFn.apply(input, self.comm)
        lead = input.shape[:-1]
        y = _RowFn.apply(input.reshape(-1, k), self.weight, self.bias, self.comm, self.sequence_parallel)
        if self.sequence_parallel:
            lead = torch.Size((lead[0] // W, *lead[1:]))
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        """See :meth:`_ParallelLinear.extra_repr`; plus ``input_is_parallel``."""
        return super().extra_repr() + ("" if self.input_is_parallel else ", input_is_parallel=False")

    @classmethod
    def from_linear(cls, linear: nn.Linear, process_group: Any = None, **kw: Any) -> RowParallelLinear:
        """This rank's columns of ``linear``'s weight (a copy) and its whole bias (a copy) as a
        :class:`RowParallelLinear`; ``kw`` are the constructor's keywords (not device, dtype,
        bias: those of ``linear``)."""
        out: RowParallelLinear = cls._shard_linear(linear, process_group, kw)
        return out
