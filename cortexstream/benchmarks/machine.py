"""The one machine description every benchmark writes into its results, and the model named without local paths.

A result file says what ran and where: platform, CPU model and cores, Python and library versions, the MLX device
and the BLAS MLX uses. It never holds a path of the machine that made it (a home folder, a checkout, a venv):
`model_record` names the model by its file and where it came from instead of where it lies.
"""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def machine() -> dict[str, Any]:
    """What the numbers of a run depend on, apart from the code: one record for every benchmark."""
    import mlx.core as mx
    import mlx_lm
    import numpy as np

    from cortexstream.backend import backend_info
    from cortexstream.kernels.mlx_jit import active as jit_flags_active
    from cortexstream.kernels.small_gemm import interposer

    info = backend_info()
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cores_note": "shared with other workloads",
        "python": platform.python_version(),
        "device": info.device,
        "blas": info.blas,
        # The engine's CPU small-batch matmul (backend/small_batch.py) was preloaded in this process.
        "small_batch_kernel": interposer() is not None,
        # MLX's CPU JIT kernels built with vectorising flags (kernels/mlx_jit.py); False: MLX's own flags.
        "mlx_jit_flags": jit_flags_active(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "numpy": np.__version__,
    }


def machine_sentence(m: dict[str, Any]) -> str:
    """One line for a report. Reads records written before this description was shared, too."""
    cores = m.get("cpu_count", m.get("cores"))
    cpu = m.get("cpu", m.get("processor", "unknown CPU"))
    return f"{m['platform']}, {cpu}, {cores} cores (shared), MLX {m['mlx']}, BLAS: {m['blas']}"


_SITE_PACKAGE = re.compile(r"[/\\]site-packages[/\\]([^/\\]+)[/\\]")


def neutral_source(source: str) -> str:
    """A model source as a result file may name it: hub ids and bare names as given, files by their name and
    origin (an installed package, the benchmark asset cache), never by the folder they lie in."""
    if not (os.path.isabs(source) or os.path.exists(source)):
        return source
    name = os.path.basename(source.rstrip("/\\")) or source
    package = _SITE_PACKAGE.search(source)
    if package:
        return f"{name} (from the {package.group(1).replace('_', '-')} package)"
    if f"{os.sep}.cache{os.sep}cortexstream{os.sep}" in source:
        return f"{name} (benchmark asset)"
    return name


def model_record(model: Any) -> dict[str, Any]:
    """`models.loader.model_info` of a loaded model, with its source named by `neutral_source`."""
    from cortexstream.models.loader import model_info

    record = model_info(model).as_dict()
    if isinstance(record.get("source"), str):
        record["source"] = neutral_source(record["source"])
    return record


__all__ = ["cpu_model", "machine", "machine_sentence", "model_record", "neutral_source"]
