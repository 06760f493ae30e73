"""Single stream part of `bench throughput`: `cortexstream.generate` vs `mlx_lm.generate`, whole-call wall time.

Same loaded model, same token-id prompt, greedy, alternating order each round; the returned texts are compared.
"""

from __future__ import annotations

from typing import Any

from cortexstream.benchmarks.throughput_prompts import text_windows
from cortexstream.benchmarks.throughput_measure import alternate, ratios, wall_summary

SINGLE_TARGET = 1.0  # cortexstream.generate wall time >= 1.0x mlx_lm.generate


def single_calls(model: Any, tokenizer: Any, prompt: list[int], max_tokens: int, ranks: Any = None) -> dict[str, Any]:
    """Both calls; with `ranks` (rank 0's DistributedSession) ours alone, on every rank (throughput_ranks.py)."""
    if ranks is not None:
        from cortexstream.benchmarks.throughput_ranks import generate_on_ranks

        return {"cortexstream": lambda: generate_on_ranks(ranks, model, tokenizer, prompt, max_tokens)}
    import mlx_lm

    import cortexstream

    return {
        "cortexstream": lambda: cortexstream.generate(model, tokenizer, prompt, max_tokens=max_tokens),
        "mlx_lm": lambda: mlx_lm.generate(model, tokenizer, prompt, max_tokens=max_tokens),
    }


def warm_up_single(model: Any, tokenizer: Any, ranks: Any = None) -> None:
    prompt = text_windows(tokenizer, 1, 16)[0]
    for call in single_calls(model, tokenizer, prompt, 4, ranks).values():
        call()


def measure_single(model: Any, tokenizer: Any, prompt_tokens: int, max_tokens: int, rounds: int,
                   ranks: Any = None) -> dict[str, Any]:
    """One prompt length. With `ranks`: our row alone, without the ratio, its target or the text comparison."""
    prompt = text_windows(tokenizer, 1, prompt_tokens)[0]
    runs = alternate(single_calls(model, tokenizer, prompt, max_tokens, ranks), rounds)
    ours = wall_summary(runs["cortexstream"])
    if ranks is not None:
        return {"prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "rounds": rounds, "cortexstream": ours}
    reference = wall_summary(runs["mlx_lm"])
    single_ratios = ratios(ours, reference)
    texts_equal = all(a.result == b.result for a, b in zip(runs["cortexstream"], runs["mlx_lm"]))
    return {
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "cortexstream": ours,
        "mlx_lm": reference,
        **single_ratios,
        "identical_text": texts_equal,
        "ratio_target": SINGLE_TARGET,
        "meets_ratio_target": single_ratios["ratio_median"] >= SINGLE_TARGET,
    }
