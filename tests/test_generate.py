"""stream_generate / generate on a tiny model: prompts, stopping, sampling validation, parity with mlx-lm."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

import cortexstream
from cortexstream.errors import InvalidArgumentError
from cortexstream.engine.sampling import SamplingParams
from cortexstream.engine.text_stream import TextStream


def _mlx_lm_greedy(model, tokens, n):
    out = []
    for (token, _), _ in zip(generate_step(mx.array(tokens), model, max_tokens=n), range(n)):
        out.append(int(token))
    return out


def test_greedy_tokens_match_mlx_lm_generate_step(tiny):
    model, tokenizer = tiny
    prompt = tokenizer.encode("the cat sat on the mat and then it ran away " * 3)
    ours = [r.token for r in cortexstream.stream_generate(model, tokenizer, prompt, max_tokens=24)]
    expected = _mlx_lm_greedy(model, prompt, 24)
    eos = 2
    if eos in expected:  # we stop at eos, mlx-lm's generate_step does not
        expected = expected[: expected.index(eos) + 1]
    assert ours == expected


def test_greedy_logprobs_match_mlx_lm_generate_step(tiny):
    """Greedy tokens skip the logsumexp and leave the log-probabilities lazy: read later, they must still be mlx-lm's
    (including the one whose step was discarded by the pipeline, and after the request's blocks were freed)."""
    model, tokenizer = tiny
    prompt = tokenizer.encode("a b c d e f g " * 4)
    responses = list(cortexstream.stream_generate(model, tokenizer, prompt, max_tokens=12))
    expected = [np.array(lp) for (_, lp), _ in zip(generate_step(mx.array(prompt), model, max_tokens=12), range(12))]
    assert len(responses) >= 2
    for response, reference in zip(responses, expected):
        np.testing.assert_allclose(np.array(response.logprobs), reference, rtol=1e-5, atol=1e-5)
        assert abs(float(mx.logsumexp(response.logprobs))) < 1e-4  # normalised


def test_prompt_forms_string_tokens_and_chat(tiny):
    model, tokenizer = tiny
    text = "hello there"
    a = cortexstream.generate(model, tokenizer, text, max_tokens=8)
    b = cortexstream.generate(model, tokenizer, tokenizer.encode(text), max_tokens=8)
    assert a == b
    messages = [{"role": "user", "content": "hi"}]
    chat_tokens = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    c = cortexstream.generate(model, tokenizer, messages, max_tokens=8)
    d = cortexstream.generate(model, tokenizer, list(chat_tokens), max_tokens=8)
    assert c == d


def test_responses_carry_stats_and_finish_reason(tiny):
    model, tokenizer = tiny
    responses = list(cortexstream.stream_generate(model, tokenizer, "the", max_tokens=5))
    assert 1 <= len(responses) <= 5
    last = responses[-1]
    assert last.finish_reason in ("stop", "length")
    assert all(r.finish_reason is None for r in responses[:-1])
    assert last.prompt_tokens == len(tokenizer.encode("the"))
    assert last.generation_tokens == len(responses)
    assert last.prompt_tps > 0 and last.peak_memory > 0
    assert last.logprobs.shape == (model.args.vocab_size,)
    if len(responses) == 5:
        assert last.finish_reason == "length"


def test_stop_string_truncates_and_is_never_emitted(tiny):
    model, tokenizer = tiny
    full = cortexstream.generate(model, tokenizer, "the cat", max_tokens=30, temperature=0.9, seed=3)
    assert len(full) > 6
    stop = full[3:6]
    pieces = list(cortexstream.stream_generate(model, tokenizer, "the cat", max_tokens=30, temperature=0.9,
                                               seed=3, stop=[stop]))
    text = "".join(p.text for p in pieces)
    assert text == full[: full.index(stop)]
    assert pieces[-1].finish_reason == "stop"


class _FakeDetok:
    def __init__(self, pieces):
        self.pieces, self.text = pieces, ""

    def reset(self):
        self.text = ""

    def add_token(self, token):
        self.text += self.pieces[token]

    def finalize(self):
        pass


class _FakeTok:
    def __init__(self, pieces):
        self.detokenizer = _FakeDetok(pieces)


def test_text_stream_holds_back_possible_stop_prefix():
    stream = TextStream(_FakeTok(["Hel", "lo ", "EN", "D!"]), stop=("END",))
    assert stream.add_token(0) == "H"  # "el" could start "END"? no, but 2 chars are held back
    assert stream.add_token(1) == "ell"
    out = stream.add_token(2)
    assert "E" not in out
    assert stream.add_token(3) == "" or stream.stopped
    assert stream.stopped and stream.text == "Hello "


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"stop": "x"}, "stop"),
    ],
)
def test_bad_sampling_values_are_rejected_by_name(kwargs, name):
    with pytest.raises(InvalidArgumentError, match=name):
        SamplingParams(**kwargs)


def test_bad_prompts_are_rejected(tiny):
    model, tokenizer = tiny
    for bad in ["", [], [1, -5], [10**9], [{"role": "user"}], 3.5]:
        with pytest.raises(InvalidArgumentError, match="prompt"):
            cortexstream.generate(model, tokenizer, bad, max_tokens=2)


def test_sampling_with_seed_is_reproducible_and_respects_top_k(tiny):
    model, tokenizer = tiny
    kw = dict(max_tokens=12, temperature=1.0, top_k=5, top_p=0.9, min_p=0.01, repetition_penalty=1.2, seed=11)
    assert cortexstream.generate(model, tokenizer, "the", **kw) == cortexstream.generate(model, tokenizer, "the", **kw)
