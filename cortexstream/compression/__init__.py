"""KV-cache compression: learned token-merging compressors (FastCache style) used by KV policies."""

from cortexstream.compression.compressor import (
    CompressorConfig,
    KVCompressor,
    head_dim_of,
    map_fastcache_state_dict,
    segment_length,
)

__all__ = ["CompressorConfig", "KVCompressor", "head_dim_of", "map_fastcache_state_dict", "segment_length"]
