"""Pipelined decode: same tokens, logprobs, texts and finish reasons as the synchronous engine, in every case where
the step launched on an unread token must be discarded (eos, stop strings, max_tokens, aborts), and no leaks."""

from __future__ import annotations

import numpy as np

from cortexstream.engine.engine import Engine
from test_engine import collect, random_prompts


def run(model, tokenizer, pipeline, requests, abort_at=None, **engine_kwargs):
    """requests: list of (prompt, kwargs). abort_at: {request index: step number}. Returns per-request results."""
    # A fixed prefill budget: "auto" sizes chunks from measured step times, so two runs under different machine load
    # would batch prompts differently and a tiny random model's near-tied logits could flip.
    defaults = {"kv_tokens": 2048, "block_size": 4, "prefill_tokens_while_decoding": 16}
    engine = Engine(model, tokenizer, pipeline=pipeline, **{**defaults, **engine_kwargs})
    ids = [engine.add_request(p, **kw) for p, kw in requests]
    results = {i: {"tokens": [], "logprobs": [], "text": "", "reason": None} for i in ids}
    step, inflight_steps = 0, 0
    while engine.has_unfinished:
        for index, at in (abort_at or {}).items():
            if at == step:
                engine.abort(ids[index])
        for out in engine.step():
            entry = results[out.request_id]
            if out.token is not None:
                entry["tokens"].append(out.token)
                entry["logprobs"].append(np.array(out.logprobs))
            entry["text"] += out.text
            entry["reason"] = out.finish_reason or entry["reason"]
        inflight_steps += engine.has_in_flight
        step += 1
    assert engine.arena.allocator.num_used_blocks == engine.block_manager.num_cached_blocks
    assert all(seq.num_inflight == 0 for seq in engine.scheduler.running)
    return [results[i] for i in ids], inflight_steps


def assert_same(a, b):
    for x, y in zip(a, b):
        assert x["tokens"] == y["tokens"] and x["text"] == y["text"] and x["reason"] == y["reason"]
        for p, q in zip(x["logprobs"], y["logprobs"]):
            # A request whose last token is in flight joins one more batch, so batch shapes (and float
            # summation order) differ by a few ulps between the two runs.
            np.testing.assert_allclose(p, q, rtol=0, atol=1e-5)


def test_pipelined_equals_synchronous_with_every_way_of_finishing(tiny):
    model, tokenizer = tiny
    prompts = random_prompts(6, seed=5, low=2, high=30)  # seed 5: outputs with printable text
    sync_free, _ = run(model, tokenizer, False, [(p, {"max_tokens": 25}) for p in prompts])
    # Stop strings and eos taken from what the requests really generate, so they do trigger mid-stream.
    eos_token = sync_free[5]["tokens"][5]
    stop_text = sync_free[2]["text"][4:7]
    assert len(stop_text) == 3 and stop_text.isprintable()
    requests = [
        (prompts[0], {"max_tokens": 1}),
        (prompts[5], {"max_tokens": 25}),
        (prompts[2], {"max_tokens": 25, "stop": [stop_text]}),
        (prompts[3], {"max_tokens": 9}),
        (prompts[4], {"max_tokens": 25, "repetition_penalty": 1.3}),
        (prompts[1], {"max_tokens": 25}),
    ]
    original_eos = set(getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id])
    tokenizer.eos_token_ids = original_eos | {eos_token}
    try:
        sync, sync_inflight = run(model, tokenizer, False, requests, abort_at={5: 6})
        piped, piped_inflight = run(model, tokenizer, True, requests, abort_at={5: 6})
    finally:
        tokenizer.eos_token_ids = original_eos
    assert sync_inflight == 0 and piped_inflight > 5  # the pipelined run really had steps in flight
    assert_same(piped[:5], sync[:5])
    # An abort drops the token in flight: the pipelined run has emitted at most one token fewer at that point.
    aborted, reference = piped[5]["tokens"], sync[5]["tokens"]
    assert aborted == reference[: len(aborted)] and len(reference) - len(aborted) <= 1
    assert piped[1]["reason"] == "stop" and piped[1]["tokens"][-1] == eos_token
    assert piped[2]["reason"] == "stop" and stop_text not in piped[2]["text"]
    assert [len(r["tokens"]) for r in (piped[0], piped[3])] == [1, 9]
    assert piped[5]["reason"] == "aborted"


def test_pipelined_with_admissions_preemption_and_policies(tiny):
    """Arrivals, a small arena (preemption) and evicting policies force synchronous steps in between."""
    model, tokenizer = tiny
    prompts = random_prompts(10, seed=4, low=5, high=40)
    requests = [(p, {"max_tokens": 20, **({"kv_policy": "h2o:budget=16,recent=4"} if i % 3 == 0 else {})})
                for i, p in enumerate(prompts)]
    sync, _ = run(model, tokenizer, False, requests, kv_tokens=160, prefill_step_size=16)
    piped, inflight = run(model, tokenizer, True, requests, kv_tokens=160, prefill_step_size=16)
    assert inflight > 0
    for x, y in zip(piped, sync):
        assert x["tokens"] == y["tokens"] and x["reason"] == y["reason"]


def test_a_job_sized_private_arena_pipelines_its_one_request(tiny):
    """The public calls' private arena holds the job and one spare block per request. Every decode step of a
    single request on it has room for its next two tokens, so it is pipelined (it once was not: the check asked
    for two free blocks beyond what the sequences need)."""
    from cortexstream.engine.sizing import fit_to_context, private_arena
    from cortexstream.policies.parsing import parse_policy

    model, tokenizer = tiny
    prompt = list(range(3, 40))
    arena = private_arena(model, [(len(prompt), fit_to_context(model, len(prompt), 24), parse_policy(None))],
                          block_size=4, prefill_step_size=512)
    engine = Engine(model, tokenizer, max_num_seqs=1, prefix_caching=False, arena=arena)
    rid = engine.add_request(prompt, max_tokens=24)
    pipelined, results = [], {}
    while engine.has_unfinished:
        if engine.scheduler.running and engine.scheduler.running[0].output_ids:
            pipelined.append(engine.scheduler.may_pipeline())
        collect(engine.step(), results)
    assert len(results[rid]["tokens"]) == 24
    assert pipelined and all(pipelined[:-2])  # the last steps: its final token needs no next step
