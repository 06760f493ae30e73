"""C2C, cache-to-cache fusion: one model hands its understanding to another through the KV cache.

Two fusers, one interface (`fuse(src_cache, tgt_cache, layer_mask=None, src_tenant=None, tgt_tenant=None,
allow_cross_tenant=False, dp=None)`, in place on the receiver's cache; `fused_layers(src, tgt)` pure, trainable):
- `C2CFuser` (lowrank.py): the seed's per-layer low-rank `CacheProjector` + sigmoid `LayerGate` blend, for caches
  of the same head count and head_dim;
- `C2CProjectorFuser` (projector.py): the paper's per-receiver-layer `C2CProjector` (thu-nics/C2C), for models
  of different head counts, head dims and depths (last-aligned layers; alignment.py for tokens too).
Serving paths: pipeline.py (prompt caches, the paper's recipe) and request_fusion.py (running engine requests).
Safety (tenants, redaction, DP) in safety.py; checkpoints (thu-nics layout, seed state dicts, safetensors) in
porting.py. Training (distillation to the full-context receiver) lives apart in `cortexstream.training.c2c`:
distill.py (task, loss), data.py (held-out example sets), train.py (on the shared loop); CLI `cortexstream train
c2c`. README.md states the
guarantees and their limits.
"""

from cortexstream.c2c.alignment import TokenAligner, k_nearest, last_aligned
from cortexstream.c2c.fusion import CacheFuser, read_layers
from cortexstream.c2c.lowrank import C2CFuser, CacheProjector, LayerGate
from cortexstream.c2c.projector import C2CProjector, C2CProjectorFuser
from cortexstream.c2c.safety import DPConfig, check_tenants, dp_epsilon

__all__ = [
    "C2CFuser", "C2CProjector", "C2CProjectorFuser", "CacheFuser", "CacheProjector", "DPConfig", "LayerGate",
    "TokenAligner", "check_tenants", "dp_epsilon", "k_nearest", "last_aligned", "read_layers",
]
