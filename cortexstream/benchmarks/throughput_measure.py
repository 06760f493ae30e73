"""One timed public call, with its MLX peak memory and the process's peak RSS, and summaries of several rounds.

Used by every part of `bench throughput`: the caller passes a zero-argument function that makes the whole public
call (`cortexstream.batch_generate(...)`, `mlx_lm.generate(...)`, ...); this module only times and measures it.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"


@dataclass
class CallMeasurement:
    result: Any
    wall_s: float
    peak_memory_gb: float  # mx.get_peak_memory() during the call (model weights included, as for both systems)
    memory_before_gb: float  # mx.get_active_memory() just before the call (mostly the model's weights)
    peak_rss_gb: float | None  # process peak RSS during the call (Linux only; None elsewhere)


def _reset_peak_rss() -> bool:
    # Writing 5 to clear_refs resets VmHWM (the peak RSS) to the current RSS, so each call gets its own peak.
    try:
        with open(_CLEAR_REFS, "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_gb() -> float | None:
    try:
        with open(_STATUS, encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        return None
    return None


def measure_call(call: Callable[[], Any]) -> CallMeasurement:
    """Run `call` once from the same starting state for every system: buffer cache emptied, garbage collected."""
    import mlx.core as mx

    gc.collect()
    mx.clear_cache()  # neither system inherits the other's cached buffers (which would also inflate its RSS)
    rss_reset = _reset_peak_rss()
    before = mx.get_active_memory() / 1e9
    mx.reset_peak_memory()
    start = time.perf_counter()
    result = call()
    wall = time.perf_counter() - start
    peak = mx.get_peak_memory() / 1e9
    return CallMeasurement(result, wall, peak, before, _peak_rss_gb() if rss_reset else None)


def alternate(calls: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[CallMeasurement]]:
    """Every call once per round; round r starts with the system at position r mod n (alternating order)."""
    names = list(calls)
    runs: dict[str, list[CallMeasurement]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            runs[name].append(measure_call(calls[name]))
    return runs


def wall_summary(runs: list[CallMeasurement]) -> dict[str, Any]:
    walls = [m.wall_s for m in runs]
    rss = [m.peak_rss_gb for m in runs if m.peak_rss_gb is not None]
    return {
        "wall_s": walls,
        "wall_best_s": min(walls),
        "wall_median_s": statistics.median(walls),
        "peak_memory_gb": max(m.peak_memory_gb for m in runs),
        "memory_before_gb": min(m.memory_before_gb for m in runs),
        "peak_rss_gb": max(rss) if rss else None,
    }


def ratios(ours: dict[str, Any], reference: dict[str, Any]) -> dict[str, float]:
    """Reference wall / our wall: > 1 means CortexStream is faster. Paired = median of the per-round ratios."""
    paired = [ref / us for ref, us in zip(reference["wall_s"], ours["wall_s"])]
    return {
        "ratio_best": reference["wall_best_s"] / ours["wall_best_s"],
        "ratio_median": reference["wall_median_s"] / ours["wall_median_s"],
        "ratio_paired_median": statistics.median(paired),
    }


def strip_eos(tokens: list[int], eos_ids: set[int]) -> list[int]:
    """mlx-lm drops the eos token from its outputs; CortexStream reports it. Compare without it."""
    return tokens[:-1] if tokens and tokens[-1] in eos_ids else tokens


def compare_outputs(ours: list[list[int]], reference: list[list[int]], eos_ids: set[int]) -> dict[str, Any]:
    """How many outputs are identical token for token, and where the first few differing ones diverge."""
    identical = 0
    mismatches = []
    for i, (a, b) in enumerate(zip(ours, reference)):
        a, b = strip_eos(a, eos_ids), strip_eos(b, eos_ids)
        if a == b:
            identical += 1
            continue
        at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if len(mismatches) < 3:
            mismatches.append({"prompt": i, "first_difference_at_token": at, "ours_tokens": len(a),
                               "reference_tokens": len(b)})
    return {"identical_outputs": identical, "outputs": len(reference), "first_mismatches": mismatches}
