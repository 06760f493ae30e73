"""An installed copy is the checkout: the wheel carries the Metal sources, the TUI and the shipped weights under
`cortexstream/`, installs nothing as a top-level `apps` or `bench`, and its package list matches the source tree.
What users run is installed, the laboratory is not: no diagnostic benchmark, no asset fetcher, and no httpx among
the runtime dependencies (it is the `bench` extra's).

The wheel is built from a copy of the sources in a temporary folder (so no `build/` lands in the checkout) with
the setuptools of this environment; the full install into a fresh venv and a `cortexstream generate` from
outside the tree is a manual check (it needs the dependencies' wheels), reported with the change.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]
# pyproject.toml's build-time mapping of folders outside cortexstream/ into the package
MAPPED = {"cortexstream.tui": ROOT / "apps" / "tui", "cortexstream.kernels.metal": ROOT / "metal"}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _packages_in_tree() -> set[str]:
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "cortexstream").rglob("__init__.py")}
    for name, folder in MAPPED.items():
        found |= {".".join([name, *p.parent.relative_to(folder).parts]) for p in folder.rglob("__init__.py")}
    return {name for name in found if "__pycache__" not in name}


def test_the_package_list_covers_every_package_folder():
    setuptools = _pyproject()["tool"]["setuptools"]
    assert set(setuptools["packages"]) == _packages_in_tree()
    assert {k: (ROOT / v).resolve() for k, v in setuptools["package-dir"].items()} == MAPPED


def test_the_editable_install_finds_the_tui_and_the_metal_sources():
    from cortexstream.kernels.launch import metal_dir
    from cortexstream.tui.app import CortexStreamApp

    assert Path(CortexStreamApp.CSS_PATH).is_file()
    assert {p.name for p in metal_dir().glob("*.metal")} == {p.name for p in (ROOT / "metal").glob("*.metal")}


def _build_wheel(src: Path, out: Path) -> None:
    """`pip wheel` of the copied sources: with this environment's setuptools when it builds wheels by itself
    (>= 70), else in pip's isolated build environment (which downloads pyproject.toml's build requirements)."""
    try:
        import setuptools

        offline = int(setuptools.__version__.split(".")[0]) >= 70
    except ImportError:
        offline = False
    command = [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "-q", "-w", str(out)]
    run = subprocess.run(command + (["--no-build-isolation"] if offline else []), capture_output=True, text=True,
                         timeout=900)
    if run.returncode != 0 and not offline and any(
            word in run.stderr for word in ("No matching distribution", "Could not find a version", "connection")):
        pytest.skip("no setuptools >= 70 here and the build requirements cannot be downloaded")
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "results")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("cortexstream", "apps", "metal", "bench"):  # bench/ too: it must stay out of the wheel
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    _build_wheel(src, out)
    (built,) = out.glob("cortexstream-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel_files(wheel) -> set[str]:
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


def test_the_wheel_carries_metal_sources_tui_and_weights(wheel_files):
    for source in (ROOT / "metal").glob("*.metal"):
        assert f"cortexstream/kernels/metal/{source.name}" in wheel_files
    for module in (ROOT / "apps" / "tui").rglob("*.py"):
        assert f"cortexstream/tui/{module.relative_to(ROOT / 'apps' / 'tui').as_posix()}" in wheel_files
    assert "cortexstream/tui/app.tcss" in wheel_files
    for folder in ("compression", "sidecar"):
        for weights in (ROOT / "cortexstream" / folder / "weights").glob("*.safetensors"):
            assert f"cortexstream/{folder}/weights/{weights.name}" in wheel_files
    assert "cortexstream/compression/weights/manifest.json" in wheel_files
    assert "cortexstream/kernels/cpp_shim/metal_shim.h" in wheel_files
    assert "cortexstream/kernels/small_gemm.c" in wheel_files  # built on the user's machine on first use


def test_the_wheel_installs_nothing_outside_cortexstream(wheel_files):
    tops = {name.split("/")[0] for name in wheel_files}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"cortexstream"}


def test_the_wheel_holds_no_diagnostic_benchmark_and_no_asset_fetcher(wheel, wheel_files):
    from bench import DIAGNOSTICS

    installed = {Path(name).parts[2].removesuffix(".py") for name in wheel_files
                 if name.startswith("cortexstream/benchmarks/") and len(Path(name).parts) > 2}
    assert installed and not installed & set(DIAGNOSTICS)
    assert not [name for name in wheel_files if name.startswith("bench/")]
    with zipfile.ZipFile(wheel) as zf:  # by what it does, whatever its name: what installed code runs pip download
        fetchers = {name for name in wheel_files if name.endswith(".py")
                    and '"pip", "download"' in zf.read(name).decode("utf-8")}
    # The evaluation text (gensim's Wikipedia test file, `bench quality`/`frontier` and the trainers read it) is the
    # one download the installed package makes; the anonymous wheels of the C2C sharer are bench/assets.py's.
    assert fetchers == {"cortexstream/evaluation/wiki_corpus.py"}


def _requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        (metadata,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        text = zf.read(metadata).decode("utf-8")
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def test_httpx_is_an_extra_not_a_runtime_dependency(wheel):
    requirements = _requirements(wheel)
    runtime = [r for r in requirements if "extra ==" not in r]
    assert runtime and not [r for r in runtime if r.lower().startswith("httpx")]
    assert [r for r in requirements if r.lower().startswith("httpx") and "extra == \"bench\"" in r]
