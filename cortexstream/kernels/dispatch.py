"""Which implementation of the custom kernels runs: the Metal kernels or the pure-MLX reference.

Metal is chosen when `mx.metal.is_available()`; the environment variable `CORTEXSTREAM_KERNELS` overrides it:
`reference` forces the reference everywhere (to rule a kernel out while debugging, or to compare), `metal`
demands Metal and fails loudly without it, `auto` (or unset) decides from the device. Every public kernel
function also takes `backend=` for one call. `kernel_backend()` is what `cortexstream info` prints.
"""

from __future__ import annotations

import os

ENV_VAR = "CORTEXSTREAM_KERNELS"
METAL = "metal"
REFERENCE = "reference"
_CHOICES = ("auto", METAL, REFERENCE)


def metal_available() -> bool:
    """True when MLX can run Metal kernels in this process (an Apple GPU and a Metal-enabled MLX build)."""
    try:
        import mlx.core as mx

        return bool(mx.metal.is_available())
    except Exception:  # an MLX build without the metal module
        return False


def _requested(backend: str | None) -> str:
    choice = (backend if backend is not None else os.environ.get(ENV_VAR, "auto")).strip().lower() or "auto"
    if choice not in _CHOICES:
        source = "backend=" if backend is not None else f"{ENV_VAR}="
        raise ValueError(f"{source}{choice!r}: must be one of {', '.join(_CHOICES)}")
    return choice


def resolve_backend(backend: str | None = None) -> str:
    """`metal` or `reference` for one call: `backend` if given, else the environment, else the device."""
    choice = _requested(backend)
    if choice == REFERENCE:
        return REFERENCE
    if metal_available():
        return METAL
    if choice == METAL:
        raise RuntimeError(f"Metal kernels requested ({ENV_VAR}=metal or backend='metal') but Metal is unavailable")
    return REFERENCE


def kernel_backend() -> str:
    """The backend the kernels use by default in this process: `metal` or `reference`."""
    return resolve_backend(None)


def kernel_backend_description() -> str:
    """One line for `cortexstream info`: the backend and why it was chosen."""
    choice = _requested(None)
    if choice == REFERENCE:
        return f"reference (pure MLX; forced by {ENV_VAR}=reference)"
    if metal_available():
        return "metal (custom Metal kernels; set CORTEXSTREAM_KERNELS=reference for the pure-MLX path)"
    if choice == METAL:
        return f"unavailable: {ENV_VAR}=metal but there is no Metal device"
    return "reference (pure MLX; no Metal device)"
