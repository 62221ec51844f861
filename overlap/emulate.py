"""One GPU, no peer: an **emulated** communication side for occupancy studies.

A collective kernel is a memory-bound loop on a few SMs; :class:`EmulatedComm` stands in for
it with a copy of ``nbytes``:

* ``copy-kernel`` (GPU): :func:`cokit.triton_kernels.sm_copy.sm_copy`, a persistent copy on
  ``n_sms`` programs (``exclusive_sms=True`` reserves a whole SM's shared memory per program,
  so it occupies exactly ``n_sms`` SMs) -- competes with compute for SMs, like NCCL;
* ``d2h`` (GPU): a device-to-host copy into pinned memory -- uses a copy engine, no SMs
  (the PCIe/NVLink side of communication without SM contention);
* ``thread-copy`` (CPU): a copy on a helper thread, so a CPU run overlaps something real.

Everything built from it is labelled as emulation (``emulated = True``, ``label`` says
"EMULATED"): it measures contention for the GPU, not a network.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from typing import Any

import torch

from cokit.triton_kernels._checks import check_int

from .streams import _device

__all__ = ["EMULATION_KINDS", "EmulatedComm"]

#: kinds per device type.
EMULATION_KINDS = {"cuda": ("copy-kernel", "d2h"), "cpu": ("thread-copy",)}


class _FutureHandle:
    """A ``concurrent.futures.Future`` with the ``wait()`` of a ``dist.Work``."""

    def __init__(self, future: concurrent.futures.Future) -> None:
        self.future = future

    def wait(self) -> None:
        self.future.result()


class EmulatedComm:
    """A callable that starts an emulated transfer of ``nbytes`` and returns a handle (None
    for stream-ordered GPU work: run it under a :class:`~cokit.overlap.streams.CommStream`)."""

    emulated = True

    def __init__(
        self,
        nbytes: int,
        device: torch.device | str | int | None = None,
        *,
        kind: str | None = None,
        n_sms: int | None = None,
        passes: int = 1,
        exclusive_sms: bool = False,
    ) -> None:
        self.device = _device(device)
        allowed = EMULATION_KINDS[self.device.type]
        self.kind = kind or allowed[0]
        if self.kind not in allowed:
            raise ValueError(
                f"kind={self.kind!r} is not available on {self.device.type}; allowed: {', '.join(allowed)}"
            )
        check_int("nbytes", nbytes, 4)
        check_int("passes", passes)
        if n_sms is not None and self.kind != "copy-kernel":
            raise ValueError(f"n_sms applies to the copy-kernel emulation only, not {self.kind!r}")
        if exclusive_sms and self.kind != "copy-kernel":
            raise ValueError(f"exclusive_sms applies to the copy-kernel emulation only, not {self.kind!r}")
        self.nbytes = nbytes - nbytes % 4
        self.passes = passes
        self.n_sms = n_sms
        self.smem_bytes: int | None = None
        n = self.nbytes // 4
        self.src = torch.randn(n, device=self.device)
        self.dst = torch.empty_like(self.src)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        if self.kind == "copy-kernel":
            from cokit.triton_kernels.backend import device_limits

            limits = device_limits(self.device)
            if n_sms is not None and not 1 <= n_sms <= limits.num_sms:
                raise ValueError(f"n_sms={n_sms} is invalid; allowed: 1 to {limits.num_sms} on {limits.name}")
            self.n_sms = n_sms or limits.num_sms
            if exclusive_sms:
                from cokit.triton_kernels.occupancy import smem_for_blocks

                self.smem_bytes = smem_for_blocks(limits, 1)
        elif self.kind == "d2h":
            self.dst = torch.empty(n, dtype=self.src.dtype, pin_memory=True)
        else:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="cokit-emulated-comm"
            )

    @property
    def label(self) -> str:
        """What this emulation is, marked EMULATED."""
        mb = self.nbytes / 2**20
        if self.kind == "copy-kernel":
            excl = ", one program per SM" if self.smem_bytes is not None else ""
            what = f"copy kernel on {self.n_sms} SMs{excl}"
        elif self.kind == "d2h":
            what = "device-to-host copy (copy engine, no SMs)"
        else:
            what = "copy on a CPU helper thread"
        return f"EMULATED communication: {what}, {mb:.2f} MiB x {self.passes} pass(es)"

    def __call__(self) -> Any:
        if self.kind == "copy-kernel":
            from cokit.triton_kernels.sm_copy import sm_copy

            sm_copy(self.src, self.dst, n_sms=self.n_sms, passes=self.passes, smem_bytes=self.smem_bytes)
            return None
        if self.kind == "d2h":
            for _ in range(self.passes):
                self.dst.copy_(self.src, non_blocking=True)
            return None
        assert self._pool is not None

        def work() -> None:
            for _ in range(self.passes):
                self.dst.copy_(self.src)

        return _FutureHandle(self._pool.submit(work))

    def verify(self) -> bool:
        """True when the last transfer delivered the source (call after waiting for it)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return bool(torch.equal(self.dst.to(self.src.device), self.src))

    def close(self) -> None:
        """Stop the helper thread (CPU)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __del__(self) -> None:  # pragma: no cover - best effort
        with contextlib.suppress(Exception):  # interpreter shutdown: the pool may be gone
            self.close()
