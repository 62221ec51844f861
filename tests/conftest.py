"""Test setup: Triton kernels run on CPU tensors through the interpreter.

TRITON_INTERPRET must be set before any kernel module is imported, so it is set here, at
the top of the first file pytest loads. Compile-only checks run in subprocesses without it.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seeded():
    """A fresh but reproducible random stream for every test."""
    torch.manual_seed(0x5EED)
    yield
