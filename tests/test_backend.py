"""Backend selection and architecture limits."""

import pytest
import torch

from cokit.triton_kernels import backend

needs_interpreter = pytest.mark.skipif(
    not backend.interpreter_enabled(), reason="compares the CPU interpreter path; this run uses the GPU"
)


@needs_interpreter
def test_cpu_tensors_use_the_interpreter_in_tests(monkeypatch):
    assert backend.kernel_path("cpu") == "interpreter"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert backend.kernel_path("cpu") == "torch"


def test_unsupported_device_is_rejected():
    with pytest.raises(ValueError, match=r"cuda .* or cpu"):
        backend.kernel_path("meta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_device_without_gpu():
    with pytest.raises(RuntimeError, match="torch sees no GPU"):
        backend.kernel_path("cuda")
    with pytest.raises(RuntimeError, match="arch_limits"):
        backend.device_limits()


def test_named_targets():
    h100 = backend.arch_limits("sm_90")
    assert (h100.max_shared_per_block, h100.warp_size, h100.num_sms) == (232448, 32, 132)
    assert backend.arch_limits("sm_80").max_shared_per_block == 166912
    mi300 = backend.arch_limits("gfx942")
    assert (mi300.backend, mi300.warp_size, mi300.max_shared_per_block) == ("hip", 64, 65536)
    assert backend.arch_limits("gfx90a").num_sms == 110
    assert mi300.target_name == "gfx942" and h100.target_name == "sm_90"
    with pytest.raises(ValueError, match="known targets: sm_80, sm_90, gfx90a, gfx942"):
        backend.arch_limits("sm_75")


@needs_interpreter
def test_torch_path_matches_interpreter(monkeypatch):
    """The pure-torch path (CPU without interpreter) gives the kernels' results."""
    from cokit.triton_kernels.dct import dct_encode
    from cokit.triton_kernels.error_feedback import ef_decode, ef_encode
    from cokit.triton_kernels.topk import chunk_topk

    x, g = torch.randn(96, 128), torch.randn(96, 128)

    def run():
        d, p = [torch.ones(96, 128)], [torch.ones(96, 128)]
        idx, vals = ef_encode(d, [g], beta=0.9, lr=0.1, k=8)
        ef_decode(p, idx[None], vals[None], lr=0.01, k=8, use_sign=False)
        return dct_encode(x), chunk_topk(dct_encode(x), 8), idx, vals, d[0], p[0]

    interp = run()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch_path = run()
    assert torch.allclose(interp[0], torch_path[0], atol=1e-5)
    assert torch.equal(interp[1][0], torch_path[1][0])
    assert torch.equal(interp[2], torch_path[2])
    for a, b in zip(interp[3:], torch_path[3:], strict=True):
        assert torch.allclose(a, b, atol=1e-5)


@needs_interpreter
def test_compat_interpreter_converts_scalar_arguments():
    """After import, the interpreter turns a scalar argument into an int (range(n) in a
    kernel), whatever the triton version (3.6 needs _compat's fix, 3.9 does it itself)."""
    from triton.runtime import interpreter

    from cokit.triton_kernels import _compat

    assert _compat._index_works(interpreter._patch_lang_tensor, interpreter._LangPatchScope)


def test_compat_compile_options():
    from cokit._versions import MIN_VERSIONS, parse_version
    from cokit.triton_kernels._compat import TRITON_VERSION_STRING, compile_option_names

    assert parse_version(TRITON_VERSION_STRING)[:2] >= MIN_VERSIONS["triton"]
    assert {"num_warps", "num_stages", "maxnreg"} <= compile_option_names("cuda", 90, 32)
    assert {"num_warps", "waves_per_eu", "matrix_instr_nonkdim"} <= compile_option_names("hip", "gfx942", 64)
    assert "waves_per_eu" not in compile_option_names("cuda", 90, 32)
