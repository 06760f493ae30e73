"""Snapshot tests (pytest-textual-snapshot) of the TUI's main screen on the tiny model.

Deterministic by construction: fixed terminal size, greedy decoding, `TuiConfig(deterministic=True)` (speeds,
TTFT and the BLAS name show as "-", no blinking cursor), and each screenshot is taken only once the engine is
idle and its last snapshot rendered. Update after an intended UI change with
`pytest tests/test_tui_snapshots.py --snapshot-update` and look at the SVGs under tests/__snapshots__/.
"""

from __future__ import annotations

from textual.pilot import Pilot

from test_tui import make_app, send, wait_ready, wait_reply, wait_until

SIZE = (120, 36)


def test_main_screen_at_start(snap_compare, tiny):
    async def ready(pilot: Pilot) -> None:
        await wait_ready(pilot)

    assert snap_compare(make_app(tiny), terminal_size=SIZE, run_before=ready)


def test_main_screen_after_two_conversations(snap_compare, tiny):
    """Two conversations: one with two turns (prefix-cached blocks), one with one; block map, legend, stats."""

    async def chat(pilot: Pilot) -> None:
        await wait_ready(pilot)
        await send(pilot, 1, "hello")
        await wait_reply(pilot, 1)
        await send(pilot, 1, "and again")
        await wait_reply(pilot, 1)
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: 2 in pilot.app.conversations, what="the new conversation")
        await send(pilot, 2, "a second conversation")
        await wait_reply(pilot, 2)

    assert snap_compare(make_app(tiny, max_tokens=40), terminal_size=SIZE, run_before=chat)


def test_block_map_scales_for_a_big_arena(snap_compare, tiny):
    """8192 blocks do not fit one per cell: the map packs several blocks per cell and says so on its border."""

    async def chat(pilot: Pilot) -> None:
        await wait_ready(pilot)
        await send(pilot, 1, "hello")
        await wait_reply(pilot, 1)

    app = make_app(tiny, kv_tokens=8192 * 4, block_size=4, max_tokens=200)
    assert snap_compare(app, terminal_size=SIZE, run_before=chat)


def test_help_screen(snap_compare, tiny):
    async def ready(pilot: Pilot) -> None:
        await wait_ready(pilot)
        pilot.app.set_focus(None)

    assert snap_compare(make_app(tiny), terminal_size=SIZE, run_before=ready, press=["f1"])
