"""`cortexstream tui`: several conversations streaming at once, the KV arena's blocks live, and engine stats.

Threading: widgets are only ever touched here, on Textual's thread. The engine runs on its own thread behind
`EngineLink`, which posts `ReplyDelta` / `StatsUpdate` / ... messages (see `engine_link.py`); the UI calls
only the link's non-blocking commands. The model loads on a background thread after the UI is drawn, so the
app is usable (prompts queue up) within a second; the default model takes a few seconds more on CPU.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, Header, Input, Static, TabbedContent, TabPane

from cortexstream.tui.config import TuiConfig
from cortexstream.tui.engine_link import EngineLink, describe, launch
from cortexstream.tui.messages import (
    ConversationCleared,
    EngineError,
    EngineReady,
    EngineSnapshot,
    ReplyDelta,
    RequestFailed,
    StatsUpdate,
)
from cortexstream.tui.widgets.block_map import BlockLegend, BlockMap, conv_color
from cortexstream.tui.widgets.chat import ChatPane, Conversation, available_policies
from cortexstream.tui.widgets.help import HelpScreen
from cortexstream.tui.widgets.stats import StatsPanel
from cortexstream.engine.engine import Engine
from cortexstream.engine.finish_reason import FinishReason
from cortexstream.errors import InvalidArgumentError
from cortexstream.policies import parse_policy


class CortexStreamApp(App[int]):
    CSS_PATH = str(Path(__file__).with_name("app.tcss"))  # absolute: subclasses live elsewhere (tests)
    TITLE = "CortexStream"
    BINDINGS = [
        Binding("f1", "help", "Help"),
        Binding("question_mark", "help", "Help", show=False),
        Binding("ctrl+n", "new_conversation", "New chat", priority=True),
        Binding("ctrl+l", "clear_conversation", "Clear chat", priority=True),
        Binding("escape", "abort_reply", "Stop reply"),
        Binding("ctrl+pagedown,alt+right", "switch(1)", "Next chat"),
        Binding("ctrl+pageup,alt+left", "switch(-1)", "Prev chat", show=False),
        Binding("ctrl+c,ctrl+q", "quit", "Quit", priority=True),
        Binding("q", "quit", "Quit", show=False),
    ]

    def __init__(self, config: TuiConfig | None = None, *, model: object = None, tokenizer: object = None,
                 engine: Engine | None = None) -> None:
        """Pass `model`+`tokenizer` or a ready `engine` to skip loading (tests); else `config.model` is loaded."""
        super().__init__()
        self.config = config or TuiConfig()
        self._preloaded = (model, tokenizer, engine)
        self.engine_link: EngineLink | None = None
        self.conversations: dict[int, Conversation] = {}
        self.policies = available_policies()
        self.fatal_error: str | None = None
        self.last_snapshot: EngineSnapshot | None = None
        self._pending: list[int] = []  # conversations whose prompt waits for the model to load
        self._next_conv = 1

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            yield TabbedContent(id="chats")
            with Vertical(id="side"):
                with Vertical(id="map-panel"):
                    yield BlockMap(id="block-map")
                    yield BlockLegend(id="legend")
                yield StatsPanel(deterministic=self.config.deterministic, id="stats")
        yield Static("loading the model...", id="statusbar")
        yield Footer()

    async def on_mount(self) -> None:
        self.sub_title = "loading the model..."
        await self.action_new_conversation()
        model, tokenizer, engine = self._preloaded
        launch(self.config, self.post_message, model, tokenizer, engine)
        self.set_interval(0.5, self._check_engine)

    # --- helpers ------------------------------------------------------------------------------------------------
    def pane(self, conv_id: int) -> ChatPane:
        return self.query_one(f"#chat-{conv_id}", TabPane).query_one(ChatPane)

    def current(self) -> Conversation | None:
        active = self.query_one("#chats", TabbedContent).active
        return self.conversations.get(int(active.rsplit("-", 1)[1])) if active else None

    def set_statusbar(self, text: str, error: bool = False) -> None:
        bar = self.query_one("#statusbar", Static)
        bar.update(Text(text))  # not markup: error texts may hold brackets
        bar.set_class(error, "error")

    def _refresh_status(self, conv: Conversation, generated: int | None = None) -> None:
        usage = self.last_snapshot.conversations.get(conv.conv_id) if self.last_snapshot else None
        state = "waiting for the model" if conv.conv_id in self._pending else (
            f"generating ({generated or 0} tokens)" if conv.busy else "idle")
        kv = (f" | tokens {usage.logical} logical, {usage.physical} physical"
              f" | blocks {usage.blocks}+{usage.cached_blocks} cached" if usage else "")
        self.pane(conv.conv_id).set_status(f"{state} | {conv.policy}{kv}")

    def _update_legend(self) -> None:
        self.query_one(BlockLegend).set_conversations([(c.conv_id, c.title) for c in self.conversations.values()])

    # --- actions ------------------------------------------------------------------------------------------------
    async def action_new_conversation(self) -> None:
        conv_id, self._next_conv = self._next_conv, self._next_conv + 1
        conv = Conversation(conv_id, f"Chat {conv_id}", system=self.config.system, policy=self.config.kv_policy)
        tabs = self.query_one("#chats", TabbedContent)
        pane = TabPane(f"[{conv_color(conv_id)}]■[/] {conv.title}", ChatPane(conv, self.policies),
                       id=f"chat-{conv_id}")
        await tabs.add_pane(pane)
        self.conversations[conv_id] = conv  # only now: handlers running meanwhile must not look for its pane
        tabs.active = pane.id or ""
        if self.config.deterministic:  # a blinking cursor would make screenshots differ run to run
            for field in pane.query(Input):
                field.cursor_blink = False
        self.pane(conv_id).query_one("#prompt", Input).focus()
        self._refresh_status(conv)
        self._update_legend()

    def action_switch(self, step: int) -> None:
        tabs = self.query_one("#chats", TabbedContent)
        ids = [f"chat-{c}" for c in self.conversations]
        if ids and tabs.active in ids:
            tabs.active = ids[(ids.index(tabs.active) + step) % len(ids)]
            self.pane(int(tabs.active.rsplit("-", 1)[1])).query_one("#prompt", Input).focus()

    def action_abort_reply(self) -> None:
        conv = self.current()
        if conv is None or not conv.busy:
            return
        if conv.conv_id in self._pending:
            self._pending.remove(conv.conv_id)
            self._finish(conv, FinishReason.ABORTED, None)
        elif self.engine_link is not None and conv.request_id is not None:
            self.engine_link.abort(conv.request_id)
            self.pane(conv.conv_id).set_status("stopping...")

    def action_clear_conversation(self) -> None:
        conv = self.current()
        if conv is None:
            return
        request_id, conv.request_id = conv.request_id, None
        conv.messages.clear()
        conv.reply = ""
        if conv.conv_id in self._pending:
            self._pending.remove(conv.conv_id)
        self.pane(conv.conv_id).clear_view()
        if self.engine_link is not None:
            self.engine_link.clear(conv.conv_id, request_id)
        self._refresh_status(conv)

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.policies))

    async def action_quit(self) -> None:
        self._stop_engine()
        self.exit(0)

    def _stop_engine(self) -> None:
        link, self.engine_link = self.engine_link, None
        if link is not None:
            link.stop()

    def on_unmount(self) -> None:
        self._stop_engine()

    # --- sending ------------------------------------------------------------------------------------------------
    def on_chat_pane_send(self, event: ChatPane.Send) -> None:
        conv = self.conversations[event.conv_id]
        pane = self.pane(conv.conv_id)
        if conv.busy:
            self.notify("Still replying: wait, or press Esc to stop it.", severity="warning", markup=False)
            return
        if self.fatal_error is not None:
            self.notify(self.fatal_error, title="No engine", severity="error", markup=False)
            return
        conv.messages.append({"role": "user", "content": event.text})
        pane.add_user(event.text)
        pane.start_reply()
        conv.new_request_id()
        if self.engine_link is None:
            self._pending.append(conv.conv_id)
        else:
            self._submit(conv)
        self._refresh_status(conv)

    def _submit(self, conv: Conversation) -> None:
        assert self.engine_link is not None and conv.request_id is not None
        try:
            policy = parse_policy(conv.policy)
        except Exception as exc:  # noqa: BLE001 - e.g. a default policy this engine does not know
            self._finish(conv, FinishReason.REJECTED, describe(exc))
            return
        self.engine_link.submit(conv.conv_id, conv.request_id, conv.prompt(), kv_policy=policy,
                           tenant=self.config.tenant(conv.conv_id), **self.config.sampling())

    def _finish(self, conv: Conversation, reason: FinishReason, error: str | None) -> None:
        """A reply ended: keep it in the history, or drop the unanswered question when it failed or was empty."""
        conv.request_id = None
        pane = self.pane(conv.conv_id)
        failed = error is not None or reason in (FinishReason.REJECTED, FinishReason.ERROR)
        if failed or (reason == FinishReason.ABORTED and not conv.reply):
            if conv.messages and conv.messages[-1]["role"] == "user":
                conv.messages.pop()
        else:
            conv.messages.append({"role": "assistant", "content": conv.reply})
        if failed:
            text = f"{reason}: {error or 'no reason given'}"
            pane.end_reply(text, error=True)
            self.notify(text, title=f"{conv.title}: request failed", severity="error", markup=False)
        else:
            if not conv.reply:
                pane.show_reply("(empty reply)")
            notes = {FinishReason.ABORTED: "(stopped)", FinishReason.LENGTH: "(max tokens reached)"}
            if reason == FinishReason.ABORTED and not conv.reply:
                notes[FinishReason.ABORTED] = "(stopped before any reply: the question is dropped from the history)"
            pane.end_reply(notes.get(reason))
        self._refresh_status(conv)

    # --- messages from the engine side --------------------------------------------------------------------------
    def on_engine_ready(self, message: EngineReady) -> None:
        self.engine_link = message.engine_link
        self.sub_title = message.model_label
        self.query_one(StatsPanel).set_model(message.model_label, message.backend_label)
        self.set_statusbar("ready: F1 help, Ctrl+N new conversation, Ctrl+L clear, Esc stop")
        pending, self._pending = self._pending, []
        for conv_id in pending:
            conv = self.conversations.get(conv_id)
            if conv is not None and conv.busy:
                self._submit(conv)
                self._refresh_status(conv)

    def on_engine_error(self, message: EngineError) -> None:
        if message.fatal:
            self.fatal_error = message.error
            self.sub_title = "no model"
            for conv_id in self._pending:
                self._finish(self.conversations[conv_id], FinishReason.ERROR, message.error)
            self._pending = []
        self.set_statusbar(f"error: {message.error}", error=True)
        self.notify(message.error, title="Engine error", severity="error", timeout=10, markup=False)

    def on_request_failed(self, message: RequestFailed) -> None:
        conv = self.conversations.get(message.conv_id)
        if conv is not None and conv.request_id == message.request_id:
            self._finish(conv, FinishReason.REJECTED, message.error)

    def on_reply_delta(self, message: ReplyDelta) -> None:
        conv = self.conversations.get(message.conv_id)
        if conv is None or conv.request_id != message.request_id:
            return  # a reply that was cleared meanwhile
        if message.ttft is not None:
            self.query_one(StatsPanel).add_ttft(message.ttft)
        if message.text:
            conv.reply += message.text
            self.pane(conv.conv_id).show_reply(conv.reply)
        if message.finish_reason is not None:
            self._finish(conv, message.finish_reason, message.error)
        else:
            self._refresh_status(conv, message.generated)

    def on_stats_update(self, message: StatsUpdate) -> None:
        self.last_snapshot = snap = message.snapshot
        self.query_one(BlockMap).show(snap)
        self.query_one(StatsPanel).show(snap, {c.conv_id: c.title for c in self.conversations.values()})
        for conv in self.conversations.values():
            if not conv.busy:
                self._refresh_status(conv)

    def on_conversation_cleared(self, message: ConversationCleared) -> None:
        conv = self.conversations.get(message.conv_id)
        if conv is not None:
            self.pane(conv.conv_id).add_note(f"conversation cleared: {message.freed} blocks returned to the arena")

    def _check_engine(self) -> None:
        """ThreadedEngine survives a failed step by aborting everything without outputs: end those replies."""
        failure = self.engine_link.take_failure() if self.engine_link is not None else None
        if failure is None:
            return
        self.set_statusbar(f"error: {failure}", error=True)
        for conv in self.conversations.values():
            if conv.busy and conv.conv_id not in self._pending:
                self._finish(conv, FinishReason.ERROR, failure)
        if self.engine_link is not None:
            self.engine_link.refresh()


def main(args: argparse.Namespace) -> int:
    """Entry point of `cortexstream tui`: bad options fail here, before the screen is taken over."""
    config = TuiConfig.from_args(args)
    parse_policy(config.kv_policy)
    if config.block_size < 1 or config.kv_tokens < config.block_size or config.max_tokens < 1:
        raise InvalidArgumentError(
            f"tui: need --block-size >= 1, --kv-tokens >= --block-size and --max-tokens >= 1 (got "
            f"{config.block_size}, {config.kv_tokens}, {config.max_tokens})"
        )
    result = CortexStreamApp(config).run()
    return int(result or 0)
