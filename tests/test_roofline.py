"""The compression kernels' static estimate (cokit info --kernels): bytes per element from each
build's signature, blocks per SM from the occupancy calculator, the roofline per chip."""

from __future__ import annotations

import pytest

from cokit.triton_kernels.compile_only import kernel_specs
from cokit.triton_kernels.roofline import CHIPS, NOMINAL_RANKS, bytes_per_element, estimates


def test_every_shipped_build_has_a_byte_count_from_its_element_types():
    for target in ("sm_80", "sm_90", "gfx942"):
        for label, _fn, sig, constexprs, _options in kernel_specs(target):
            nbytes = bytes_per_element(label, sig, constexprs)
            assert nbytes is not None and nbytes > 0, label


def test_byte_counts_per_kernel_family():
    dct = {"src_ref": "*bf16", "dst_ref": "*fp32"}
    assert bytes_per_element("dct_encode_2d[w4s1]", dct, {}) == 6.0
    enc = {"delta_ref": "*fp32", "grad_ref": "*bf16"}
    assert bytes_per_element("ef_encode_1d[w8s1]", enc, {}) == 2 + 2 * 4
    dec = {"param_ref": "*fp32", "indices": "*i16", "values": "*fp16"}
    got = bytes_per_element("ef_decode_2d[w8]", dec, {"BLOCK_W": 64, "TWO_D": True, "K_POW2": 32})
    assert got == pytest.approx(2 * 4 + NOMINAL_RANKS * 32 * 4 / 64**2)
    assert bytes_per_element("sm_copy", {"src": "*fp32", "dst": "*fp32"}, {}) == 8.0
    assert bytes_per_element("gemm", {}, {}) is None
    with pytest.raises(ValueError, match="not a pointer"):
        bytes_per_element("sm_copy", {"src": "i32", "dst": "*fp32"}, {})


def test_estimates_use_the_occupancy_calculator_and_each_chips_bandwidth():
    row = {"name": "k", "target": "sm_90", "num_warps": 8, "num_stages": 1, "registers": 128}
    (est,) = estimates([{**row, "shared_bytes": 100_000, "bytes_per_element": 8.0}])
    assert est["blocks_per_sm"] == 2 and est["limited_by"] == "shared memory"  # 2 x ~100 kB in 228 kB
    h100, h200 = dict(CHIPS["sm_90"])["H100"], dict(CHIPS["sm_90"])["H200"]
    assert est["roofline_ms_per_1e9"] == {
        "H100": pytest.approx(8 / h100 * 1e3),
        "H200": pytest.approx(8 / h200 * 1e3),
    }
    (amd,) = estimates([{**row, "target": "gfx942", "shared_bytes": 0, "bytes_per_element": None}])
    assert amd["roofline_ms_per_1e9"] == {"MI300X": None} and amd["blocks_per_sm"] >= 1
