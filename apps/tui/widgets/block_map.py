"""The live block map: one cell per KV arena block, coloured by the conversation that owns it.

Scaling: the map always fits the space it is given. With `n` blocks and a `w x h` area, one character cell
stands for `k = ceil(n / (w * h))` consecutive blocks (k = 1 for the default 512-block arena in a normal
terminal). When k > 1 a cell's glyph shows how full its k blocks are (` ░▒▓█`) and its colour the most common
owner among them, so thousands of blocks stay readable without scrolling; the border says the current scale.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
from rich.text import Text
from textual.color import Color
from textual.widget import Widget
from textual.widgets import Static

from cortexstream.tui.messages import FLAG_CACHED, FLAG_ON_DISK, FLAG_TRIMMED, FREE, OTHER, SHARED, EngineSnapshot

PALETTE = ("#4ea1ff", "#ff9f43", "#2ed573", "#ff6b81", "#b388ff", "#00d2d3", "#feca57", "#ff7f50")
FREE_STYLE = "#5c5c5c"
SHARED_STYLE = "bold #f0f0f0"
OTHER_STYLE = "#9a9a9a"
GLYPH = {"free": "·", "used": "█", "cached": "▒", "shared": "▓", "trimmed": "▚"}
FILL = " ░▒▓█"


def conv_color(conv_id: int) -> str:
    """A conversation's colour (the palette cycles)."""
    return PALETTE[conv_id % len(PALETTE)]


def cached_color(conv_id: int) -> str:
    """The same hue, darker: that conversation's blocks kept by the prefix cache after its turn ended."""
    return Color.parse(conv_color(conv_id)).blend(Color(20, 20, 20), 0.5).hex


def scale(num_blocks: int, width: int, height: int) -> int:
    """Blocks per character cell so that `num_blocks` fit in `width x height` cells."""
    if num_blocks <= 0 or width <= 0 or height <= 0:
        return 1
    return max(1, math.ceil(num_blocks / (width * height)))


def _cell(owner: int, flags: int) -> tuple[str, str]:
    """Glyph and style of a single block; underlined when the disk tier holds a copy of it."""
    glyph, style = _cell_state(owner, flags)
    return glyph, f"{style} underline" if flags & FLAG_ON_DISK and owner != FREE else style


def _cell_state(owner: int, flags: int) -> tuple[str, str]:
    if owner == FREE:
        return GLYPH["free"], FREE_STYLE
    if owner == SHARED:
        return GLYPH["shared"], SHARED_STYLE
    if owner == OTHER:
        return GLYPH["used"], OTHER_STYLE
    if flags & FLAG_CACHED:
        return GLYPH["cached"], cached_color(owner)
    return (GLYPH["trimmed"] if flags & FLAG_TRIMMED else GLYPH["used"]), conv_color(owner)


def _group(owners: list[int], flags: list[int]) -> tuple[str, str]:
    """Glyph and style of a cell standing for several blocks."""
    used = [(o, f) for o, f in zip(owners, flags) if o != FREE]
    if not used:
        return GLYPH["free"], FREE_STYLE
    glyph = FILL[max(1, math.ceil(4 * len(used) / len(owners)))]
    owner, count = Counter(o for o, _ in used).most_common(1)[0]
    if owner == SHARED:
        return glyph, SHARED_STYLE
    if owner == OTHER:
        return glyph, OTHER_STYLE
    cached = sum(1 for o, f in used if o == owner and f & FLAG_CACHED)
    return glyph, cached_color(owner) if 2 * cached > count else conv_color(owner)


def render_cells(owners: np.ndarray, flags: np.ndarray, width: int, height: int) -> tuple[Text, int]:
    """The map as rich Text (rows of `width` cells) and the blocks-per-cell scale used."""
    k = scale(int(owners.size), width, height)
    own, flg = owners.tolist(), flags.tolist()
    cells = [_cell(o, f) for o, f in zip(own, flg)] if k == 1 else [
        _group(own[i : i + k], flg[i : i + k]) for i in range(0, len(own), k)
    ]
    text = Text(no_wrap=True, overflow="crop")
    for row in range(0, len(cells), width):
        if row:
            text.append("\n")
        run, style = "", None
        for glyph, cell_style in cells[row : row + width]:
            if cell_style != style and run:
                text.append(run, style)
                run = ""
            run, style = run + glyph, cell_style
        if run:
            text.append(run, style)
    return text, k


class BlockMap(Widget):
    """Renders the newest snapshot's per-block owners; `show()` is called by the app on each StatsUpdate."""

    DEFAULT_CSS = "BlockMap { height: 1fr; min-height: 3; }"

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._owners = np.zeros(0, np.int32)
        self._flags = np.zeros(0, np.uint8)
        self._block_size = 0
        self.blocks_per_cell = 1

    def show(self, snapshot: EngineSnapshot) -> None:
        self._owners, self._flags = snapshot.owners, snapshot.flags
        self._block_size = int(snapshot.stats.get("block_size", 0))
        self._update_titles()
        self.refresh()

    def on_resize(self) -> None:
        self._update_titles()

    def _update_titles(self) -> None:
        """Arena size and the current scale go on the surrounding panel's border."""
        size = self.content_size
        self.blocks_per_cell = scale(int(self._owners.size), size.width, size.height)
        parent = self.parent
        if isinstance(parent, Widget) and self._owners.size:
            per = "1 block" if self.blocks_per_cell == 1 else f"{self.blocks_per_cell} blocks"
            parent.border_title = f"KV arena: {self._owners.size} blocks x {self._block_size} tokens"
            parent.border_subtitle = f"1 cell = {per}"

    def render(self) -> Text:
        size = self.content_size
        if self._owners.size == 0:
            return Text("waiting for the engine...", style=FREE_STYLE)
        return render_cells(self._owners, self._flags, size.width, size.height)[0]


class BlockLegend(Static):
    """Colour key: one entry per conversation, then the block states."""

    def set_conversations(self, conversations: list[tuple[int, str]]) -> None:
        text = Text()
        for conv_id, title in conversations:
            text.append(GLYPH["used"], conv_color(conv_id)).append(GLYPH["cached"], cached_color(conv_id))
            text.append(f" {title}  ")
        rows = (
            ((GLYPH["used"], "#d0d0d0", "live"), (GLYPH["cached"], "#808080", "cached prefix"),
             (GLYPH["shared"], SHARED_STYLE, "shared"), (GLYPH["free"], FREE_STYLE, "free")),
            ((GLYPH["trimmed"], "#d0d0d0", "live, some KV evicted/compressed"),
             (GLYPH["cached"], "#808080 underline", "on disk")),
        )
        for row in rows:
            text.append("\n")
            for glyph, style, label in row:
                text.append(glyph, style).append(f" {label}  ")
        self.update(text)
