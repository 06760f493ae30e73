"""Disconnects and aborts under load: every request completes or gets an error, no KV block leaks, and greedy
completions equal `cortexstream.generate` on the same prompts."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

import cortexstream
from server_harness import LiveServer

WORDS = "the rain in spain falls mainly on plain there are many words here to make prompts differ".split()


@pytest.fixture(scope="module")
def server(tiny):
    model, tokenizer = tiny
    with LiveServer(model, tokenizer, kv_tokens=6144, max_num_seqs=16, max_queue=128) as live:
        yield live


def _assert_no_leak(kv: dict) -> None:
    assert kv["sequences"] == []
    assert kv["num_orphan_blocks"] == 0
    # Only the prefix cache may still hold blocks once nothing is live.
    assert kv["num_used_blocks"] == kv["num_prefix_cached_blocks"]


def _aborted_count(server: LiveServer) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    lines = [l for l in text.splitlines() if 'finished_reason="aborted"' in l]
    return float(lines[0].split()[-1]) if lines else 0.0


async def _leave_after(server: LiveServer, prompt: str, chunks: int) -> None:
    """Stream a long completion, read `chunks` chunks, then close the connection."""
    client = server.async_client()
    stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=4000, temperature=0,
                                             stream=True)
    seen = 0
    async for _chunk in stream:
        seen += 1
        if seen == chunks:
            break
    await stream.close()


def test_disconnect_mid_stream_frees_the_blocks_within_a_step(server):
    before = _aborted_count(server)
    asyncio.run(_leave_after(server, "in the " * 30, 3))
    deadline = time.time() + 5
    while time.time() < deadline and _aborted_count(server) == before:
        time.sleep(0.02)
    assert _aborted_count(server) == before + 1  # aborted, not run to its 4000 tokens
    _assert_no_leak(server.wait_idle())


def test_a_disconnected_request_frees_its_blocks_before_the_second_step_after_the_abort(server):
    """Counted in engine steps, not seconds: the engine steps completed between the server's abort call (when it
    noticed the disconnect) and the moment the blocks are released are at most one."""
    bridge = server.state.bridge
    engine = bridge.engine
    steps = [0]
    abort_requested: dict[str, int] = {}
    released: dict[str, tuple[int, int]] = {}  # request id -> (step count, used blocks of live sequences after)

    def count(_engine) -> None:
        steps[0] += 1

    original_abort, original_engine_abort = bridge.client.abort, engine.abort

    def client_abort(request_id: str) -> None:
        abort_requested.setdefault(request_id, steps[0])
        original_abort(request_id)

    def engine_abort(request_id: str) -> bool:
        result = original_engine_abort(request_id)
        live = sum(len(s.block_table) for s in engine.scheduler.running if s.request_id == request_id)
        released.setdefault(request_id, (steps[0], live))
        return result

    bridge.step_listeners.append(count)
    bridge.client.abort, engine.abort = client_abort, engine_abort
    try:
        async def sixteen() -> None:
            await asyncio.gather(*(_leave_after(server, "on the plain " * 20, 2 + i % 5) for i in range(16)))

        asyncio.run(sixteen())
        # The server notices a closed connection on its own schedule (its next send or receive), which can come
        # after the client's close returned: wait for all sixteen aborts, not only for those already asked.
        deadline = time.time() + 10
        while time.time() < deadline and (len(abort_requested) < 16 or len(released) < len(abort_requested)):
            time.sleep(0.02)
    finally:
        bridge.step_listeners.remove(count)
        bridge.client.abort, engine.abort = original_abort, original_engine_abort
    assert len(abort_requested) >= 16  # every client that left was aborted
    for request_id, asked_at in abort_requested.items():
        released_at, live_blocks = released[request_id]
        assert released_at - asked_at <= 1, (request_id, asked_at, released_at)
        assert live_blocks == 0  # the sequence is gone from the running set with its blocks
    _assert_no_leak(server.wait_idle())


def test_64_concurrent_streams_with_random_disconnects(server, tiny):
    model, tokenizer = tiny
    rng = random.Random(1234)
    jobs = []
    for i in range(64):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))
        max_tokens = rng.randint(4, 40)
        leave_after = rng.choice([None, None, 1, 3, 8]) if i % 2 else None  # about a third leave early
        if i % 8 == 0:
            leave_after, max_tokens = 0, 400  # non-streaming, abandoned by a client-side timeout
        jobs.append((prompt, max_tokens, leave_after))

    async def one(client, prompt: str, max_tokens: int, leave_after: int | None) -> tuple[str, str]:
        if leave_after == 0:  # a non-streaming client that gives up (timeout) while its request runs
            try:
                await client.with_options(timeout=0.05).completions.create(
                    model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0)
                return "done-whole", ""
            except Exception as exc:  # noqa: BLE001 - the client's own timeout is the expected outcome
                return f"gave up {type(exc).__name__}", ""
        try:
            stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                                     temperature=0, stream=True)
            pieces, finish, count = [], None, 0
            async for chunk in stream:
                count += 1
                if chunk.choices:
                    pieces.append(chunk.choices[0].text)
                    finish = chunk.choices[0].finish_reason or finish
                if leave_after is not None and count >= leave_after:
                    await stream.close()
                    return "left", ""
            return ("done" if finish in ("stop", "length") else f"bad finish {finish}"), "".join(pieces)
        except Exception as exc:  # noqa: BLE001 - an error is an acceptable outcome; a hang is not
            return f"error {type(exc).__name__}", ""

    async def run_all() -> list[tuple[str, str]]:
        client = server.async_client()
        return await asyncio.wait_for(asyncio.gather(*(one(client, *job) for job in jobs)), timeout=240)

    aborted_before = _aborted_count(server)
    results = asyncio.run(run_all())
    outcomes = [status for status, _ in results]
    assert all(s in ("done", "left", "done-whole") or s.startswith(("error", "gave up")) for s in outcomes), outcomes
    assert sum(s.startswith("gave up") for s in outcomes) >= 4
    assert outcomes.count("done") >= 32
    _assert_no_leak(server.wait_idle())
    server.engine.arena.allocator.check_invariants()
    # Abandoned non-streaming requests (400 tokens each) were aborted by the server, not run to the end.
    assert _aborted_count(server) - aborted_before >= sum(s.startswith("gave up") for s in outcomes)
    for (prompt, max_tokens, _), (status, text) in zip(jobs, results):
        if status == "done":
            assert text == cortexstream.generate(model, tokenizer, prompt, max_tokens=max_tokens, temperature=0)


def test_tenant_map_is_pruned_to_the_owners_of_blocks(server, monkeypatch):
    from cortexstream.server import bridge as bridge_module

    bridge = server.state.bridge
    client = server.client()
    for i in range(6):  # short prompts: no full block, so nothing of theirs stays in the prefix cache
        client.completions.create(model="tiny", prompt=f"prune {i}", max_tokens=2, temperature=0)
    server.wait_idle()
    before = dict(bridge.owner_tenants)
    monkeypatch.setattr(bridge_module, "_PRUNE_EVERY", 1)
    client.completions.create(model="tiny", prompt="trigger", max_tokens=2, temperature=0)  # prunes on finish
    allocator = server.engine.arena.allocator
    owners = {allocator.owner_of(b) for b in range(allocator.num_total_blocks)}
    after = set(bridge.owner_tenants)
    assert len(before) >= 6 and after <= owners and len(after) < len(before)
    assert bridge._finished_since_prune == 0
