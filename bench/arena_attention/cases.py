"""The measured variants of experiment 1: mlx-lm's KVCache and the arena's ways to run one decode step."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from cortexstream.engine.batch_cache import DecodeBatch
from cortexstream.kv.arena import KVArena
from cortexstream.kv.arena_cache import ArenaKVCache
from cortexstream.kv.sequence_kv import SequenceKV
from cortexstream.engine.attention_hook import dispatch_sdpa

from .common import SCALE, Inputs, Variant, arena_blocks, make_arena, sdpa


class MlxLm(Variant):
    key = "mlx_lm"

    def __init__(self, inp: Inputs, with_mask: bool = False, key: str | None = None) -> None:
        super().__init__()
        self.inp = inp
        self.with_mask = with_mask
        self.key = key or ("mlx_lm_mask" if with_mask else "mlx_lm")
        self.cache = KVCache()
        self.cache.update_and_fetch(inp.prefill_k, inp.prefill_v)
        mx.eval(self.cache.keys, self.cache.values)

    def step(self) -> tuple[float, mx.array]:
        inp = self.inp
        t0 = time.perf_counter()
        k, v = self.cache.update_and_fetch(inp.k_new, inp.v_new)
        mask = None
        if self.with_mask:  # what a batch of unequal lengths needs; all True here
            lengths = mx.full((inp.batch,), self.cache.offset, dtype=mx.int32)
            mask = (mx.arange(k.shape[2])[None, :] < lengths[:, None])[:, None, None, :]
        out = sdpa(inp.q, k, v, mask)
        mx.eval(out)
        return time.perf_counter() - t0, out



def make_sequences(
    inp: Inputs, capacity: int, layout: str, rng: np.random.Generator
) -> tuple[KVArena, list[SequenceKV]]:
    """An arena holding `inp.batch` sequences prefilled with `inp.prefill_*`.

    layout: "contiguous" (each sequence one run of blocks), "shuffled" (each sequence's blocks in random order),
    "interleaved" (sequence i owns blocks i, i+B, i+2B, ...).
    """
    per_seq, total = arena_blocks(inp.batch, capacity)
    arena = make_arena(total)
    seqs: list[SequenceKV] = []
    if layout == "contiguous":
        for i in range(inp.batch):
            seq = SequenceKV(arena, owner=i, contiguous=True)
            seq.ensure_capacity(capacity)
            seqs.append(seq)
    else:
        blocks = arena.allocator.allocate(inp.batch * per_seq, owner=0)
        for i in range(inp.batch):
            table = blocks[i * per_seq : (i + 1) * per_seq] if layout == "shuffled" else blocks[i :: inp.batch]
            if layout == "shuffled":
                table = [int(b) for b in rng.permutation(table)]
            seqs.append(SequenceKV(arena, owner=0, contiguous=False, blocks=list(table)))
    for i, seq in enumerate(seqs):
        if layout != "contiguous":
            assert KVArena.contiguous_start(seq.blocks) is None, "paged table must not be contiguous"
        arena.write(0, seq.blocks, 0, inp.prefill_k[i], inp.prefill_v[i])
        seq.lengths[0] = seq.offsets[0] = inp.ctx
    mx.eval(arena.arrays())
    return arena, seqs


class ArenaSingle(Variant):
    """Batch 1 through `ArenaKVCache.update_and_fetch` (view if contiguous, block gather if paged)."""

    def __init__(self, key: str, inp: Inputs, seq: SequenceKV) -> None:
        super().__init__()
        self.key = key
        self.inp = inp
        self.cache = ArenaKVCache(seq, 0)

    def step(self) -> tuple[float, mx.array]:
        inp = self.inp
        t0 = time.perf_counter()
        k, v = self.cache.update_and_fetch(inp.k_new, inp.v_new)
        out = sdpa(inp.q, k, v)
        mx.eval(out)
        return time.perf_counter() - t0, out


class ArenaDecodeBatch(Variant):
    """Batch B through `DecodeBatch` exactly as the engine's batched decode runs it: `update_and_fetch` (one scatter
    per buffer; returns the lazy padded gather), then mlx-lm's SDPA entry point as patched by the engine
    (`dispatch_sdpa`), which hands the call to the cache's attention hook, i.e. the batch's strategy.

    strategy: None (the engine's default, `batch_attention.choose_strategy()`) or a forced one (e.g. "gather", the
    padded gather + one masked SDPA that was the only path before).
    """

    def __init__(self, key: str, inp: Inputs, arena: KVArena, seqs: list[SequenceKV],
                 strategy: str | None = None) -> None:
        super().__init__()
        self.key = key
        self.inp = inp
        self.arena = arena
        self.seqs = seqs
        self.requested = strategy
        # the strategy the batch really runs (`auto` and a `strided` request depend on the layout)
        self.strategy = DecodeBatch(arena, seqs, attention=strategy).strategy

    def step(self) -> tuple[float, mx.array]:
        inp = self.inp
        t_setup = time.perf_counter()
        batch = DecodeBatch(self.arena, self.seqs, attention=self.requested)
        cache = batch.caches()[0]
        t0 = time.perf_counter()
        k, v = cache.update_and_fetch(inp.k_new, inp.v_new)
        out = dispatch_sdpa(inp.q, k, v, cache, SCALE, cache.make_mask(1))
        mx.eval(out)
        dt = time.perf_counter() - t0
        t1 = time.perf_counter()
        batch.commit()
        self.setup.append((t0 - t_setup) + (time.perf_counter() - t1))
        return dt, out


class ArenaPerSequenceViews(Variant):
    """Batch B as B zero-copy views: every sequence's write first, then one SDPA per view, outputs concatenated.

    (Interleaving write/view per sequence in one graph makes each write copy the buffer: see experiment 5.)
    """

    def __init__(self, key: str, inp: Inputs, arena: KVArena, seqs: list[SequenceKV]) -> None:
        super().__init__()
        self.key = key
        self.inp = inp
        self.arena = arena
        self.seqs = seqs
        self.q = [inp.q[i : i + 1] for i in range(inp.batch)]
        self.k_new = [inp.k_new[i] for i in range(inp.batch)]
        self.v_new = [inp.v_new[i] for i in range(inp.batch)]
        mx.eval(self.q, self.k_new, self.v_new)

    def step(self) -> tuple[float, mx.array]:
        arena = self.arena
        t0 = time.perf_counter()
        for i, seq in enumerate(self.seqs):
            arena.write(0, seq.blocks, seq.lengths[0], self.k_new[i], self.v_new[i])
            seq.lengths[0] += 1
            seq.offsets[0] += 1
        outs = []
        for i, seq in enumerate(self.seqs):
            k, v = arena.read(0, seq.blocks, seq.lengths[0])
            outs.append(sdpa(self.q[i], k[None], v[None]))
        out = mx.concatenate(outs, axis=0)
        mx.eval(out)
        return time.perf_counter() - t0, out

