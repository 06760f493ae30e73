"""Property-based requests from the app's own OpenAPI schema (schemathesis, quick form), every endpoint among them
/v1/responses and /v1/messages: whatever a client sends that the schema allows or nearly allows, the answer is never
a 5xx, and every 4xx carries its API's error body (Anthropic's under /v1/messages, OpenAI's elsewhere)."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402

from server_harness import LiveServer  # noqa: E402


@pytest.fixture(scope="module")
def live(tiny):
    model, tokenizer = tiny
    with LiveServer(model, tokenizer, kv_tokens=512, max_num_seqs=4) as server:
        yield server


@pytest.fixture(scope="module")
def api_schema(live):
    return schemathesis.openapi.from_url(f"{live.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_errors_and_openai_error_bodies(case, live):
    response = case.call(timeout=60)
    assert response.status_code < 500, f"{case.method} {case.path}: {response.status_code} {response.text[:300]}"
    if response.status_code >= 400:
        body = response.json()
        if case.path.startswith("/v1/messages") and response.status_code != 401:
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        else:
            assert set(body["error"]) == {"message", "type", "param", "code"}


def test_engine_is_healthy_afterwards(live):
    kv = live.wait_idle()
    assert kv["num_orphan_blocks"] == 0 and kv["sequences"] == []
    assert live.client().completions.create(model="tiny", prompt="still fine", max_tokens=2).choices
