"""cokit: Triton kernels for compressed and overlapped distributed training."""

__version__ = "0.1.0"
