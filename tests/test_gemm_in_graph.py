"""The GEMM ops (``cokit::linear``, ``cokit::matmul``) are ``torch.library.triton_op``s: on a
GPU their kernel is launched through ``wrap_triton``, so ``torch.compile`` puts the Triton
kernel itself into its graph (Inductor compiles it as a user-defined kernel); what Inductor
cannot launch goes through the opaque ``cokit::gemm_launch``.

Without a GPU this is checked two ways:

* **the graph** -- a subprocess without ``TRITON_INTERPRET`` fakes an H100 (sm_90 limits, a
  device name) and traces the ops on fake CUDA tensors the way AOTAutograd does before
  Inductor (``make_fx`` under functionalization, where a ``triton_op`` decomposes): each
  GEMM must appear as a ``triton_kernel_wrapper_functional`` node carrying the config's
  tiles, ``num_warps``/``num_stages``, grid and strides; occupancy-shaped and ``maxnreg``
  configs, and empty problems, as ``cokit::gemm_launch``; symbolic sizes must trace without
  a guard. (Autograd cannot record on fake CUDA tensors in a CPU build of torch, so the
  backward formula is traced on its own.)
* **the numbers** -- in this process (the interpreter), the same GPU branch runs eagerly on
  CPU tensors with the device faked, forward and backward, against float64.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import ROOT, worker_report
from tolerances import GPU_BRANCH

MARK = "COKIT-IN-GRAPH-REPORT:"
INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
CACHED = "BLOCK_M=64,BLOCK_N=128,BLOCK_K=32,GROUP_M=4,num_warps=4,num_stages=4"


# ---------------------------------------------------------------------- the worker (subprocess)
def _fake_h100(cache_dir: str) -> None:
    """Make cokit see an H100: the GPU path, sm_90 limits, a device name for cache keys."""
    import cokit.triton_kernels.backend as B
    import cokit.triton_kernels.gemm as G
    from cokit.triton_kernels.backend import arch_limits

    B._gpu_backend = lambda: "cuda"
    B._limits_at = lambda index: arch_limits("sm_90")
    G.cached_device_name = lambda index: "FakeH100"
    os.environ["COKIT_CACHE_DIR"] = cache_dir


def _nodes(gm) -> dict:
    """The GEMM launches of a traced graph: Triton kernel nodes (kernel, grid, arguments,
    launch options) and opaque ``cokit::gemm_launch`` calls."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from triton.runtime.autotuner import Autotuner

    kernels, opaque = [], 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if "triton_kernel_wrapper" in str(node.target):
            kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
            launch = {}
            if isinstance(kernel, Autotuner):  # num_warps/num_stages travel as its one Config
                (cfg,) = kernel.configs
                launch = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
                kernel = kernel.fn
            args = {
                k: (v if isinstance(v, (int, bool, str)) else str(v))
                for k, v in node.kwargs["kwargs"].items()
            }
            grid = [str(g) if not isinstance(g, int) else g for g in node.kwargs["grid"][0]]
            kernels.append({"kernel": kernel.fn.__name__, "grid": grid, "args": args, **launch})
        elif str(node.target) == "cokit.gemm_launch.default":
            opaque += 1
    return {"kernels": kernels, "opaque": opaque}


def _worker(cache_dir: str) -> dict:
    import logging

    _fake_h100(cache_dir)
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import dispatch_functionalize
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from cokit.triton_kernels import linear as L
    from cokit.triton_kernels.gemm import matmul
    from cokit.triton_kernels.gemm_config import GemmConfig, parse_config_spec
    from cokit.triton_kernels.linear import linear
    from cokit.triton_kernels.tuning_cache import TuningCache

    # mutation analysis of a user kernel asks the (absent) driver and falls back to "all"
    logging.getLogger("torch._higher_order_ops.triton_kernel_wrap").setLevel(logging.ERROR)
    bf16, fp32 = torch.bfloat16, torch.float32
    TuningCache(cache_dir).store(
        TuningCache.key("FakeH100", bf16, 256, 384, 512), parse_config_spec(CACHED), time_ms=0.1
    )
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)

    def cuda(*shape, dtype=bf16):
        with mode:
            return torch.empty(*shape, device="cuda", dtype=dtype)

    def trace(fn, *inputs) -> dict:
        return _nodes(make_fx(dispatch_functionalize(fn), tracing_mode="fake")(*inputs))

    x, w, b = cuda(256, 512), cuda(384, 512), cuda(384)
    shaped = GemmConfig(128, 128, 64, 8, num_warps=8, num_stages=3, smem_bytes=200_000)
    report = {
        "cached": trace(lambda x, w, b: linear(x, w, b), x, w, b),
        "uncached": trace(lambda x, w: linear(x, w), cuda(3, 5, 512), w),
        "config": trace(
            lambda x, w: linear(x, w, config=GemmConfig(64, 64, 64, 8, num_warps=4, num_stages=3)),
            cuda(100, 100, dtype=fp32),
            cuda(48, 100, dtype=fp32),
        ),
        "tf32": trace(
            lambda a, c: matmul(a, c, precision="tf32"), cuda(64, 64, dtype=fp32), cuda(64, 32, dtype=fp32)
        ),
        "persistent": trace(lambda a, c: matmul(a, c, persistent=True), cuda(4096, 512), cuda(512, 4096)),
        "shaped": trace(lambda x, w: linear(x, w, config=shaped), x, w),
        "maxnreg": trace(
            lambda x, w: linear(x, w, config=shaped.replace(smem_bytes=None, maxnreg=128)), x, w
        ),
        "empty": trace(lambda a, c: matmul(a, c), cuda(8, 0), cuda(0, 16)),
    }

    def backward(grad, input, weight):
        """The op's backward formula, with the context its setup_context saves."""
        ctx = SimpleNamespace(
            saved_tensors=(input, weight),
            needs_input_grad=(True, True, True),
            has_bias=True,
            config="",
            precision="ieee",
            persistent=False,
        )
        return L._linear_backward(ctx, grad)

    report["backward"] = trace(backward, cuda(256, 384), x, w)
    with mode:
        rows = env.create_symintnode(
            env.create_symbol(300, _source("rows"), dynamic_dim=DimDynamic.DYNAMIC), hint=300
        )
        xs = torch.empty(rows, 512, device="cuda", dtype=bf16)
    report["symbolic"] = trace(lambda x, w: linear(x, w), xs, w)
    report["symbolic_persistent"] = trace(lambda x, w: linear(x, w, persistent=True), xs, w)
    report["guards"] = [str(g.expr) for g in env.guards]
    return report


def _source(name: str):
    from torch._dynamo.source import ConstantSource

    return ConstantSource(name)


# ---------------------------------------------------------------------- the graph
@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    cache = tmp_path_factory.mktemp("in-graph-cache")
    return worker_report(__file__, str(cache), mark=MARK, timeout=600)


def _only_kernel(case: dict) -> dict:
    assert case["opaque"] == 0 and len(case["kernels"]) == 1, case
    return case["kernels"][0]


def test_linear_is_one_triton_kernel_with_the_cached_config(report):
    k = _only_kernel(report["cached"])
    assert k["kernel"] == "_gemm_kernel"
    args = k["args"]
    assert (args["BLOCK_M"], args["BLOCK_N"], args["BLOCK_K"], args["GROUP_M"]) == (64, 128, 32, 4)
    assert (k["num_warps"], k["num_stages"]) == (4, 4)
    assert k["grid"] == [(256 // 64) * (384 // 128), 1, 1]
    assert (args["M"], args["N"], args["K"]) == (256, 384, 512)
    # b = weight.t(): a transposed view, no copy; the bias is read
    assert (args["stride_bk"], args["stride_bn"]) == (1, 512)
    assert args["HAS_BIAS"] and args["EVEN_K"] and not args["UPCAST"]


def test_an_untuned_shape_uses_the_first_fitting_config(report):
    from cokit.triton_kernels.backend import arch_limits
    from cokit.triton_kernels.gemm_config import config_space, prune_configs

    first = prune_configs(config_space("cuda"), torch.bfloat16, arch_limits("sm_90"), 15, 384, 512)[0]
    k = _only_kernel(report["uncached"])
    fields = ("BLOCK_M", "BLOCK_N", "BLOCK_K")
    assert [k["args"][f] for f in fields] == [getattr(first, f) for f in fields]
    assert (k["num_warps"], k["num_stages"]) == (first.num_warps, first.num_stages)
    args = k["args"]
    assert args["M"] == 15 and not args["HAS_BIAS"]  # (3, 5, 512) flattened to 15 rows


def test_a_given_config_and_precision_reach_the_kernel(report):
    k = _only_kernel(report["config"])
    args = k["args"]
    assert (args["BLOCK_M"], args["BLOCK_N"], args["BLOCK_K"]) == (64, 64, 64)
    assert (k["num_warps"], k["num_stages"]) == (4, 3)
    assert args["EVEN_K"] is False and args["INPUT_PRECISION"] == "ieee"  # K = 100
    assert k["grid"] == [2 * 1, 1, 1]
    assert _only_kernel(report["tf32"])["args"]["INPUT_PRECISION"] == "tf32"


def test_persistent_form_runs_one_program_per_sm(report):
    from cokit.triton_kernels.backend import arch_limits

    k = _only_kernel(report["persistent"])
    assert k["kernel"] == "_gemm_persistent_kernel"
    assert k["grid"] == [arch_limits("sm_90").num_sms, 1, 1]


@pytest.mark.parametrize("case", ["shaped", "maxnreg", "empty"])
def test_what_inductor_cannot_launch_stays_opaque(report, case):
    assert report[case]["kernels"] == [] and report[case]["opaque"] == 1, report[case]


def test_backward_is_two_triton_kernels(report):
    kernels = report["backward"]["kernels"]
    assert report["backward"]["opaque"] == 0 and len(kernels) == 2
    shapes = sorted((k["args"]["M"], k["args"]["N"], k["args"]["K"]) for k in kernels)
    assert shapes == [(256, 512, 384), (384, 512, 256)]  # dX = dY W, dW = dY^T X


def test_symbolic_sizes_trace_without_guards(report):
    tiled, persistent = _only_kernel(report["symbolic"]), _only_kernel(report["symbolic_persistent"])
    for k in (tiled, persistent):
        assert not isinstance(k["args"]["M"], int) and k["args"]["N"] == 384
        assert not isinstance(k["grid"][0], int)  # the grid follows the size at run time
    assert report["guards"] == []


# ---------------------------------------------------------------------- the numbers
@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """The GPU branch of the ops on CPU tensors (interpreter): path 'cuda', sm_90 limits; the
    opaque launch is made to fail, so a result proves the wrap_triton launch computed it."""
    import cokit.triton_kernels.gemm as G
    from cokit.triton_kernels.backend import arch_limits

    monkeypatch.setattr(G, "kernel_path", lambda device=None: "cuda")
    monkeypatch.setattr(G, "_limits_for", lambda path, device: arch_limits("sm_90"))
    monkeypatch.setattr(G, "cached_device_name", lambda index: "FakeGPU")
    monkeypatch.setenv("COKIT_CACHE_DIR", str(tmp_path))

    def no_opaque(*args, **kwargs):
        raise AssertionError("the opaque cokit::gemm_launch ran")

    monkeypatch.setattr(G, "gemm", no_opaque)


@pytest.mark.skipif(not INTERPRETER, reason="fakes a GPU through the interpreter (CPU only)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("persistent", [False, True], ids=["tiled", "persistent"])
def test_gpu_branch_forward_and_backward_vs_float64(fake_gpu, dtype, persistent):
    from cokit.triton_kernels.gemm_config import GemmConfig
    from cokit.triton_kernels.linear import linear

    cfg = GemmConfig(
        32, 32, 32, 2, num_warps=4, num_stages=2, persistent=persistent, num_sms=3 if persistent else None
    )
    x = torch.randn(3, 13, 40).to(dtype).requires_grad_()
    w = torch.randn(37, 40).to(dtype).requires_grad_()
    b = torch.randn(37).to(dtype).requires_grad_()
    y = linear(x, w, b, config=cfg)
    g = torch.randn_like(y)
    y.backward(g)
    xd, wd, bd, gd = (t.detach().double() for t in (x, w, b, g))
    tol = GPU_BRANCH[dtype]
    torch.testing.assert_close(y.double(), xd @ wd.t() + bd, rtol=tol, atol=tol)
    torch.testing.assert_close(x.grad.double(), gd @ wd, rtol=tol, atol=tol)
    torch.testing.assert_close(
        w.grad.double(), gd.reshape(-1, 37).t() @ xd.reshape(-1, 40), rtol=tol, atol=tol
    )
    torch.testing.assert_close(b.grad.double(), gd.sum((0, 1)), rtol=tol, atol=tol)


if __name__ == "__main__":
    if INTERPRETER:
        sys.exit("run without TRITON_INTERPRET")
    sys.path.insert(0, str(ROOT))
    print(MARK + json.dumps(_worker(sys.argv[1])))
