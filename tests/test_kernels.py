"""Parity: every Metal kernel body, compiled as C++ through the shim (cortexstream/kernels/cpp_shim), against
its pure-MLX reference, through the same launch description the Metal wrapper uses. Shapes cover partial blocks,
fragmented block tables, GQA, odd lengths and head dims, several block sizes and dtypes, and empty inputs.
Each case also runs with threadgroups in reverse order and must give bit-identical results.
tests/test_kernels_metal.py runs these same tests with the real Metal kernels on a Mac (`kernel_runner` fixture).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cortexstream.kernels import compress_gather as cg
from cortexstream.kernels import evict_gather as eg
from cortexstream.kernels import paged_attention as pa
from cortexstream.kernels.cpp_shim import compiler, run_launch
from cortexstream.kernels.launch import KernelLaunch, KernelSpec, execute

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C++ compiler (g++): the kernel shim cannot build")

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def shim(spec: KernelSpec, launch: KernelLaunch):
    """Run through the C++ shim in both threadgroup orders; they must agree exactly."""
    forward = execute(spec, launch, run_launch)
    backward = execute(spec, launch, lambda s, l: run_launch(s, l, reverse=True))
    for a, b in zip(forward if isinstance(forward, tuple) else (forward,),
                    backward if isinstance(backward, tuple) else (backward,)):
        assert np.array_equal(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)), equal_nan=True)
    return forward


@pytest.fixture
def kernel_runner():
    """How a launch is executed: here the C++-compiled body; test_kernels_metal.py overrides it with Metal."""
    return shim


def close(actual: mx.array, expected: mx.array, tol: float) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    a, e = np.array(actual.astype(mx.float32)), np.array(expected.astype(mx.float32))
    assert not np.isnan(a).any(), "the kernel left output elements unwritten (NaN poison) or produced NaN"
    np.testing.assert_allclose(a, e, rtol=tol, atol=tol)


def arena(rng: np.random.Generator, heads: int, blocks: int, bs: int, dim: int, dtype: str) -> mx.array:
    return mx.array(rng.standard_normal((heads, blocks * bs, dim)).astype(np.float32)).astype(DTYPES[dtype])


def fragmented_table(rng: np.random.Generator, blocks: int, used: int) -> list[int]:
    return [int(b) for b in rng.permutation(blocks)[:used]]


# --- (a) eviction gather ------------------------------------------------------------------------------------------
EVICT_CASES = [
    # dtype, block size, heads, dk, dv, sequence length, kept, per-head keep
    ("float32", 4, 3, 8, 8, 13, 7, True),      # partial last block, per-head selections
    ("float32", 4, 2, 5, 11, 9, 9, False),     # keep everything, odd dims, K/V dims differ, shared selection
    ("float32", 16, 4, 64, 64, 37, 1, True),   # a single survivor
    ("float32", 1, 2, 16, 16, 11, 5, True),    # block size 1: every token its own block
    ("float32", 4, 3, 8, 8, 13, 0, True),      # empty: nothing kept, nothing dispatched
    ("float16", 16, 3, 64, 64, 100, 51, True),
    ("bfloat16", 4, 2, 32, 32, 23, 10, False),
]


@pytest.mark.parametrize("dtype,bs,heads,dk,dv,length,kept,per_head", EVICT_CASES)
def test_evict_gather_matches_reference(dtype, bs, heads, dk, dv, length, kept, per_head, kernel_runner):
    rng = np.random.default_rng(length * 31 + kept)
    blocks = -(-length // bs) + 3
    keys, values = arena(rng, heads, blocks, bs, dk, dtype), arena(rng, heads, blocks, bs, dv, dtype)
    table = fragmented_table(rng, blocks, -(-length // bs))
    rows = [np.sort(rng.choice(length, kept, replace=False)) for _ in range(heads if per_head else 1)]
    keep = np.stack(rows) if per_head else rows[0]
    got = kernel_runner(eg.SPEC, eg.evict_gather_launch(keys, values, table, keep, bs))
    want = eg.evict_gather_reference(keys, values, table, keep, bs)
    assert got[0].shape == (heads, kept, dk) and got[1].shape == (heads, kept, dv)
    for g, w in zip(got, want):
        assert mx.array_equal(g, w).item()  # a gather is exact


# --- (b) compression gather + first Linear + ReLU, and window packing ---------------------------------------------
COMPRESS_CASES = [
    # buffer dtype, weight dtype, block size, heads, dim, out dim, factor, start, groups
    ("float32", "float32", 4, 3, 8, 8, 4, 3, 5),      # groups straddle blocks (start 3), partial last block
    ("float32", "float32", 16, 2, 16, 12, 3, 0, 7),   # odd factor, D_out != D
    ("float16", "float32", 8, 3, 32, 32, 2, 5, 9),    # half arena, float32 MLP
    ("float32", "float32", 4, 3, 8, 8, 4, 2, 0),      # empty range
]


@pytest.mark.parametrize("dtype,wdtype,bs,heads,dim,out_dim,factor,start,groups", COMPRESS_CASES)
def test_compress_gather_matches_reference(dtype, wdtype, bs, heads, dim, out_dim, factor, start, groups,
                                          kernel_runner):
    rng = np.random.default_rng(dim * 7 + groups)
    length = start + groups * factor
    blocks = -(-length // bs) + 2
    buf = arena(rng, heads, blocks, bs, dim, dtype)
    table = fragmented_table(rng, blocks, max(1, -(-length // bs)))
    w1 = mx.array(rng.standard_normal((out_dim, factor * dim)).astype(np.float32) / np.sqrt(factor * dim))
    b1 = mx.array(rng.standard_normal(out_dim).astype(np.float32) * 0.1)
    w1, b1 = w1.astype(DTYPES[wdtype]), b1.astype(DTYPES[wdtype])
    args = (buf, table, start, groups, factor, w1, b1, bs)
    got = kernel_runner(cg.COMPRESS_SPEC, cg.compress_gather_launch(*args))
    want = cg.compress_gather_reference(*args)
    assert got.shape == (heads, groups, out_dim)
    close(got, want, 1e-5)
    if groups:
        assert (np.array(got) == 0).any() and (np.array(got) > 0).any()  # the ReLU is exercised both ways


PACK_CASES = [
    # dtype, block size, heads, dim, window, start, windows
    ("float32", 4, 3, 8, 4, 1, 6),
    ("float32", 16, 2, 5, 3, 7, 9),   # odd dim and window
    ("bfloat16", 8, 3, 16, 2, 0, 11),
    ("float32", 4, 3, 8, 4, 0, 0),    # empty
]


@pytest.mark.parametrize("dtype,bs,heads,dim,window,start,windows", PACK_CASES)
def test_pack_windows_matches_reference(dtype, bs, heads, dim, window, start, windows, kernel_runner):
    rng = np.random.default_rng(dim + windows)
    length = start + windows * window
    blocks = -(-length // bs) + 2
    buf = arena(rng, heads, blocks, bs, dim, dtype)
    table = fragmented_table(rng, blocks, max(1, -(-length // bs)))
    args = (buf, table, start, windows, window, bs)
    got = kernel_runner(cg.PACK_SPEC, cg.pack_windows_launch(*args))
    assert got.shape == (heads, windows, window * dim)
    assert mx.array_equal(got, cg.pack_windows_reference(*args)).item()


# --- (c, d) paged decode attention and H2O column sums --------------------------------------------------------------
ATTENTION_CASES = [
    # dtype, block size, kv heads, group, D, DV, lengths, simdgroups, colsum
    ("float32", 4, 3, 3, 64, 64, (13, 1, 30), 1, True),       # 9 query heads on 3 KV heads; partial blocks
    ("float32", 4, 3, 3, 64, 64, (13, 1, 30, 70), 4, True),   # several simdgroups; 70 > 32 lanes wraps colsum
    ("float32", 16, 2, 1, 32, 32, (16, 33, 5), 2, False),     # plain MHA, full and partial blocks
    ("float32", 8, 2, 2, 40, 24, (0, 9, 41, 3), 3, True),     # odd head dims, a length-0 sequence, 3 simdgroups
    ("float32", 1, 1, 5, 16, 16, (70, 2), 1, True),           # block size 1, 5 query heads on one KV head
    ("float16", 16, 2, 4, 64, 64, (200, 17), 4, True),
    ("float32", 4, 3, 3, 64, 64, (), 1, True),                # empty batch
]


@pytest.mark.parametrize("dtype,bs,kv_heads,group,dim,vdim,lengths,nsg,colsum", ATTENTION_CASES)
def test_paged_attention_matches_reference(dtype, bs, kv_heads, group, dim, vdim, lengths, nsg, colsum,
                                          kernel_runner):
    rng = np.random.default_rng(sum(lengths) + dim)
    batch = len(lengths)
    max_blocks = max([-(-n // bs) for n in lengths] + [1]) + 1  # one padding block beyond the longest
    blocks = max_blocks * max(batch, 1) + 2
    keys, values = arena(rng, kv_heads, blocks, bs, dim, dtype), arena(rng, kv_heads, blocks, bs, vdim, dtype)
    tables = np.stack([rng.permutation(blocks)[:max_blocks] for _ in range(batch)]).astype(np.int32) \
        if batch else np.zeros((0, max_blocks), np.int32)
    queries = mx.array(rng.standard_normal((batch, kv_heads * group, 1, dim)).astype(np.float32)).astype(DTYPES[dtype])
    scale = dim ** -0.5
    launch = pa.paged_attention_launch(queries, keys, values, tables, list(lengths), scale, bs, colsum=colsum,
                                       simdgroups=nsg)
    got = kernel_runner(pa.SPEC, launch)
    want = pa.paged_attention_reference(queries, keys, values, tables, list(lengths), scale, bs, colsum=colsum)
    tol = 1e-5 if dtype == "float32" else 2e-2
    if colsum:
        close(got[0], want[0], tol)
        close(got[1], want[1], 1e-5 if dtype == "float32" else 1e-3)
        if batch:  # each query head's probabilities sum to 1 over the valid positions
            sums = np.array(got[1]).sum(axis=-1)
            np.testing.assert_allclose(sums, np.array([[group if n else 0] * kv_heads for n in lengths]), rtol=1e-4)
    else:
        close(got, want, tol)


def test_paged_attention_ignores_what_padding_blocks_hold(kernel_runner):
    """Table entries past a sequence's length may point anywhere valid: they must not change the result."""
    rng = np.random.default_rng(3)
    keys, values = arena(rng, 2, 12, 4, 32, "float32"), arena(rng, 2, 12, 4, 32, "float32")
    queries = mx.array(rng.standard_normal((1, 4, 1, 32)).astype(np.float32))
    outs = []
    for pad in (0, 11):
        launch = pa.paged_attention_launch(queries, keys, values, [[3, 7, pad]], [6], 0.2, 4, colsum=True,
                                           simdgroups=1)
        outs.append(kernel_runner(pa.SPEC, launch))
    assert mx.array_equal(outs[0][0], outs[1][0]).item() and mx.array_equal(outs[0][1], outs[1][1]).item()


def test_compact_layer_moves_kept_tokens_to_the_front():
    """The whole eviction step on a real arena (reference backend here), per KV head, fragmented block table."""
    from cortexstream.kv.arena import KVArena
    from cortexstream.kv.arena_config import ArenaConfig

    rng = np.random.default_rng(11)
    arena_ = KVArena(ArenaConfig(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=12, block_size=4))
    blocks = [7, 2, 9, 4]
    keys = mx.array(rng.standard_normal((2, 14, 8)).astype(np.float32))
    values = mx.array(rng.standard_normal((2, 14, 8)).astype(np.float32))
    arena_.write(1, blocks, 0, keys, values)
    keep = np.stack([np.sort(rng.choice(14, 6, replace=False)) for _ in range(2)])
    assert eg.compact_layer(arena_, 1, blocks, keep, backend="reference") == 6
    k, v = arena_.read(1, blocks, 6)
    rows = mx.array(keep)[:, :, None]
    assert mx.array_equal(k, mx.take_along_axis(keys, rows, axis=1)).item()
    assert mx.array_equal(v, mx.take_along_axis(values, rows, axis=1)).item()


@pytest.mark.parametrize("metal", [False, True], ids=["reference", "metal-branch-via-shim"])
def test_sequence_keep_runs_the_eviction_gather_of_the_chosen_backend(monkeypatch, metal):
    """`SequenceKV.keep` (the engine's eviction) goes through `compact_layer`: with Metal reported available the
    Metal branch runs (here the C++-compiled body), otherwise the reference; both keep the right rows per head."""
    from cortexstream.kernels import dispatch
    from cortexstream.kv.arena import KVArena
    from cortexstream.kv.arena_config import ArenaConfig
    from cortexstream.kv.sequence_kv import SequenceKV

    calls = []
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    monkeypatch.setattr(dispatch, "metal_available", lambda: metal)
    monkeypatch.setattr(eg, "run_metal", lambda spec, launch: calls.append(spec.name) or run_launch(spec, launch))
    rng = np.random.default_rng(5)
    arena_ = KVArena(ArenaConfig(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=12, block_size=4))
    allocated = arena_.allocator.allocate(4)
    seq = SequenceKV(arena_, contiguous=False, blocks=[allocated[i] for i in (2, 0, 3, 1)])  # fragmented
    originals = []
    for layer in range(2):
        kv = [mx.array(rng.standard_normal((2, 14, 8)).astype(np.float32)) for _ in "kv"]
        arena_.write(layer, seq.blocks, 0, *kv)
        originals.append(kv)
    seq.lengths, seq.offsets = [14, 14], [14, 14]
    keep = np.stack([np.stack([np.sort(rng.choice(14, 6, replace=False)) for _ in range(2)]) for _ in range(2)])
    assert seq.keep(keep) == 2  # 6 tokens fit in 2 of the 4 blocks
    assert calls == (["cs_evict_gather"] * 2 if metal else [])
    assert seq.lengths == [6, 6] and seq.offsets == [14, 14] and arena_.num_evicted_tokens == 16
    for layer, (keys, values) in enumerate(originals):
        k, v = arena_.read(layer, seq.blocks, 6)
        rows = mx.array(keep[layer])[:, :, None]
        assert mx.array_equal(k, mx.take_along_axis(keys, rows, axis=1)).item()
        assert mx.array_equal(v, mx.take_along_axis(values, rows, axis=1)).item()


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_compact_layer_moves_only_what_follows_the_first_change(monkeypatch, kv_dtype):
    """A token evicted while decoding: the rows before it stay where they are and are not rewritten; the arena
    reads as a full compaction would leave it (codes moved with their scales on int8)."""
    from cortexstream.kv.arena import KVArena
    from cortexstream.kv.arena_config import ArenaConfig
    from cortexstream.kv.kv_dtype import parse_kv_dtype

    assert eg.unchanged_prefix(np.array([0, 1, 2, 4, 5])) == 3
    assert eg.unchanged_prefix(np.array([[0, 1, 3], [0, 2, 3]])) == 1
    assert eg.unchanged_prefix(np.array([0, 1, 2])) == 3
    rng = np.random.default_rng(12)
    storage = None if kv_dtype is None else parse_kv_dtype(kv_dtype, model_dtype="float32")
    arena_ = KVArena(ArenaConfig(num_layers=1, num_kv_heads=2, head_dim=64, num_blocks=12, block_size=4,
                                 kv_dtype=storage))
    blocks = [7, 2, 9, 4]
    keys = mx.array(rng.standard_normal((2, 14, 64)).astype(np.float32))
    values = mx.array(rng.standard_normal((2, 14, 64)).astype(np.float32))
    arena_.write(0, blocks, 0, keys, values)
    before_k, before_v = arena_.read(0, blocks, 14)
    keep = np.array([[0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12, 13], [0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13]])
    writes = []
    original = arena_.write if kv_dtype is None else arena_.move_rows
    name = "write" if kv_dtype is None else "move_rows"

    def counting(*args, **kwargs):
        writes.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(arena_, name, counting)
    assert eg.compact_layer(arena_, 0, blocks, keep, backend="reference") == 13
    k, v = arena_.read(0, blocks, 13)
    rows = mx.array(keep)[:, :, None]
    assert mx.array_equal(k, mx.take_along_axis(before_k, rows, axis=1)).item()
    assert mx.array_equal(v, mx.take_along_axis(before_v, rows, axis=1)).item()
    moved = writes[0][3] if kv_dtype is None else writes[0][2]
    assert (moved.shape[1] if kv_dtype is None else moved.shape[0]) == 13 - 6  # rows from position 6 on
