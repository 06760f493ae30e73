"""Custom kernels for the engine's hot paths: Metal bodies in metal/, pure-MLX references, automatic dispatch.

- `evict_gather.evict_gather` / `evict_gather.compact_layer`: eviction compaction inside the arena (kernel a)
- `compress_gather.compress_gather`, `compress_gather.pack_windows`: compressor gather + first Linear + ReLU,
  sidecar window packing (kernel b)
- `paged_attention.paged_attention`: decode attention through block tables, GQA-aware, optional H2O column sums
  (kernels c, d)

Each has `<name>_reference` (pure MLX, what runs on Linux), `<name>_metal` (mx.fast.metal_kernel, macOS) and
`<name>_launch` (the launch description both the Metal wrapper and the C++ test shim execute). Import them from
their modules: the functions share the modules' names, so this package does not re-export them. The default
choice is `dispatch.kernel_backend()`: Metal when available unless CORTEXSTREAM_KERNELS=reference.
"""

from cortexstream.kernels.dispatch import ENV_VAR, kernel_backend, kernel_backend_description, resolve_backend

__all__ = ["ENV_VAR", "kernel_backend", "kernel_backend_description", "resolve_backend"]
