"""Legacy names for the engine's use of the CPU small-batch kernel, until engine.py uses its `ComputeBackend`.

Remove after the switch: the kernel, its row limit and OpenBLAS's thread count now belong to `CpuBackend`
(backend/compute.py: `begin_step`, `end_step`, `before_forward`, `close`), and the count of holders to the C
interposer (kernels/small_gemm.c). These wrappers keep `Engine` working unchanged meanwhile.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from cortexstream.backend.small_batch import DEFAULT_MAX_ROWS, SmallBatchHold, resolve_small_batch_rows  # noqa: F401
from cortexstream.backend.small_batch import small_batch_usable as usable  # noqa: F401
from cortexstream.kernels import small_gemm


class KernelHold(SmallBatchHold):
    """One engine's claim on the kernel (legacy; `CpuBackend` holds a `SmallBatchHold` itself)."""

    def __del__(self) -> None:  # legacy safety net, gone with this module: CpuBackend releases explicitly only
        self.release()


def blas_threads_for_pass(rows: int) -> None:
    """Before building a forward pass of `rows` rows inside a held step (legacy; `CpuBackend.before_forward`)."""
    small_gemm.before_pass(rows)


def with_row_limit(method: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate `Engine.step` (legacy): the engine's `kernel_hold` is acquired for the step and released once
    nothing of the engine is in flight (also when the step raises)."""
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.kernel_hold.acquire()
        try:
            return method(self, *args, **kwargs)
        finally:
            if not self.has_in_flight:
                self.kernel_hold.release()
    return wrapper
