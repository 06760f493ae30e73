"""Per-sequence policy runtime: accumulated scores, logical positions, and the eviction step after a forward pass.

`PolicyState` lives next to one `SequenceKV` (the engine's runner keeps one per request; the direct path keeps it
on the `PolicyKVCache` objects of a prompt cache, so it survives between chat turns). For every layer it holds
`scores[l]` `[kv_heads, n]` (float64: sums over thousands of queries) and `positions[l]` `[kv_heads, n]`, the
logical position of each physical slot, both aligned with the physical slots: `after_forward` appends the new
tokens' entries, then evicts through `SequenceKV.keep` and gathers scores/positions with the same indices, so
they stay aligned through compaction and block frees. A policy that shares a layer's budget among its heads
(`pools_heads`) also gets `owners[l]` `[kv_heads, n]`: the head whose key each cell holds (`engine.pooled_heads`),
and `owner_layers[l]`, the layer whose key it holds (a policy that `pools_layers`, `engine.pooled_layers`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from cortexstream.errors import InvalidArgumentError
from cortexstream.kv.sequence_kv import SequenceKV
from cortexstream.engine.evict_merge import folded_kv, merged_values, write_kv, write_values
from cortexstream.engine.observation import observation_for
from cortexstream.engine.pooled_decode import ExtrasReader
from cortexstream.engine.pooled_heads import column_owners
from cortexstream.engine.pooled_layers import ForeignCells, add_foreign, layer_columns
from cortexstream.engine.pooled_state import PooledCells
from cortexstream.engine.query_statistics import QueryStatistics
from cortexstream.engine.reconstruction import FRESH, ReconstructionScores
from cortexstream.policies.base import KVPolicy
from cortexstream.engine.rerotate import KeyRotator, find_rope, key_rotator, renumber


class PolicyState(PooledCells):
    """Scores and positions of one sequence's physical slots, and the policy that evicts them."""

    def __init__(self, policy: KVPolicy, num_layers: int, num_kv_heads: int, num_tokens: int = 0) -> None:
        self.policy = policy
        self.scores = [np.zeros((num_kv_heads, num_tokens)) for _ in range(num_layers)]
        self.positions = [np.broadcast_to(np.arange(num_tokens), (num_kv_heads, num_tokens)).copy()
                          for _ in range(num_layers)]
        self.pending: list[mx.array | None] = [None] * num_layers  # this forward's contributions, lazy
        # Merging policies (`merging`): original tokens per slot (same in all layers/heads) and an additive
        # attention-logit bias per layer, KV head and slot (0 for raw tokens).
        self.mass = np.ones(num_tokens)
        self.bias = [np.zeros((num_kv_heads, num_tokens), np.float32) for _ in range(num_layers)]
        self.owners = [column_owners(num_kv_heads, num_tokens) for _ in range(num_layers)]
        self.owner_layers = [layer_columns(layer, num_kv_heads, num_tokens) for layer in range(num_layers)]
        self.pooled = [False] * num_layers  # some cell of the layer holds another head's (or layer's) key
        # pools_layers: per layer, its keys held in other layers' cells, and the attention they got this pass
        self.foreign: list[ForeignCells | None] = [None] * num_layers
        self.pending_foreign: list[mx.array | None] = [None] * num_layers
        self.sequence: SequenceKV | None = None  # the sequence whose arena holds the foreign cells (`bind`)
        self._bias_arrays: dict[int, tuple[int, mx.array]] = {}  # layer -> (keys, [1, Hq, 1, keys]) cache
        # pooled layouts: per layer, its cells as laid out since the last compaction (`engine.pooled_decode`)
        self._layer_cells: dict[int, ExtrasReader] = {}
        self.num_evicted = 0
        self.num_evictions = 0
        self.num_merged = 0  # physical slots removed by merging
        self.rotate: KeyRotator | None = None  # set for policies that renumber positions (StreamingLLM rerotate)
        self.num_merges = 0
        self.num_folded = 0  # evicted slots folded into a kept one's value (merges_evicted)
        self.observation = observation_for(policy)  # which queries vote, for policies with a window (SnapKV)
        self.queries: QueryStatistics | None = None  # the prompt's query statistics (ExpectedAttention)
        self.prompt_end: int | None = None
        # KVzip: the reconstruction's maxima, and eviction held until it ran (`engine.reconstruction`)
        self.reconstruction = ReconstructionScores(num_layers) if policy.reconstructs else None

    def expect_prompt_end(self, logical_end: int) -> None:
        """The prompt being prefilled ends at `logical_end`: for a policy with an observation window only its last
        queries (and later ones) vote, and nothing is evicted before it is complete; query statistics take the
        prompt's queries only. No effect on other policies."""
        self.prompt_end = int(logical_end)

    def add_queries(self, layer: int, queries: mx.array, end: int) -> None:
        """A pass's queries `[Hq, n, D]` at logical positions [end - n, end), for the query statistics (those of
        the prompt only, when its end is known)."""
        if self.queries is None:
            return
        n = queries.shape[1]
        keep = n if self.prompt_end is None else min(n, max(0, self.prompt_end - (end - n)))
        if keep:
            self.queries.add(layer, queries[:, :keep], end - n + keep)

    def voting_row(self, end: int, num_queries: int) -> int | None:
        """First query row of a pass ending at logical position `end` whose attention is recorded (None: none)."""
        return 0 if self.observation is None else self.observation.first_voting_row(self.prompt_end, end,
                                                                                    num_queries)

    @classmethod
    def for_sequence(cls, policy: KVPolicy, seq: SequenceKV, model: Any = None) -> "PolicyState":
        """State for a sequence that already holds tokens; only valid while nothing has been evicted.

        model: needed by policies that re-rotate keys (its RoPE module); ignored otherwise."""
        if seq.num_tokens != seq.logical_length:
            raise InvalidArgumentError(
                "kv_policy: this cache was already evicted by another runtime; its slots' positions are unknown"
            )
        cfg = seq.arena.config
        state = cls(policy, cfg.num_layers, cfg.num_kv_heads, seq.num_tokens)
        state.bind(seq)
        if policy.rerotate and model is not None:
            state.rotate = key_rotator(model)
        if policy.needs_query_statistics:
            if model is None:
                raise InvalidArgumentError(f"{policy.describe()}: query statistics need the model's RoPE "
                                           "(attach the policy with model=...)")
            state.queries = QueryStatistics(cfg.num_layers, find_rope(model))
        return state

    def bind(self, seq: SequenceKV) -> None:
        """The sequence this state describes (its view of the arena and block table): foreign cells are read
        through it at each pass."""
        self.sequence = seq

    @property
    def num_tokens(self) -> int:
        return self.positions[0].shape[1]

    # --- scores -----------------------------------------------------------------------------------------------
    def record(self, layer: int, received: mx.array) -> None:
        """Add one forward pass's attention `[kv_heads, keys]` for `layer` (keys: the physical slots after it)."""
        prior = self.pending[layer]
        self.pending[layer] = received if prior is None else prior + received

    def pending_arrays(self) -> list[mx.array]:
        extra = self.queries.arrays() if self.queries is not None else []
        return [p for p in self.pending + self.pending_foreign if p is not None] + extra

    def sync(self, seq: SequenceKV) -> None:
        """Append entries for the tokens the last forward pass added, and fold in its scores."""
        for layer in range(len(self.scores)):
            length, offset = seq.lengths[layer], seq.offsets[layer]
            new = length - self.positions[layer].shape[1]
            if new < 0:
                raise InvalidArgumentError(f"kv_policy: layer {layer} lost slots outside the policy ({length})")
            heads = self.scores[layer].shape[0]
            if new:
                fresh = np.broadcast_to(np.arange(offset - new, offset), (heads, new))
                self.positions[layer] = np.concatenate([self.positions[layer], fresh], axis=1)
                fill = 0.0 if self.reconstruction is None else FRESH
                self.scores[layer] = np.concatenate([self.scores[layer], np.full((heads, new), fill)], axis=1)
                self.bias[layer] = np.concatenate([self.bias[layer], np.zeros((heads, new), np.float32)], axis=1)
                self.owners[layer] = np.concatenate([self.owners[layer], column_owners(heads, new)], axis=1)
                self.owner_layers[layer] = np.concatenate([self.owner_layers[layer],
                                                           layer_columns(layer, heads, new)], axis=1)
                if layer == 0:
                    self.mass = np.concatenate([self.mass, np.ones(new)])
            received = self.pending[layer]
            if received is not None:
                self.scores[layer] += np.asarray(received[:, :length], dtype=np.float64)
                self.pending[layer] = None
        for layer, received in enumerate(self.pending_foreign):
            if received is not None:
                add_foreign(self.scores, self.foreign[layer], np.asarray(received, dtype=np.float64))
                self.pending_foreign[layer] = None

    # --- eviction ---------------------------------------------------------------------------------------------
    def after_forward(self, seq: SequenceKV, context: int) -> int:
        """Sync, then let the policy evict and/or merge down to its budget. Returns the physical slots removed."""
        self.sync(seq)
        if self.observation is not None and not self.observation.may_evict(self.prompt_end, seq.logical_length):
            return 0
        if self.reconstruction is not None and not self.reconstruction.may_evict(self.prompt_end,
                                                                                 seq.logical_length):
            return 0
        n = seq.num_tokens
        budget = self.policy.budget_tokens(context)
        if self.policy.pools_heads and budget is not None and n <= budget:
            return 0  # within its budget a pooling policy keeps every cell: no stacking of every layer's state
        scores = np.stack(self.scores) if self.policy.needs_attention_scores else None
        if self.policy.pools_heads:
            owners = np.stack(self.owners).astype(np.int64)
            if self.policy.pools_layers:  # a cell's owner as layer x H + head
                owners = np.stack(self.owner_layers).astype(np.int64) * owners.shape[1] + owners
            return self.keep_cells(seq, self.policy.select_cells(n, context, scores, np.stack(self.positions),
                                                                 owners))
        if self.queries is not None and n > budget:
            scores = self.expected_scores(seq)
        keep = self.policy.select(n, context, scores)
        removed = 0
        if keep is not None:
            keep = np.asarray(keep, dtype=np.int64)
            new_values = new_kv = None
            if self.policy.merges_evicted:
                full = keep if keep.ndim == 3 else np.broadcast_to(keep, (len(self.scores), self.scores[0].shape[0],
                                                                          keep.shape[-1]))
                threshold = float(self.policy.merge_threshold)
                if self.policy.folds_keys:
                    new_kv, folded = folded_kv(seq, full, threshold, self.policy.fold_evicted)
                else:
                    new_values, folded = merged_values(seq, full, threshold)
                self.num_folded += folded
            seq.keep(keep)
            if new_values is not None:
                write_values(seq, new_values)
            if new_kv is not None:
                write_kv(seq, new_kv)
            self.compact(keep)
            if self.policy.rerotate:
                if self.rotate is None:
                    raise InvalidArgumentError(f"{self.policy.describe()}: re-rotation needs the model's RoPE "
                                               "(attach the policy with model=...)")
                renumber(seq, self.positions, self.rotate)
            removed = n - keep.shape[-1]
            self.num_evicted += removed
            self.num_evictions += 1
        if self.policy.merges:
            removed += self.merge(seq, context)
        return removed

    def expected_scores(self, seq: SequenceKV) -> np.ndarray:
        """`[L, H, n]` expected attention of every slot (see `engine.query_statistics`)."""
        out = []
        for layer in range(len(self.scores)):
            keys, values = seq.arena.read(layer, seq.blocks, seq.num_tokens)
            out.append(self.queries.scores(layer, keys, values, seq.logical_length, self.policy.future))
        return np.stack(out)

    def merge(self, seq: SequenceKV, context: int) -> int:
        """Apply the policy's merges (`merging.MergingPolicy`) until it asks for none. Returns slots removed."""
        removed = 0
        while True:
            span = self.policy.merge_range(seq.num_tokens, context, self.mass)
            if span is None:
                return removed
            start, end = int(span[0]), int(span[1])
            if not 0 <= start < end <= seq.num_tokens:
                raise InvalidArgumentError(f"{self.policy.name}: merge range [{start}, {end}) outside the cache")
            results = []
            for layer in range(len(self.scores)):
                results.append(self.policy.merge_from_arena(layer, seq.arena, seq.blocks, start, end,
                                                            self.mass[start:end]))
            slots = int(results[0].keys.shape[1])
            sizes = self._group_sizes(results[0].sizes, end - start, slots)
            if slots >= end - start:
                raise InvalidArgumentError(f"{self.policy.name}: merging {end - start} slots into {slots} frees nothing")
            seq.replace(start, end, [r.keys for r in results], [r.values for r in results])
            self._merge_bookkeeping(start, end, sizes, results)
            removed += end - start - slots
            self.num_merged += end - start - slots
            self.num_merges += 1

    @staticmethod
    def _group_sizes(sizes: Any, span: int, slots: int) -> np.ndarray:
        if sizes is None:
            if span % slots:
                raise InvalidArgumentError(f"merge: {span} slots do not split evenly into {slots}; give sizes")
            return np.full(slots, span // slots)
        sizes = np.asarray(sizes, dtype=np.int64)
        if sizes.shape != (slots,) or sizes.min(initial=1) < 1 or int(sizes.sum()) != span:
            raise InvalidArgumentError(f"merge: sizes {sizes.tolist()} must be {slots} counts >= 1 summing to {span}")
        return sizes

    def _merge_bookkeeping(self, start: int, end: int, sizes: np.ndarray, results: list[Any]) -> None:
        """Mass adds up, a merged slot sits at its newest member's position, scores add up, bias comes from merge."""
        bounds = np.concatenate([[0], np.cumsum(sizes)])[:-1] + start
        self.mass = np.concatenate([self.mass[:start], np.add.reduceat(self.mass[start:end], bounds - start),
                                    self.mass[end:]])
        for layer, result in enumerate(results):
            heads = self.scores[layer].shape[0]
            pos, sc = self.positions[layer], self.scores[layer]
            merged_pos = np.maximum.reduceat(pos[:, start:end], bounds - start, axis=1)
            merged_sc = np.add.reduceat(sc[:, start:end], bounds - start, axis=1)
            bias = np.zeros((heads, len(sizes)), np.float32) if result.bias is None \
                else np.asarray(result.bias, dtype=np.float32).reshape(heads, len(sizes))
            self.positions[layer] = np.concatenate([pos[:, :start], merged_pos, pos[:, end:]], axis=1)
            self.scores[layer] = np.concatenate([sc[:, :start], merged_sc, sc[:, end:]], axis=1)
            self.bias[layer] = np.concatenate([self.bias[layer][:, :start], bias, self.bias[layer][:, end:]], axis=1)
        self._bias_arrays.clear()
        self._layer_cells.clear()

    # --- logit bias -------------------------------------------------------------------------------------------
    def has_bias(self) -> bool:
        return any(b.any() for b in self.bias)

    def bias_row(self, layer: int, num_keys: int) -> np.ndarray | None:
        """This layer's bias `[kv_heads, num_keys]` (0 past the stored slots: this forward's new tokens), or None."""
        bias = self.bias[layer]
        if not bias.any():
            return None
        out = np.zeros((bias.shape[0], num_keys), np.float32)
        n = min(num_keys, bias.shape[1])
        out[:, :n] = bias[:, :n]
        return out

    def logit_bias(self, layer: int, num_keys: int, query_heads: int) -> mx.array | None:
        """The bias as `[1, Hq, 1, num_keys]` (repeated over each GQA group), cached per layer and key count."""
        cached = self._bias_arrays.get(layer)
        if cached is not None and cached[0] == num_keys:
            return cached[1]
        row = self.bias_row(layer, num_keys)
        if row is None:
            return None
        array = mx.array(np.repeat(row, query_heads // row.shape[0], axis=0))[None, :, None, :]
        self._bias_arrays[layer] = (num_keys, array)
        return array

    def compact(self, keep: np.ndarray) -> None:
        """Gather scores/positions exactly as `SequenceKV.keep` gathers the slots (sorted per row)."""
        keep = np.sort(keep, axis=-1)
        if keep.ndim == 1:
            self.mass = self.mass[keep]
        elif (self.mass != 1).any():  # mass is one row for all layers/heads: per-layer choices would split it
            raise InvalidArgumentError("kv_policy: per-layer eviction of merged slots is not supported")
        else:
            self.mass = np.ones(keep.shape[-1])
        for layer in range(len(self.scores)):
            heads = self.scores[layer].shape[0]
            row = keep if keep.ndim == 1 else keep[layer]
            index = np.broadcast_to(row, (heads, row.shape[-1]))
            self.scores[layer] = np.take_along_axis(self.scores[layer], index, axis=1)
            self.positions[layer] = np.take_along_axis(self.positions[layer], index, axis=1)
            self.bias[layer] = np.take_along_axis(self.bias[layer], index, axis=1)
            self.owners[layer] = np.take_along_axis(self.owners[layer], index, axis=1)
            self.owner_layers[layer] = np.take_along_axis(self.owner_layers[layer], index, axis=1)
        self._bias_arrays.clear()
        self._layer_cells.clear()

    def trim(self, layer: int, n: int, offset: int) -> None:
        """Drop the last n slots of a layer, which must be the last n logical tokens in every head."""
        if n <= 0:
            return
        tail = self.positions[layer][:, -n:]
        if not (tail >= offset - n).all():
            raise InvalidArgumentError("trim: the last tokens were evicted; an evicted cache cannot be trimmed")
        self.positions[layer] = self.positions[layer][:, :-n]
        self.scores[layer] = self.scores[layer][:, :-n]
        self.bias[layer] = self.bias[layer][:, :-n]
        self.owners[layer] = self.owners[layer][:, :-n]
        self.owner_layers[layer] = self.owner_layers[layer][:, :-n]
        if layer == 0:
            self.mass = self.mass[:-n]
        self._bias_arrays.pop(layer, None)
        self._layer_cells.pop(layer, None)

    def clone(self) -> "PolicyState":
        other = PolicyState(self.policy, 0, 0)
        other.scores = [s.copy() for s in self.scores]
        other.positions = [p.copy() for p in self.positions]
        other.pending = [None] * len(self.scores)
        other.mass = self.mass.copy()
        other.bias = [b.copy() for b in self.bias]
        other.owners = [o.copy() for o in self.owners]
        other.owner_layers = [o.copy() for o in self.owner_layers]
        other.foreign = list(self.foreign)  # frozen values; the clone reads them through its own sequence (bind)
        other.pending_foreign = [None] * len(self.scores)
        other.pooled = list(self.pooled)
        other.num_evicted, other.num_evictions = self.num_evicted, self.num_evictions
        other.num_merged, other.num_merges = self.num_merged, self.num_merges
        other.num_folded = self.num_folded
        other.rotate = self.rotate
        other.observation = self.observation  # immutable: the policy's window
        other.prompt_end = self.prompt_end
        other.queries = self.queries.clone() if self.queries is not None else None
        other.reconstruction = self.reconstruction.clone() if self.reconstruction is not None else None
        return other
