"""KV-cache compression: learned token-merging compressors (FastCache style) used by KV policies.

`compressor` (the MLPs, porting, export), `shipped` (weights in the package, by model shape), `objective` /
`data` / `train` (training in MLX against the full-cache model: `cortexstream train compressor`). The KV policy
that uses them is `cortexstream.policies.Compressor`.
"""

from cortexstream.compression.compressor import (
    CompressorConfig,
    KVCompressor,
    head_dim_of,
    map_fastcache_state_dict,
    segment_length,
)

__all__ = ["CompressorConfig", "KVCompressor", "head_dim_of", "map_fastcache_state_dict", "segment_length"]
