"""Regenerate the README screenshot: drive the real app headless on the default model, save it mid-stream.

    python -m cortexstream.tui.demo docs/tui.svg [--png docs/tui.png]

Scripted like a user would do it: a two-turn chat (its first turn's blocks stay in the prefix cache), then three
conversations streaming at once (two share the system prompt's block, the third runs StreamingLLM). Run it with
OpenBLAS preloaded on Linux for realistic speeds. `--png` needs cairosvg (`pip install cairosvg`); the SVG's
"Fira Code" web font is swapped for DejaVu Sans Mono so the PNG keeps the terminal grid.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
from typing import Callable

from textual.pilot import Pilot
from textual.widgets import Input

from cortexstream.tui.app import CortexStreamApp
from cortexstream.tui.config import TuiConfig


async def _until(pilot: Pilot, condition: Callable[[], bool], timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the demo took too long")
        await pilot.pause(0.05)


async def _send(pilot: Pilot, app: CortexStreamApp, conv_id: int, text: str, wait: bool = False) -> None:
    prompt = app.pane(conv_id).query_one("#prompt", Input)
    prompt.focus()
    prompt.value = text
    await pilot.press("enter")
    if wait:
        await _until(pilot, lambda: not app.conversations[conv_id].busy)


async def record(svg_path: str, size: tuple[int, int] = (150, 46)) -> None:
    app = CortexStreamApp(TuiConfig(max_tokens=160, repetition_penalty=1.1, share_prefix=True))
    async with app.run_test(size=size) as pilot:
        await _until(pilot, lambda: app.engine_link is not None and app.last_snapshot is not None)
        await _send(pilot, app, 1, "What is the capital of France?", wait=True)
        await _send(pilot, app, 1, "And what is it famous for?", wait=True)
        for conv_id, text in ((2, "Write a short poem about the sea."),
                              (3, "Explain how a key-value cache speeds up a transformer."),
                              (4, "Tell me a long story about a robot who learns to paint.")):
            await pilot.press("ctrl+n")
            await _until(pilot, lambda: conv_id in app.conversations)
            if conv_id == 4:
                policy = app.pane(4).query_one("#policy", Input)
                policy.focus()
                policy.value = "streaming:window=64"
                await pilot.press("enter")
            await _send(pilot, app, conv_id, text)
        await _until(pilot, lambda: app.last_snapshot is not None and app.last_snapshot.stats["running"] == 3
                     and len(app.conversations[4].reply) > 250)
        await pilot.pause(0.3)
        app.save_screenshot(svg_path)


def to_png(svg_path: str, png_path: str, width: int = 1800) -> None:
    import cairosvg  # type: ignore[import-not-found]

    svg = open(svg_path, encoding="utf-8").read()
    svg = re.sub(r'"?Fira Code"?', '"DejaVu Sans Mono"', svg)
    cairosvg.svg2png(bytestring=svg.encode("utf-8"), write_to=png_path, output_width=width)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("svg")
    parser.add_argument("--png", default=None)
    args = parser.parse_args()
    asyncio.run(record(args.svg))
    if args.png:
        to_png(args.svg, args.png)


if __name__ == "__main__":
    main()
