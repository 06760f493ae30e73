"""Kernel (b) wired into the merging policies: the compressor's merges go through `compress_gather` and the
sidecar's through `pack_windows`, reading the range through the sequence's block table.

On the reference path (Linux) the arena merge must equal the old read-then-merge for contiguous and fragmented
tables with a partial last block and several KV heads; with Metal reported available, the Metal branch runs with
the kernel bodies compiled as C++ (cortexstream/kernels/cpp_shim) and must give the same merges and the same
likelihoods end to end, and the kernels must really be called.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cortexstream.compression import CompressorConfig, KVCompressor
from cortexstream.evaluation.perplexity import token_nlls
from cortexstream.kernels import compress_gather as cg
from cortexstream.kernels import dispatch
from cortexstream.kernels.cpp_shim import compiler, run_launch
from cortexstream.kv.arena import KVArena
from cortexstream.kv.arena_config import ArenaConfig
from cortexstream.kv.sequence_kv import SequenceKV
from cortexstream.policies.compressor import Compressor
from cortexstream.policies.sidecar import Sidecar
from test_sidecar_policy import _weights
from tiny_models import random_token_ids

needs_gxx = pytest.mark.skipif(compiler() is None, reason="no C++ compiler (g++): the kernel shim cannot build")
LAYERS, HEADS, DIM, BS = 2, 3, 16, 4


def _compressor(factor: int = 4, seed: int = 0) -> KVCompressor:
    mx.random.seed(seed)
    comp = KVCompressor(CompressorConfig(LAYERS, DIM, factor, image=False))
    mx.eval(comp.parameters())
    return comp


def _sequence(tokens: int, fragmented: bool, seed: int = 0) -> SequenceKV:
    """A sequence of `tokens` random K/V (a partial last block) in an arena, contiguous or fragmented."""
    rng = np.random.default_rng(seed)
    arena = KVArena(ArenaConfig(LAYERS, HEADS, DIM, 24, BS))
    blocks = -(-tokens // BS)
    if fragmented:
        allocated = arena.allocator.allocate(blocks)
        seq = SequenceKV(arena, contiguous=False, blocks=[int(b) for b in rng.permutation(allocated)])
        assert seq.contiguous_first() is None
    else:
        seq = SequenceKV(arena, contiguous=True)
        seq.ensure_capacity(tokens)
    for layer in range(LAYERS):
        k, v = (mx.array(rng.standard_normal((HEADS, tokens, DIM)).astype(np.float32)) for _ in "kv")
        arena.write(layer, seq.blocks, 0, k, v)
    seq.lengths, seq.offsets = [tokens] * LAYERS, [tokens] * LAYERS
    mx.eval(arena.arrays())
    return seq


def _read_then_merge(policy, seq: SequenceKV, layer: int, start: int, end: int):
    keys, values = seq.arena.read(layer, seq.blocks, seq.lengths[layer])
    return policy.merge(layer, keys[:, start:end], values[:, start:end], np.ones(end - start))


def _policies(tmp_path):
    sidecar = _weights(tmp_path, window=4, num_kv_heads=HEADS)
    return {"compressor": Compressor(factor=4, weights=_compressor(), sinks=2, recent=4),
            "sidecar": Sidecar(window=4, sinks=2, recent=4, weights=sidecar)}


@pytest.mark.parametrize("fragmented", [False, True], ids=["contiguous", "fragmented"])
@pytest.mark.parametrize("name", ["compressor", "sidecar"])
def test_arena_merge_equals_read_then_merge_on_the_reference_path(tmp_path, monkeypatch, name, fragmented):
    monkeypatch.setattr(dispatch, "metal_available", lambda: False)
    policy = _policies(tmp_path)[name]
    seq = _sequence(23, fragmented)  # 6 blocks of 4, the last holding 3 tokens
    for layer in range(LAYERS):
        for start, end in ((2, 18), (3, 23)):  # unaligned to blocks; the second reaches the partial block
            got = policy.merge_from_arena(layer, seq.arena, seq.blocks, start, end, np.ones(end - start))
            want = _read_then_merge(policy, seq, layer, start, end)
            assert got.keys.shape == want.keys.shape == (HEADS, (end - start) // 4, DIM)
            for a, b in ((got.keys, want.keys), (got.values, want.values), (got.bias, want.bias)):
                if b is None:
                    assert a is None
                else:
                    np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-5)


@needs_gxx
@pytest.mark.parametrize("name,kernel", [("compressor", "cs_compress_gather"), ("sidecar", "cs_pack_windows")])
def test_the_metal_branch_runs_the_kernel_bodies_and_matches(tmp_path, monkeypatch, name, kernel):
    """With Metal reported available the policies call the kernels (bodies compiled as C++ here): one call for K and
    one for V per layer and merge, with the same merges and the same likelihoods as the reference."""
    policy = _policies(tmp_path)[name]
    seq = _sequence(23, fragmented=True, seed=1)
    monkeypatch.setattr(dispatch, "metal_available", lambda: False)
    reference = [_read_then_merge(policy, seq, layer, 2, 18) for layer in range(LAYERS)]

    calls: list[str] = []
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    monkeypatch.setattr(dispatch, "metal_available", lambda: True)
    monkeypatch.setattr(cg, "run_metal", lambda spec, launch: calls.append(spec.name) or run_launch(spec, launch))
    for layer in range(LAYERS):
        got = policy.merge_from_arena(layer, seq.arena, seq.blocks, 2, 18, np.ones(16))
        np.testing.assert_allclose(np.array(got.keys), np.array(reference[layer].keys), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.array(got.values), np.array(reference[layer].values), rtol=1e-5, atol=1e-5)
    assert calls == [kernel] * (2 * LAYERS)


@needs_gxx
@pytest.mark.parametrize("name,kernel", [("compressor", "cs_compress_gather"), ("sidecar", "cs_pack_windows")])
def test_the_runtime_merges_through_the_kernels(tiny, tmp_path, monkeypatch, name, kernel):
    """End to end on the tiny model (2 KV heads): every merge of the runtime goes through the kernel, and the
    likelihoods equal the reference path's."""
    model, _ = tiny
    if name == "compressor":
        mx.random.seed(3)
        comp = KVCompressor(CompressorConfig(2, 16, 4, image=False))
        mx.eval(comp.parameters())
        policy = Compressor(factor=4, weights=comp, sinks=2, recent=4)
    else:
        policy = Sidecar(window=4, sinks=2, recent=4, weights=_weights(tmp_path, window=4))
    tokens = random_token_ids(48, seed=5)
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    monkeypatch.setattr(dispatch, "metal_available", lambda: False)
    reference = token_nlls(model, tokens, policy, chunk_size=8)
    calls: list[str] = []
    monkeypatch.setattr(dispatch, "metal_available", lambda: True)
    monkeypatch.setattr(cg, "run_metal", lambda spec, launch: calls.append(spec.name) or run_launch(spec, launch))
    import cortexstream.kernels.evict_gather as eg  # merges compact through SequenceKV.replace, not keep

    monkeypatch.setattr(eg, "run_metal", lambda spec, launch: run_launch(spec, launch))
    got = token_nlls(model, tokens, policy, chunk_size=8)
    assert calls and set(calls) == {kernel} and len(calls) % 4 == 0  # K and V, 2 layers, per merge
    np.testing.assert_allclose(got, reference, rtol=1e-4, atol=1e-4)
