"""Pilot tests driving the real TUI (real engine thread, tiny random-weight model): a typed prompt gets a reply,
the block map shows the conversation's blocks, clearing frees them, two conversations stream at once, and
errors end up in the UI. Pilot is async; each test runs its scenario with `asyncio.run` (no pytest-asyncio).
The helpers here are shared with test_tui_snapshots.py.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

import numpy as np
from textual.pilot import Pilot
from textual.widgets import Input

from cortexstream.tui.app import CortexStreamApp
from cortexstream.tui.config import TuiConfig
from cortexstream.tui.messages import ReplyDelta, StatsUpdate
from cortexstream.tui.widgets.block_map import BlockMap, cached_color, conv_color, render_cells
from cortexstream.tui.widgets.help import HelpScreen
from cortexstream.engine.engine import Engine

SIZE = (120, 36)


class RecordingApp(CortexStreamApp):
    """The real app, also recording what arrives from the engine thread (for assertions only)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.deltas: list[ReplyDelta] = []
        self.snapshots: list[Any] = []

    def on_reply_delta(self, message: ReplyDelta) -> None:
        self.deltas.append(message)
        super().on_reply_delta(message)

    def on_stats_update(self, message: StatsUpdate) -> None:
        self.snapshots.append(message.snapshot)
        super().on_stats_update(message)


def make_app(tiny: tuple[Any, Any], step_delay: float = 0.0, **overrides: Any) -> RecordingApp:
    """The app on the tiny model. `step_delay` paces the engine like a real model: the tiny one decodes
    hundreds of tokens a second, faster than a Pilot key press round trip, so "while it streams" needs it."""
    settings: dict[str, Any] = {"kv_tokens": 1024, "block_size": 16, "max_tokens": 24, "deterministic": True}
    settings.update(overrides)
    config = TuiConfig(**settings)
    model, tokenizer = tiny
    if not step_delay:
        return RecordingApp(config, model=model, tokenizer=tokenizer)
    engine = Engine(model, tokenizer, kv_tokens=config.kv_tokens, block_size=config.block_size)
    step = engine.step

    def paced_step() -> list[Any]:
        time.sleep(step_delay)
        return step()

    engine.step = paced_step  # type: ignore[method-assign]
    return RecordingApp(config, engine=engine)


async def wait_until(pilot: Pilot, condition: Callable[[], bool], timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if pilot.app._exception is not None:  # the app died: fail now, with its error
            raise AssertionError(f"the app failed while waiting for {what}") from pilot.app._exception
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or condition}")
        await pilot.pause(0.02)


async def wait_ready(pilot: Pilot) -> None:
    app = pilot.app
    await wait_until(pilot, lambda: app.engine_link is not None and app.last_snapshot is not None, what="the engine")


async def send(pilot: Pilot, conv_id: int, text: str, typed: bool = False) -> None:
    """Put `text` in the conversation's prompt (typed key by key, or set at once) and press Enter."""
    prompt = pilot.app.pane(conv_id).query_one("#prompt", Input)
    prompt.focus()
    if typed:
        await pilot.press(*text)
    else:
        prompt.value = text
    await pilot.press("enter")


async def wait_reply(pilot: Pilot, conv_id: int, timeout: float = 60.0) -> None:
    """Until the reply ended and a snapshot of the idle engine has been rendered."""
    app = pilot.app
    await wait_until(pilot, lambda: not app.conversations[conv_id].busy, timeout, f"chat {conv_id}'s reply")
    await wait_until(pilot, lambda: app.last_snapshot.stats["running"] == 0, timeout, "an idle snapshot")
    await pilot.pause()


def blocks_of(app: CortexStreamApp, conv_id: int) -> int:
    return int(np.count_nonzero(app.last_snapshot.owners == conv_id))


def live_snapshots(app: RecordingApp, conv_id: int) -> list[Any]:
    """Snapshots (as posted by the engine thread) in which the conversation's sequence was running."""
    return [s for s in app.snapshots if (u := s.conversations.get(conv_id)) is not None and u.running and u.blocks]


def prompt_tokens(app: CortexStreamApp, conv_id: int) -> int:
    """Prompt length of the conversation's last turn, as the engine tokenized it."""
    conv = app.conversations[conv_id]
    return len(app.engine_link.engine.tokenizer.apply_chat_template(conv.messages[:-1], add_generation_prompt=True))


def map_styles(app: CortexStreamApp) -> set[str]:
    return {str(span.style) for span in app.query_one(BlockMap).render().spans}


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(scenario())


# --- the checks -----------------------------------------------------------------------------------------------------
def test_typed_prompt_gets_a_streamed_reply(tiny):
    app = make_app(tiny)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await wait_ready(pilot)
            await send(pilot, 1, "hello there", typed=True)
            await wait_reply(pilot, 1)
            conv = app.conversations[1]
            assert conv.messages[0] == {"role": "user", "content": "hello there"}
            assert conv.messages[1]["role"] == "assistant" and conv.messages[1]["content"]
            shown = app.pane(1).query(".msg.assistant").last()
            assert str(shown.content) == conv.messages[1]["content"]
            assert app.pane(1).query_one("#prompt", Input).value == ""
            final = [d for d in app.deltas if d.finish_reason]
            assert [d.finish_reason for d in final] == ["length"] and final[0].generated == 24

    run(scenario)


def test_block_map_shows_the_conversations_blocks(tiny):
    app = make_app(tiny, max_tokens=400, kv_tokens=2048)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await wait_ready(pilot)
            await send(pilot, 1, "show me the blocks")
            await wait_until(pilot, lambda: live_snapshots(app, 1), what="a snapshot with live blocks")
            snap = live_snapshots(app, 1)[0]
            usage = snap.conversations[1]
            assert int(np.count_nonzero(snap.owners == 1)) == usage.blocks + usage.cached_blocks
            text, per_cell = render_cells(snap.owners, snap.flags, 40, 20)
            assert per_cell == 1 and conv_color(1) in {str(span.style) for span in text.spans}
            await wait_reply(pilot, 1)
            usage = app.last_snapshot.conversations[1]
            # The finished turn stays in the prefix cache: shown as that conversation's cached blocks.
            assert usage.blocks == 0 and usage.cached_blocks == blocks_of(app, 1) > 0
            assert usage.logical == usage.physical == app.deltas[-1].generated + prompt_tokens(app, 1) - 1
            assert cached_color(1) in map_styles(app)

    run(scenario)


def test_clearing_a_conversation_frees_its_blocks(tiny):
    app = make_app(tiny, step_delay=0.005, max_tokens=300, kv_tokens=2048)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await wait_ready(pilot)
            total = app.last_snapshot.stats["num_blocks"]
            await send(pilot, 1, "first turn")
            await wait_reply(pilot, 1)
            assert blocks_of(app, 1) > 0
            seen = len(live_snapshots(app, 1))
            await send(pilot, 1, "second turn, cleared while it streams")
            await wait_until(pilot, lambda: len(live_snapshots(app, 1)) > seen, what="the second turn")
            await pilot.press("ctrl+l")
            await wait_until(pilot, lambda: app.last_snapshot.stats["num_free_blocks"] == total, what="free arena")
            await wait_until(pilot, lambda: app.pane(1).query(".msg.note"), what="the cleared note")
            assert blocks_of(app, 1) == 0 and 1 not in app.last_snapshot.conversations
            assert app.conversations[1].messages == [] and not app.conversations[1].busy
            assert "blocks returned to the arena" in str(app.pane(1).query(".msg.note").last().content)
            assert conv_color(1) not in map_styles(app) and cached_color(1) not in map_styles(app)

    run(scenario)


def test_two_conversations_stream_at_once(tiny):
    app = make_app(tiny, step_delay=0.015, max_tokens=300, kv_tokens=4096)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await wait_ready(pilot)
            await pilot.press("ctrl+n")
            await wait_until(pilot, lambda: 2 in app.conversations, what="the new conversation")
            assert sorted(app.conversations) == [1, 2] and app.current().conv_id == 2
            await pilot.press("alt+left")
            assert app.current().conv_id == 1
            await send(pilot, 1, "first conversation")
            await pilot.press("alt+right")
            await send(pilot, 2, "second conversation")
            await wait_reply(pilot, 1)
            await wait_reply(pilot, 2)
            both = [s for s in app.snapshots if s.conversations.get(1) and s.conversations.get(2)
                    and s.conversations[1].running and s.conversations[2].running]
            assert both, "never saw both conversations running in the same engine step"
            assert both[0].stats["running"] == 2
            assert int(np.count_nonzero(both[0].owners == 1)) > 0 and int(np.count_nonzero(both[0].owners == 2)) > 0
            for conv_id in (1, 2):
                assert [m["role"] for m in app.conversations[conv_id].messages] == ["user", "assistant"]

    run(scenario)


# --- keys and errors ------------------------------------------------------------------------------------------------
def test_escape_stops_a_reply(tiny):
    app = make_app(tiny, step_delay=0.01, max_tokens=1000, kv_tokens=2048)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await wait_ready(pilot)
            await send(pilot, 1, "a long answer please")
            await wait_until(pilot, lambda: live_snapshots(app, 1), what="the reply")
            await pilot.press("escape")
            await wait_reply(pilot, 1)
            assert [d.finish_reason for d in app.deltas if d.finish_reason] == ["aborted"]
            assert "(stopped" in str(app.pane(1).query(".msg.note").last().content)

    run(scenario)


def test_errors_are_shown_in_the_ui(tiny):
    # 4 blocks of 16 tokens cannot hold prompt + 512 new tokens: the engine rejects the request.
    app = make_app(tiny, kv_tokens=64, max_tokens=512)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await wait_ready(pilot)
            await send(pilot, 1, "too long for this arena")
            await wait_until(pilot, lambda: not app.conversations[1].busy, what="the rejection")
            assert "rejected" in str(app.pane(1).query(".msg.error").last().content)
            assert app.conversations[1].messages == []  # the unanswered question left the history
            policy = app.pane(1).query_one("#policy", Input)
            policy.focus()
            policy.value = "no-such-policy"
            await pilot.press("enter")
            assert app.conversations[1].policy == "full" and policy.value == "full"
            messages = [n.message for n in app._notifications]
            assert any("KV blocks" in m for m in messages) and any("no-such-policy" in m for m in messages)
            assert app.is_running

    run(scenario)


def test_a_model_that_fails_to_load_is_reported_in_the_ui(tmp_path):
    app = RecordingApp(TuiConfig(model=str(tmp_path / "missing.gguf"), deterministic=True))

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.fatal_error is not None, what="the load error")
            assert "missing.gguf" in app.fatal_error
            assert app.query_one("#statusbar").has_class("error")
            await send(pilot, 1, "hello")
            assert app.conversations[1].messages == [] and app.is_running

    run(scenario)


def test_policy_selection_and_help_and_quit(tiny):
    app = make_app(tiny)

    async def scenario() -> None:
        async with app.run_test(size=SIZE) as pilot:
            await wait_ready(pilot)
            assert "full" in app.policies and any(p.startswith("streaming") for p in app.policies)
            policy = app.pane(1).query_one("#policy", Input)
            policy.focus()
            policy.value = "streaming:window=64"
            await pilot.press("enter")
            assert app.conversations[1].policy == "streaming:window=64"
            await send(pilot, 1, "with a window")
            await wait_reply(pilot, 1)
            assert app.conversations[1].messages[-1]["role"] == "assistant"
            await pilot.press("f1")  # works from a text field
            assert isinstance(app.screen, HelpScreen)
            await pilot.press("escape")
            assert not isinstance(app.screen, HelpScreen)
            app.set_focus(None)  # outside text fields, ? and q are keys, not text
            await pilot.press("question_mark")
            assert isinstance(app.screen, HelpScreen)
            await pilot.press("q")
            assert not isinstance(app.screen, HelpScreen) and app.is_running
            thread = app.engine_link.client.threaded._thread
            await pilot.press("ctrl+c")
            await pilot.pause()
            assert not thread.is_alive() and not app.is_running

    run(scenario)


def test_main_without_a_valid_policy_fails_before_the_screen(tiny_gguf):
    import argparse

    import pytest

    from cortexstream.tui.app import main
    from cortexstream.errors import InvalidArgumentError

    args = argparse.Namespace(model=tiny_gguf, dtype=None, keep_quantized=False, kv_tokens=256, block_size=16,
                              max_tokens=8, kv_policy="bogus")
    with pytest.raises(InvalidArgumentError):
        main(args)
    assert TuiConfig.from_args(args).kv_tokens == 256
