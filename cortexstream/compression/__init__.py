"""KV-cache compression: learned token-merging compressors (FastCache style) used by KV policies.

`compressor` (the MLPs, porting, export) and `shipped` (weights in the package, by model shape): what the KV
policy `cortexstream.policies.Compressor` loads. Training (objective, data, loop; `cortexstream train
compressor`) lives apart in `cortexstream.training.compression` and is never imported from here.
"""

from cortexstream.compression.compressor import (
    CompressorConfig,
    KVCompressor,
    head_dim_of,
    map_fastcache_state_dict,
    segment_length,
)

__all__ = ["CompressorConfig", "KVCompressor", "head_dim_of", "map_fastcache_state_dict", "segment_length"]
