"""KV memory policies: small objects attached to a request that decide what stays in its physical KV cache.

A policy never changes a sequence's text; it only chooses which physical KV slots survive. The runtime calls
`select()` after every forward pass (a prefill chunk or a decode step, never in the middle of one), so between
forward passes a sequence holds at most `budget_tokens(context)` physical tokens, and while a forward pass runs
at most that plus the tokens being computed (one prefill chunk, or one decode token).

Budgets are a token count (int >= 1) or a fraction of the *context* (float in (0, 1]). The context is the total
logical length the request is allowed to reach: prompt + max_tokens for a request (for a continued conversation,
everything already in the cache plus this turn's prompt and max_tokens), and the number of scored tokens for
`cortexstream.perplexity`. A fraction therefore resolves to one fixed cache size per request, as in the H2O paper
("20% of the sequence length"), rather than a cache that grows with the text. Every policy raises a resolved
budget to its own minimum (the tokens it always protects plus one), so tiny contexts never produce an empty cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Union

import numpy as np

from cortexstream.errors import InvalidArgumentError

Budget = Union[int, float]


def check_budget(name: str, value: Budget | None, *, allow_none: bool = False) -> Budget | None:
    """Validate a budget-like argument: int >= 1 tokens, or a float fraction in (0, 1]."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(f"{name}: {value!r} must be a token count (int >= 1) or a fraction in (0, 1]")
    if isinstance(value, int):
        if value < 1:
            raise InvalidArgumentError(f"{name}: {value} tokens must be >= 1")
        return value
    if not 0.0 < value <= 1.0:
        raise InvalidArgumentError(f"{name}: fraction {value} must be in (0, 1] (use an int for a token count)")
    return float(value)


def check_count(name: str, value: int, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(f"{name}: {value!r} must be an integer >= {minimum}")
    return value


def check_real(owner: str, name: str, value: float, low: float, high: float, rule: str) -> float:
    """A number (not a bool) in [low, high], else an error naming the policy, the argument and `rule`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= float(value) <= high:
        raise InvalidArgumentError(f"{owner}: {name} {value!r} must be {rule}")
    return value


def option_suffix(key: str, value: float | None) -> str:
    """A policy string's `,key=value` for an optional number (nothing when it is None)."""
    return "" if value is None else f",{key}={value:g}"


def merge_suffix(merge: float | None) -> str:
    """A policy string's `,merge=T` (nothing when the policy does not fold dropped keys into kept ones)."""
    return option_suffix("merge", merge)


def resolve_budget(value: Budget, context: int) -> int:
    """Tokens for a budget: ints as given, fractions of `context` rounded up."""
    if isinstance(value, int):
        return value
    return max(1, math.ceil(value * max(int(context), 1)))


class FoldsDropped:
    """For a policy whose optional `merge` field (a cosine, or None) folds each dropped key into its most similar kept
    key of the same head (`merges_evicted`, `engine.evict_merge`): SnapKV's and KVzip's `merge=T`."""

    def check_merge(self, owner: str) -> None:
        """`merge`, when given, is a cosine in [-1, 1] (else an error naming `owner` and the argument)."""
        merge = getattr(self, "merge")
        if merge is not None:
            check_real(owner, "merge", merge, -1.0, 1.0,
                       "a cosine in [-1, 1] (a dropped key folds into its most similar kept key at or above it)")

    @property
    def merges_evicted(self) -> bool:
        return getattr(self, "merge") is not None

    @property
    def merge_threshold(self) -> float | None:
        merge = getattr(self, "merge")
        return None if merge is None else float(merge)


class KVPolicy:
    """Base class and the whole policy protocol: every capability the runtime reads is declared here, so the
    engine reads `policy.evicts` and friends directly (a request without a policy gets `FullCache`, never None).

    Capabilities (class attributes a subclass overrides, or a dataclass field / property of the same name):

    - `evicts`: the runtime keeps per-sequence state for this request and calls `select` / `merge_range` after
      every forward pass. False: the engine skips all policy work (and may share the request's blocks through
      the prefix cache).
    - `needs_attention_scores`: the runtime accumulates the attention each key received (the SDPA hook) and
      passes it to `select`.
    - `merges`: the runtime asks `merge_range` for slots to merge and writes `merge_from_arena`'s result
      through `SequenceKV.replace` (see `merging`).
    - `uses_logit_bias`: merged slots carry an additive attention-logit bias the SDPA hook adds.
    - `rerotate`: kept keys are re-rotated to positions 0..n-1 after each eviction (needs the model's RoPE).
    - `merges_evicted`: before the slots `select` dropped are compacted away, each is folded into the value of
      its most similar kept slot (`engine.evict_merge`) when their keys' cosine reaches `merge_threshold`.
    - `folds_keys` (with `merges_evicted`): the fold is the policy's own `fold_evicted` (a learned merger), which
      rewrites the kept slots' keys as well as their values; otherwise D2O's fixed average of the values.
    - `needs_query_statistics`: the runtime keeps the prompt's query mean and covariance per layer and head and
      passes each key's expected attention to `select` as its scores (`engine.query_statistics`).
    - `observation_window`: None, or how many queries before the end of a prompt vote (SnapKV): the runtime
      records attention only from queries at or after `prompt_end - window` and evicts only once the prompt is
      complete (see `engine.observation`).
    - `selects_per_head`: each (layer, KV head) keeps a budget-fixed count of slots from its own GQA group's scores.
    - `merges_per_head`: a merging policy whose ranges come from the lengths and the shared mass alone and whose
      merged slots (and logit biases) of each KV head come from that head's own keys and values, with no weights
      tied to the model's KV head count: a cache holding only some of the heads merges them as the whole would.
    - `reconstructs`: once a prompt is complete the model is made to repeat it (KVzip): the runtime records the
      most attention each key got from those reconstruction queries, and evicts only once that pass has run
      (see `engine.reconstruction`).
    - `pools_heads`: a layer's budget is shared by its KV heads (Ada-KV): `select_cells` picks the stored cells
      (column, slot) to keep, a head may keep more keys than there are slots, and the runtime stores the surplus
      in other heads' columns, recording each cell's owner (`engine.pooled_heads`).
    - `pools_layers` (with `pools_heads`): layers keep different counts (PyramidKV), their mean the budget; the
      runtime stores a layer's surplus in the cells of layers that keep fewer (`engine.pooled_layers`), and
      `select_cells` gets each cell's owner as `layer x H + head`.
    - `parse_keys`: keys accepted in the policy's string form (key -> kind, see `parsing`).
    """

    name = "base"
    evicts = False
    needs_attention_scores = False
    merges = False
    uses_logit_bias = False
    rerotate = False
    needs_query_statistics = False
    merges_evicted = False
    folds_keys = False
    reconstructs = False
    observation_window: int | None = None
    selects_per_head = False
    merges_per_head = False
    pools_heads = False
    pools_layers = False
    merge_threshold: float | None = None
    parse_keys: ClassVar[dict[str, str]] = {}

    @property
    def needs_attention_hook(self) -> bool:
        """Whether a sequence's attention goes through the policy's SDPA hook: to record scores, add logit biases,
        gather query statistics, or attend cells that hold another head's or layer's key (`pools_heads`)."""
        return bool(self.needs_attention_scores or self.uses_logit_bias or self.needs_query_statistics
                    or self.pools_heads)

    def budget_tokens(self, context: int) -> int | None:
        """Physical tokens allowed between forward passes for a request of `context` tokens (None: no bound)."""
        return None

    def max_physical_tokens(self, max_total_tokens: int, chunk: int, prompt_tokens: int | None = None) -> int | None:
        """Upper bound on the physical KV slots a sequence can hold: the budget plus one forward pass's tokens.
        `prompt_tokens`: the prompt's length, for policies that compress a prompt only once it is complete."""
        budget = self.budget_tokens(max_total_tokens)
        return None if budget is None else budget + chunk

    def peak_tokens(self, max_total_tokens: int, chunk: int, prompt_tokens: int | None = None) -> int:
        """Most KV slots a request holds at once: `max_physical_tokens`, at most its own text (prompt +
        max_tokens), except for a policy that also holds tokens that are not its text (`reconstructs`: KVzip's
        scoring passes sit after the prompt, up to a pass of `chunk` tokens)."""
        bound = self.max_physical_tokens(max_total_tokens, chunk, prompt_tokens)
        if bound is None:
            return max_total_tokens
        return bound if self.reconstructs else min(max_total_tokens, bound)

    def fold_evicted(self, layer: int, anchor_k: Any, anchor_v: Any, mean_k: Any, mean_v: Any,
                     weight: Any) -> tuple[Any, Any]:
        """With `folds_keys`: the new keys and values `[H, k, D]` of a layer's kept slots from their own (anchor)
        and their groups' cosine-weighted means (`compression.evicted_merger.group_means`)."""
        raise NotImplementedError(f"{self.name}: folds_keys without fold_evicted")

    def select(self, num_physical: int, context: int, scores: np.ndarray | None) -> np.ndarray | None:
        """Physical indices to keep (`[n]` for every layer/head, or `[L, H, n]`), or None to keep everything.

        scores: accumulated attention per (layer, KV head, physical slot), `[L, H, num_physical]`, when
        `needs_attention_scores`; else None.
        """
        return None

    def eviction_target(self, num_physical: int, budget: int, minimum: int) -> int:
        """Slots an evicting policy keeps when `num_physical` exceeds `budget`. When only a few tokens went over
        the budget (decoding), it keeps `slack` fewer, so the next `slack` tokens need no eviction: a compaction
        (and, for a pooling policy, the rebuild of its layout) once every `slack` tokens instead of after each
        one. A pass that overshoots by more (a prompt) is compressed to the budget itself. Never below `minimum`.
        The cache never holds more than the budget between passes either way."""
        slack = min(16, budget // 8)
        return max(minimum, budget - slack) if num_physical - budget < slack else budget

    def select_cells(self, num_physical: int, context: int, scores: np.ndarray | None, positions: np.ndarray,
                     owners: np.ndarray) -> np.ndarray | None:
        """Only when `pools_heads`: a bool mask `[L, H, n]` of the stored cells to keep (the same count in every
        layer, a multiple of H; with `pools_layers` the same count in all), or None. `positions`/`owners`
        `[L, H, n]`: each cell's logical position and the KV head whose key it holds (`layer x H + head` when
        `pools_layers`)."""
        raise NotImplementedError(f"{self.name}: does not pool heads")

    def merge_range(self, num_physical: int, context: int, mass: np.ndarray) -> tuple[int, int] | None:
        """Physical slots [start, end) to merge now, or None (only called when `merges`)."""
        return None

    def merge_from_arena(self, layer: int, arena: Any, blocks: list[int], start: int, end: int,
                         mass: np.ndarray) -> Any:
        """Merge physical slots [start, end) of one layer into fewer (a `merging.Merged`); only when `merges`."""
        raise NotImplementedError(f"{self.name}: does not merge")

    def describe(self) -> str:
        return self.name


@dataclass(frozen=True)
class FullCache(KVPolicy):
    """Keep every token (the default: what a request without a policy gets)."""

    name = "full"
