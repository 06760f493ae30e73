"""The compute backend: everything platform-specific an engine does, behind one object chosen when it is built.

An engine asks its backend four things and nothing else about the platform: hold what a step needs
(`begin_step` / `end_step`), prepare a forward pass of some rows (`before_forward`), which decode-attention strategy
a batch runs (`decode_attention`), and a line saying what it chose (`describe`). `close` releases what it holds;
`limit_memory` bounds MLX's allocations and buffer cache for a server under a memory budget.
All state is on the instance; what is genuinely one per process (the small-batch interposer's row limit and its
count of holders) lives in the preloaded C library (kernels/small_gemm.c), not in Python.

Kinds: `cpu` (MLX's CPU backend; on Linux with the small-batch kernel and OpenBLAS thread control when the process
was started with them, see backend/tuning.py), `metal` (an Apple GPU; the custom Metal kernels), and `cuda`
(named so that a CUDA backend has its place; never chosen today).
"""

from __future__ import annotations

import enum
from typing import Any

from cortexstream.backend.attention import AttentionChoice, AttentionStrategy, CpuAttention, MetalAttention
from cortexstream.backend.blas import loaded_blas, openblas_threads
from cortexstream.backend.small_batch import SmallBatchHold


class BackendKind(enum.Enum):
    CPU = "cpu"
    METAL = "metal"
    CUDA = "cuda"


def choose_kind(metal_available: bool, default_device_is_gpu: bool) -> BackendKind:
    """Metal when MLX has a Metal device and computes on it by default, else the CPU."""
    return BackendKind.METAL if metal_available and default_device_is_gpu else BackendKind.CPU


class ComputeBackend:
    """One per engine. Subclasses: `CpuBackend`, `MetalBackend` (below)."""

    kind: BackendKind

    def __init__(self, attention: AttentionChoice) -> None:
        self._attention = attention

    @classmethod
    def for_engine(cls, small_batch_matmul: int | str = "auto", *, model: Any = None) -> "ComputeBackend":
        """The backend for an engine built now: Metal when MLX computes on a Metal device, else the CPU.

        small_batch_matmul: `Engine(small_batch_matmul=...)`: "auto" (the CPU small-batch kernel where this process
        has it), 0 (off) or a row limit (an InvalidArgumentError where the kernel is not available).
        model: the engine's model; its mlx-lm modules get their SDPA routed through `dispatch_sdpa`
        (backend/sdpa.py), once, so that batch caches' attention hooks are called.
        Also raises MLX's buffer-cache limit (`ensure_buffer_cache`) and reads CORTEXSTREAM_BATCH_ATTENTION.
        """
        import mlx.core as mx

        from cortexstream.backend.attention import strategy_from_env
        from cortexstream.backend.device import ensure_buffer_cache
        from cortexstream.backend.sdpa import route_sdpa
        from cortexstream.backend.small_batch import resolve_small_batch_rows
        from cortexstream.kernels.dispatch import metal_available

        rows = resolve_small_batch_rows(small_batch_matmul)  # validated before anything changes
        override = strategy_from_env()
        kind = choose_kind(metal_available(), mx.default_device() == mx.gpu)
        backend: ComputeBackend
        if kind is BackendKind.METAL:
            backend = MetalBackend.create(override)
        else:
            backend = CpuBackend.create(rows, override)
        ensure_buffer_cache()
        if model is not None:
            route_sdpa(model)
        return backend

    def begin_step(self) -> None:
        """At the start of `Engine.step`."""

    def end_step(self, in_flight: bool) -> None:
        """At the end of `Engine.step`, also when it raised; `in_flight`: a pipelined pass of the engine is still
        being evaluated (what the step holds stays held until a step ends without one)."""

    def before_forward(self, rows: int) -> None:
        """Before building a forward pass of `rows` token rows (decode rows plus prompt-chunk tokens)."""

    def decode_attention(self) -> AttentionChoice:
        """The rule that picks a decode batch's attention strategy (`DecodeBatch(..., backend=self)` asks it)."""
        return self._attention

    def describe(self) -> str:
        """One line for `cortexstream info` and logs: the kind and what it chose."""
        return f"{self.kind.value} ({self._attention.describe()})"

    def close(self) -> None:
        """Release whatever the backend holds now; idempotent. A later step takes what it needs again."""

    def limit_memory(self, memory_bytes: int, cache_bytes: int) -> tuple[int, int]:
        """Bound what MLX allocates (`memory_bytes`, a guideline evaluation waits on) and the freed buffers it
        keeps for reuse (`cache_bytes`), for a process under a memory budget (engine/memory_budget.py). Applies to
        the whole process, after `for_engine` raised the cache for speed. Returns the previous limits."""
        from cortexstream.backend.device import limit_buffer_memory

        return limit_buffer_memory(memory_bytes, cache_bytes)


class CpuBackend(ComputeBackend):
    """MLX's CPU backend: the CPU attention rule, and on Linux the small-batch kernel held while the engine steps
    (backend/small_batch.py). `small_batch_rows`: the kernel's row limit for this engine (0: not used)."""

    kind = BackendKind.CPU

    def __init__(self, small_batch_rows: int = 0, attention: CpuAttention | None = None) -> None:
        super().__init__(attention or CpuAttention())
        self._kernel = SmallBatchHold(small_batch_rows)

    @classmethod
    def create(cls, small_batch_rows: int, override: AttentionStrategy | None = None) -> "CpuBackend":
        return cls(small_batch_rows, CpuAttention(override=override))

    @property
    def small_batch_rows(self) -> int:
        return self._kernel.rows

    @property
    def holds_kernel(self) -> bool:
        """Whether this backend holds the small-batch kernel now (from a step's start until its release)."""
        return self._kernel.held

    def begin_step(self) -> None:
        self._kernel.acquire()

    def end_step(self, in_flight: bool) -> None:
        if not in_flight:
            self._kernel.release()

    def before_forward(self, rows: int) -> None:
        self._kernel.before_pass(rows)

    def close(self) -> None:
        self._kernel.release()

    def describe(self) -> str:
        from cortexstream.kernels import mlx_jit

        threads = openblas_threads()
        blas = loaded_blas() + (f" {threads} threads" if threads else "")
        jit = "MLX JIT flags vectorised" if mlx_jit.active() else "MLX JIT default flags"
        return f"cpu ({self._kernel.describe()}, {blas}, {jit}, {self._attention.describe()})"


class MetalBackend(ComputeBackend):
    """An Apple GPU: nothing to hold per step; decode attention through the paged-attention kernel when the
    custom kernels run on Metal (kernels/dispatch.py; CORTEXSTREAM_KERNELS=reference turns them off)."""

    kind = BackendKind.METAL

    def __init__(self, attention: MetalAttention | None = None) -> None:
        super().__init__(attention or MetalAttention())

    @classmethod
    def create(cls, override: AttentionStrategy | None = None) -> "MetalBackend":
        """Decided from this process's kernel choice (`kernels.dispatch.resolve_backend`)."""
        from cortexstream.kernels.dispatch import METAL, resolve_backend

        return cls(MetalAttention(paged_kernel=resolve_backend() == METAL, override=override))
