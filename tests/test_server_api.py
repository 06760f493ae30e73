"""The real `openai` client against a live server on the tiny model: chat and completions, streaming and not."""

from __future__ import annotations

import httpx
import pytest

import cortexstream
from server_harness import LiveServer

SYSTEM = "You are a careful assistant. " * 6


@pytest.fixture(scope="module")
def server(tiny):
    model, tokenizer = tiny
    with LiveServer(model, tokenizer, kv_tokens=4096, max_num_seqs=8) as live:
        yield live


def _messages(user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def test_chat_non_streaming_equals_generate(server, tiny):
    model, tokenizer = tiny
    client = server.client()
    reply = client.chat.completions.create(model="tiny", messages=_messages("the weather"), max_tokens=12,
                                           temperature=0)
    expected = cortexstream.generate(model, tokenizer, _messages("the weather"), max_tokens=12, temperature=0)
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 12
    assert reply.usage.prompt_tokens == len(tokenizer.apply_chat_template(_messages("the weather"),
                                                                          add_generation_prompt=True))
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 12


def test_chat_streaming_matches_non_streaming_and_reports_usage(server):
    client = server.client()
    kwargs = dict(model="tiny", messages=_messages("a streamed answer"), max_tokens=10, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_prompt_as_text_and_token_ids_agree(server, tiny):
    _, tokenizer = tiny
    client = server.client()
    by_text = client.completions.create(model="tiny", prompt="the rain in the", max_tokens=8, temperature=0)
    ids = tokenizer.encode("the rain in the")
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.usage.prompt_tokens == len(ids)
    streamed = client.completions.create(model="tiny", prompt="the rain in the", max_tokens=8, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == by_text.choices[0].text


def test_stop_string_cuts_the_text_and_finishes_with_stop(server):
    client = server.client()
    free = client.completions.create(model="tiny", prompt="in the", max_tokens=20, temperature=0)
    text = free.choices[0].text
    assert len(text) >= 4
    stop = text[2:5]  # "e t" of "the the ..."
    cut = client.completions.create(model="tiny", prompt="in the", max_tokens=20, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]
    streamed = client.completions.create(model="tiny", prompt="in the", max_tokens=20, temperature=0,
                                         stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text


def test_logprobs_chat_and_completions(server):
    client = server.client()
    reply = client.chat.completions.create(model="tiny", messages=_messages("numbers"), max_tokens=5,
                                           temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # Greedy: the sampled token is the most likely one.
        assert entry.logprob == pytest.approx(tops[0], abs=1e-5)
    legacy = client.completions.create(model="tiny", prompt="numbers", max_tokens=4, temperature=0, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    no_lp = client.completions.create(model="tiny", prompt="numbers", max_tokens=4, temperature=0)
    assert no_lp.choices[0].logprobs is None


def test_n2_completions_share_the_prompt_and_count_usage(server):
    client = server.client()
    greedy = client.chat.completions.create(model="tiny", messages=_messages("twins"), max_tokens=6,
                                            temperature=0, n=2)
    assert [c.index for c in greedy.choices] == [0, 1]
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    assert greedy.usage.completion_tokens == 12
    sampled = client.chat.completions.create(model="tiny", messages=_messages("twins"), max_tokens=16,
                                             temperature=1.5, n=2, seed=5)
    assert sampled.choices[0].message.content != sampled.choices[1].message.content
    again = client.chat.completions.create(model="tiny", messages=_messages("twins"), max_tokens=16,
                                           temperature=1.5, n=2, seed=5)
    assert [c.message.content for c in again.choices] == [c.message.content for c in sampled.choices]
    chunks = list(client.chat.completions.create(model="tiny", messages=_messages("twins"), max_tokens=6,
                                                 temperature=0, n=2, stream=True))
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in (0, 1)]
    assert texts == [greedy.choices[0].message.content] * 2


def test_repeated_system_prompt_reports_cached_tokens(server):
    client = server.client()
    system = "Cache me: " + "blue green red yellow " * 12
    first = client.chat.completions.create(model="tiny", messages=[{"role": "system", "content": system},
                                                                   {"role": "user", "content": "one"}],
                                           max_tokens=2, temperature=0)
    second = client.chat.completions.create(model="tiny", messages=[{"role": "system", "content": system},
                                                                    {"role": "user", "content": "two"}],
                                            max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 48 and cached % 16 == 0 and cached < second.usage.prompt_tokens


def test_models_health_metrics_and_kv(server):
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    client.completions.create(model="tiny", prompt="metrics please", max_tokens=3, temperature=0)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_blocks_used", "kv_blocks_total",
                 "prefix_cache_hit_tokens_total", "generation_tokens_total"):
        assert f"cortexstream:{name}{{" in text
    assert "cortexstream:time_to_first_token_seconds_bucket{" in text
    assert "cortexstream:inter_token_latency_seconds_count{" in text
    generated = [line for line in text.splitlines() if line.startswith("cortexstream:generation_tokens_total")]
    assert float(generated[0].split()[-1]) >= 3
    kv = httpx.get(f"{server.url}/v1/kv").json()
    assert kv["num_blocks"] == 256 and kv["block_size"] == 16
    assert len(kv["block_map"]) == 256
    assert kv["num_orphan_blocks"] == 0
    assert kv["num_used_blocks"] == kv["num_prefix_cached_blocks"]  # nothing live: only the prefix cache


def test_kv_policy_extension(server):
    client = server.client()
    reply = client.completions.create(model="tiny", prompt="evict " * 40, max_tokens=6, temperature=0,
                                      extra_body={"kv_policy": "streaming:budget=32,sinks=4"})
    assert reply.usage.completion_tokens == 6
    bad = client.with_options(max_retries=0)
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        bad.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"kv_policy": "nonsense:zz=1"})
    assert info.value.body["param"] == "kv_policy"
