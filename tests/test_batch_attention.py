"""Batched decode attention straight from the arena (engine/batch_attention.py, engine/batch_cache.py).

Every strategy must give the attention a float64 NumPy reference computes from the K/V written into the arena,
over batches mixing contiguous and paged block tables of different lengths, with GQA; `per_sequence` must be
bit-identical to the unbatched `ArenaKVCache` decode; a hook set by the runner (KV policies) must replace the arena
attention and see the padded gather as before; and the engine must really run the arena attention. The `paged`
strategy's Metal branch runs here with the kernel body compiled as C++ (cortexstream/kernels/cpp_shim).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cortexstream.backend import CpuAttention, CpuBackend
from cortexstream.engine import batch_attention as ba
from cortexstream.engine import batch_cache
from cortexstream.engine.batch_cache import DecodeBatch
from cortexstream.kernels import dispatch
from cortexstream.kernels import paged_attention as pa
from cortexstream.kernels.cpp_shim import compiler, run_launch
from cortexstream.kv.arena import KVArena
from cortexstream.kv.arena_cache import ArenaKVCache
from cortexstream.kv.arena_config import ArenaConfig
from cortexstream.kv.sequence_kv import SequenceKV
from cortexstream.engine.attention_hook import dispatch_sdpa, original_sdpa

LAYERS, KV_HEADS, GROUP, DIM, BS = 2, 2, 3, 8, 4
SCALE = DIM**-0.5
LENGTHS = [5, 12, 1, 9]  # physical tokens before the step; with the new token: partial and full blocks
PAGED = [False, True, False, True]  # which sequences get a shuffled (non-contiguous) block table
needs_gxx = pytest.mark.skipif(compiler() is None, reason="no C++ compiler (g++): the kernel shim cannot build")


def build(seed: int = 0, layout: list[bool] = PAGED, dtype: str = "float32") -> tuple[KVArena, list[SequenceKV], dict]:
    """An arena with one sequence per LENGTHS entry holding random K/V, plus the step's new K/V and queries.
    layout[i]: whether sequence i gets a shuffled (non-contiguous) block table."""
    arena = KVArena(ArenaConfig(LAYERS, KV_HEADS, DIM, 40, BS, dtype))
    seqs, step = fill(arena, np.random.default_rng(seed), layout)
    assert [s.contiguous_first() is None for s in seqs] == layout
    mx.eval(arena.arrays())
    return arena, seqs, step


def fill(arena: KVArena, rng: np.random.Generator, layout: list[bool], lengths: list[int] = LENGTHS,
         capacities: list[int] | None = None) -> tuple[list[SequenceKV], dict]:
    """One sequence per `lengths` entry holding random K/V (paged tables shuffled, contiguous ones `capacities`
    tokens long, default 16), plus the step's new K/V and queries."""
    seqs = []
    for length, paged, capacity in zip(lengths, layout, capacities or [16] * len(lengths)):
        seq = SequenceKV(arena, contiguous=not paged)
        if paged:
            seq.blocks.extend(int(b) for b in rng.permutation(arena.allocator.allocate(4))[::-1])
        else:
            seq.ensure_capacity(capacity)
        for layer in range(LAYERS):
            k, v = (mx.array(rng.standard_normal((KV_HEADS, length, DIM)).astype(np.float32)) for _ in "kv")
            arena.write(layer, seq.blocks, 0, k, v)
        seq.lengths = [length] * LAYERS
        seq.offsets = [length] * LAYERS
        seqs.append(seq)
    batch = len(lengths)
    step = {name: [mx.array(rng.standard_normal(shape).astype(np.float32)).astype(arena.dtype) for _ in range(LAYERS)]
            for name, shape in (("k", (batch, KV_HEADS, 1, DIM)), ("v", (batch, KV_HEADS, 1, DIM)),
                                ("q", (batch, KV_HEADS * GROUP, 1, DIM)))}
    return seqs, step


def batched_step(arena: KVArena, seqs: list[SequenceKV], step: dict, strategy: str | None) -> list[mx.array]:
    """One decode step through the batch caches, called the way an mlx-lm model calls them."""
    batch = DecodeBatch(arena, seqs, attention=strategy)
    outs = []
    for layer, cache in enumerate(batch.caches()):
        k, v = cache.update_and_fetch(step["k"][layer], step["v"][layer])
        outs.append(dispatch_sdpa(step["q"][layer], k, v, cache, SCALE, cache.make_mask(1)))
    batch.commit()
    mx.eval(outs)
    return outs


def reference(arena: KVArena, seqs: list[SequenceKV], step: dict) -> list[np.ndarray]:
    """Float64 attention over each sequence's K/V as read back token by token (after the step's writes)."""
    outs = []
    for layer in range(LAYERS):
        rows = []
        for b, seq in enumerate(seqs):
            slots = arena.slot_indices(seq.blocks, 0, seq.lengths[layer])
            k = np.array(arena.keys[layer])[0][:, slots].astype(np.float64)
            v = np.array(arena.values[layer])[0][:, slots].astype(np.float64)
            q = np.array(step["q"][layer][b, :, 0]).astype(np.float64).reshape(KV_HEADS, GROUP, DIM)
            logits = np.einsum("hgd,hld->hgl", q, k) * SCALE
            p = np.exp(logits - logits.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            rows.append(np.einsum("hgl,hld->hgd", p, v).reshape(KV_HEADS * GROUP, 1, DIM))
        outs.append(np.stack(rows))
    return outs


@pytest.mark.parametrize("layout", [PAGED, [False] * len(LENGTHS), [True] * len(LENGTHS)],
                         ids=["mixed", "contiguous", "paged"])
@pytest.mark.parametrize("strategy", ba.STRATEGIES)
def test_every_strategy_computes_attention_over_each_sequences_tokens(strategy, layout):
    arena, seqs, step = build(layout=layout)
    outs = batched_step(arena, seqs, step, strategy)
    assert [s.lengths for s in seqs] == [[n + 1] * LAYERS for n in LENGTHS]
    for out, expected in zip(outs, reference(arena, seqs, step)):
        np.testing.assert_allclose(np.array(out), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_arenas_agree_with_the_old_gather_path(dtype):
    half = getattr(mx, dtype)
    assert ba.choose_strategy(None, half) == ba.PER_SEQUENCE  # CPU gather_mm is float32 only
    with pytest.raises(ValueError, match="needs a float32 arena"):
        ba.choose_strategy(ba.BLOCKS, half)
    strategies = [None, ba.PER_SEQUENCE, ba.GATHER, ba.PAGED]
    outs = {strategy: batched_step(*build(seed=4, dtype=dtype), strategy) for strategy in strategies}
    for strategy, out in outs.items():
        for layer in range(LAYERS):
            assert out[layer].dtype == getattr(mx, dtype)
            np.testing.assert_allclose(np.array(out[layer].astype(mx.float32)),
                                       np.array(outs[ba.GATHER][layer].astype(mx.float32)), rtol=2e-2, atol=2e-2)


def test_per_sequence_is_bit_identical_to_the_unbatched_decode_for_contiguous_tables():
    arena, seqs, step = build(seed=3)
    outs = batched_step(arena, seqs, step, ba.PER_SEQUENCE)
    alone_arena, alone_seqs, _ = build(seed=3)
    for b, seq in enumerate(alone_seqs):
        if PAGED[b]:  # paged rows go through one padded gather, like the old path: equal to rounding only
            continue
        for layer in range(LAYERS):
            cache = ArenaKVCache(seq, layer)
            k, v = cache.update_and_fetch(step["k"][layer][b : b + 1], step["v"][layer][b : b + 1])
            q = mx.array(np.array(step["q"][layer][b : b + 1]))  # a separate array, as the model would produce
            alone = original_sdpa(q, k, v, cache, scale=SCALE, mask=cache.make_mask(1))
            assert np.array_equal(np.array(alone), np.array(outs[layer][b : b + 1]))


def test_a_hook_set_by_the_runner_replaces_the_arena_attention_and_sees_the_padded_gather():
    arena, seqs, step = build()
    batch = DecodeBatch(arena, seqs)  # default strategy: installs the arena hook
    cache = batch.caches()[0]
    assert cache.attention_hook is not None
    seen = {}

    def runner_hook(queries, keys, values, scale, mask, sinks):
        seen.update(keys=keys.shape, mask=mask)
        return original_sdpa(queries, keys, values, None, scale=scale, mask=mask, sinks=sinks)

    cache.attention_hook = runner_hook
    k, v = cache.update_and_fetch(step["k"][0], step["v"][0])
    out = dispatch_sdpa(step["q"][0], k, v, cache, SCALE, cache.make_mask(1))
    batch.commit()
    assert seen["keys"] == (len(seqs), KV_HEADS, 4 * BS, DIM) and seen["mask"] is batch.mask
    np.testing.assert_allclose(np.array(out), reference(arena, seqs, step)[0], rtol=1e-5, atol=1e-5)


def test_learned_sinks_fall_back_to_sdpa_over_the_gather():
    arena, seqs, step = build()
    batch = DecodeBatch(arena, seqs, attention=ba.PER_SEQUENCE)
    cache = batch.caches()[0]
    k, v = cache.update_and_fetch(step["k"][0], step["v"][0])
    sinks = mx.array(np.linspace(-1, 1, KV_HEADS * GROUP).astype(np.float32))
    out = cache.attention_hook(step["q"][0], k, v, SCALE, batch.mask, sinks)
    expected = original_sdpa(step["q"][0], k, v, None, scale=SCALE, mask=batch.mask, sinks=sinks)
    assert np.array_equal(np.array(out), np.array(expected))


def test_strategy_choice_follows_the_backend_the_argument_and_the_environment(monkeypatch):
    monkeypatch.delenv(ba.ENV_VAR, raising=False)
    monkeypatch.setattr(dispatch, "metal_available", lambda: False)
    assert ba.choose_strategy() == ba.BLOCKS == ba.choose_strategy("auto")
    monkeypatch.setattr(dispatch, "metal_available", lambda: True)
    assert ba.choose_strategy() == ba.PAGED
    monkeypatch.setenv(ba.ENV_VAR, "gather")
    assert ba.choose_strategy() == ba.GATHER and ba.choose_strategy("per_sequence") == ba.PER_SEQUENCE
    with pytest.raises(ValueError, match="must be auto or one of"):
        ba.choose_strategy("fast")
    arena, seqs, _ = build()
    assert DecodeBatch(arena, seqs).caches()[0].attention_hook is None  # gather: no hook, mlx-lm's SDPA


@needs_gxx
def test_metal_branch_runs_the_paged_kernel_body(monkeypatch):
    """With Metal reported available, the default strategy is the kernel; its body runs compiled as C++."""
    calls = []
    monkeypatch.delenv(ba.ENV_VAR, raising=False)
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    monkeypatch.setattr(dispatch, "metal_available", lambda: True)
    monkeypatch.setattr(pa, "run_metal", lambda spec, launch: calls.append(spec.name) or run_launch(spec, launch))
    arena, seqs, step = build(seed=5)
    outs = batched_step(arena, seqs, step, None)
    assert calls == ["cs_paged_attention"] * LAYERS
    for out, expected in zip(outs, reference(arena, seqs, step)):
        np.testing.assert_allclose(np.array(out), expected, rtol=1e-5, atol=1e-5)


def engine_tokens(tiny, prompts: list[list[int]], n: int, batched: bool) -> list[list[int]]:
    from cortexstream.engine.engine import Engine

    # A fixed budget while decoding ("auto" sizes chunks from measured step times): the same chunks every run.
    engine = Engine(*tiny, kv_tokens=2048, block_size=4, prefill_step_size=7, prefill_tokens_while_decoding=4)
    ids, results = [], {}
    for prompt in prompts:
        ids.append(engine.add_request(prompt, max_tokens=n))
        while not batched and engine.has_unfinished:
            for out in engine.step():
                results.setdefault(out.request_id, []).extend([out.token] if out.token is not None else [])
    while engine.has_unfinished:
        for out in engine.step():
            results.setdefault(out.request_id, []).extend([out.token] if out.token is not None else [])
    return [results[i] for i in ids]


@pytest.mark.parametrize("strategy", [ba.BLOCKS, ba.PER_SEQUENCE, ba.GATHER])
def test_engine_batched_decode_runs_the_chosen_strategy_and_matches_unbatched(tiny, monkeypatch, strategy):
    rng = np.random.default_rng(2)
    prompts = [[int(x) for x in rng.integers(3, 250, size=int(n))] for n in (5, 23, 11, 40)]
    expected = engine_tokens(tiny, prompts, 12, batched=False)
    monkeypatch.setenv(ba.ENV_VAR, strategy)
    calls: list[str] = []
    for name in ("block_matmul_attention", "per_sequence_attention", "paged_kernel_attention"):
        original = getattr(batch_cache, name)
        monkeypatch.setattr(batch_cache, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    assert engine_tokens(tiny, prompts, 12, batched=True) == expected
    used = {ba.BLOCKS: {"block_matmul_attention"}, ba.PER_SEQUENCE: {"per_sequence_attention"}, ba.GATHER: set()}
    assert set(calls) == used[strategy] and (calls or strategy == ba.GATHER)


def test_strided_layout_needs_contiguous_evenly_spaced_tables_that_stay_in_the_buffer():
    assert ba.strided_layout([2, 6, 10], 16, 4, 64) == (8, 16)
    assert ba.strided_layout([5], 7, 4, 64) == (20, 0)  # one sequence: any spacing
    assert ba.strided_layout([2, None, 10], 16, 4, 64) is None  # a paged table
    assert ba.strided_layout([2, 6, 11], 16, 4, 64) is None  # uneven spacing
    assert ba.strided_layout([10, 6, 2], 16, 4, 64) is None  # decreasing starts
    assert ba.strided_layout([2, 2], 9, 4, 64) is None  # the same start twice
    assert ba.strided_layout([2, 6, 10], 25, 4, 64) is None  # the last window would leave the buffer
    assert ba.strided_layout([], 16, 4, 64) is None


@pytest.mark.parametrize("equal_lengths", [False, True], ids=["masked", "unmasked"])
def test_evenly_spaced_contiguous_batches_attend_through_one_strided_view(monkeypatch, equal_lengths):
    monkeypatch.delenv(ba.ENV_VAR, raising=False)
    arena, seqs, step = build(seed=6, layout=[False] * len(LENGTHS))
    if equal_lengths:  # every sequence attends over the same number of keys: no mask at all
        for seq in seqs:
            seq.lengths = [9] * LAYERS
            seq.offsets = [9] * LAYERS
    calls = []
    original = ba.mx.fast.scaled_dot_product_attention
    monkeypatch.setattr(ba.mx.fast, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: calls.append((k.shape, kw["mask"] is None)) or original(q, k, v, **kw))
    probe = DecodeBatch(arena, seqs)  # what batched_step will build
    assert probe.strategy == ba.STRIDED and probe.strided == (0, 4 * BS)
    outs = batched_step(arena, seqs, step, None)
    longest = 10 if equal_lengths else max(LENGTHS) + 1
    assert calls == [((len(seqs), KV_HEADS, longest, DIM), equal_lengths)] * LAYERS  # one SDPA per layer
    for out, expected in zip(outs, reference(arena, seqs, step)):
        np.testing.assert_allclose(np.array(out), expected, rtol=1e-5, atol=1e-5)


def test_a_requested_strided_strategy_falls_back_when_the_layout_does_not_allow_it(monkeypatch):
    monkeypatch.setattr(dispatch, "metal_available", lambda: False)
    arena, seqs, _ = build()  # mixed: paged tables
    assert DecodeBatch(arena, seqs, attention=ba.STRIDED).strategy == ba.BLOCKS
    arena, seqs, _ = build(layout=[False] * len(LENGTHS))
    assert DecodeBatch(arena, seqs, attention=ba.BLOCKS).strategy == ba.BLOCKS  # an explicit request wins
    assert DecodeBatch(arena, seqs).strategy == ba.STRIDED
    longest = max(LENGTHS) + 1  # keys of the longest sequence after the step

    def cpu(strided_max: int, blocks_max: int) -> CpuBackend:  # the CPU backend with other crossovers
        return CpuBackend(0, CpuAttention(strided_max_keys=strided_max, blocks_max_keys=blocks_max))

    assert DecodeBatch(arena, seqs, backend=cpu(longest - 1, 1 << 20)).strategy == ba.BLOCKS  # middle: block-wise
    assert DecodeBatch(arena, seqs, backend=cpu(longest - 1, longest - 1)).strategy == ba.STRIDED  # long: one SDPA
    assert DecodeBatch(arena, seqs, backend=cpu(longest - 1, longest)).strategy == ba.BLOCKS
    assert DecodeBatch(arena, seqs, backend=cpu(longest, longest)).strategy == ba.STRIDED  # short
    assert DecodeBatch(arena, seqs, attention=ba.GATHER, backend=cpu(0, 0)).strategy == ba.GATHER
    monkeypatch.setattr(dispatch, "metal_available", lambda: True)
    assert DecodeBatch(arena, seqs).strategy == ba.PAGED  # Metal keeps the kernel


def test_engine_uses_the_strided_view_while_its_tables_are_evenly_spaced(tiny, monkeypatch):
    """Equal prompts admitted together get consecutive, equally long block runs reserved for prompt + max_tokens:
    every decode step goes through the strided view (without the reservation, the tables would interleave once
    the sequences grow, and attention would go block-wise). Tokens equal unbatched."""
    rng = np.random.default_rng(7)
    prompts = [[int(x) for x in rng.integers(3, 250, size=13)] for _ in range(4)]
    expected = engine_tokens(tiny, prompts, 8, batched=False)
    monkeypatch.delenv(ba.ENV_VAR, raising=False)
    calls: list[str] = []
    for name in ("block_matmul_attention", "strided_attention"):
        original = getattr(batch_cache, name)
        monkeypatch.setattr(batch_cache, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    assert engine_tokens(tiny, prompts, 8, batched=True) == expected
    assert "strided_attention" in calls and "block_matmul_attention" not in calls


def test_new_tokens_are_written_through_a_stepped_slice_when_their_slots_are_evenly_spaced():
    assert ba.evenly_spaced(np.array([7])) == slice(7, 8)
    assert ba.evenly_spaced(np.array([3, 19, 35])) == slice(3, 36, 16)
    assert ba.evenly_spaced(np.array([3, 19, 36])) is None
    assert ba.evenly_spaced(np.array([19, 3])) is None
    arena, seqs, step = build(seed=8, layout=[False] * len(LENGTHS))
    for seq in seqs:  # equal lengths in equally spaced runs: slots 9, 25, 41, 57
        seq.lengths, seq.offsets = [9] * LAYERS, [9] * LAYERS
    batch = DecodeBatch(arena, seqs)
    assert batch.write_at == slice(9, 58, 16)
    outs = batched_step(arena, seqs, step, None)
    for layer in range(LAYERS):  # the new K/V landed in each sequence's slot 9
        got = np.array(arena.keys[layer])[0][:, [9, 25, 41, 57], :].transpose(1, 0, 2)
        np.testing.assert_array_equal(got, np.array(step["k"][layer])[:, :, 0, :])
    for out, expected in zip(outs, reference(arena, seqs, step)):
        np.testing.assert_allclose(np.array(out), expected, rtol=1e-5, atol=1e-5)
