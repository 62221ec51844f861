"""GEMM kernel vs a float64 reference (on the ``device`` fixture: the GPU when there is one,
else the Triton interpreter on CPU); configs and the per-vendor config spaces; tuning cache;
the cokit::matmul custom op (autograd, opcheck, torch.compile)."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
from tolerances import FP32_SUM_CLOSE, TF32_OPERAND, fp32_accumulation_bound

from cokit.triton_kernels import gemm_configs_amd, gemm_configs_nvidia
from cokit.triton_kernels.backend import arch_limits
from cokit.triton_kernels.gemm import gemm, gemm_reference, matmul
from cokit.triton_kernels.gemm_config import (
    CUDA_KNOBS,
    HIP_KNOBS,
    GemmConfig,
    config_space,
    default_config,
    dtype_name,
    estimate_shared_bytes,
    interpreter_config,
    known_to_spill,
    parse_config_spec,
    parse_dtype,
    prune_configs,
)
from cokit.triton_kernels.tuning_cache import TuningCache, autotune, default_cache_dir, shape_bucket

INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
SHAPES = [(1, 1, 1), (17, 33, 65), (128, 96, 200)]


def _tolerance(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, ref: torch.Tensor, precision: str
) -> torch.Tensor:
    """Elementwise error bound, by precision (``tolerances.fp32_accumulation_bound``).

    |c - ref| <= eps_out * |ref|                      (final rounding to the output dtype)
               + (K * 2^-24 + eps_dot) * (|A| @ |B|)  (fp32 accumulation; tf32 operand rounding)
    with eps_dot = 2^-10 (``TF32_OPERAND``) for tf32 (10-bit mantissa inputs, both operands)
    and 0 otherwise, doubled as a safety margin.
    """
    eps_dot = TF32_OPERAND if (precision == "tf32" and a.dtype == torch.float32) else 0.0
    mag = a.double().abs() @ b.double().abs()
    if bias is not None:
        mag = mag + bias.double().abs()
    return fp32_accumulation_bound(ref, mag, a.shape[1], a.dtype, eps_dot)


def _check(
    c: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    precision: str = "ieee",
) -> None:
    ref = a.double() @ b.double()
    if bias is not None:
        ref = ref + bias.double()
    assert c.dtype == a.dtype and c.shape == ref.shape
    assert torch.isfinite(c).all(), "output not fully written (NaN poison left)"
    err = (c.double() - ref).abs()
    tol = _tolerance(a, b, bias, ref, precision)
    worst = (err / tol).max().item()
    assert worst <= 1.0, f"error exceeds bound by {worst:.2f}x (max abs err {err.max().item():.3g})"


def _poisoned(M: int, N: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.full((M, N), float("nan"), dtype=dtype, device=device)


@pytest.fixture(autouse=True)
def _private_cache_dir(tmp_path_factory, monkeypatch):
    """GEMMs tuned on a GPU write their winners to a throwaway cache, not ~/.cache/cokit."""
    if "COKIT_CACHE_DIR" not in os.environ:
        monkeypatch.setenv("COKIT_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cokit-cache"))


# ---------------------------------------------------------------------- numerics
@pytest.mark.parametrize("persistent", [False, True], ids=["tiled", "persistent"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize(
    "dtype,precision",
    [(torch.float16, "ieee"), (torch.bfloat16, "ieee"), (torch.float32, "ieee"), (torch.float32, "tf32")],
    ids=["fp16", "bf16", "fp32-ieee", "fp32-tf32"],
)
def test_gemm_vs_float64(dtype, precision, shape, persistent, device):
    M, N, K = shape
    a = torch.randn(M, K, device=device).to(dtype)
    b = torch.randn(K, N, device=device).to(dtype)
    bias = torch.randn(N, device=device).to(dtype) if M > 1 else None
    c = gemm(
        a, b, bias, precision=precision, persistent=persistent, tune=False, out=_poisoned(M, N, dtype, device)
    )
    _check(c, a, b, bias, precision)


@pytest.mark.parametrize("persistent", [False, True], ids=["tiled", "persistent"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16", "fp32"])
def test_gemm_transposed_and_strided_operands(dtype, persistent, device):
    M, N, K = 17, 33, 65
    a_t = torch.randn(K, M, device=device).to(dtype).t()  # column-major A
    b_t = torch.randn(N, K, device=device).to(dtype).t()  # column-major B
    assert not a_t.is_contiguous() and not b_t.is_contiguous()
    _check(gemm(a_t, b_t, persistent=persistent, tune=False), a_t, b_t)
    a_s = torch.randn(M, 2 * K, device=device).to(dtype)[:, ::2]  # every other column: stride 2 along K
    bias_s = torch.randn(2 * N, device=device).to(dtype)[::2]
    out = _poisoned(N, M, dtype, device).t()  # strided output
    c = gemm(a_s, b_t, bias_s, persistent=persistent, tune=False, out=out)
    assert c.data_ptr() == out.data_ptr()
    _check(c, a_s, b_t, bias_s)


@pytest.mark.parametrize(
    "config",
    [
        GemmConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, GROUP_M=2, num_warps=2, num_stages=2),
        GemmConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=1, persistent=True, num_sms=3),
        GemmConfig(BLOCK_M=32, BLOCK_N=16, BLOCK_K=64, GROUP_M=3, persistent=True, num_sms=1),
    ],
    ids=["tiled-grouped", "persistent-3", "persistent-1"],
)
def test_gemm_explicit_configs_cover_many_tiles(config, device):
    """Several tiles, partial edge tiles, grouped ordering and persistent striding."""
    M, N, K = 33, 47, 65
    a = torch.randn(M, K, dtype=torch.bfloat16, device=device)
    b = torch.randn(K, N, dtype=torch.bfloat16, device=device)
    bias = torch.randn(N, dtype=torch.bfloat16, device=device)
    _check(gemm(a, b, bias, config=config, out=_poisoned(M, N, torch.bfloat16, device)), a, b, bias)


def test_gemm_degenerate_shapes(device):
    a = torch.randn(3, 0, device=device)
    b = torch.randn(0, 5, device=device)
    assert torch.equal(gemm(a, b), torch.zeros(3, 5, device=device))
    bias = torch.randn(5, device=device)
    assert torch.equal(gemm(a, b, bias), bias.expand(3, 5))
    assert gemm(torch.randn(0, 4, device=device), torch.randn(4, 6, device=device)).shape == (0, 6)


def test_torch_path_without_interpreter(monkeypatch):
    """CPU tensors without TRITON_INTERPRET run the torch reference with the same semantics
    (CPU by definition: this is the path without Triton)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    a = torch.randn(17, 65, dtype=torch.bfloat16)
    b = torch.randn(65, 33, dtype=torch.bfloat16)
    c = gemm(a, b)
    assert torch.equal(c, gemm_reference(a, b))
    _check(c, a, b)


# ---------------------------------------------------------------------- input errors
@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: (torch.randn(4, 5), torch.randn(6, 3)), "a.shape\\[1\\] must equal b.shape\\[0\\]"),
        (lambda: (torch.randn(4, 5), torch.randn(5, 3, dtype=torch.float16)), "same dtype"),
        (lambda: (torch.randn(4), torch.randn(4, 3)), "a must be 2-D"),
        (
            lambda: (torch.randn(4, 5).double(), torch.randn(5, 3).double()),
            "not supported; allowed: fp16, bf16, fp32",
        ),
    ],
)
def test_gemm_rejects_bad_inputs(make, match, device):
    a, b = (t.to(device) for t in make())
    with pytest.raises(ValueError, match=match):
        gemm(a, b)


def test_gemm_rejects_bad_bias_precision_out_and_form(device):
    a, b = torch.randn(4, 5, device=device), torch.randn(5, 3, device=device)
    with pytest.raises(ValueError, match=r"bias must have shape \(3,\)"):
        gemm(a, b, torch.randn(4, device=device))
    with pytest.raises(ValueError, match="precision='fp64' is invalid; allowed: ieee, tf32"):
        gemm(a, b, precision="fp64")
    with pytest.raises(ValueError, match="out must be a 4x3"):
        gemm(a, b, out=torch.empty(3, 4, device=device))
    with pytest.raises(ValueError, match=r"contradicts config\.persistent"):
        gemm(a, b, config=GemmConfig(), persistent=True)


# ---------------------------------------------------------------------- configs
@pytest.mark.parametrize(
    "config,backend,match",
    [
        (GemmConfig(BLOCK_M=96), "cuda", "BLOCK_M=96 is invalid; allowed: a power of 2 from 16 to 256"),
        (GemmConfig(BLOCK_K=8), "cuda", "BLOCK_K=8 is invalid"),
        (GemmConfig(num_warps=3), "cuda", "num_warps=3 is invalid on cuda; allowed: 1, 2, 4, 8, 16, 32"),
        (GemmConfig(num_warps=32), "hip", "num_warps=32 is invalid on hip; allowed: 1, 2, 4, 8, 16"),
        (GemmConfig(num_stages=0), "cuda", "num_stages=0 is invalid"),
        (GemmConfig(GROUP_M=0), "cuda", "GROUP_M=0 is invalid"),
        (GemmConfig(num_sms=10), "cuda", "num_sms=10 applies to the persistent form only"),
        (GemmConfig(persistent=True, num_sms=500), "cuda", r"num_sms=500 is invalid; allowed: 1 to 132"),
        (GemmConfig(waves_per_eu=2), "cuda", "waves_per_eu is an AMD \\(hip\\) knob"),
        (GemmConfig(kpack=2), "cuda", "kpack is an AMD \\(hip\\) knob"),
        (GemmConfig(matrix_instr_nonkdim=16), "cuda", "matrix_instr_nonkdim is an AMD"),
        (GemmConfig(maxnreg=128), "hip", "maxnreg is an NVIDIA \\(cuda\\) knob"),
        (GemmConfig(maxnreg=300), "cuda", "maxnreg=300 is invalid; allowed: an integer from 16 to 255"),
        (GemmConfig(kpack=3), "hip", "kpack=3 is invalid; allowed: 1, 2"),
        (GemmConfig(matrix_instr_nonkdim=8), "hip", "matrix_instr_nonkdim=8 is invalid"),
        (GemmConfig(smem_bytes=300_000), "cuda", "smem_bytes=300000 is above the device limit of 232448"),
        (GemmConfig(smem_bytes=70_000), "hip", "smem_bytes=70000 is above the device limit of 65536"),
        # default tiles 128x128x64 bf16, 3 stages on sm_90 (wgmma): 3 * 64 * (128 + 128) * 2 = 98304 B
        (GemmConfig(smem_bytes=1000), "cuda", "smem_bytes=1000 is below the 98304 B of shared memory"),
    ],
)
def test_config_validation_errors(config, backend, match):
    limits = arch_limits("sm_90" if backend == "cuda" else "gfx942")
    with pytest.raises(ValueError, match=match):
        config.validate(backend, limits, dtype=torch.bfloat16)


def test_valid_vendor_configs_pass():
    GemmConfig(maxnreg=128, smem_bytes=150_000).validate("cuda", arch_limits("sm_90"), dtype=torch.bfloat16)
    GemmConfig(num_stages=2, waves_per_eu=2, matrix_instr_nonkdim=16, kpack=2, smem_bytes=65536).validate(
        "hip", arch_limits("gfx942"), dtype=torch.bfloat16
    )
    for backend in ("cuda", "hip"):
        for cfg in config_space(backend):
            cfg.validate(backend)


# ---------------------------------------------------------------------- per-vendor spaces
VENDORS = [
    (gemm_configs_nvidia, "sm_80"),
    (gemm_configs_nvidia, "sm_90"),
    (gemm_configs_amd, "gfx90a"),
    (gemm_configs_amd, "gfx942"),
]


@pytest.mark.parametrize("vendor,target", VENDORS, ids=[t for _, t in VENDORS])
def test_vendor_space_validates_against_its_chip(vendor, target):
    """Every config of a vendor's space is valid on that vendor's chips (both forms, every
    program count up to the chip's SMs/CUs), fits a block's threads, and the 16-bit space
    pruned for the chip keeps most of it, the default (first) config included."""
    limits = arch_limits(target)
    assert target in vendor.TARGETS and limits.backend == vendor.BACKEND
    assert limits.warp_size == vendor.WARP_SIZE
    space = config_space(vendor.BACKEND)
    assert space and len(space) == len(vendor.SPACE) and len(set(space)) == len(space)
    foreign = HIP_KNOBS if vendor.BACKEND == "cuda" else CUDA_KNOBS
    for cfg in space:
        cfg.validate(vendor.BACKEND, limits)
        cfg.replace(persistent=True, num_sms=limits.num_sms).validate(vendor.BACKEND, limits)
        assert cfg.num_warps in vendor.NUM_WARPS
        assert cfg.num_warps * limits.warp_size <= limits.max_threads_per_block
        assert all(getattr(cfg, knob) is None for knob in foreign)
        opts = cfg.launch_options(vendor.BACKEND)
        assert set(opts) - {"num_warps", "num_stages"} <= set(vendor.KNOBS)
    for dtype in (torch.float16, torch.bfloat16):
        kept = prune_configs(space, dtype, limits)
        assert space[0] in kept and len(kept) >= len(space) // 2
        for cfg in kept:  # a footprint equal to the estimate is accepted
            need = estimate_shared_bytes(cfg, dtype, limits)
            cfg.replace(smem_bytes=need).validate(vendor.BACKEND, limits, dtype=dtype)
    assert default_config(vendor.BACKEND) == space[0]


@pytest.mark.parametrize("vendor,target", VENDORS, ids=[t for _, t in VENDORS])
def test_configs_over_the_chip_are_refused_before_compile_and_defaults_fit(vendor, target):
    """For every dtype and its space: a config whose shared memory (the estimate) exceeds the
    chip's per-block limit is refused by validation, naming the limit and the chip; every
    config pruning keeps passes; the dtype's default config is the first that fits. The 16-bit
    default does not fit fp32 on sm_80 and gfx942 (192 KiB of 163 KiB, 128 KiB of 64 KiB), so
    fp32 has a space of its own."""
    limits = arch_limits(target)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        space = config_space(vendor.BACKEND, dtype=dtype)
        assert [c.to_dict() for c in space] == [
            {**f, "persistent": False} for f in vendor.SPACES[dtype_name(dtype)]
        ]
        kept = prune_configs(space, dtype, limits)
        assert space[0] in kept
        for cfg in space:
            need = estimate_shared_bytes(cfg, dtype, limits)
            if cfg in kept:
                cfg.validate(vendor.BACKEND, limits, dtype=dtype)
            else:
                assert need > limits.max_shared_per_block
                with pytest.raises(
                    ValueError,
                    match=rf"needs {need} B .* above the {limits.max_shared_per_block} B limit of {re.escape(limits.name)}",
                ):
                    cfg.validate(vendor.BACKEND, limits, dtype=dtype)
        default = default_config(vendor.BACKEND, dtype=dtype, limits=limits)
        assert default == kept[0]
        default.validate(vendor.BACKEND, limits, dtype=dtype)
    assert default_config(vendor.BACKEND, dtype=torch.bfloat16) == config_space(vendor.BACKEND)[0]
    over = {"sm_80": 196608, "gfx942": 131072}.get(target)
    if over is not None:  # the finding: the 16-bit default does not fit in fp32
        with pytest.raises(ValueError, match=f"needs {over} B"):
            config_space(vendor.BACKEND)[0].validate(vendor.BACKEND, limits, dtype=torch.float32)
    too_many = space[0].replace(num_warps=max(vendor.NUM_WARPS))
    if too_many.num_warps * limits.warp_size > limits.max_threads_per_block:
        with pytest.raises(ValueError, match="threads per block"):
            too_many.validate(vendor.BACKEND, limits)


@pytest.mark.parametrize("vendor,target", VENDORS, ids=[t for _, t in VENDORS])
def test_compile_checked_spills_are_pruned_on_their_chip_only(vendor, target):
    """The vendor's SPILLS table (configs compile checks found spilling in one form on one
    chip) is pruned there, in that form and dtype only; fp32 has its own, smaller default."""
    limits = arch_limits(target)
    listed = [e for e in vendor.SPILLS if e[0] == target]
    for _, dtypes, persistent, fields in listed:
        cfg = GemmConfig(**fields, persistent=persistent)
        for name in dtypes:
            dtype = parse_dtype(name)
            assert known_to_spill(cfg, dtype, limits)
            assert cfg not in prune_configs(config_space(vendor.BACKEND, persistent, dtype), dtype, limits)
            assert not known_to_spill(cfg.replace(persistent=not persistent), dtype, limits)
    for other in {t for t in vendor.TARGETS if t != target}:
        for _, dtypes, persistent, fields in [e for e in vendor.SPILLS if e[0] == other]:
            cfg = GemmConfig(**fields, persistent=persistent)
            assert not any(known_to_spill(cfg, parse_dtype(n), limits) for n in dtypes)
    if target == "sm_80":  # the persistent 16-bit default on sm_80 is the first that does not spill
        persistent = default_config("cuda", True, dtype=torch.bfloat16, limits=limits)
        assert (persistent.BLOCK_M, persistent.BLOCK_N, persistent.BLOCK_K) == (128, 128, 64)
        assert default_config("cuda", dtype=torch.bfloat16, limits=limits) == config_space("cuda")[0]
    fp32 = config_space(vendor.BACKEND, dtype=torch.float32)
    if vendor.BACKEND == "cuda":  # FMA dots: at most 64 accumulators per thread of fp32 tiles
        assert all(c.BLOCK_M * c.BLOCK_N // (c.num_warps * 32) <= 64 for c in fp32)


def test_registers_over_the_chip_are_refused_before_compile():
    """maxnreg for every thread above an SM's register file, and an fp32 accumulator tile above
    the registers a thread may have, are refused naming the limit and the chip."""
    sm90, gfx = arch_limits("sm_90"), arch_limits("gfx942")
    with pytest.raises(
        ValueError, match=r"maxnreg=255 is 261120 registers per block, above the 65536 registers"
    ):
        GemmConfig(num_warps=32, maxnreg=255).validate("cuda", sm90)
    GemmConfig(num_warps=8, maxnreg=255).validate("cuda", sm90)  # 256 x 255 = 65280 fits
    with pytest.raises(
        ValueError, match=r"in 2048 registers per thread, above the 255 registers per thread limit"
    ):
        GemmConfig(BLOCK_M=256, BLOCK_N=256, num_warps=1).validate("cuda", sm90)
    with pytest.raises(ValueError, match=r"in 128 registers per thread, above the 64 registers"):
        GemmConfig(num_warps=4, maxnreg=64).validate("cuda", sm90)
    with pytest.raises(
        ValueError, match=rf"above the 128 registers per thread limit .*{re.escape(gfx.name)}"
    ):
        GemmConfig(256, 256, 64, num_warps=4, num_stages=2, waves_per_eu=4).validate("hip", gfx)
    GemmConfig(256, 256, 64, num_warps=8, num_stages=2, waves_per_eu=2).validate("hip", gfx)
    GemmConfig(BLOCK_M=256, BLOCK_N=256, num_warps=1).validate("cuda")  # no chip: nothing to bound


def test_amd_space_is_rejected_on_nvidia():
    """Every AMD config carries AMD-only knobs, so none passes as an NVIDIA config; an NVIDIA
    knob is refused on AMD."""
    for cfg in config_space("hip"):
        with pytest.raises(ValueError, match=r"is an AMD \(hip\) knob; it cannot be used on cuda"):
            cfg.validate("cuda", arch_limits("sm_90"))
    with pytest.raises(ValueError, match=r"maxnreg is an NVIDIA \(cuda\) knob"):
        config_space("cuda")[0].replace(maxnreg=128).validate("hip", arch_limits("gfx942"))


def test_config_space_dispatches_to_the_vendor_module():
    for vendor in (gemm_configs_nvidia, gemm_configs_amd):
        assert config_space(vendor.BACKEND) == [GemmConfig(**f) for f in vendor.SPACE]
        persistent = config_space(vendor.BACKEND, persistent=True)
        assert all(c.persistent for c in persistent)
        assert [c.replace(persistent=False) for c in persistent] == config_space(vendor.BACKEND)
        assert default_config(vendor.BACKEND, persistent=True).persistent
    with pytest.raises(ValueError, match="backend 'cpu' has no config space; allowed: cuda, hip"):
        config_space("cpu")


def test_config_modules_layout():
    """gemm_configs.py is gone (no shim); the vendor modules are leaves (import nothing of
    cokit), so triton_kernels' module graph stays acyclic."""
    assert importlib.util.find_spec("cokit.triton_kernels.gemm_configs") is None
    for vendor in (gemm_configs_nvidia, gemm_configs_amd):
        tree = ast.parse(Path(vendor.__file__).read_text())
        imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
        assert all(isinstance(n, ast.ImportFrom) and n.module == "__future__" for n in imports)


def test_smem_below_need_is_rejected(device):
    """Interpreter: checked against the estimate; GPU: against the compiled kernel."""
    a, b = torch.randn(4, 5, device=device), torch.randn(5, 3, device=device)
    with pytest.raises(ValueError, match="smem_bytes=16 is below"):
        gemm(a, b, config=GemmConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, smem_bytes=16))
    # a footprint above the need is accepted (it only changes occupancy on a GPU)
    cfg = GemmConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_stages=2, smem_bytes=60_000)
    _check(gemm(a, b, config=cfg), a, b)


def test_parse_config_spec_round_trip_and_errors():
    cfg = parse_config_spec(
        "BLOCK_M=128, block_n=64,BLOCK_K=32,num_warps=8,num_stages=4,smem_bytes=96k,"
        "persistent=true,num_sms=100,maxnreg=128"
    )
    assert cfg == GemmConfig(
        BLOCK_M=128,
        BLOCK_N=64,
        BLOCK_K=32,
        num_warps=8,
        num_stages=4,
        smem_bytes=96 * 1024,
        persistent=True,
        num_sms=100,
        maxnreg=128,
    )
    assert parse_config_spec(cfg.spec()) == cfg
    assert GemmConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="unknown config key 'BLOCKM'; allowed: BLOCK_M"):
        parse_config_spec("BLOCKM=128")
    with pytest.raises(ValueError, match="num_warps='eight' is invalid; allowed: an integer"):
        parse_config_spec("num_warps=eight")
    with pytest.raises(ValueError, match="is not KEY=VALUE"):
        parse_config_spec("BLOCK_M")
    with pytest.raises(ValueError, match="persistent='maybe' is invalid; allowed: true, false"):
        parse_config_spec("persistent=maybe")


def test_shared_memory_estimate_and_pruning():
    """The estimate follows the per-backend model (checked against real builds in
    test_gemm_compile.py); pruning drops what cannot fit."""
    cfg = GemmConfig(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)
    tile = 64 * (128 + 256) * 2  # bf16 A and B tiles of one stage = 49152 B
    assert estimate_shared_bytes(cfg, torch.bfloat16, "sm_80") == 2 * tile  # num_stages - 1
    assert estimate_shared_bytes(cfg, torch.bfloat16, "sm_90") == 3 * tile  # wgmma: num_stages
    assert estimate_shared_bytes(cfg.replace(num_stages=2), torch.bfloat16, "gfx942") == tile
    # fp32 ieee on sm_90 has no wgmma: num_stages - 1 buffers of 4-byte elements
    assert estimate_shared_bytes(cfg, torch.float32, "sm_90") == 2 * 64 * 384 * 4
    gfx = arch_limits("gfx942")
    kept = prune_configs(config_space("hip"), torch.float32, gfx)
    dropped = set(config_space("hip")) - set(kept)
    assert dropped and all(estimate_shared_bytes(c, torch.float32, gfx) > 65536 for c in dropped)
    assert all(estimate_shared_bytes(c, torch.float32, gfx) <= 65536 for c in kept)
    # a small problem keeps only tiles that do not dwarf it
    small = prune_configs(config_space("cuda"), torch.bfloat16, arch_limits("sm_90"), 64, 64, 64)
    assert small and all(c.BLOCK_M <= 64 and c.BLOCK_N <= 64 for c in small)


def test_interpreter_config_is_deterministic_and_large():
    assert interpreter_config(17, 33, 65) == interpreter_config(17, 33, 65)
    cfg = interpreter_config(4096, 100, 3)
    assert (cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K) == (128, 128, 16)
    assert interpreter_config(5, 5, 5, persistent=True).num_sms == 2


# ---------------------------------------------------------------------- tuning cache
def _count_bench():
    calls: list[str] = []

    def bench(fn):
        fn()
        calls.append("x")
        return float(len(calls) % 3)  # deterministic fake timings: 1, 2, 0, 1, ...

    return bench, calls


def test_autotune_persists_and_second_run_does_not_tune(tmp_path):
    configs = config_space("cuda")[:4]
    ran: list[GemmConfig] = []
    bench, calls = _count_bench()
    key = TuningCache.key("NVIDIA H200", torch.bfloat16, 4096, 4096, 4096)
    best, timings = autotune(configs, ran.append, bench, cache=TuningCache(tmp_path), key=key)
    assert len(calls) == 4 and len(timings) == 4
    assert best == configs[2]  # fake times 1, 2, 0, 1 -> the third wins
    data = json.loads((tmp_path / TuningCache.FILENAME).read_text())
    assert data["entries"][key]["config"] == best.to_dict()
    # a second run (fresh cache object, same dir) reads the winner and times nothing
    best2, timings2 = autotune(configs, ran.append, bench, cache=TuningCache(tmp_path), key=key)
    assert best2 == best and timings2 == {} and len(calls) == 4
    # another shape bucket is a different key
    assert shape_bucket(4000, 4096, 4097) == "4096x4096x8192"
    assert TuningCache.key("NVIDIA H200", torch.bfloat16, 4000, 4096, 4097) != key


def test_cache_dir_from_env_and_argument(tmp_path, monkeypatch):
    monkeypatch.setenv("COKIT_CACHE_DIR", str(tmp_path / "env"))
    assert TuningCache().path == tmp_path / "env" / TuningCache.FILENAME
    assert TuningCache(tmp_path / "arg").path == tmp_path / "arg" / TuningCache.FILENAME
    TuningCache().store("k", GemmConfig())
    assert TuningCache().load("k") == GemmConfig()


def test_tuning_cache_round_trips_every_field(tmp_path):
    """A stored config (vendor knobs, persistent form, footprint) loads back equal from a
    fresh cache object; other entries and the extra info are kept; the file is versioned JSON."""
    cuda = GemmConfig(
        BLOCK_M=64,
        BLOCK_N=128,
        BLOCK_K=32,
        GROUP_M=4,
        num_warps=8,
        num_stages=4,
        persistent=True,
        num_sms=100,
        smem_bytes=98304,
        maxnreg=128,
    )
    hip = config_space("hip")[3].replace(persistent=True, num_sms=200)
    k1 = TuningCache.key("NVIDIA H200", torch.bfloat16, 4096, 1024, 512, True, "ieee")
    k2 = TuningCache.key("AMD Instinct MI300X", torch.float32, 100, 200, 300, True, "ieee")
    k3 = TuningCache.key("NVIDIA H200", torch.float32, 4096, 1024, 512, False, "tf32")
    assert len({k1, k2, k3}) == 3
    assert k3 == "NVIDIA H200|fp32|tiled|tf32|4096x1024x512"
    TuningCache(tmp_path).store(k1, cuda, time_ms=1.5)
    TuningCache(tmp_path).store(k2, hip)
    TuningCache(tmp_path).store(k3, default_config("cuda"))
    fresh = TuningCache(tmp_path)
    assert fresh.load(k1) == cuda and fresh.load(k2) == hip and fresh.load(k3) == default_config("cuda")
    assert fresh.load("missing") is None
    assert fresh.entries()[k1]["time_ms"] == 1.5
    data = json.loads((tmp_path / TuningCache.FILENAME).read_text())
    assert data["version"] == TuningCache.VERSION and set(data["entries"]) == {k1, k2, k3}
    # overwrite in place; no temp files left behind (the lock file stays, empty)
    TuningCache(tmp_path).store(k1, cuda.replace(smem_bytes=None))
    assert TuningCache(tmp_path).load(k1).smem_bytes is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [TuningCache.FILENAME, TuningCache.LOCK_FILENAME]


def test_default_cache_dir_order(monkeypatch, tmp_path):
    monkeypatch.setenv("COKIT_CACHE_DIR", str(tmp_path / "c"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("COKIT_CACHE_DIR")
    assert default_cache_dir() == tmp_path / "x" / "cokit"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert default_cache_dir() == tmp_path / "h" / ".cache" / "cokit"


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"entries": 3}', ""])
def test_corrupt_cache_is_ignored_with_warning(tmp_path, content):
    (tmp_path / TuningCache.FILENAME).write_text(content)
    cache = TuningCache(tmp_path)
    bench, calls = _count_bench()
    with pytest.warns(UserWarning, match="ignoring corrupt GEMM tuning cache"):
        best, _ = autotune(config_space("cuda")[:2], lambda c: None, bench, cache=cache, key="k")
    assert len(calls) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rewritten: valid now
        assert cache.load("k") == best


def test_bad_cache_entry_is_ignored_with_warning(tmp_path):
    (tmp_path / TuningCache.FILENAME).write_text(json.dumps({"entries": {"k": {"config": {"BLOCK_Q": 1}}}}))
    with pytest.warns(UserWarning, match="ignoring bad tuning cache entry"):
        assert TuningCache(tmp_path).load("k") is None


def test_autotune_skips_failing_configs():
    configs = config_space("cuda")[:3]

    def run(cfg):
        if cfg is configs[0]:
            raise RuntimeError("out of resources")

    best, timings = autotune(configs, run, lambda fn: (fn(), 1.0)[1])
    assert best == configs[1] and len(timings) == 2
    with pytest.raises(RuntimeError, match="no config ran"):
        autotune(configs[:1], run, lambda fn: (fn(), 1.0)[1])


# ---------------------------------------------------------------------- custom op
def test_matmul_autograd_through_the_kernel(device):
    a = torch.randn(17, 65, device=device, requires_grad=True)
    b = torch.randn(65, 33, device=device, requires_grad=True)
    bias = torch.randn(33, device=device, requires_grad=True)
    out = matmul(a, b, bias)
    g = torch.randn_like(out)
    out.backward(g)
    _check(a.grad, g, b.detach().t())
    _check(b.grad, a.detach().t(), g)
    torch.testing.assert_close(bias.grad, g.sum(0))


def test_matmul_opcheck(device):
    a, b, bias = (torch.randn(*s, device=device) for s in ((9, 20), (20, 7), (7,)))
    torch.library.opcheck(torch.ops.cokit.matmul.default, (a, b, bias, "ieee", False))
    torch.library.opcheck(torch.ops.cokit.matmul.default, (a.t().contiguous().t(), b, None, "tf32", True))


@pytest.mark.slow
def test_matmul_torch_compile_fullgraph(device):
    a = torch.randn(17, 65, device=device, requires_grad=True)
    b = torch.randn(65, 33, device=device, requires_grad=True)
    bias = torch.randn(33, device=device, requires_grad=True)
    fn = torch.compile(lambda x, y, z: matmul(x, y, z), fullgraph=True)
    out = fn(a, b, bias)
    _check(out.detach(), a.detach(), b.detach(), bias.detach())
    out.sum().backward()
    torch.testing.assert_close(bias.grad, torch.full((33,), 17.0, device=device))
    assert a.grad is not None and b.grad is not None
    dyn = torch.compile(lambda x, y: matmul(x, y).sum(), fullgraph=True, dynamic=True, backend="aot_eager")
    for M, K, N in ((5, 7, 3), (6, 9, 4)):
        x, y = torch.randn(M, K, device=device), torch.randn(K, N, device=device)
        torch.testing.assert_close(dyn(x, y), (x @ y).sum(), **FP32_SUM_CLOSE)


@pytest.mark.skipif(not INTERPRETER, reason="fakes a GPU through the interpreter (CPU only)")
def test_gpu_tuning_flow_with_a_fake_device(monkeypatch, tmp_path):
    """gemm() without a config on a 'GPU' (faked: sm_90 limits, interpreter execution, a fake
    timer): the pruned config space is timed once, the winner persists in the JSON cache under
    COKIT_CACHE_DIR, and the second call does not tune again."""
    import cokit.triton_kernels.gemm as G

    monkeypatch.setattr(G, "kernel_path", lambda device=None: "cuda")
    monkeypatch.setattr(G, "_limits_for", lambda path, device: arch_limits("sm_90"))
    monkeypatch.setattr(G, "cached_device_name", lambda index: "FakeGPU")
    bench, calls = _count_bench()
    monkeypatch.setattr(G, "bench_gpu", bench)
    monkeypatch.setenv("COKIT_CACHE_DIR", str(tmp_path))
    a, b = torch.randn(64, 48, dtype=torch.float16), torch.randn(48, 40, dtype=torch.float16)
    candidates = prune_configs(config_space("cuda"), torch.float16, arch_limits("sm_90"), 64, 40, 48)
    _check(gemm(a, b), a, b)
    assert len(calls) == len(candidates) >= 2
    entries = TuningCache(tmp_path).entries()
    assert list(entries) == ["FakeGPU|fp16|tiled|ieee|64x64x64"]
    _check(gemm(a, b), a, b)
    assert len(calls) == len(candidates)  # second run: cache hit, nothing timed
    gemm(a, b, persistent=True)  # the persistent form is tuned under its own key
    assert "FakeGPU|fp16|persistent|ieee|64x64x64" in TuningCache(tmp_path).entries()


@pytest.mark.gpu
def test_gpu_tuning_persists_and_is_reused(tmp_path, device):
    """On a real GPU: gemm() without a config times the pruned space once, stores the winner
    under this device's key, and the second call reuses it (no new entry, same result)."""
    a = torch.randn(256, 192, dtype=torch.float16, device=device)
    b = torch.randn(192, 160, dtype=torch.float16, device=device)
    c = gemm(a, b, cache_dir=tmp_path)
    _check(c, a, b)
    entries = TuningCache(tmp_path).entries()
    assert len(entries) == 1
    (key,) = entries
    assert key.endswith("|fp16|tiled|ieee|256x256x256") and entries[key]["candidates"] >= 1
    best = TuningCache(tmp_path).load(key)
    assert best is not None
    torch.testing.assert_close(gemm(a, b, cache_dir=tmp_path), gemm(a, b, config=best), rtol=0, atol=0)
    assert TuningCache(tmp_path).entries() == entries
