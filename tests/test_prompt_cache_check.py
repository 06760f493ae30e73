"""Prompt caches: saved files are checked against their own tensors before anything is allocated, user metadata
cannot shadow ours, writes are atomic, and a cache handed to generation must fit the model (issue #24 repro 3, 6
and the foreign-cache case of 12)."""

from __future__ import annotations

import json
import os
import struct

import mlx.core as mx
import pytest

import cortexstream
from cortexstream.errors import InvalidArgumentError, ModelLoadError
from cortexstream.kv.prompt_cache import load_prompt_cache, make_prompt_cache, save_prompt_cache
from tiny_models import tiny_model


@pytest.fixture()
def saved(tiny, tmp_path):
    model, _ = tiny
    cache = make_prompt_cache(model)
    model(mx.array([[5, 6, 7, 8, 9]]), cache=cache)
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, cache, {"note": "hello"})
    return path, len(model.layers)


def rewrite_info(path: str, **changes) -> None:
    """Rewrite the `cortexstream` metadata entry of a saved cache, keeping its tensors."""
    blob = open(path, "rb").read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    info = json.loads(header["__metadata__"]["cortexstream"])
    info.update(changes)
    header["__metadata__"]["cortexstream"] = json.dumps(info)
    raw = json.dumps(header).encode()
    open(path, "wb").write(struct.pack("<Q", len(raw)) + raw + blob[8 + n:])


def test_roundtrip_still_works_with_user_metadata(saved):
    path, layers = saved
    cache, meta = load_prompt_cache(path, return_metadata=True)
    assert len(cache) == layers and cache[0].offset == 5 and cache[0].size() == 5 and meta == {"note": "hello"}


@pytest.mark.parametrize("changes, field", [
    (lambda n: {"lengths": [10**9] * n}, "'lengths'"),
    (lambda n: {"num_layers": 10**6}, "'num_layers'"),
    (lambda n: {"offsets": [-5] * n}, "'offsets'"),
    (lambda n: {"lengths": "abc"}, "'lengths'"),
    (lambda n: {"offsets": [True] * n}, "'offsets'"),
    (lambda n: {"num_layers": n - 1}, "'num_layers'"),
    (lambda n: {"offsets": [2**40] * n}, "'offsets'"),
    (lambda n: {"format": "other/9"}, "format"),
])
def test_lying_metadata_is_refused_before_allocation(saved, changes, field):
    path, layers = saved
    rewrite_info(path, **changes(layers))
    with pytest.raises(ModelLoadError, match=field) as info:
        load_prompt_cache(path)
    assert str(info.value).startswith(path)


def test_metadata_that_is_not_json_or_missing_is_refused(saved, tmp_path):
    path, _ = saved
    blob = open(path, "rb").read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    header["__metadata__"]["cortexstream"] = "{not json"
    raw = json.dumps(header).encode()
    open(path, "wb").write(struct.pack("<Q", len(raw)) + raw + blob[8 + n:])
    with pytest.raises(ModelLoadError, match="not JSON"):
        load_prompt_cache(path)
    plain = str(tmp_path / "plain.safetensors")
    mx.save_safetensors(plain, {"0.keys": mx.zeros((1, 2, 3, 16))})
    with pytest.raises(ModelLoadError, match="not a CortexStream prompt cache"):
        load_prompt_cache(plain)


def test_reserved_metadata_key_is_refused_at_save(tiny, tmp_path):
    model, _ = tiny
    cache = make_prompt_cache(model)
    model(mx.array([[1, 2]]), cache=cache)
    path = str(tmp_path / "r.safetensors")
    with pytest.raises(InvalidArgumentError, match="reserved"):
        save_prompt_cache(path, cache, {"cortexstream": "x"})
    with pytest.raises(InvalidArgumentError, match="str -> str"):
        save_prompt_cache(path, cache, {"n": 3})
    assert not os.path.exists(path)


def test_save_is_atomic_and_leaves_no_temporary_files(tiny, tmp_path, monkeypatch):
    model, _ = tiny
    cache = make_prompt_cache(model)
    model(mx.array([[1, 2, 3]]), cache=cache)
    path = str(tmp_path / "a.safetensors")
    save_prompt_cache(path, cache)
    before = open(path, "rb").read()

    def broken(*_args, **_kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(mx, "save_safetensors", broken)
    with pytest.raises(OSError, match="disk full"):
        save_prompt_cache(path, cache)
    assert open(path, "rb").read() == before and os.listdir(tmp_path) == ["a.safetensors"]


def test_cache_with_fewer_layers_than_the_model_is_refused(tiny):
    model, tokenizer = tiny
    short = make_prompt_cache(model)[:1]
    with pytest.raises(InvalidArgumentError, match="prompt_cache: has 1 layer caches, the model has 2"):
        cortexstream.generate(model, tokenizer, "hello", max_tokens=2, prompt_cache=short)


def test_cache_made_for_another_model_is_refused(tiny):
    model, tokenizer = tiny
    other = tiny_model(seed=3, num_key_value_heads=4, head_dim=8, hidden_size=32)
    with pytest.raises(InvalidArgumentError, match="another model"):
        cortexstream.generate(model, tokenizer, "hello", max_tokens=2, prompt_cache=make_prompt_cache(other))


def test_make_prompt_cache_checks_its_model_argument():
    with pytest.raises(InvalidArgumentError, match="model: expected an mlx-lm model"):
        make_prompt_cache("x")


def test_a_private_cache_that_cannot_fit_in_memory_is_refused_with_the_numbers(tiny):
    model, _ = tiny
    with pytest.raises(InvalidArgumentError, match=r"max_tokens: 1000000000000 tokens need .* GiB of KV arena "
                                                   r"\(512 bytes per token\), this machine has .* tokens fit"):
        make_prompt_cache(model, max_tokens=10**12)


def test_memory_check_rule(monkeypatch):
    from cortexstream.kv.memory_check import check_kv_fits

    check_kv_fits(900, 1, "n", memory_bytes=1000)  # exactly the 90 % share fits
    with pytest.raises(InvalidArgumentError, match="n: 901 tokens need"):
        check_kv_fits(901, 1, "n", memory_bytes=1000)
