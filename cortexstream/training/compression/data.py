"""Training data for KV compressors: token segments of real text and the full-cache "teacher" pool built from them.

Held-out rule. `cortexstream bench quality` scores the first ~20k tokens of `wiki_text()`, so compressor training
never reads them: training segments start at token `train_offset` (65536 by default) of the tokenised text and
validation segments at `val_offset` (32768), both disjoint from the benchmark's range and from each other. The
exact token ranges are returned with the segments and recorded in checkpoint metadata.

Teacher pool. For each segment of P + Q tokens one full-cache forward pass (no gradient) gives the prefix's K/V in
every layer `[S, H, P, D]` and the teacher's log-probabilities and final hidden states for the Q query tokens. The
pool is computed once per run (deterministic, so a resumed run rebuilds exactly the same pool; `cached` stores it
for runs at other factors) and reused by every training step, which then costs only the Q-token forward and
backward pass over the compressed cache.

Position offsets. Keys are cached after RoPE, so a compressor trained only on positions < P + Q meets unseen
rotations in a 4k context. With `max_offset`, each teacher batch runs at positions [o, o + P + Q) for a random o
(a segment with no context before it, as if it started at o): the targets and the student use the same positions,
so the objective stays consistent while the keys cover the positions of long contexts at the cost of short ones.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from cortexstream.compression.compressor import head_dim_of
from cortexstream.training.compression.objective import PrefixCache, logits_of
from cortexstream.errors import InvalidArgumentError
from cortexstream.models.safetensors_check import check_safetensors

# `bench quality` scores the first ~20k tokens of wiki_text() (perplexity at 2k/4k and more); keep out of them.
BENCHMARK_TOKENS = 20_000


@dataclass(frozen=True)
class Segments:
    """`tokens` [S, P + Q] int32 and a description of where they come from."""

    tokens: np.ndarray
    source: str
    start: int
    stop: int


def cut_segments(ids: Sequence[int], offset: int, count: int, length: int, source: str,
                 limit: int | None = None) -> Segments:
    """`count` consecutive, disjoint segments of `length` tokens starting at token `offset` (ending before
    `limit` if given); errors say how many tokens were needed."""
    stop = offset + count * length
    end = len(ids) if limit is None else min(limit, len(ids))
    if count < 1 or stop > end:
        raise InvalidArgumentError(f"training data: {count} segments of {length} tokens from token {offset} need "
                                   f"{stop} tokens, the text has {end} ({source})")
    tokens = np.asarray(ids[offset:stop], dtype=np.int32).reshape(count, length)
    return Segments(tokens, f"{source} tokens [{offset}, {stop})", offset, stop)


def wiki_segments(tokenizer: Any, *, train_offset: int, val_offset: int, train: int, val: int,
                  length: int) -> tuple[Segments, Segments]:
    """Training and validation segments from `cortexstream.evaluation.wiki_corpus.wiki_text()`."""
    from cortexstream.evaluation.wiki_corpus import wiki_text

    if min(train_offset, val_offset) < BENCHMARK_TOKENS:
        raise InvalidArgumentError(f"training data: offsets below {BENCHMARK_TOKENS} overlap the tokens that "
                                   f"`bench quality` scores (got train {train_offset}, val {val_offset})")
    text, source = wiki_text()
    ids = tokenizer.encode(text)
    train_segments = cut_segments(ids, train_offset, train, length, source)
    limit = train_offset if val_offset < train_offset else None
    val_segments = cut_segments(ids, val_offset, val, length, source, limit=limit)
    if val_offset >= train_offset and val_offset < train_segments.stop:
        raise InvalidArgumentError(f"training data: held-out tokens from {val_offset} overlap the training "
                                   f"tokens {train_segments.source}")
    return train_segments, val_segments


class TeacherPool:
    """Full-cache targets for every segment: prefix K/V per layer, teacher log-probs and hidden states."""

    def __init__(self, model: Any, segments: Segments, prefix: int, *, batch_size: int = 4,
                 progress: bool = True, desc: str = "teacher", max_offset: int = 0, seed: int = 0) -> None:
        tokens = segments.tokens
        if tokens.shape[1] <= prefix:
            raise InvalidArgumentError(f"prefix: {prefix} leaves no query tokens in segments of {tokens.shape[1]}")
        self.prefix, self.num_queries = prefix, tokens.shape[1] - prefix
        self.queries = mx.array(tokens[:, prefix:])
        # Position offsets: each teacher batch runs at positions [o, o + P + Q) with o uniform in [0, max_offset],
        # so the compressor sees post-RoPE keys at the positions long contexts reach, without paying for them.
        starts = range(0, len(tokens), batch_size)
        batch_offsets = [int(np.random.default_rng([seed, j]).integers(0, max_offset + 1)) if max_offset else 0
                         for j in range(len(starts))]
        self.offsets = np.repeat(batch_offsets, batch_size)[: len(tokens)]
        layers = model.model.layers
        keys: list[list[mx.array]] = [[] for _ in layers]
        values: list[list[mx.array]] = [[] for _ in layers]
        logp, hidden = [], []
        heads, head_dim = _kv_shape(model)
        dtype = model.model.embed_tokens.weight.dtype
        for lo, offset in tqdm(list(zip(starts, batch_offsets)), desc=desc, unit="batch", disable=not progress):
            chunk = mx.array(tokens[lo:lo + batch_size])
            caches = [PrefixCache.empty(chunk.shape[0], heads, head_dim, offset, dtype) for _ in layers]
            h = model.model(chunk, cache=caches)[:, prefix:]
            logits = logits_of(model, h).astype(mx.float32)
            logp.append(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
            hidden.append(h)
            for layer, cache in enumerate(caches):
                keys[layer].append(cache.fetched[0][:, :, :prefix])
                values[layer].append(cache.fetched[1][:, :, :prefix])
            # evaluate now: the pool is the run's largest memory, never hold a whole batch's graph on top of it
            mx.eval(logp[-1], hidden[-1], [k[-1] for k in keys], [v[-1] for v in values])
        self.keys = [mx.concatenate(k) for k in keys]
        self.values = [mx.concatenate(v) for v in values]
        self.teacher_logp, self.teacher_hidden = mx.concatenate(logp), mx.concatenate(hidden)
        self.source = segments.source

    def save(self, path: str, fingerprint: str) -> None:
        """Write the pool (float32) so another run with the same data and model can skip the teacher passes."""
        arrays = {f"keys.{i}": k for i, k in enumerate(self.keys)}
        arrays.update({f"values.{i}": v for i, v in enumerate(self.values)})
        arrays.update(queries=self.queries, teacher_logp=self.teacher_logp, teacher_hidden=self.teacher_hidden,
                      offsets=mx.array(self.offsets.astype(np.int32)))
        tmp = path + ".tmp.safetensors"
        mx.save_safetensors(tmp, arrays, metadata={"fingerprint": fingerprint, "prefix": str(self.prefix),
                                                   "source": self.source})
        os.replace(tmp, path)

    @classmethod
    def cached(cls, path: str, fingerprint: str, build: Callable[[], "TeacherPool"]) -> "TeacherPool":
        """The pool stored at `path` if its fingerprint matches, else `build()` (then stored there)."""
        if os.path.exists(path):
            check_safetensors(path)  # a damaged cache is named, not a terse MLX error
            arrays, meta = mx.load(path, return_metadata=True)
            if meta.get("fingerprint") == fingerprint:
                pool = cls.__new__(cls)
                layers = sum(1 for k in arrays if k.startswith("keys."))
                pool.keys = [arrays[f"keys.{i}"] for i in range(layers)]
                pool.values = [arrays[f"values.{i}"] for i in range(layers)]
                pool.queries, pool.teacher_logp = arrays["queries"], arrays["teacher_logp"]
                pool.teacher_hidden, pool.offsets = arrays["teacher_hidden"], np.array(arrays["offsets"])
                pool.prefix, pool.num_queries, pool.source = int(meta["prefix"]), pool.queries.shape[1], meta["source"]
                return pool
        pool = build()
        pool.save(path, fingerprint)
        return pool

    def __len__(self) -> int:
        return int(self.queries.shape[0])

    def batch(self, index: np.ndarray) -> dict[str, Any]:
        idx = mx.array(np.asarray(index, dtype=np.int32))
        return {"prefix_kv": [(k[idx], v[idx]) for k, v in zip(self.keys, self.values)],
                "offsets": self.offsets[np.asarray(index)],
                "queries": self.queries[idx], "teacher_logp": self.teacher_logp[idx],
                "teacher_hidden": self.teacher_hidden[idx]}


def _kv_shape(model: Any) -> tuple[int, int]:
    args = model.args
    return int(getattr(args, "num_key_value_heads", None) or args.num_attention_heads), head_dim_of(model)
