"""One request's bad sampling parameters must not break MLX's global random state for every other request.

mlx-lm's samplers are compiled with `mx.random.state` as input and output; an exception while one is traced
(a caller's sampler that raises; a `top_k` not below the vocabulary size did, and now keeps every token) used to leave a placeholder in the state, after
which every random draw in the process failed with "Attempting to eval an array without a primitive" (seen in CI:
the server answered 500 to unrelated requests).
"""

from __future__ import annotations

import mlx.core as mx

from cortexstream.engine.engine import Engine
from cortexstream.engine.sampling import keep_random_state


def _run(engine: Engine, tokens: dict[str, list[int]], reasons: dict[str, str] | None = None) -> list[BaseException]:
    """Step until done (at most 40 steps), collecting tokens per request, finish reasons (with the error, if any)
    and the exceptions steps raised."""
    errors: list[BaseException] = []
    for _ in range(40):
        if not engine.has_unfinished:
            break
        try:
            outputs = engine.step()
        except Exception as exc:  # noqa: BLE001 - the bad request's own failure is allowed; the state is checked
            errors.append(exc)
            continue
        for out in outputs:
            if out.token is not None and out.request_id in tokens:
                tokens[out.request_id].append(out.token)
            if out.finished and reasons is not None:
                reasons[out.request_id] = out.finish_reason + (f": {out.error}" if out.error else "")
    return errors


def test_keep_random_state_restores_the_key_after_a_failing_compiled_sampler():
    from mlx_lm.sample_utils import apply_top_k

    before = mx.random.state[0].tolist()
    try:
        with keep_random_state():
            apply_top_k(mx.zeros((1, 10)), 50)
    except ValueError:
        pass
    mx.eval(mx.random.state)  # raises if a placeholder were left
    assert mx.random.state[0].tolist() == before  # the very key from before: the sequence of draws goes on


def test_a_top_k_above_the_vocabulary_keeps_every_token(tiny):
    model, tok = tiny
    vocab = model.model.embed_tokens.weight.shape[0]
    engine = Engine(model, tok, kv_tokens=512)
    # The unseeded request draws from the global random state: seeded here so that whether it samples end-of-text
    # before 5 tokens (a shorter reply) is the same every run.
    mx.random.seed(0)
    ids = [engine.add_request([1, 2, 3, 4], max_tokens=5, temperature=0.8, top_k=vocab + 10, **extra)
           for extra in ({}, {"seed": 3})]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    assert not _run(engine, tokens)
    assert all(len(t) == 5 for t in tokens.values())


def test_a_sampler_failing_inside_mlx_compile_leaves_sampling_working_for_others(tiny):
    from mlx_lm.sample_utils import apply_top_k

    model, tok = tiny
    engine = Engine(model, tok, kv_tokens=512)
    bad = engine.add_request([1, 2, 3, 4], max_tokens=4, sampler=lambda logprobs: apply_top_k(logprobs, 10**6))
    reasons: dict[str, str] = {}
    assert not _run(engine, {}, reasons)  # no step raises: the request itself ends with an error
    assert reasons[bad].startswith("error: sampling failed: ValueError")
    mx.eval(mx.random.state)
    # A sampled (not greedy) request afterwards: it draws from the global random state.
    engine = Engine(model, tok, kv_tokens=512)
    request_id = engine.add_request([5, 6, 7], max_tokens=6, temperature=0.9, top_p=0.95)
    tokens: dict[str, list[int]] = {request_id: []}
    assert not _run(engine, tokens)
    assert len(tokens[request_id]) == 6
