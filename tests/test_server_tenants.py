"""Tenant isolation: two API keys with the same system prompt never share a KV block (seen through /v1/kv)."""

from __future__ import annotations

import asyncio

import httpx

from server_harness import LiveServer

SYSTEM = "Shared system prompt for every tenant: " + "alpha beta gamma delta " * 16


def _messages(user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def _live_view(live: LiveServer, key: str, user: str, other_key: str | None = None) -> tuple[dict, dict]:
    """Start a long streaming request with `key`, read its first chunk and snapshot /v1/kv while it runs (and,
    with `other_key`, check that the other tenant's view does not list the request)."""

    async def scenario() -> tuple[dict, dict]:
        client = live.async_client(api_key=key)
        stream = await client.chat.completions.create(model="tiny", messages=_messages(user), max_tokens=3000,
                                                      temperature=0, stream=True,
                                                      stream_options={"include_usage": True})
        await stream.__anext__()
        async with httpx.AsyncClient() as http:
            kv = (await http.get(f"{live.url}/v1/kv", headers={"Authorization": f"Bearer {key}"})).json()
            if other_key is not None:
                other = (await http.get(f"{live.url}/v1/kv",
                                        headers={"Authorization": f"Bearer {other_key}"})).json()
                assert other["sequences"] == [] and len(other["block_tenants"]) == len(kv["block_tenants"])
        await stream.close()
        (sequence,) = [s for s in kv["sequences"] if s["status"] == "running"]
        return kv, sequence

    return asyncio.run(scenario())


def test_two_keys_never_share_a_block_but_one_key_does(tiny):
    model, tokenizer = tiny
    with LiveServer(model, tokenizer, kv_tokens=8192, api_keys=("key-a-secret", "key-b-secret")) as live:
        first = live.client(api_key="key-a-secret").chat.completions.create(
            model="tiny", messages=_messages("first"), max_tokens=2, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0

        # Tenant B, same system prompt: nothing of tenant A's cached prefix may appear in its block table.
        kv, seq_b = _live_view(live, "key-b-secret", "second", other_key="key-a-secret")
        assert seq_b["tenant"] == "key-1" and seq_b["cached_prefix_tokens"] == 0
        assert {kv["block_tenants"][b] for b in seq_b["blocks"]} == {"key-1"}
        tenant_a_blocks = {b for b, tenant in enumerate(kv["block_tenants"]) if tenant == "key-0"}
        assert len(tenant_a_blocks) >= 4  # tenant A's prefix is still cached: B could have used it, and did not
        assert tenant_a_blocks.isdisjoint(seq_b["blocks"])
        assert "key-a-secret" not in str(kv) and "key-b-secret" not in str(kv)
        live.wait_idle()

        # Control: tenant A again reuses its own cached blocks, which /v1/kv shows as shared.
        kv, seq_a = _live_view(live, "key-a-secret", "third")
        reused = seq_a["blocks"][: seq_a["cached_prefix_tokens"] // kv["block_size"]]
        assert len(reused) >= 4 and all(kv["block_ref_counts"][b] > 1 for b in reused)
        assert all(kv["block_tenants"][b] == "key-0" for b in seq_a["blocks"])
        kv = live.wait_idle()
        assert kv["num_orphan_blocks"] == 0


def test_without_keys_everyone_is_one_tenant(tiny):
    model, tokenizer = tiny
    with LiveServer(model, tokenizer, kv_tokens=4096) as live:
        client = live.client()
        client.chat.completions.create(model="tiny", messages=_messages("one"), max_tokens=2, temperature=0)
        again = client.chat.completions.create(model="tiny", messages=_messages("two"), max_tokens=2,
                                               temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens >= 64
