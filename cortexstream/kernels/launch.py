"""What a custom kernel launch is, independent of who executes it.

Each kernel module turns its arguments into a `KernelLaunch` (inputs, template arguments, grid, threadgroup,
output shapes and dtypes) with a `finish` step that turns the raw outputs into the result. On a Mac
`run_metal` hands the launch to `mx.fast.metal_kernel`; in the tests `cpp_shim.run_launch` executes the very same
launch with the body compiled as C++. So everything except the Metal compiler and the GPU is shared and tested.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Sequence

import mlx.core as mx
import numpy as np

METAL_DIR_ENV = "CORTEXSTREAM_METAL_DIR"

TemplateValue = int | bool | mx.Dtype


# The repository's top-level `metal/` folder installs as this data package (pyproject.toml maps it at build
# time), so a wheel and an editable checkout find the sources the same way and nothing climbs the tree.
METAL_PACKAGE = "cortexstream.kernels.metal"


def metal_dir() -> Path:
    """Folder of the kernel body sources: $CORTEXSTREAM_METAL_DIR, else the installed `cortexstream.kernels.metal`."""
    override = os.environ.get(METAL_DIR_ENV)
    if override:
        return Path(override)
    spec = importlib.util.find_spec(METAL_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the Metal kernel sources ({METAL_PACKAGE}) are not installed: install the package "
                                f"(`pip install .` or `pip install -e .`) or set {METAL_DIR_ENV}")
    return Path(spec.origin).parent


@dataclass(frozen=True)
class KernelSpec:
    """A kernel as `mx.fast.metal_kernel` sees it: name, parameter names, and the body source file."""

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    source_file: str
    header_file: str | None = None

    @property
    def source_path(self) -> Path:
        return metal_dir() / self.source_file

    @property
    def header_path(self) -> Path | None:
        return metal_dir() / self.header_file if self.header_file else None

    def source(self) -> str:
        return self.source_path.read_text(encoding="utf-8")

    def header(self) -> str:
        path = self.header_path
        return path.read_text(encoding="utf-8") if path else ""


@dataclass
class KernelLaunch:
    """One launch: MLX's `metal_kernel(...)(...)` keyword arguments plus the post-processing of its outputs."""

    inputs: list[mx.array]
    template: list[tuple[str, TemplateValue]]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: list[tuple[int, ...]]
    output_dtypes: list[mx.Dtype]
    finish: Callable[[list[mx.array]], Any] = field(default=lambda outs: outs)

    @property
    def empty(self) -> bool:
        """No thread to run (an empty input): outputs are zeros and nothing is dispatched."""
        return 0 in self.grid


Runner = Callable[[KernelSpec, KernelLaunch], Sequence[mx.array]]


def execute(spec: KernelSpec, launch: KernelLaunch, runner: Runner) -> Any:
    """Run `launch` with `runner` (Metal or the C++ shim) and post-process; empty launches never dispatch."""
    if launch.empty:
        outputs = [mx.zeros(shape, dtype) for shape, dtype in zip(launch.output_shapes, launch.output_dtypes)]
    else:
        outputs = list(runner(spec, launch))
    return launch.finish(outputs)


@lru_cache(maxsize=None)
def _metal_kernel(spec: KernelSpec) -> Any:
    # Built once per spec: every new metal_kernel object means a new Metal library (MLX docs).
    return mx.fast.metal_kernel(
        name=spec.name,
        input_names=list(spec.input_names),
        output_names=list(spec.output_names),
        source=spec.source(),
        header=spec.header(),
        ensure_row_contiguous=True,
    )


def run_metal(spec: KernelSpec, launch: KernelLaunch) -> list[mx.array]:
    """Execute on the GPU through `mx.fast.metal_kernel` (macOS with Metal only)."""
    return _metal_kernel(spec)(
        inputs=launch.inputs,
        template=launch.template,
        grid=launch.grid,
        threadgroup=launch.threadgroup,
        output_shapes=launch.output_shapes,
        output_dtypes=launch.output_dtypes,
    )


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def threadgroup_for(grid_x: int, grid_y: int, limit: int = 256) -> tuple[int, int, int]:
    """Threadgroup for the element-wise kernels: x covers a row (rounded up to the 32-wide SIMD, at most `limit`),
    y stacks rows until the group holds `limit` threads, so short rows still fill whole threadgroups."""
    x = max(32, min(limit, ceil_div(max(grid_x, 1), 32) * 32))
    return (x, max(1, min(limit // x, grid_y)), 1)


def as_index_array(values: Any) -> mx.array:
    """A block table / position list as an int32 MLX array (lists, numpy arrays and MLX arrays accepted)."""
    if isinstance(values, mx.array):
        return values.astype(mx.int32) if values.dtype != mx.int32 else values
    return mx.array(np.asarray(values, dtype=np.int32))


def arena_slots(table: mx.array, positions: mx.array, block_size: int) -> mx.array:
    """Arena slots of logical token positions through a block table: table[t // bs] * bs + t % bs."""
    return table[positions // block_size] * block_size + positions % block_size
