"""The fixed orthogonal rotation a quantized K or V side is stored in, and when a side uses it. Pure Python + numpy.

Why: a few channels of a head's keys (and, less, its values) carry most of the magnitude, so one group of 32-64
values spans a wide range and 4-bit codes spend their 16 levels on the outliers. Multiplying every row by an
orthogonal matrix `R` spreads each channel over all of them (QuaRot, TurboQuant): the range shrinks, the codes fit
the bulk, and nothing is lost in exact arithmetic because `R` is orthogonal. Attention needs no un-rotation of the
stored rows: `q . k = (q R) . (k R)` and `p V = (p (V R)) R^T`, so readers rotate the query and un-rotate the
output (a `[D, D]` product per query row), and only readers that want the true values (policies, merges) pay for
un-rotating rows.

The matrix: `R = diag(s) H / sqrt(D)`, H the Sylvester Walsh-Hadamard matrix and s a fixed pseudo-random sign per
channel, for head dims that are powers of two (every model this engine has met: 64, 128). It is applied as a fast
Walsh-Hadamard transform (`mx.hadamard_transform`: D log D operations per row, and each row's result does not
depend on how many rows are transformed together, which a batched matmul does not promise), so only the signs are
stored. It is the same in every process and version, because stored blocks (the prefix cache on disk, saved
prompt caches) are only valid under the rotation they were written with: `ROTATION_NAME` goes into the storage's
cache key, and a change of construction must change the name. Other head dims are not rotated (AUTO) or refused
(ON).
"""

from __future__ import annotations

import enum

import numpy as np

from cortexstream.errors import InvalidArgumentError

ROTATION_NAME = "hadamard1"  # names the construction below; stored blocks carry it through the cache key
_SEED = 0x5EED_C0DE


class Rotation(str, enum.Enum):
    """Which quantized sides are stored rotated. AUTO: 4-bit sides (where 16 levels cannot afford the outlier
    channels; 8-bit sides are within rounding of the float cache without it)."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


def rotation(value: "str | Rotation", argument: str) -> Rotation:
    """`value` as a Rotation; an unknown name is refused naming `argument`."""
    if isinstance(value, Rotation):
        return value
    try:
        return Rotation(str(value).strip().lower())
    except ValueError:
        choices = ", ".join(r.value for r in Rotation)
        raise InvalidArgumentError(f"{argument}: {value!r} is not a rotation; choose one of {choices}") from None


def rotation_supported(dim: int) -> bool:
    """Whether rows of width `dim` can be stored rotated (a power of two)."""
    return isinstance(dim, int) and not isinstance(dim, bool) and dim > 0 and dim & (dim - 1) == 0


def rotation_signs(dim: int) -> np.ndarray:
    """The fixed float32 signs `s` of the rotation of width `dim`."""
    if not rotation_supported(dim):
        raise InvalidArgumentError(f"head_dim: {dim!r} cannot be stored rotated (a power of two is needed); "
                                   "use rotate=off")
    return np.random.default_rng(_SEED + dim).choice(np.array([-1.0, 1.0], np.float32), dim)


def rotation_matrix(dim: int) -> np.ndarray:
    """The orthogonal float32 `[dim, dim]` matrix `R` rows are multiplied by (on the right) before quantizing, as
    an explicit matrix (the engine applies it as a transform; this is the reference)."""
    signs = rotation_signs(dim)
    hadamard = np.ones((1, 1), np.float32)
    while hadamard.shape[0] < dim:
        hadamard = np.block([[hadamard, hadamard], [hadamard, -hadamard]])
    return (signs[:, None] * hadamard / np.float32(np.sqrt(dim))).astype(np.float32)


__all__ = ["ROTATION_NAME", "Rotation", "rotation", "rotation_matrix", "rotation_signs", "rotation_supported"]
