"""What this process computes on, and the one object through which an engine uses the platform.

- `ComputeBackend.for_engine(...)` (compute.py): the engine's backend, `CpuBackend` or `MetalBackend`, with the
  decode-attention rule of each (attention.py) and, on Linux CPUs, the small-batch kernel (small_batch.py).
- `route_sdpa(model)` (sdpa.py): mlx-lm's attention call routed to caches that attend their own way.
- `enable_linux_cpu_tuning()` (tuning.py): the opt-in re-exec with OpenBLAS, the small-batch kernel and MLX's
  vectorised JIT; the only process-wide change, made by the CLI, the test suite's plugin and scripts that call it.
- BLAS and device facts for `cortexstream info` and benchmarks (blas.py, device.py).

Importing this package imports no MLX and changes nothing in the process.
"""

from cortexstream.backend.attention import ENV_VAR as ATTENTION_ENV_VAR
from cortexstream.backend.attention import AttentionStrategy, CpuAttention, MetalAttention, attention_for_device
from cortexstream.backend.blas import (
    OPENBLAS_CANDIDATES, find_openblas, loaded_blas, openblas_threads, set_openblas_threads,
)
from cortexstream.backend.compute import BackendKind, ComputeBackend, CpuBackend, MetalBackend, choose_kind
from cortexstream.backend.device import BackendInfo, backend_info, ensure_buffer_cache, on_cpu
from cortexstream.backend.small_batch import (
    DEFAULT_MAX_ROWS, SmallBatchHold, resolve_small_batch_rows, small_batch_usable,
)
from cortexstream.backend.sdpa import dispatch_sdpa, original_sdpa, route_sdpa
from cortexstream.backend.tuning import (
    DISABLE_ENV, OPENMP_SPIN, REEXEC_MARKER, enable_linux_cpu_tuning, maybe_reexec_with_openblas, preload_libraries,
)

__all__ = [
    "ATTENTION_ENV_VAR", "AttentionStrategy", "BackendInfo", "BackendKind", "ComputeBackend", "CpuAttention",
    "CpuBackend", "DEFAULT_MAX_ROWS", "DISABLE_ENV", "MetalAttention", "MetalBackend", "OPENBLAS_CANDIDATES",
    "OPENMP_SPIN", "REEXEC_MARKER", "SmallBatchHold", "attention_for_device", "backend_info", "choose_kind",
    "dispatch_sdpa", "enable_linux_cpu_tuning", "ensure_buffer_cache", "find_openblas", "loaded_blas",
    "maybe_reexec_with_openblas", "on_cpu", "openblas_threads", "original_sdpa", "preload_libraries",
    "resolve_small_batch_rows", "route_sdpa", "set_openblas_threads", "small_batch_usable",
]
