"""C2C through the engine: extract a request's KV (any model the engine loaded), fuse into a running receiver in the
arena, keep decoding through the normal engine; shared/prefix-cached blocks never see fused KV; tenants."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from cortexstream.c2c import C2CFuser, C2CProjectorFuser
from cortexstream.c2c.request_fusion import extract_cache, fuse_into, fuse_requests, run_until_prefilled
from cortexstream.engine.engine import Engine
from cortexstream.errors import InvalidArgumentError
from tiny_models import tiny_model

PROMPT = [5, 17, 42, 99, 7, 123, 64, 250, 31, 88, 12, 200, 77]  # 13 tokens: 3 full blocks of 4 + 1
N_OUT = 8


def collect(outputs, results, logprobs=None):
    for out in outputs:
        if out.token is not None:
            results.setdefault(out.request_id, []).append(out.token)
            if logprobs is not None:
                logprobs.setdefault(out.request_id, []).append(out.logprobs)


def run(engine, results=None, logprobs=None):
    results = {} if results is None else results
    while engine.has_unfinished:
        collect(engine.step(), results, logprobs)
    return results


def alone(model, tokenizer, prompt, n=N_OUT, with_logprobs=False):
    engine = Engine(model, tokenizer, kv_tokens=512, block_size=4)
    rid = engine.add_request(prompt, max_tokens=n)
    logprobs = {}
    tokens = run(engine, logprobs=logprobs)[rid]
    return (tokens, logprobs[rid]) if with_logprobs else tokens


def same_logprobs(a, b):
    return len(a) == len(b) and all(mx.allclose(x, y, atol=1e-4) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def models(tiny):
    _, tokenizer = tiny
    receiver = tiny_model(11)
    sharer = tiny_model(12, num_hidden_layers=3, num_key_value_heads=1, head_dim=32, num_attention_heads=2)
    return receiver, sharer, tokenizer


def open_fuser(sharer, receiver):
    fuser = C2CProjectorFuser.from_models(sharer, receiver, hidden_dim=32, intermediate_dim=48)
    for p in fuser.projectors:
        p.key_gate_logit, p.value_gate_logit = mx.array(1.0), mx.array(1.0)
    return fuser


def started(model, tokenizer, prompt=PROMPT, tenant=None, n=N_OUT):
    engine = Engine(model, tokenizer, kv_tokens=512, block_size=4)
    rid = engine.add_request(prompt, max_tokens=n, tenant=tenant)
    first = [o.token for o in run_until_prefilled(engine, rid) if o.request_id == rid]
    return engine, rid, first


def test_extract_matches_an_mlx_lm_prefill(models):
    receiver, sharer, tokenizer = models
    for model in (receiver, sharer):
        engine, rid, _ = started(model, tokenizer)
        layers = extract_cache(engine, rid)
        ref = [KVCache() for _ in model.layers]
        model(mx.array(PROMPT)[None], cache=ref)
        for (k, v), c in zip(layers, ref):
            rk, rv = c.keys[..., : len(PROMPT), :], c.values[..., : len(PROMPT), :]
            assert k.shape == rk.shape and mx.allclose(k, rk, atol=1e-5) and mx.allclose(v, rv, atol=1e-5)


def test_fused_request_decodes_through_the_engine(models):
    receiver, sharer, tokenizer = models
    src_engine, src_id, _ = started(sharer, tokenizer)
    engine, rid, first = started(receiver, tokenizer)
    fuser = open_fuser(sharer, receiver)
    expected = fuser.fused_layers(extract_cache(src_engine, src_id), extract_cache(engine, rid))
    assert fuse_requests(fuser, (src_engine, src_id), (engine, rid)) == 2
    for (k, v), (ek, ev) in zip(extract_cache(engine, rid), expected):
        assert mx.array_equal(k, ek) and mx.array_equal(v, ev)
    rest, logprobs = [], []
    while engine.has_unfinished:
        for out in engine.step():
            if out.request_id == rid and out.token is not None:
                rest.append(out.token)
                logprobs.append(out.logprobs)
    assert len(first + rest) == N_OUT or tokenizer.eos_token_id in first + rest
    # Reference: mlx-lm caches holding the same fused K/V, then the same greedy continuation.
    def continuation(layers):
        caches = []
        for k, v in layers:
            c = KVCache()
            c.state = (mx.array(np.array(k)), mx.array(np.array(v)), len(PROMPT))
            caches.append(c)
        token, tokens, lps = first[0], [], []
        for _ in range(len(rest)):
            logits = receiver(mx.array([[token]]), cache=caches)[0, -1]
            lps.append(logits - mx.logsumexp(logits))
            token = int(mx.argmax(logits))
            tokens.append(token)
        return tokens, lps

    ref_tokens, ref_lps = continuation(expected)
    assert ref_tokens == rest
    assert all(mx.allclose(a, b, atol=1e-4) for a, b in zip(logprobs, ref_lps))
    _, plain_lps = continuation(extract_cache(*started(receiver, tokenizer)[:2]))
    assert not mx.allclose(logprobs[0], plain_lps[0], atol=1e-3)  # fusion changed what the receiver predicts


def test_closed_gates_change_nothing(models):
    receiver, sharer, tokenizer = models
    src_engine, src_id, _ = started(sharer, tokenizer)
    engine, rid, first = started(receiver, tokenizer)
    closed = C2CProjectorFuser.from_models(sharer, receiver, hidden_dim=32, intermediate_dim=48)
    assert fuse_requests(closed, (src_engine, src_id), (engine, rid)) == 0
    assert first + run(engine)[rid] == alone(receiver, tokenizer, PROMPT)


def test_fusion_never_leaks_into_shared_or_prefix_cached_blocks(models):
    receiver, sharer, tokenizer = models
    src_engine, src_id, _ = started(sharer, tokenizer, tenant="t")
    engine, rid, _ = started(receiver, tokenizer, tenant="t", n=16)
    sibling = engine.add_request(PROMPT, max_tokens=N_OUT, tenant="t")  # shares the cached prompt blocks
    results, logprobs = {}, {}
    collect(run_until_prefilled(engine, sibling), results, logprobs)
    fuse_requests(open_fuser(sharer, receiver), (src_engine, src_id), (engine, rid))
    for _ in range(4):  # the fused request decodes on: its 4th block fills up with fused-context KV
        collect(engine.step(), results, logprobs)
    longer = PROMPT + results[rid][:3]  # 16 tokens = 4 full blocks: would hit a registered fused block
    late = engine.add_request(longer, max_tokens=4, tenant="t")
    run(engine, results, logprobs)
    assert same_logprobs(logprobs[sibling], alone(receiver, tokenizer, PROMPT, with_logprobs=True)[1])
    assert same_logprobs(logprobs[late], alone(receiver, tokenizer, longer, 4, with_logprobs=True)[1])


def test_tenants_and_errors(models):
    receiver, sharer, tokenizer = models
    src_engine, src_id, _ = started(sharer, tokenizer, tenant="alice")
    engine, rid, _ = started(receiver, tokenizer, tenant="bob")
    fuser = open_fuser(sharer, receiver)
    before = extract_cache(engine, rid)
    with pytest.raises(PermissionError):
        fuse_requests(fuser, (src_engine, src_id), (engine, rid))
    assert all(mx.array_equal(a[0], b[0]) for a, b in zip(before, extract_cache(engine, rid)))
    assert fuse_requests(fuser, (src_engine, src_id), (engine, rid), allow_cross_tenant=True) == 2
    other_id = src_engine.add_request(PROMPT[::-1], max_tokens=4, tenant="bob")
    run_until_prefilled(src_engine, other_id)
    with pytest.raises(InvalidArgumentError, match="token-aligned"):
        fuse_requests(fuser, (src_engine, other_id), (engine, rid))
    with pytest.raises(InvalidArgumentError, match="not running"):
        extract_cache(engine, "no-such-request")
    with pytest.raises(InvalidArgumentError, match="layers"):
        fuse_into(engine, rid, before[:1])
    with pytest.raises(InvalidArgumentError, match="outside"):
        fuse_into(engine, rid, before, start=5)
    with pytest.raises(InvalidArgumentError):  # sharer K/V shapes do not fit the receiver's arena
        fuse_into(engine, rid, extract_cache(src_engine, src_id)[:2])


def test_redaction_through_the_engine(models):
    receiver, _, tokenizer = models
    src_engine, src_id, _ = started(tiny_model(13), tokenizer)
    engine, rid, _ = started(receiver, tokenizer)
    before = extract_cache(engine, rid)
    fuse_requests(C2CFuser(n_layers=2, head_dim=16, rank=4), (src_engine, src_id), (engine, rid), layer_mask=[0, 1])
    after = extract_cache(engine, rid)
    assert np.array_equal(np.array(before[0][0]).view(np.uint32), np.array(after[0][0]).view(np.uint32))
    assert np.array_equal(np.array(before[0][1]).view(np.uint32), np.array(after[0][1]).view(np.uint32))
    assert not mx.array_equal(before[1][0], after[1][0])
