"""What MLX runs on in this process: device, Metal, BLAS, version; and the buffer cache an engine needs."""

from __future__ import annotations

from dataclasses import dataclass

from cortexstream.backend.blas import loaded_blas


@dataclass(frozen=True)
class BackendInfo:
    device: str
    metal: bool
    blas: str
    mlx_version: str


def backend_info() -> BackendInfo:
    import mlx.core as mx

    metal = bool(mx.metal.is_available())
    return BackendInfo(
        device=str(mx.default_device()),
        metal=metal,
        blas="Metal (GPU)" if metal else loaded_blas(),
        mlx_version=getattr(mx, "__version__", "unknown"),
    )


def on_cpu() -> bool:
    """True when MLX computes on the CPU: the default device is the CPU, or there is no Metal device."""
    import mlx.core as mx

    return mx.default_device() == mx.cpu or not mx.metal.is_available()


def ensure_buffer_cache(min_bytes: int = 1 << 30) -> None:
    """Raise MLX's buffer-cache limit to at least `min_bytes` (capped at 10% of the memory limit).

    On the CPU backend MLX's default is small; a batched decode step allocates and frees more than that (gathered
    K/V, logits), so without this every step gives its buffers back to the OS and page-faults them in again
    (bench/results/arena_attention.md).
    """
    import mlx.core as mx

    target = min(min_bytes, mx.get_memory_limit() // 10)
    current = mx.set_cache_limit(target)  # returns the previous limit
    if current > target:
        mx.set_cache_limit(current)


def limit_buffer_memory(memory_bytes: int, cache_bytes: int) -> tuple[int, int]:
    """Set MLX's memory limit (a guideline: evaluation waits for work in flight to finish rather than allocate
    past it) and its buffer-cache limit (freed buffers kept for reuse; past it they go back to the OS). Both are
    process-wide. Returns the previous (memory, cache) limits."""
    import mlx.core as mx

    for name, value in (("memory_bytes", memory_bytes), ("cache_bytes", cache_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name}: {value!r} must be an integer >= 0")
    previous_memory = mx.set_memory_limit(memory_bytes)
    previous_cache = mx.set_cache_limit(cache_bytes)
    return previous_memory, previous_cache
