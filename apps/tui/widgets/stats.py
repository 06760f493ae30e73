"""Stats panel: speed, TTFT, KV memory and storage (kv dtype, bytes per token) and per-conversation logical vs
physical tokens.

Speeds are measured over the last `window` seconds of snapshots, divided by the engine time spent in prefill or
decode (not wall time), so they show what the engine does while it works rather than dropping to zero between
turns; with no tokens of that kind in the window the lifetime average is shown. Decode tok/s counts every
sequence in a batch, so it grows with the number of conversations streaming at once (continuous batching).
In `deterministic` mode (snapshot tests) timings and the BLAS name, which vary run to run, show as "-".
"""

from __future__ import annotations

from collections import deque
from typing import Any

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from cortexstream.tui.messages import EngineSnapshot
from cortexstream.tui.widgets.block_map import GLYPH, conv_color

MIB = 1024 * 1024


def _rate(tokens: float, seconds: float) -> str:
    return f"{tokens / seconds:,.1f} tok/s" if seconds > 0 else "-"


def kv_storage_text(stats: dict[str, Any]) -> str:
    """The arena's storage from engine stats: its kv dtype and the bytes one token's K and V take."""
    return f"{stats['kv_dtype']}, {stats['bytes_per_token']:,} B/token"


class StatsPanel(Static):
    def __init__(self, *, deterministic: bool = False, window: float = 3.0, id: str | None = None) -> None:
        super().__init__("loading model...", id=id)
        self.deterministic = deterministic
        self.window = window
        self.model_label = "loading..."
        self.backend_label = "-"
        self._history: deque[EngineSnapshot] = deque()
        self.ttfts: list[float] = []
        self._rows = -1
        self._last: tuple[EngineSnapshot, tuple[str, str], dict[int, str]] | None = None

    def set_model(self, model_label: str, backend_label: str) -> None:
        """Shown at once: the engine's first snapshot may have arrived before the ready message."""
        self.model_label = model_label
        self.backend_label = "-" if self.deterministic else backend_label
        if self._last is not None:
            self._draw(*self._last)

    def add_ttft(self, seconds: float) -> None:
        self.ttfts.append(seconds)

    def _rates(self, snap: EngineSnapshot) -> tuple[str, str]:
        self._history.append(snap)
        while len(self._history) > 2 and self._history[1].wall_time <= snap.wall_time - self.window:
            self._history.popleft()
        old = self._history[0]
        new_prefill = snap.prefill_tokens - old.prefill_tokens
        new_decode = snap.decode_tokens - old.decode_tokens
        prefill = (
            _rate(new_prefill, snap.prefill_time - old.prefill_time)
            if new_prefill > 0 else _rate(snap.prefill_tokens, snap.prefill_time)
        )
        decode = (
            _rate(new_decode, snap.decode_time - old.decode_time)
            if new_decode > 0 else _rate(snap.decode_tokens, snap.decode_time)
        )
        return prefill, decode

    def _ttft(self) -> str:
        if not self.ttfts:
            return "-"
        mean = sum(self.ttfts) / len(self.ttfts)
        return f"{self.ttfts[-1]:.2f} s last, {mean:.2f} s mean"

    def show(self, snap: EngineSnapshot, titles: dict[int, str]) -> None:
        """Re-render from a snapshot; `titles` names the conversations still open."""
        self._last = (snap, self._rates(snap), titles)
        self._draw(*self._last)

    def _draw(self, snap: EngineSnapshot, rates: tuple[str, str], titles: dict[int, str]) -> None:
        stats = snap.stats
        prefill, decode = rates
        if self.deterministic:
            prefill = decode = ttft = "-"
        else:
            ttft = self._ttft()
        grid = Table.grid(padding=(0, 1))
        grid.add_column(style="bold #99aabb")
        grid.add_column()
        grid.add_row("model", self.model_label)
        grid.add_row("backend", self.backend_label)
        grid.add_row("prefill", prefill)
        grid.add_row("decode", f"{decode}  ({stats.get('running', 0)} running, {stats.get('waiting', 0)} waiting)")
        grid.add_row("TTFT", ttft)
        grid.add_row("KV store", kv_storage_text(stats))
        grid.add_row("KV used", f"{stats['bytes_used'] / MIB:,.1f} MiB ({stats['num_used_blocks']} blocks)")
        grid.add_row("KV free", f"{stats['bytes_free'] / MIB:,.1f} MiB ({stats['num_free_blocks']} blocks)")
        grid.add_row("fragment.", f"{stats['fragmentation']:.3f}   preemptions {stats.get('preemptions', 0)}")
        grid.add_row("evicted", f"{stats['evicted_tokens']} tok   compressed {stats['compressed_tokens']} tok")
        grid.add_row("prefix", f"{stats.get('prefix_cached_blocks', 0)} cached blocks, "
                               f"{stats.get('prefix_hit_blocks', 0)} hits")
        if stats.get("spec_verify_steps"):
            grid.add_row("drafts", f"{stats['spec_accepted_tokens']}/{stats['spec_drafted_tokens']} kept in "
                                   f"{stats['spec_verify_steps']} verify passes")
        if "disk_blocks" in stats:
            grid.add_row("disk", f"{stats['disk_blocks']} blocks, {stats['disk_bytes_on_disk'] / MIB:,.1f} MiB, "
                                 f"{stats['disk_restored_tokens']} tok restored")
        table = Table(box=None, padding=(0, 1), show_edge=False, expand=False)
        for name, justify in (("conversation", "left"), ("logical", "right"), ("physical", "right"),
                              ("blocks", "right")):
            table.add_column(name, justify=justify, header_style="bold #99aabb")  # type: ignore[arg-type]
        for conv_id, usage in snap.conversations.items():
            if conv_id not in titles:
                continue
            label = Text(GLYPH["used"], conv_color(conv_id))
            label.append(f" {titles[conv_id]}{'*' if usage.running else ' '}")
            blocks = f"{usage.blocks}+{usage.cached_blocks}c" if usage.cached_blocks else str(usage.blocks)
            table.add_row(label, str(usage.logical), str(usage.physical), blocks)
        outer = Table.grid()
        outer.add_row(grid)
        outer.add_row(table)
        rows = len(snap.conversations)
        self.update(outer, layout=rows != self._rows)  # a layout pass only when its height may change
        self._rows = rows
