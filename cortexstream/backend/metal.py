"""The Metal backend: an Apple GPU. Nothing to hold per step; decode attention through the paged-attention kernel
when the custom kernels run on Metal (kernels/dispatch.py; CORTEXSTREAM_KERNELS=reference turns them off)."""

from __future__ import annotations

from cortexstream.backend.attention import AttentionStrategy, MetalAttention
from cortexstream.backend.compute import BackendKind, ComputeBackend


class MetalBackend(ComputeBackend):
    kind = BackendKind.METAL

    def __init__(self, attention: MetalAttention | None = None) -> None:
        super().__init__(attention or MetalAttention())

    @classmethod
    def create(cls, override: AttentionStrategy | None = None) -> "MetalBackend":
        """Decided from this process's kernel choice (`kernels.dispatch.resolve_backend`)."""
        from cortexstream.kernels.dispatch import METAL, resolve_backend

        return cls(MetalAttention(paged_kernel=resolve_backend() == METAL, override=override))
