"""The server's `speculative` request field: prompt lookup gives the same greedy answer as plain decoding, with
batching (concurrent requests) and n > 1; a bad setting is a 400 naming the field; /metrics counts drafted and
accepted tokens."""

from __future__ import annotations

import asyncio
import urllib.request

import openai
import pytest

from tests.server_harness import LiveServer

PROMPT = "one two three four one two three four one two three four one two three"


def test_speculative_field_same_greedy_answers(tiny):
    model, tokenizer = tiny
    with LiveServer(model, tokenizer) as server:
        client = server.client()

        def ask(**extra):
            out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                                            extra_body=extra)
            return out.choices[0].text

        plain = ask()
        assert ask(speculative="ngram:k=4,n=2") == plain
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                              max_tokens=16, temperature=0, n=2,
                                              extra_body={"speculative": "ngram"})
        plain_chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                                    max_tokens=16, temperature=0)
        assert [c.message.content for c in chat.choices] == [plain_chat.choices[0].message.content] * 2

        async def many():
            async_client = server.async_client()
            calls = [async_client.completions.create(model="tiny", prompt=PROMPT + f" {i}", max_tokens=16,
                                                     temperature=0, extra_body={"speculative": "ngram"})
                     for i in range(4)]
            return [r.choices[0].text for r in await asyncio.gather(*calls)]

        alone = [client.completions.create(model="tiny", prompt=PROMPT + f" {i}", max_tokens=16,
                                           temperature=0).choices[0].text for i in range(4)]
        assert asyncio.run(many()) == alone
        with pytest.raises(openai.BadRequestError) as err:
            ask(speculative="ngram:k=99")
        assert err.value.body["param"] == "speculative" and "k=99" in err.value.body["message"]


def test_server_default_speculation_and_request_off(tiny):
    from cortexstream.server import ServerConfig

    with pytest.raises(Exception, match="speculative"):
        ServerConfig(speculative="ngram:k=0")
    model, tokenizer = tiny
    with LiveServer(model, tokenizer, speculative="ngram:k=4,n=2") as server:
        client = server.client()
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
        drafted = server.engine.stats()["spec_drafted_tokens"]
        assert drafted > 0
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                                  extra_body={"speculative": "off"})
        stats = server.engine.stats()
        assert stats["spec_drafted_tokens"] == drafted
        # /metrics shows the same counters (acceptance = accepted / drafted)
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as response:
            text = response.read().decode()
        shown = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                 if line.startswith("cortexstream:spec_")}
        assert shown == {"cortexstream:spec_verify_steps_total": stats["spec_verify_steps"],
                         "cortexstream:spec_drafted_tokens_total": drafted,
                         "cortexstream:spec_accepted_tokens_total": stats["spec_accepted_tokens"]}
