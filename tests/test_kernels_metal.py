"""The parity tests of test_kernels.py, run with the real Metal kernels (`mx.fast.metal_kernel`) instead of the
C++ shim. Skipped without Metal; on a Mac this is the check the shim cannot make (see metal/README.md).
"""

from __future__ import annotations

import pytest

from cortexstream.kernels.dispatch import metal_available
from cortexstream.kernels.launch import KernelLaunch, KernelSpec, execute, run_metal
from test_kernels import (  # noqa: F401  (collected here again, with this module's kernel_runner)
    test_compress_gather_matches_reference,
    test_evict_gather_matches_reference,
    test_pack_windows_matches_reference,
    test_paged_attention_ignores_what_padding_blocks_hold,
    test_paged_attention_matches_reference,
)

pytestmark = pytest.mark.skipif(not metal_available(), reason="no Metal device: the Metal kernels need a Mac")


@pytest.fixture
def kernel_runner():
    def metal(spec: KernelSpec, launch: KernelLaunch):
        return execute(spec, launch, run_metal)

    return metal
