"""What `bench kv-dtype` measures on one model, cell by cell: perplexity and passkey retrieval with the KV stored as a
given `kv_dtype` (alone or under an eviction policy), mlx-lm's `QuantizedKVCache` on the same text, and the bytes a
token costs.

Every cortexstream cell runs on a private arena of the asked storage (`make_prompt_cache(..., kv_dtype=...)`) on the
direct path `bench quality` uses: the policy attached to that cache (`attach_policy`) evicts after every chunk.
Perplexity is `evaluation.perplexity.token_nlls` on that cache; mlx-lm's caches are scored by the same call (same
chunks, same float32 log-softmax) on a list of `QuantizedKVCache`s.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from cortexstream.benchmarks.passkey import passkey_prompt
from cortexstream.benchmarks.quality import ANSWER_TOKENS, greedy_answer
from cortexstream.evaluation.answering import feed_chunks
from cortexstream.engine.policy_prompt_cache import attach_policy, fork_cache
from cortexstream.evaluation.perplexity import token_nlls
from cortexstream.kv.arena_config import ArenaConfig, model_kv_shape
from cortexstream.kv.kv_dtype import parse_kv_dtype
from cortexstream.kv.prompt_cache import make_prompt_cache
from cortexstream.policies import KVPolicy

GIB = 1 << 30


@dataclass(frozen=True)
class Storage:
    """One KV storage under test: `text` as `parse_kv_dtype` spells it ("float32", "int8", "k=int8,v=int4") and the
    group size its quantized sides use (None when nothing is quantized: a group size would be refused there)."""

    text: str
    group_size: int | None

    @classmethod
    def parse(cls, spec: str, group_size: int, model_dtype: str) -> "Storage":
        parsed = parse_kv_dtype(spec, None, model_dtype=model_dtype)  # the spelling alone, errors name kv_dtype
        return cls(parsed.text, group_size if parsed.quantized else None)

    @property
    def quantized(self) -> bool:
        return self.group_size is not None

    def cache(self, model: Any, max_tokens: int) -> list[Any]:
        return make_prompt_cache(model, max_tokens=max_tokens, kv_dtype=self.text, kv_group_size=self.group_size)


def default_storages(model_dtype: str) -> list[str]:
    """The model's float type, float16 when that differs, int8, int4, and int8 keys with int4 values."""
    floats = [model_dtype] + (["float16"] if model_dtype != "float16" else [])
    return floats + ["int8", "int4", "k=int8,v=int4"]


def memory_row(model: Any, storage: Storage) -> dict[str, Any]:
    """Bytes per token (all layers, K + V, scales and biases included) and tokens per GiB of arena."""
    cfg = ArenaConfig.for_model(model, num_bytes=GIB, kv_dtype=storage.text, kv_group_size=storage.group_size)
    return {"storage": storage.text, "group_size": storage.group_size, "bytes_per_token": cfg.bytes_per_token,
            "tokens_per_gib": cfg.num_slots}


def perplexity_cell(model: Any, ids: Sequence[int], storage: Storage, policy: KVPolicy | None,
                    chunk: int) -> dict[str, Any]:
    """Perplexity of `ids` with K/V stored as `storage` and `policy` evicting after every chunk; `kept_tokens` is the
    most tokens the cache held after any eviction (the context for the full cache)."""
    tic = time.perf_counter()
    context = len(ids)
    bound = policy.max_physical_tokens(context, chunk) if policy is not None else None
    cache = storage.cache(model, min(context, bound or context))
    kept: list[int] = []
    nll = token_nlls(model, ids, policy, chunk_size=chunk, prompt_cache=cache,
                     on_chunk=lambda _, c: kept.append(int(c[0].size())))
    kept_tokens = max(kept) if policy is not None else context
    bytes_per_token = memory_row(model, storage)["bytes_per_token"]
    return {"system": "cortexstream", "storage": storage.text, "group_size": storage.group_size, "chunk": chunk,
            "ppl": float(np.exp(nll.mean())), "kept_tokens": kept_tokens, "bytes_per_token": bytes_per_token,
            "bytes_per_context_token": bytes_per_token * kept_tokens / context,
            "seconds": time.perf_counter() - tic}


def mlx_lm_cell(model: Any, ids: Sequence[int], bits: int, group_size: int, chunk: int) -> dict[str, Any]:
    """Perplexity on mlx-lm's `QuantizedKVCache(group_size, bits)` (one per layer), and the bytes per token it
    allocated (its `nbytes` over the slots it holds: it grows in steps of 256 tokens)."""
    from mlx_lm.models.cache import QuantizedKVCache

    tic = time.perf_counter()
    cache = [QuantizedKVCache(group_size=group_size, bits=bits) for _ in model.layers]
    nll = token_nlls(model, ids, None, chunk_size=chunk, prompt_cache=cache)
    slots = int(cache[0].keys[0].shape[-2])
    bytes_per_token = sum(c.nbytes for c in cache) / slots
    return {"system": "mlx_lm", "storage": f"int{bits}", "group_size": group_size, "chunk": chunk,
            "ppl": float(np.exp(nll.mean())), "kept_tokens": len(ids), "bytes_per_token": bytes_per_token,
            "bytes_per_context_token": bytes_per_token, "seconds": time.perf_counter() - tic}


def passkey_cell(model: Any, tokenizer: Any, context: int, storage: Storage, policy: KVPolicy | None, trials: int,
                 chunk: int, seed: int) -> dict[str, Any]:
    """`bench quality`'s passkey cell on `storage`: keys at depths spread over 10-90% of the filler, the shared
    prefix before each needle fed once and forked per trial (storage and policy state kept), greedy answer."""
    tic = time.perf_counter()
    rng = np.random.default_rng(seed + context)
    depths = np.linspace(0.1, 0.9, trials)
    keys = [str(k) for k in rng.integers(10000, 100000, trials)]
    budget_context = context + ANSWER_TOKENS
    base = storage.cache(model, context)
    attach_policy(base, policy, model)
    fed, results = 0, []
    for depth, key in zip(depths, keys):
        ids, needle_at = passkey_prompt(tokenizer, context, float(depth), key)
        feed_chunks(model, base, ids[fed:needle_at], chunk, budget_context)
        fed = needle_at
        trial = fork_cache(base)  # keeps the storage: the trial goes on writing in kv_dtype
        logits = feed_chunks(model, trial, ids[needle_at:], chunk, budget_context, logits=True)
        answer = greedy_answer(model, tokenizer, trial, logits, budget_context)
        found = re.search(r"\d{5}", answer)
        results.append({"depth": round(float(depth), 3), "key": key, "answer": answer.strip(),
                        "correct": bool(found and found.group(0) == key)})
    correct = sum(r["correct"] for r in results)
    return {"storage": storage.text, "group_size": storage.group_size, "trials": trials, "correct": correct,
            "accuracy": correct / trials, "chunk": chunk, "results": results, "seconds": time.perf_counter() - tic}


def model_dtype(model: Any) -> str:
    """The model's float type, the storage "float" means here."""
    return model_kv_shape(model)[3]


__all__ = ["Storage", "default_storages", "memory_row", "mlx_lm_cell", "model_dtype",
           "passkey_cell", "perplexity_cell"]
