"""pytest plugin (enabled in pyproject's addopts): rerun the test process with the Linux CPU tuning the CLI gets.

Loaded with `-p` so it runs before pytest captures stdout and before anything imports MLX, whose Linux wheel
links the reference BLAS: `backend.enable_linux_cpu_tuning()` re-executes the process with OpenBLAS, the
small-batch kernel and MLX's vectorised JIT. No-op on macOS, without those libraries, or with
CORTEXSTREAM_NO_OPENBLAS=1 (CI's plain run: the engine without any of it).
"""

from cortexstream.backend import enable_linux_cpu_tuning

enable_linux_cpu_tuning()
