"""Test setup: where the kernels run, seeded randomness, and the ``gpu`` marker.

Without a GPU (our machines and CI), Triton kernels run on CPU tensors through the
interpreter: ``TRITON_INTERPRET`` must be set before any kernel module is imported, so it
is set here, in the first file pytest loads. With a CUDA or ROCm device visible, the same
kernel tests take the ``device`` fixture's GPU and run compiled kernels there
(``COKIT_TEST_DEVICE=cpu`` forces the interpreter anyway). Compile-only checks run in
subprocesses without the interpreter.
"""

import os

import pytest
import torch

GPU = torch.cuda.is_available() and os.environ.get("COKIT_TEST_DEVICE", "") != "cpu"
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

KERNEL_DEVICE = "cuda" if GPU else "cpu"  # torch calls ROCm devices "cuda" too


@pytest.fixture
def device() -> torch.device:
    """The device kernel tests put their tensors on: the GPU when there is one, else the CPU
    (where the kernels run in the Triton interpreter)."""
    return torch.device(KERNEL_DEVICE)


@pytest.fixture(autouse=True)
def _seeded():
    """A fresh but reproducible random stream for every test."""
    torch.manual_seed(0x5EED)
    yield


@pytest.fixture(autouse=True)
def _interpreter_setting_kept():
    """A test that changes ``TRITON_INTERPRET`` in this process fails, and the setting is put
    back: the kernel tests after it (in any order, on any pytest-xdist worker) would otherwise
    take the torch path. Rank functions set it in their own processes; tests use monkeypatch."""
    before = os.environ.get("TRITON_INTERPRET")
    yield
    after = os.environ.get("TRITON_INTERPRET")
    if after != before:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before
        pytest.fail(f"the test changed TRITON_INTERPRET in the test process ({before!r} -> {after!r})")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped when no GPU is visible."""
    if GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA or ROCm GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
