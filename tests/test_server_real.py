"""The `openai` client against a live server on SmolLM2-135M."""

from __future__ import annotations

import pytest

import cortexstream
from server_harness import LiveServer

pytestmark = pytest.mark.real_model

SYSTEM = ("You are a helpful assistant who answers geography questions in one short sentence. "
          "Always name the country and the city. Never add anything else. ") * 2


def test_smollm2_chat_completions_streaming_cached_prefix_and_n2(smollm):
    model, tokenizer = smollm
    with LiveServer(model, tokenizer, model_name="smollm2-135m", kv_tokens=4096) as live:
        client = live.client()
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": "What is the capital of France?"}]
        reply = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=24,
                                               temperature=0)
        expected = cortexstream.generate(model, tokenizer, messages, max_tokens=24, temperature=0)
        assert reply.choices[0].message.content == expected
        assert "Paris" in expected
        assert reply.choices[0].finish_reason in ("stop", "length")

        messages[1]["content"] = "What is the capital of Italy?"
        chunks = list(client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=24,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert "Rome" in text
        usage = chunks[-1].usage
        assert usage.prompt_tokens_details.cached_tokens >= 32  # the repeated system prompt

        both = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=24,
                                              temperature=0, n=2)
        assert [c.message.content for c in both.choices] == [text, text]

        completion = client.completions.create(model="smollm2-135m", prompt="The capital of France is",
                                               max_tokens=8, temperature=0, logprobs=1, stop=["."])
        assert "Paris" in completion.choices[0].text
        assert len(completion.choices[0].logprobs.tokens) == completion.usage.completion_tokens
        live.wait_idle()
