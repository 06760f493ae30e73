"""The engine's decode matmuls on the CPU: the small-batch kernel (kernels/small_gemm.c) on during its steps.

A decode step multiplies one row per running sequence by every weight of the model. BLAS sgemm packs each weight
before multiplying, which for a few rows costs about as much as the multiply; the kernel streams each weight once
(measured on this 2-core machine: `bench/results/small_gemm.md`). It sits in front of the BLAS as a process-wide
interposer whose row limit is 0 (plain BLAS) unless an engine is inside `Engine.step`: the engine owns this choice,
so mlx-lm's functions called on the same model between steps keep MLX's own matmul. The limit is one value per
process, so another thread running the model *while* an engine steps gets the kernel for its few-row matmuls too:
the same products up to float rounding order.

While an engine holds the kernel, OpenBLAS runs one thread per call in the passes whose rows all fit the kernel
(`blas_threads_for_pass`): there the only BLAS calls left are attention's small products. Passes with more rows
(a large batch, a long chunk, a prefill alone) keep OpenBLAS's own count, since their Linear layers go to BLAS. On a
2-core machine the kernel's OpenMP worker and OpenBLAS's worker (which idles by yielding the CPU in a loop)
otherwise take cores from each other whenever a pass alternates between them, as a decode pass carrying a small
prefill chunk does. Measured per step (8 streams while a 2,048-token prompt is admitted, one round each, a
diagnostic): with two OpenBLAS threads 150-200 ms of system time and about 1,900 context switches in a 300 ms step,
and steps at random twice their neighbours' time; with one, 10 ms and 700, and no such steps. One thread for every
pass of a held step was tried first: 32-row decode steps then ran their Linear layers on one core (c=32 x 128
fell from 1.15x to 0.89x of mlx-lm). The benchmark: bench/results/throughput_itl.md.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

from cortexstream.backend import on_cpu, openblas_threads, set_openblas_threads
from cortexstream.errors import InvalidArgumentError
from cortexstream.kernels import small_gemm

# Rows up to which the kernel beats OpenBLAS on this CPU (bench/results/small_gemm.md).
DEFAULT_MAX_ROWS = 12

_lock = threading.Lock()
_active_steps = 0  # engines (any thread) holding the kernel; the limit drops to 0 when none does
_blas_threads = 0  # OpenBLAS's own thread count while engines hold the kernel (0: OpenBLAS absent or not held)


def usable() -> bool:
    """True when this process has the interposer preloaded and runs MLX on the CPU."""
    return small_gemm.interposer() is not None and on_cpu()


def resolve_small_batch_rows(value: int | str) -> int:
    """`Engine(small_batch_matmul=...)` as a row limit: "auto" is DEFAULT_MAX_ROWS where the kernel is usable and
    0 (off) elsewhere; an int >= 0 is the limit itself (0: off)."""
    if value == "auto":
        return DEFAULT_MAX_ROWS if usable() else 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(f"small_batch_matmul: {value!r} must be 'auto' or an integer >= 0 (0 turns the "
                                   "small-batch kernel off)")
    if value > 0 and not usable():
        raise InvalidArgumentError(
            f"small_batch_matmul: {value} asks for the CPU small-batch kernel, which this process does not have "
            "(it is preloaded by the cortexstream command and the test suite on Linux with a C compiler, and only "
            "used on the CPU backend); use 'auto' or 0")
    return min(value, small_gemm.MAX_ROWS)


class KernelHold:
    """One engine's claim on the kernel. Held from a step's start until the engine has no decode step in flight:
    with pipelining a step's graph is evaluated asynchronously, partly after `step()` returns, and every matmul
    of the engine must take the same path (the kernel and BLAS round differently), whatever the timing."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.held = False

    def acquire(self) -> None:
        global _active_steps, _blas_threads
        if self.rows <= 0 or self.held:
            return
        with _lock:
            _active_steps += 1
            small_gemm.set_row_limit(self.rows)
            if _active_steps == 1:
                _blas_threads = openblas_threads()  # each pass then picks its count (blas_threads_for_pass)
        self.held = True

    def release(self) -> None:
        global _active_steps, _blas_threads
        if not self.held:
            return
        with _lock:
            _active_steps -= 1
            if _active_steps == 0:
                small_gemm.set_row_limit(0)
                if _blas_threads:
                    set_openblas_threads(_blas_threads)
                _blas_threads = 0
        self.held = False

    def __del__(self) -> None:
        self.release()


def blas_threads_for_pass(rows: int) -> None:
    """Before building a forward pass of `rows` rows (decode rows plus chunk tokens) inside a held step: one
    OpenBLAS thread if the kernel takes all its Linear products, else OpenBLAS's own count. Without OpenBLAS or a
    held kernel: nothing. A pass still in flight from the previous step may finish under the new count, which
    changes its speed (OpenBLAS's threads split a product's rows and columns, not its sums)."""
    with _lock:
        if _blas_threads:
            set_openblas_threads(1 if rows <= small_gemm.row_limit() else _blas_threads)


def with_row_limit(method: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate `Engine.step`: the engine's `kernel_hold` is acquired for the step and released once nothing of
    the engine is in flight (also when the step raises)."""
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.kernel_hold.acquire()
        try:
            return method(self, *args, **kwargs)
        finally:
            if not self.has_in_flight:
                self.kernel_hold.release()
    return wrapper
