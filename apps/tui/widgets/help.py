"""F1 / ? help: the key bindings, the KV policies `parse_policy` accepts, and how to read the block map."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from cortexstream.tui.widgets.block_map import FREE_STYLE, GLYPH, SHARED_STYLE

KEYS = (
    ("Enter", "send the message (the whole conversation is the prompt)"),
    ("Esc", "stop the reply being generated in this conversation"),
    ("Ctrl+N", "new conversation (several can stream at once)"),
    ("Ctrl+L", "clear this conversation: abort it and return all its blocks to the arena"),
    ("Ctrl+PgDn / Alt+Right", "next conversation"),
    ("Ctrl+PgUp / Alt+Left", "previous conversation"),
    ("Tab / Shift+Tab", "move between policy, system prompt and message fields"),
    ("F1 / ?", "this help (Esc closes it)"),
    ("Ctrl+C / Ctrl+Q / q", "quit (q only outside text fields); stops the engine thread"),
)


def help_text(policies: list[str]) -> Table:
    keys = Table(box=None, padding=(0, 2), show_header=False)
    keys.add_column(style="bold #4ea1ff", no_wrap=True)
    keys.add_column()
    for key, what in KEYS:
        keys.add_row(key, what)
    legend = Text()
    for glyph, style, label in (
        (GLYPH["used"], "#4ea1ff", "a block in a conversation's live sequence (one colour per conversation)"),
        (GLYPH["cached"], "#27507f", "kept by the prefix cache after the turn; the next turn reuses it"),
        (GLYPH["shared"], SHARED_STYLE, "in two or more live sequences at once (shared prefix)"),
        (GLYPH["trimmed"], "#4ea1ff", "live, and its policy has evicted or compressed some of its tokens"),
        (GLYPH["free"], FREE_STYLE, "free"),
    ):
        legend.append(f" {glyph} ", style).append(f"{label}\n")
    legend.append(" ░▒▓█ when one cell stands for several blocks: how full they are\n")
    out = Table.grid(padding=(0, 0))
    out.add_row(Text("Keys", style="bold underline"))
    out.add_row(keys)
    out.add_row(Text("\nKV policies (type one in the policy field; applies from the next reply)",
                     style="bold underline"))
    specs = "".join(f"  {spec}\n" for spec in policies)
    out.add_row(Text(specs + "  (any name:key=value,... that parse_policy accepts)"))
    out.add_row(Text("\nBlock map", style="bold underline"))
    out.add_row(legend)
    return out


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,f1,question_mark,q", "dismiss", "Close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll {
        width: 90; max-width: 95%; height: auto; max-height: 90%;
        border: round #4ea1ff; background: $panel; padding: 0 1;
    }
    """

    def __init__(self, policies: list[str]) -> None:
        super().__init__()
        self.policies = policies

    def compose(self) -> ComposeResult:
        with VerticalScroll() as scroll:
            scroll.border_title = "CortexStream TUI help"
            yield Static(help_text(self.policies))
