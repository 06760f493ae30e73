"""pytest plugin (enabled in pyproject's addopts): rerun the test process with OpenBLAS preloaded.

Loaded with `-p` so it runs before pytest captures stdout and before anything imports MLX, whose Linux wheel
links the reference BLAS (7-50x slower for float32 matmul). No-op on macOS, without OpenBLAS installed, or with
CORTEXSTREAM_NO_OPENBLAS=1.
"""

from cortexstream.backend import maybe_reexec_with_openblas

maybe_reexec_with_openblas()
