"""KV-arena attention benchmark: one decode step of one attention layer, arena vs mlx-lm's KVCache.

Run: ``LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python -m bench.arena_attention``
(about 4 min on 2 busy shared cores; ``--quick``: fewer steps). Writes bench/results/arena_attention.json and
bench/results/arena_attention.md. ``--previous OLD.json`` reports an earlier run's batch-8 ratios next to this
run's (run it twice: the machine is shared); ``--from-json`` rewrites the report without measuring.

Shapes are SmolLM2-like: 9 query heads, 3 KV heads, head_dim 64, float32, block size 16. A *step* is what one layer
does per generated token: write the new token's K/V into the cache, fetch the K/V to attend over, run
``mx.fast.scaled_dot_product_attention`` and ``mx.eval`` the output. It is timed with ``perf_counter`` around graph
construction + eval (Python overhead included); the median over 30 steps (90 at batch 1, where steps are cheap)
after 5 untimed ones is reported (``--quick``: 10 / 30 after 2).
All variants of one (context, batch) point run interleaved, one step each in turn, so that load from neighbours on
this shared machine hits them alike. Every variant starts from the same random prefill and the same new token, and
its first output is checked against mlx-lm's (max |diff| is in the JSON).

Experiments:
1. ``attention``: context 512 / 2048 / 8192, batch 1 and 8 (all sequences of the same length):
   * mlx-lm ``KVCache`` (batch B: one cache holding [B, H, L, D]), the baseline; at batch 8 also with the same
     boolean padding mask DecodeBatch uses (a reference that separates the mask's cost from the gather's);
   * arena contiguous: batch 1 through ``ArenaKVCache`` (zero-copy view); batch 8 through the engine's real batched
     path: ``DecodeBatch`` + ``BatchLayerCache.update_and_fetch`` (one scatter per buffer) + mlx-lm's SDPA entry
     point as the engine patches it (``engine.attention_hook.dispatch_sdpa``), which hands the call to the
     cache's attention hook, i.e. the batch strategy (engine/batch_attention.py): the engine's default
     (``blocks`` on CPU: block-wise ``gather_mm`` through the table, no K/V copy), ``per_sequence`` (zero-copy
     view + one SDPA per contiguous sequence; paged rows through one padded gather) and ``gather`` (the padded
     [B, H, L, D] gather + one masked SDPA, the only path before);
   * arena paged: block tables deliberately non-contiguous (batch 1: a random permutation of the sequence's blocks;
     batch 8: the sequences' blocks interleaved round-robin), through ``ArenaKVCache`` (block gather) and the same
     three ``DecodeBatch`` strategies.
   The arena of each variant holds all its sequences (context + the steps run) plus 25 % spare blocks. mlx-lm's
   cache regrows by concatenation every 256 tokens; that happens during warm-up here, so its numbers are its steady
   state (favourable to the baseline). ``DecodeBatch()`` construction + ``commit()`` happen once per forward pass
   for all layers; they are timed apart (``setup_us``) and not in the step.
   Experiment 1 runs twice: with MLX's default CPU buffer-cache limit (32 MiB) and with ``mx.set_cache_limit(1 GiB)``
   (what the engine sets, ``backend.ensure_buffer_cache``). A freed buffer that does not fit in the cache goes back
   to the OS, and the next allocation of that size page-faults fresh memory; the minor page faults per step are
   recorded.
2. ``layout``: SDPA alone on a head-major view ``buf[:, s:e, :]`` ([H, S, D], the arena's layout) vs a token-major
   view ``buf[s:e].transpose(1, 0, 2)`` ([S, H, D]) vs a dense [1, H, L, D] array, batch 1, context 2048 and 8192.
3. ``buffer_per_layer``: a 30-layer decode step (write, view, SDPA per layer; each layer's new K/V computed from the
   previous layer's attention output, as in a model) over one buffer per layer vs one [L, H, S, D] buffer for all
   layers, 3 KV heads x 4096 slots x 64 x float32 (94 MB per all-layer K buffer), context 2048: time and peak memory.
4. ``write_in_place``: ``KVArena.write`` of one token + eval at arena sizes from 13 MB to 805 MB per buffer: a
   constant time says the update is in place (no copy of the buffer).
5. ``per_sequence_pitfall``: batch 8, context 2048: 8 ``ArenaKVCache.update_and_fetch`` calls (write, view, write,
   view, ...) in one graph vs all writes first, then the views.
6. ``python_overhead``: graph-construction time (no eval) of one ``update_and_fetch``, arena vs mlx-lm, per layer.
"""

from __future__ import annotations

from bench.arena_attention.cli import main

if __name__ == "__main__":
    main()
