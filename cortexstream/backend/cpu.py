"""The CPU backend: attention thresholds, and on Linux the small-batch matmul kernel and OpenBLAS's thread count.

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

from cortexstream.backend.attention import AttentionStrategy, CpuAttention
from cortexstream.backend.blas import loaded_blas, openblas_threads
from cortexstream.backend.compute import BackendKind, ComputeBackend
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


class CpuBackend(ComputeBackend):
    """MLX's CPU backend. `small_batch_rows`: the kernel's row limit while this engine steps (0: not used)."""

    kind = BackendKind.CPU

    def __init__(self, small_batch_rows: int = 0, attention: CpuAttention | None = None) -> None:
        if small_batch_rows < 0:
            raise ValueError(f"small_batch_rows: {small_batch_rows} must be >= 0")
        super().__init__(attention or CpuAttention())
        self.small_batch_rows = small_batch_rows
        self._held = False

    @classmethod
    def create(cls, small_batch_rows: int, override: AttentionStrategy | None = None) -> "CpuBackend":
        return cls(small_batch_rows, CpuAttention(override=override))

    @property
    def holds_kernel(self) -> bool:
        """Whether this backend holds the small-batch kernel now (between a step's start and its release)."""
        return self._held

    def begin_step(self) -> None:
        if self.small_batch_rows > 0 and not self._held:
            small_gemm.acquire(self.small_batch_rows)
            self._held = True

    def end_step(self, in_flight: bool) -> None:
        if not in_flight:
            self._release()

    def before_forward(self, rows: int) -> None:
        if self._held:
            small_gemm.before_pass(rows)

    def close(self) -> None:
        self._release()

    def _release(self) -> None:
        if self._held:
            self._held = False
            small_gemm.release()

    def describe(self) -> str:
        from cortexstream.kernels import mlx_jit

        if self.small_batch_rows > 0:
            kernel = f"small-batch kernel <= {self.small_batch_rows} rows"
        elif small_gemm.interposer() is not None:
            kernel = "small-batch kernel off"
        else:
            kernel = "small-batch kernel not preloaded"
        blas = loaded_blas()
        threads = openblas_threads()
        blas += f" {threads} threads" if threads else ""
        jit = "MLX JIT flags vectorised" if mlx_jit.active() else "MLX JIT default flags"
        return f"cpu ({kernel}, {blas}, {jit}, {self._attention.describe()})"
