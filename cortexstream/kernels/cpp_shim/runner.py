"""Compile a kernel body (metal/*.metal) as C++ and run a `KernelLaunch` on the CPU: the Metal-free test path.

The generated translation unit reproduces MLX's `metal_kernel` signature rules (mlx/backend/metal/custom_kernel:
`write_signature`): same parameter names and order, `<name>_shape/_strides/_ndim` only when the body mentions them,
0-d inputs by reference, and a thread attribute parameter for every attribute name found in the body. The body
file itself is `#include`d between the braces, so the text under test is byte for byte the text Metal gets.
It is built with AddressSanitizer + UBSan when available, linked with driver.cpp (compiled once), and run as a
separate process that reads the inputs from files and writes the outputs back.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import numpy as np

from cortexstream.kernels.launch import KernelLaunch, KernelSpec

SHIM_DIR = Path(__file__).resolve().parent
CACHE_ENV = "CORTEXSTREAM_SHIM_CACHE"
SANITIZE_ENV = "CORTEXSTREAM_SHIM_SANITIZE"

# (attribute, type) in the order MLX appends them to a signature.
ATTRIBUTES = (
    ("dispatch_quadgroups_per_threadgroup", "uint"), ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"), ("grid_origin", "uint3"), ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"), ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"), ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"), ("thread_index_in_quadgroup", "uint"), ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"), ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"), ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"), ("threads_per_grid", "uint3"), ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)
EMULATED = {  # the attributes driver.cpp computes (cs::Thread)
    "thread_position_in_grid", "thread_position_in_threadgroup", "threadgroup_position_in_grid", "threads_per_grid",
    "threads_per_threadgroup", "threadgroups_per_grid", "thread_index_in_threadgroup", "thread_index_in_simdgroup",
    "simdgroup_index_in_threadgroup", "threads_per_simdgroup",
}
MAX_CONSTANT_ARRAY_SIZE = 8  # MLX binds smaller inputs in the constant address space

_CPP_TYPES = {
    mx.float32: ("float", np.float32), mx.float16: ("float16_t", np.float16), mx.bfloat16: ("bfloat16_t", np.uint16),
    mx.int32: ("int32_t", np.int32), mx.uint32: ("uint32_t", np.uint32), mx.int64: ("int64_t", np.int64),
    mx.uint8: ("uint8_t", np.uint8), mx.bool_: ("bool", np.bool_),
}
_COLLECTIVE = re.compile(r"\bsimd_\w+\s*\(|\bthreadgroup_barrier\s*\(")


class ShimError(RuntimeError):
    """The kernel failed to compile, crashed, tripped a sanitizer, or diverged at a collective."""


def compiler() -> str | None:
    """The C++ compiler to use ($CXX, else g++), or None when there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))


def _cpp_type(dtype: mx.Dtype) -> str:
    if dtype not in _CPP_TYPES:
        raise ShimError(f"dtype {dtype} is not supported by the C++ shim")
    return _CPP_TYPES[dtype][0]


def _template_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return _cpp_type(value)  # an mx.Dtype


def _template_kind(value: object) -> str:
    return "bool" if isinstance(value, bool) else "int" if isinstance(value, int) else "typename"


def translation_unit(spec: KernelSpec, launch: KernelLaunch) -> str:
    """The C++ source: the MLX-shaped signature around the included body, and a main() that launches it."""
    source = spec.source()
    params: list[str] = []
    args: list[str] = []
    loads: list[str] = []
    for i, (name, arr) in enumerate(zip(spec.input_names, launch.inputs, strict=True)):
        ctype = _cpp_type(arr.dtype)
        space = "constant" if arr.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        loads.append(f"  auto in{i} = run.input<{ctype}>({i});")
        if arr.ndim == 0:
            params.append(f"const {space} {ctype}& {name}")
            args.append(f"*in{i}.data")
            continue
        params.append(f"const {space} {ctype}* {name}")
        args.append(f"in{i}.data")
        for suffix, decl, arg in (("_shape", "const constant int*", ".shape.data()"),
                                  ("_strides", "const constant int64_t*", ".strides.data()"),
                                  ("_ndim", "const constant int&", ".ndim")):
            if name + suffix in source:
                params.append(f"{decl} {name}{suffix}")
                args.append(f"in{i}{arg}")
    for i, (name, dtype) in enumerate(zip(spec.output_names, launch.output_dtypes, strict=True)):
        ctype = _cpp_type(dtype)
        loads.append(f"  auto out{i} = run.output<{ctype}>({i});")
        params.append(f"device {ctype}* {name}")
        args.append(f"out{i}.data")
    for attr, kind in ATTRIBUTES:
        if attr in source:
            if attr not in EMULATED:
                raise ShimError(f"{spec.source_file}: the shim does not emulate the attribute {attr}")
            params.append(f"{kind} {attr}")
            args.append(f"th.{attr}")
    func = f"custom_kernel_{spec.name}"
    lines = ['#include "driver.h"', '#include "metal_keywords.h"']
    if spec.header_path is not None:
        lines.append(f'#include "{spec.header_path}"')
    if launch.template:
        lines.append("template <" + ", ".join(f"{_template_kind(v)} {k}" for k, v in launch.template) + ">")
    lines.append(f"void {func}(\n    " + ",\n    ".join(params) + ") {")
    lines.append(f'#include "{spec.source_path}"')
    lines.append("}")
    instance = func + ("<" + ", ".join(_template_value(v) for _, v in launch.template) + ">" if launch.template else "")
    cooperative = "true" if _COLLECTIVE.search(source) else "false"
    lines += ["", "int main(int argc, char** argv) {", "  cs::Run run(argc, argv);", *loads,
              "  auto body = [&](const cs::Thread& th) {", f"    {instance}({', '.join(args)});", "  };",
              f"  run.launch({cooperative}, body);", "  run.save();", "  return 0;", "}", ""]
    return "\n".join(lines)


def _cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(tempfile.gettempdir(), f"cortexstream-kernel-shim-{os.getuid()}")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


@lru_cache(maxsize=None)
def sanitizers_available() -> bool:
    """True when the compiler can build and run AddressSanitizer + UBSan programs here."""
    cxx = compiler()
    if cxx is None or os.environ.get(SANITIZE_ENV, "1") == "0":
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp, "probe.cpp"), Path(tmp, "probe")
        src.write_text("int main() { return 0; }\n")
        built = subprocess.run([cxx, "-fsanitize=address,undefined", str(src), "-o", str(exe)],
                               capture_output=True).returncode == 0
        return built and subprocess.run([str(exe)], capture_output=True, env=_run_env()).returncode == 0


def _flags() -> list[str]:
    flags = ["-std=c++17", "-O1", "-g", "-pthread", "-Wall", "-Wno-unused-variable", "-Werror=return-type",
             f"-I{SHIM_DIR}"]
    if sanitizers_available():
        flags += ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]
    return flags


def _run_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)  # the test process may preload OpenBLAS; ASan must come first or not at all
    env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=0:exitcode=23"
    env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1:exitcode=24"
    return env


def _compile(args: list[str], what: str) -> None:
    result = subprocess.run(args, capture_output=True, text=True)
    if result.returncode != 0:
        raise ShimError(f"{what} does not compile as C++:\n{result.stderr[-6000:]}")


def _shim_digest(cxx: str) -> str:
    digest = hashlib.sha256(" ".join([cxx, *_flags()]).encode())
    for path in sorted(SHIM_DIR.glob("*.h")) + [SHIM_DIR / "driver.cpp"]:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:20]


def _driver_object(cxx: str) -> Path:
    """driver.cpp compiled once per flags and shim version: the heavy part, shared by every kernel program."""
    obj = _cache_dir() / f"driver-{_shim_digest(cxx)}.o"
    if not obj.exists():
        with tempfile.TemporaryDirectory(dir=_cache_dir()) as tmp:
            _compile([cxx, *_flags(), "-c", str(SHIM_DIR / "driver.cpp"), "-o", str(Path(tmp, "driver.o"))],
                     "cpp_shim/driver.cpp")
            os.replace(Path(tmp, "driver.o"), obj)
    return obj


def build(spec: KernelSpec, launch: KernelLaunch) -> Path:
    """Compile (or reuse from the cache) the program for this spec and template instantiation."""
    cxx = compiler()
    if cxx is None:
        raise ShimError("no C++ compiler (g++) on PATH")
    unit = translation_unit(spec, launch)
    digest = hashlib.sha256()
    for part in (unit, spec.source(), spec.header(), _shim_digest(cxx)):
        digest.update(part.encode())
    exe = _cache_dir() / f"{spec.name}-{digest.hexdigest()[:20]}"
    if exe.exists():
        return exe
    driver = _driver_object(cxx)
    with tempfile.TemporaryDirectory(dir=_cache_dir()) as tmp:
        src = Path(tmp, "kernel.cpp")
        src.write_text(unit)
        _compile([cxx, *_flags(), str(src), str(driver), "-o", str(Path(tmp, "kernel"))], spec.source_file)
        os.replace(Path(tmp, "kernel"), exe)
    return exe


def _to_numpy(arr: mx.array) -> np.ndarray:
    if arr.dtype == mx.bfloat16:
        arr = arr.view(mx.uint16)
    return np.ascontiguousarray(np.array(arr))


def run_launch(
    spec: KernelSpec, launch: KernelLaunch, *, reverse: bool = False, timeout: float = 600
) -> list[mx.array]:
    """Execute `launch` with the C++-compiled body; same contract as `launch.run_metal`."""
    exe = build(spec, launch)
    with tempfile.TemporaryDirectory() as tmp:
        meta = [f"grid {' '.join(map(str, launch.grid))}", f"threadgroup {' '.join(map(str, launch.threadgroup))}"]
        for i, arr in enumerate(launch.inputs):
            data = _to_numpy(arr)
            data.tofile(os.path.join(tmp, f"in{i}.bin"))
            meta.append(f"input {i} {data.itemsize} {arr.ndim} {' '.join(map(str, arr.shape))}".rstrip())
        for i, (shape, dtype) in enumerate(zip(launch.output_shapes, launch.output_dtypes)):
            meta.append(f"output {i} {np.dtype(_CPP_TYPES[dtype][1]).itemsize} {len(shape)} "
                        f"{' '.join(map(str, shape))}".rstrip())
        Path(tmp, "meta.txt").write_text("\n".join(meta) + "\n")
        try:
            result = subprocess.run([str(exe), tmp, "1" if reverse else "0"], capture_output=True, text=True,
                                    timeout=timeout, env=_run_env())
        except subprocess.TimeoutExpired as exc:
            raise ShimError(f"{spec.name}: timed out after {timeout}s (a collective that never completes?)") from exc
        if result.returncode != 0:
            raise ShimError(f"{spec.name} failed (exit {result.returncode}):\n{result.stderr[-6000:]}")
        outputs = []
        for i, (shape, dtype) in enumerate(zip(launch.output_shapes, launch.output_dtypes)):
            raw = np.fromfile(os.path.join(tmp, f"out{i}.bin"), dtype=_CPP_TYPES[dtype][1]).reshape(shape)
            out = mx.array(raw)
            outputs.append(out.view(mx.bfloat16) if dtype == mx.bfloat16 else out)
        return outputs
