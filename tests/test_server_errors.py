"""Every client error gets OpenAI's error body with the right status, and never disturbs other requests."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from server_harness import LiveServer


@pytest.fixture(scope="module")
def server(tiny):
    model, tokenizer = tiny
    with LiveServer(model, tokenizer, kv_tokens=512, max_num_seqs=2, max_queue=1, max_body_bytes=20_000,
                    max_header_bytes=4096) as live:
        yield live


def _check_body(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


def _post(server: LiveServer, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", timeout=30, **kwargs)


def test_malformed_json_is_400(server):
    response = _post(server, "/v1/chat/completions", content=b'{"messages": [', headers={"content-type":
                                                                                       "application/json"})
    _check_body(response, 400)


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 9}, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": []}, "messages"),
    ({}, "messages"),
])
def test_bad_fields_are_422_naming_the_field(server, body, param):
    _check_body(_post(server, "/v1/chat/completions", json=body), 422, param)


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, 2, 10**6]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x", "kv_policy": "h2o:budget=-3"}, "kv_policy"),
])
def test_refused_values_are_400(server, body, param):
    _check_body(_post(server, "/v1/completions", json=body), 400, param)


def test_top_logprobs_without_logprobs_is_400(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}
    _check_body(_post(server, "/v1/chat/completions", json=body), 400, "top_logprobs")


def test_unknown_model_is_404(server):
    with pytest.raises(openai.NotFoundError) as info:
        server.client().completions.create(model="gpt-17", prompt="x", max_tokens=2)
    assert info.value.body["code"] == "model_not_found"


def test_prompt_plus_max_tokens_beyond_the_arena_is_400_at_once(server):
    with pytest.raises(openai.BadRequestError) as info:
        server.client().completions.create(model="tiny", prompt="x", max_tokens=600)
    assert info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model="tiny", prompt="x", max_tokens=200, n=3)


def test_body_and_headers_over_the_caps_are_413(server):
    _check_body(_post(server, "/v1/completions", json={"prompt": "x" * 30_000}), 413)
    _check_body(httpx.get(f"{server.url}/v1/models", headers={"x-padding": "p" * 5000}), 413)


def test_unknown_path_and_method_keep_the_error_shape(server):
    _check_body(httpx.get(f"{server.url}/v1/nothing"), 404)
    _check_body(httpx.get(f"{server.url}/v1/completions"), 405)


def test_queue_full_is_429_with_retry_after(server):
    """With the engine thread held, max_num_seqs + max_queue requests fill the server: the next one is 429."""
    import asyncio

    gate = threading.Event()
    holder = threading.Thread(target=server.state.bridge.client.call, args=(lambda engine: gate.wait(20),))
    holder.start()

    async def scenario() -> tuple[httpx.Response, list[httpx.Response]]:
        async with httpx.AsyncClient(timeout=60) as http:
            body = {"prompt": "queued", "max_tokens": 2}
            admitted = [asyncio.ensure_future(http.post(f"{server.url}/v1/completions", json=body))
                        for _ in range(3)]
            await asyncio.sleep(0.5)
            refused = await http.post(f"{server.url}/v1/completions", json=body)
            gate.set()
            return refused, list(await asyncio.gather(*admitted))

    try:
        refused, admitted = asyncio.run(scenario())
    finally:
        gate.set()
        holder.join()
    _check_body(refused, 429)
    assert refused.headers["retry-after"] == "1"
    assert [r.status_code for r in admitted] == [200, 200, 200]


def test_errors_do_not_disturb_a_running_stream(server):
    results: list[str] = []

    def stream() -> None:
        chunks = server.client().completions.create(model="tiny", prompt="in the", max_tokens=40, temperature=0,
                                                    stream=True)
        results.append("".join(c.choices[0].text for c in chunks if c.choices))

    thread = threading.Thread(target=stream)
    thread.start()
    for _ in range(5):
        _post(server, "/v1/completions", content=b"not json", headers={"content-type": "application/json"})
        _post(server, "/v1/completions", json={"prompt": "x", "max_tokens": 10**6})
        _post(server, "/v1/completions", json={"prompt": 5})
    thread.join(60)
    expected = server.client().completions.create(model="tiny", prompt="in the", max_tokens=40, temperature=0)
    assert results == [expected.choices[0].text]


def test_api_keys_401_and_accepted(tiny):
    model, tokenizer = tiny
    with LiveServer(model, tokenizer, kv_tokens=512, api_keys=("alpha", "beta")) as live:
        body = {"prompt": "x", "max_tokens": 2}
        _check_body(_post(live, "/v1/completions", json=body), 401)
        _check_body(_post(live, "/v1/completions", json=body, headers={"Authorization": "Bearer gamma"}), 401)
        _check_body(_post(live, "/v1/completions", json=body, headers={"Authorization": "Basic alpha"}), 401)
        # Auth is checked before the body: a bad body without a key is still 401.
        _check_body(_post(live, "/v1/completions", content=b"{", headers={"content-type": "application/json"}), 401)
        with pytest.raises(openai.AuthenticationError):
            live.client(api_key="wrong").models.list()
        assert live.client(api_key="beta").completions.create(model="tiny", prompt="x", max_tokens=2).choices
        assert httpx.get(f"{live.url}/health").status_code == 200  # health and metrics need no key


def test_anthropic_clients_authenticate_with_x_api_key_and_get_anthropic_401s(tiny):
    import anthropic

    model, tokenizer = tiny
    with LiveServer(model, tokenizer, kv_tokens=512, api_keys=("alpha", "beta")) as live:
        good = anthropic.Anthropic(base_url=live.url, api_key="beta", max_retries=0)
        reply = good.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert reply.type == "message" and reply.usage.output_tokens >= 1
        bad = anthropic.Anthropic(base_url=live.url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as info:
            bad.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        body = info.value.response.json()
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
        # OpenAI's paths keep OpenAI's body; a Bearer header still wins over x-api-key
        response = _post(live, "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                         headers={"x-api-key": "alpha", "Authorization": "Bearer wrong"})
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
