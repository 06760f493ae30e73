"""Runs the scheduled step on the model: prefill chunks (one sequence each) and one batched decode forward.

KV policies: a sequence whose policy evicts gets a `PolicyState` here. After each of its forward passes (a whole
prefill chunk or the decode step, never in the middle of one, so the causal mask of a chunk is never broken) the
runner evaluates the logits first (so no lazy graph still reads the arena buffers the eviction rewrites in place),
then lets the policy evict through `SequenceKV.keep`, which frees surplus blocks at once, and sets
`seq.num_physical` from the sequence's physical length. Sequences without such a policy take the unchanged path.

Each forward pass over the arena first lets it grow one layer ahead (`KVArena.grow_ahead`, see kv/arena.py), so a
growing arena's copies and page faults are spread over steps instead of stalling one.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from cortexstream.engine.batch_cache import DecodeBatch
from cortexstream.engine.mixed_batch import MixedBatch
from cortexstream.engine.prefill_batch import PrefillBatch
from cortexstream.engine.sequence import Sequence
from cortexstream.kv.arena import KVArena
from cortexstream.kv.arena_cache import ArenaKVCache
from cortexstream.kv.sequence_kv import SequenceKV
from cortexstream.engine.policy_runtime import PolicyState, batch_attention_hook, needs_batch_hook, policy_caches


def head_of(model: nn.Module) -> Any:
    """The output projection of an mlx-lm decoder (`model.model` -> hidden states -> this -> logits), or None when
    the model is not one of the known layouts (then the whole model is called)."""
    body = getattr(model, "model", None)
    if body is None or getattr(model, "model_type", None) not in _KNOWN_LAYOUTS:
        return None
    head = getattr(model, "lm_head", None)
    if head is not None:
        return head
    embed = getattr(body, "embed_tokens", None)
    args = getattr(model, "args", None)
    if embed is not None and getattr(args, "tie_word_embeddings", False):
        return embed.as_linear
    return None


# mlx-lm model types whose __call__ is exactly `head(self.model(inputs, cache))`.
_KNOWN_LAYOUTS = ("llama", "qwen2", "mistral")


def last_token_logits(model: nn.Module, tokens: mx.array, cache: list[Any]) -> mx.array:
    """Logits of the last position only, `[B, 1, V]`: the prompt's other positions never go through the
    vocabulary projection (49152 x 576 for SmolLM2, about a tenth of a 512-token prefill)."""
    head = head_of(model)
    if head is None:
        return model(tokens, cache=cache)[:, -1:, :]
    hidden = model.model(tokens, cache=cache)
    return head(hidden[:, -1:, :])


class ModelRunner:
    def __init__(self, model: nn.Module, arena: KVArena) -> None:
        self.model = model
        self.arena = arena
        self._kv: dict[str, SequenceKV] = {}
        self._policy: dict[str, PolicyState] = {}

    # --- per-sequence KV views --------------------------------------------------------------------------------
    def kv(self, seq: Sequence) -> SequenceKV:
        """The sequence's arena view, sharing its block table list with the scheduler's Sequence."""
        kv = self._kv.get(seq.request_id)
        if kv is None or kv.blocks is not seq.block_table:
            kv = SequenceKV(self.arena, owner=seq.owner, contiguous=False, blocks=seq.block_table)
            kv.lengths = [seq.num_physical] * len(kv.lengths)
            kv.offsets = [seq.num_computed] * len(kv.offsets)
            self._kv[seq.request_id] = kv
            self._policy.pop(seq.request_id, None)
        return kv

    def policy_state(self, seq: Sequence) -> PolicyState | None:
        """The sequence's policy runtime, or None when its policy never evicts (the fast path)."""
        policy = seq.kv_policy
        if not policy.evicts:
            return None
        state = self._policy.get(seq.request_id)
        if state is None:
            state = PolicyState.for_sequence(policy, self.kv(seq), self.model)
            self._policy[seq.request_id] = state
        return state

    def drop(self, seq: Sequence) -> None:
        self._kv.pop(seq.request_id, None)
        self._policy.pop(seq.request_id, None)

    def _caches(self, seq: Sequence, kv: SequenceKV) -> list[Any]:
        state = self.policy_state(seq)
        if state is not None:
            return policy_caches(kv, state)
        return [ArenaKVCache(kv, layer) for layer in range(self.arena.config.num_layers)]

    def _evict(self, seq: Sequence, kv: SequenceKV) -> None:
        state = self.policy_state(seq)
        if state is not None:
            state.after_forward(kv, seq.max_total_tokens)
        seq.num_physical = kv.num_tokens

    # --- forward passes ---------------------------------------------------------------------------------------
    def prefill(self, seq: Sequence, num_tokens: int) -> mx.array | None:
        """Compute KV for the next `num_tokens` pending tokens; logits of the last one if the prompt is done."""
        if not seq.uses_arena:
            return self._bound_forward(seq, seq.all_ids[seq.num_computed : seq.num_computed + num_tokens])
        self.arena.grow_ahead()
        kv = self.kv(seq)
        start = seq.num_computed
        tokens = mx.array(seq.all_ids[start : start + num_tokens], dtype=mx.uint32)
        kv.make_writable(kv.num_tokens, kv.num_tokens + num_tokens)
        state = self.policy_state(seq)
        caches = self._caches(seq, kv)
        seq.num_computed += num_tokens
        if seq.num_pending == 0:
            out = last_token_logits(self.model, tokens[None], caches)[0]
        else:
            out = None
            body = getattr(self.model, "model", None)
            (body if body is not None and head_of(self.model) is not None else self.model)(tokens[None], cache=caches)
        if state is not None:
            mx.eval([a for a in (out,) if a is not None], self.arena.keys, self.arena.values, state.pending_arrays())
            self._evict(seq, kv)
            return out
        seq.num_physical = kv.num_tokens
        # Evaluate now, not with the step's other logits: a later prefill in the same step writing the arena while
        # this graph (holding views of the layer buffers) is pending would make MLX copy every layer buffer.
        mx.eval([a for a in (out,) if a is not None], self.arena.keys, self.arena.values)
        return out

    def prefill_batch(self, items: list[tuple[Sequence, int]]) -> list[mx.array | None]:
        """One forward pass over several sequences' next prefill chunks (none with an evicting policy): each
        gets its KV computed, and the logits `[1, V]` of its last token when its prompt is done, else None."""
        if len(items) == 1:
            return [self.prefill(*items[0])]
        self.arena.grow_ahead()
        kvs = [self.kv(seq) for seq, _ in items]
        chunks = [seq.all_ids[seq.num_computed : seq.num_computed + n] for seq, n in items]
        for kv, (_, n) in zip(kvs, items):
            kv.make_writable(kv.num_tokens, kv.num_tokens + n)
        batch = PrefillBatch(self.arena, kvs, chunks)
        logits = last_token_logits(self.model, batch.tokens, batch.caches())[:, 0, :]
        batch.commit()
        for (seq, n), kv in zip(items, kvs):
            seq.num_computed += n
            seq.num_physical = kv.num_tokens
        done = [seq.num_pending == 0 for seq, _ in items]
        # As in `prefill`: evaluate before any other forward pass writes the arena.
        mx.eval(logits if any(done) else [], self.arena.keys, self.arena.values)
        return [logits[i : i + 1] if finished else None for i, finished in enumerate(done)]

    def decode(self, seqs: list[Sequence], tokens: mx.array | None = None) -> mx.array:
        """One forward for all `seqs` (each with exactly one pending token); returns logits [B, V].

        tokens: the pending tokens as `[B, 1]`, possibly lazy (sampled by a step still in flight); by default
        read from the sequences.
        """
        if tokens is None:
            tokens = mx.array(np.array([[seq.token_at(seq.num_computed)] for seq in seqs], dtype=np.uint32))
        if not all(seq.uses_arena for seq in seqs):
            return self._decode_with_bound(seqs, tokens)
        self.arena.grow_ahead()
        kvs = [self.kv(seq) for seq in seqs]
        states = [self.policy_state(seq) for seq in seqs]
        for kv in kvs:
            kv.make_writable(kv.num_tokens, kv.num_tokens + 1)
        if len(seqs) == 1:  # contiguous tables get zero-copy views through the single-sequence cache
            logits = self.model(tokens, cache=self._caches(seqs[0], kvs[0]))
        else:
            batch = DecodeBatch(self.arena, kvs)
            caches = batch.caches()
            if needs_batch_hook(states):  # attention scores (H2O) or logit biases of merged slots
                for cache in caches:
                    cache.attention_hook = batch_attention_hook(cache.layer, batch.lengths_after, states,
                                                              attend=getattr(cache, "attend", None))
            logits = self.model(tokens, cache=caches)
            batch.commit()
        logits = logits[:, -1, :]
        if any(s is not None for s in states):
            mx.eval(logits, [s.pending_arrays() for s in states if s is not None])
        for seq, kv in zip(seqs, kvs):
            seq.num_computed += 1
            self._evict(seq, kv)
        return logits

    def mixable(self, decode: list[Sequence], items: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """The prefill items that may ride in the decode forward of `decode` (see engine/mixed_batch.py): none
        unless every decode row can, then those on the arena that prefill with others and have no hook."""
        if not decode or head_of(self.model) is None or not all(
                seq.uses_arena and not seq.kv_policy.evicts for seq in decode):
            return []
        return [(seq, n) for seq, n in items if seq.uses_arena and not seq.prefills_alone and seq.hook is None]

    def mixed(self, seqs: list[Sequence], tokens: mx.array | None,
              items: list[tuple[Sequence, int]]) -> tuple[mx.array, list[mx.array | None]]:
        """One forward that decodes `seqs` (one pending token each; `tokens` `[B, 1]` possibly lazy, as for
        `decode`) and computes the next prefill chunk of each item (all of them `mixable`). Returns the
        decode logits `[B, V]` and, per item, the logits `[1, V]` of its last token when its prompt is done."""
        if tokens is None:
            tokens = mx.array(np.array([[seq.token_at(seq.num_computed)] for seq in seqs], dtype=np.uint32))
        self.arena.grow_ahead()
        kvs = [self.kv(seq) for seq in seqs]
        for kv in kvs:
            kv.make_writable(kv.num_tokens, kv.num_tokens + 1)
        chunk_kvs = [self.kv(seq) for seq, _ in items]
        for kv, (_, n) in zip(chunk_kvs, items):
            kv.make_writable(kv.num_tokens, kv.num_tokens + n)
        batch = MixedBatch(DecodeBatch(self.arena, kvs), [
            (kv, seq.all_ids[seq.num_computed : seq.num_computed + n]) for kv, (seq, n) in zip(chunk_kvs, items)])
        hidden = self.model.model(batch.tokens(tokens), cache=batch.caches())  # [T, 1, hidden]
        batch.commit()
        for seq, kv in zip(seqs, kvs):
            seq.num_computed += 1
            seq.num_physical = kv.num_tokens
        for (seq, n), kv in zip(items, chunk_kvs):
            seq.num_computed += n
            seq.num_physical = kv.num_tokens
        done = [seq.num_pending == 0 for seq, _ in items]
        rows = batch.logit_rows(done)
        logits = head_of(self.model)(hidden[mx.array(np.asarray(rows, dtype=np.int32))])[:, 0, :]
        chunk_logits: list[mx.array | None] = []
        row = len(seqs)
        for finished in done:
            chunk_logits.append(logits[row : row + 1] if finished else None)
            row += int(finished)
        return logits[: len(seqs)], chunk_logits

    # --- sequences bound to a caller's prompt cache -------------------------------------------------------------
    def _bound_forward(self, seq: Sequence, tokens: list[int] | mx.array) -> mx.array | None:
        tokens = tokens if isinstance(tokens, mx.array) else mx.array(tokens, dtype=mx.uint32)[None]
        seq.num_computed += tokens.shape[1]
        seq.num_physical = seq.num_computed
        return seq.bound_cache.forward(self.model, head_of(self.model), tokens, want_logits=seq.num_pending == 0)

    def _decode_with_bound(self, seqs: list[Sequence], tokens: mx.array) -> mx.array:
        """Arena sequences in one batched forward, each bound one in its own; logits [B, V] in `seqs` order."""
        rows = [i for i, seq in enumerate(seqs) if seq.uses_arena]
        logits: list[mx.array | None] = [None] * len(seqs)
        if rows:
            batch = self.decode([seqs[i] for i in rows], tokens[mx.array(rows)])
            for j, i in enumerate(rows):
                logits[i] = batch[j : j + 1]
        for i, seq in enumerate(seqs):
            if not seq.uses_arena:
                logits[i] = self._bound_forward(seq, tokens[i : i + 1])
        return mx.concatenate(logits, axis=0)
