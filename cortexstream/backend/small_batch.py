"""The CPU backend's small-batch matmul kernel on Linux: its row limit, an engine's hold on it, OpenBLAS's threads.

The small-batch kernel (kernels/small_gemm.c) is a BLAS interposer preloaded by the re-exec (backend/tuning.py);
its row limit is 0 (plain BLAS) unless an engine holds it, so mlx-lm's own calls on the same model between steps
keep MLX's matmul. An engine holds it from a step's start until it has no decode pass in flight: with pipelining a
step's graph is evaluated partly after `step()` returns, and every matmul of the engine must take the same path
(the kernel and BLAS round differently), whatever the timing. The limit is one value per process, so another
thread running a model *while* an engine steps gets the kernel for its few-row matmuls too: the same products up
to float rounding order.

While held, OpenBLAS runs one thread per call in the passes whose rows all fit the kernel (there only attention's
small products are left to BLAS, and a second BLAS thread fights the kernel's OpenMP worker for a core); passes
with more rows keep OpenBLAS's own count, since their Linear layers go to BLAS. Why, and what it was measured to
do: docs/linux-cpu.md, bench/results/throughput_itl.md, bench/results/small_gemm.md.
"""

from __future__ import annotations

from cortexstream.backend.device import on_cpu
from cortexstream.errors import InvalidArgumentError
from cortexstream.kernels import small_gemm

# Rows up to which the kernel beats OpenBLAS on the CPUs measured (bench/results/small_gemm.md).
DEFAULT_MAX_ROWS = 12


def small_batch_usable() -> bool:
    """True when this process has the interposer preloaded and runs MLX on the CPU."""
    return small_gemm.interposer() is not None and on_cpu()


def resolve_small_batch_rows(value: int | str) -> int:
    """`Engine(small_batch_matmul=...)` as a row limit: "auto" is DEFAULT_MAX_ROWS where the kernel is usable and
    0 (off) elsewhere; an int >= 0 is the limit itself (0: off)."""
    if value == "auto":
        return DEFAULT_MAX_ROWS if small_batch_usable() else 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgumentError(f"small_batch_matmul: {value!r} must be 'auto' or an integer >= 0 (0 turns the "
                                   "small-batch kernel off)")
    if value > 0 and not small_batch_usable():
        raise InvalidArgumentError(
            f"small_batch_matmul: {value} asks for the CPU small-batch kernel, which this process does not have "
            "(it is preloaded by the cortexstream command and the test suite on Linux with a C compiler, and only "
            "used on the CPU backend); use 'auto' or 0")
    return min(value, small_gemm.MAX_ROWS)


class SmallBatchHold:
    """One engine's claim on the kernel, at `rows` rows (0: never holds). Held from `acquire` to `release`; the
    count of holders in the process is the C library's, so holds of several engines (any thread) nest."""

    def __init__(self, rows: int) -> None:
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
            raise ValueError(f"rows: {rows!r} must be an integer >= 0")
        self.rows = rows
        self._held = False

    @property
    def held(self) -> bool:
        return self._held

    def acquire(self) -> None:
        if self.rows > 0 and not self._held:
            small_gemm.acquire(self.rows)
            self._held = True

    def release(self) -> None:
        """Idempotent: a hold is given back once."""
        if self._held:
            self._held = False
            small_gemm.release()

    def before_pass(self, rows: int) -> None:
        """While held: OpenBLAS's thread count for a pass of `rows` rows (kernels/small_gemm.c)."""
        if self._held:
            small_gemm.before_pass(rows)

    def describe(self) -> str:
        if self.rows > 0:
            return f"small-batch kernel <= {self.rows} rows"
        return "small-batch kernel " + ("off" if small_gemm.interposer() is not None else "not preloaded")
