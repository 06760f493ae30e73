"""`cortexstream.perplexity`: teacher-forced scoring through the cache, with and without eviction."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import cortexstream
from cortexstream.errors import InvalidArgumentError
from cortexstream.evaluation.perplexity import token_nlls

TEXT = ("The quick brown fox jumps over the lazy dog while the sun sets behind the hills, and the farmer "
        "walks home along the river, counting the sheep that graze near the old stone bridge. ") * 3


def reference_nlls(model, ids):
    """One forward over the whole text without any cache (mlx-lm's perplexity computation)."""
    logits = model(mx.array(ids[:-1])[None])[0].astype(mx.float32)
    target = mx.array(ids[1:])[:, None]
    return np.array(mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, target, axis=-1)[:, 0])


def test_full_cache_perplexity_matches_a_single_forward(tiny):
    model, tokenizer = tiny
    ids = list(tokenizer.encode(TEXT))
    ref = reference_nlls(model, ids)
    for chunk in (1, 7, None):
        np.testing.assert_allclose(token_nlls(model, ids, None, chunk_size=chunk), ref, rtol=1e-4, atol=1e-4)
    value = cortexstream.perplexity(model, tokenizer, TEXT)
    assert value == pytest.approx(float(np.exp(ref.mean())), rel=1e-4)


def test_eviction_really_happens_while_scoring(tiny):
    model, tokenizer = tiny
    n = len(tokenizer.encode(TEXT))
    full = cortexstream.perplexity(model, tokenizer, TEXT, chunk_size=1)  # evicting policies default to 1
    assert cortexstream.perplexity(model, tokenizer, TEXT, kv_policy="h2o:budget=1.0") == full
    assert cortexstream.perplexity(model, tokenizer, TEXT, kv_policy=f"streaming:budget={n}") == full
    small = cortexstream.perplexity(model, tokenizer, TEXT, kv_policy="streaming:budget=0.1,sinks=2")
    assert small != full


def test_num_tokens_and_errors(tiny):
    model, tokenizer = tiny
    ids = list(tokenizer.encode(TEXT))
    head = cortexstream.perplexity(model, tokenizer, TEXT, num_tokens=20)
    assert head == pytest.approx(float(np.exp(reference_nlls(model, ids[:20]).mean())), rel=1e-4)
    with pytest.raises(InvalidArgumentError, match="has"):
        cortexstream.perplexity(model, tokenizer, TEXT, num_tokens=len(ids) + 1)
    with pytest.raises(InvalidArgumentError, match="num_tokens"):
        cortexstream.perplexity(model, tokenizer, TEXT, num_tokens=1)
    with pytest.raises(InvalidArgumentError, match="chunk_size"):
        cortexstream.perplexity(model, tokenizer, TEXT, chunk_size=0)
    with pytest.raises(InvalidArgumentError, match="non-empty"):
        cortexstream.perplexity(model, tokenizer, "")
    with pytest.raises(InvalidArgumentError, match="unknown policy"):
        cortexstream.perplexity(model, tokenizer, TEXT, kv_policy="lru")
    assert "perplexity" in cortexstream.__all__


@pytest.mark.real_model
def test_smollm_perplexity_on_english_is_low_and_policies_without_eviction_match(smollm):
    model, tokenizer = smollm
    full = cortexstream.perplexity(model, tokenizer, TEXT, num_tokens=96)
    assert 1.0 < full < 60.0
    same = cortexstream.perplexity(model, tokenizer, TEXT, kv_policy="h2o:budget=1.0", num_tokens=96,
                                   chunk_size=16)
    assert same == pytest.approx(full, rel=1e-4)
    evicted = cortexstream.perplexity(model, tokenizer, TEXT, kv_policy="h2o:budget=24,recent=8", num_tokens=96,
                                      chunk_size=8)
    assert evicted != full and evicted < 10 * full
