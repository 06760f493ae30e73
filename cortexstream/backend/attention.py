"""Which decode-attention strategy a batch runs: the names, and each backend's rule for choosing one.

The strategies themselves (how each attends from the arena) are in engine/batch_attention.py; what is chosen here
depends on the platform only. CPU: `strided` (one SDPA over a strided view of the arena, mlx-lm's own speed) where
the layout allows it and the longest sequence is short or long, `blocks` (block-wise `gather_mm`) in between, where
it was measured faster (bench/results/strategy_crossover.md); `per_sequence` for half-precision arenas (MLX's CPU
`gather_mm` is float32 only). Metal: the paged-attention kernel when the custom kernels run on Metal, else
`blocks` (the strided view's cost on Metal is unmeasured). CORTEXSTREAM_BATCH_ATTENTION or a batch's `attention=`
forces one (debugging, benchmarks).

A quantized arena (int8/int4 K or V) has its own strategy, `quantized`: each sequence attends over its stored rows
(`kv.quantized_attention`); `gather` (dequantized) is the only other one it accepts. How the codes are read is the
platform's part: through `mx.quantized_matmul`, except on the CPU with half-precision scales, where MLX's quantized
matmul is 15-18x slower than dequantizing first (bench/results/kv_quant_attention.md): `dequantize_quantized`.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Any, Protocol

ENV_VAR = "CORTEXSTREAM_BATCH_ATTENTION"  # auto (unset) or one of AttentionStrategy's values
AUTO = "auto"


class AttentionStrategy(str, enum.Enum):
    """A batched decode attention strategy; the values are the names used by the env var, results and the CLI."""

    GATHER = "gather"
    PER_SEQUENCE = "per_sequence"
    BLOCKS = "blocks"
    STRIDED = "strided"
    PAGED = "paged"
    QUANTIZED = "quantized"

    def __str__(self) -> str:
        return self.value


def parse_strategy(value: str | None, source: str) -> AttentionStrategy | None:
    """`value` as a strategy, None for `auto` / unset / empty; a ValueError naming `source` (the argument or the
    environment variable it came from) for anything else."""
    choice = (value or AUTO).strip().lower() or AUTO
    if choice == AUTO:
        return None
    try:
        return AttentionStrategy(choice)
    except ValueError:
        names = ", ".join(s.value for s in AttentionStrategy)
        raise ValueError(f"{source}{choice!r}: must be auto or one of {names}") from None


def strategy_from_env() -> AttentionStrategy | None:
    """The strategy CORTEXSTREAM_BATCH_ATTENTION forces, None when unset or `auto`."""
    return parse_strategy(os.environ.get(ENV_VAR), f"{ENV_VAR}=")


class AttentionChoice(Protocol):
    """A backend's rule: the strategy for one decode batch."""

    def choose(self, requested: str | None, dtype: Any, strided: bool, num_keys: int,
               quantized: bool = False) -> AttentionStrategy: ...

    def dequantize_quantized(self, dtype: Any) -> bool: ...

    def quantized_per_head(self, num_keys: int) -> bool: ...

    def describe(self) -> str: ...


def _forced(requested: str | None, override: AttentionStrategy | None, strided: bool) -> AttentionStrategy | None:
    """The strategy asked for (the batch's `requested`, else the backend's override), None for the automatic
    choice; a `strided` the layout does not allow falls back to the automatic choice."""
    forced = parse_strategy(requested, "attention=") if requested is not None else override
    if forced is AttentionStrategy.QUANTIZED:
        raise ValueError("attention 'quantized' is chosen by a quantized arena itself (kv_dtype int8/int4)")
    if forced is AttentionStrategy.STRIDED and not strided:
        return None
    return forced


@dataclass(frozen=True)
class CpuAttention:
    """The CPU rule. `strided`: whether the batch's layout allows the strided view; `num_keys`: its longest
    sequence's keys after the step; `dtype`: the arena's."""

    strided_max_keys: int = 1024  # strided up to here ...
    blocks_max_keys: int = 4096  # ... and above here; blocks in between (bench/results/strategy_crossover.md)
    override: AttentionStrategy | None = None
    # Quantized rows: one product per KV head above this many keys (MLX copies a non-contiguous operand of its
    # quantized matmul; measured faster from 2048 keys, slower at 1024: bench/results/kv_quant_attention.md).
    quantized_per_head_above: int = 1536

    def __post_init__(self) -> None:
        if not 0 <= self.strided_max_keys <= self.blocks_max_keys:
            raise ValueError(f"strided_max_keys {self.strided_max_keys} and blocks_max_keys {self.blocks_max_keys}: "
                             "need 0 <= strided_max_keys <= blocks_max_keys")

    def choose(self, requested: str | None, dtype: Any, strided: bool, num_keys: int,
               quantized: bool = False) -> AttentionStrategy:
        import mlx.core as mx

        if quantized:
            return _quantized_choice(requested, self.override)
        no_gather_mm = dtype != mx.float32 and mx.default_device() == mx.cpu
        forced = _forced(requested, self.override, strided)
        if forced is None:
            if strided and (num_keys <= self.strided_max_keys or num_keys > self.blocks_max_keys):
                return AttentionStrategy.STRIDED
            return AttentionStrategy.PER_SEQUENCE if no_gather_mm else AttentionStrategy.BLOCKS
        if forced is AttentionStrategy.BLOCKS and no_gather_mm:
            raise ValueError(f"batch attention 'blocks' needs a float32 arena on CPU (mx.gather_mm), this one is "
                             f"{dtype}: use per_sequence or gather")
        return forced

    def quantized_per_head(self, num_keys: int) -> bool:
        """Whether a quantized sequence of `num_keys` keys attends one KV head at a time (see the field)."""
        return num_keys > self.quantized_per_head_above

    def dequantize_quantized(self, dtype: Any) -> bool:
        """Read quantized rows by dequantizing first: for half-precision scales (MLX's CPU quantized matmul is
        slow for them), not for float32 ones."""
        import mlx.core as mx

        return dtype != mx.float32

    def describe(self) -> str:
        if self.override is not None:
            return f"attention {self.override.value} ({ENV_VAR})"
        return (f"attention strided up to {self.strided_max_keys} or above {self.blocks_max_keys} keys, else blocks")


@dataclass(frozen=True)
class MetalAttention:
    """The Metal rule: the paged-attention kernel when the custom kernels run on Metal, else `blocks`."""

    paged_kernel: bool = True
    override: AttentionStrategy | None = None

    def choose(self, requested: str | None, dtype: Any, strided: bool, num_keys: int,
               quantized: bool = False) -> AttentionStrategy:
        if quantized:
            return _quantized_choice(requested, self.override)
        forced = _forced(requested, self.override, strided)
        if forced is not None:
            return forced
        return AttentionStrategy.PAGED if self.paged_kernel else AttentionStrategy.BLOCKS

    def describe(self) -> str:
        if self.override is not None:
            return f"attention {self.override.value} ({ENV_VAR})"
        return "attention paged (Metal kernel)" if self.paged_kernel else "attention blocks (reference kernels)"

    def dequantize_quantized(self, dtype: Any) -> bool:
        """Metal reads codes through MLX's quantized matmul kernels at every float type."""
        return False

    def quantized_per_head(self, num_keys: int) -> bool:
        """As on the CPU (the copy of a non-contiguous operand is MLX's on both); the crossover is unmeasured on
        Metal, so the CPU's is used."""
        return num_keys > CpuAttention.quantized_per_head_above


def _quantized_choice(requested: str | None, override: AttentionStrategy | None) -> AttentionStrategy:
    """A quantized arena's strategy: `quantized`, or `gather` when asked for; the float arena's layouts (strided
    views, gather_mm blocks, the paged kernel) read float buffers and do not apply."""
    forced = parse_strategy(requested, "attention=") if requested is not None else override
    if forced is AttentionStrategy.GATHER:
        return AttentionStrategy.GATHER
    if requested is not None and forced is not None:
        raise ValueError(f"attention {forced.value!r} reads float buffers; a quantized arena (kv_dtype int8/int4) "
                         "runs 'quantized' or 'gather'")
    return AttentionStrategy.QUANTIZED


def attention_for_device() -> AttentionChoice:
    """The rule for a batch built without an engine's backend (tests, benchmarks): decided now from the kernels'
    device and the environment, as an engine's backend decides once when it is built."""
    from cortexstream.kernels.dispatch import METAL, resolve_backend

    override = strategy_from_env()
    if resolve_backend() == METAL:
        return MetalAttention(paged_kernel=True, override=override)
    return CpuAttention(override=override)
