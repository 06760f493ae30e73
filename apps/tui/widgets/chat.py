"""One conversation: its state (`Conversation`) and its pane (settings row, transcript, status line, prompt).

Multi-turn chats send the whole message list every turn (the chat template is applied by the engine); the
engine's prefix cache finds the blocks of the previous turns, so only the new text is prefilled.
The KV policy and system prompt are per conversation and apply from the next reply on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.suggester import SuggestFromList
from textual.widgets import Input, Label, Static

from cortexstream.policies import parse_policy

# Tried against `parse_policy` at start-up; only the ones it accepts are offered (the engine's list grows).
CANDIDATE_POLICIES = (
    "full",
    "streaming:window=256",
    "streaming:budget=0.25,sinks=4",
    "h2o:budget=0.2",
    "h2o:budget=0.2,sinks=4,recent=64",
    "kvzip:budget=0.33",
)


def available_policies() -> list[str]:
    """The policy specs `parse_policy` accepts right now (shown as suggestions and in the help screen)."""
    accepted = []
    for spec in CANDIDATE_POLICIES:
        try:
            parse_policy(spec)
        except Exception:  # noqa: BLE001 - not (yet) implemented by the engine
            continue
        accepted.append(spec)
    return accepted


@dataclass
class Conversation:
    conv_id: int
    title: str
    system: str = ""
    policy: str = "full"
    messages: list[dict[str, str]] = field(default_factory=list)
    request_id: str | None = None  # the reply in flight, if any
    reply: str = ""
    turns: int = 0

    @property
    def busy(self) -> bool:
        return self.request_id is not None

    def prompt(self) -> list[dict[str, str]]:
        """The whole chat as the engine gets it; an empty system prompt leaves the template's default."""
        system = [{"role": "system", "content": self.system}] if self.system.strip() else []
        return system + list(self.messages)

    def new_request_id(self) -> str:
        """Unique per turn, and never reused after a clear (the engine rejects duplicate ids)."""
        self.turns += 1
        self.request_id = f"chat{self.conv_id}-turn{self.turns}"
        self.reply = ""
        return self.request_id


class ChatPane(Vertical):
    """The widgets of one conversation. Only the UI thread calls these methods."""

    class Send(Message):
        """The user pressed Enter in the prompt."""

        def __init__(self, conv_id: int, text: str) -> None:
            super().__init__()
            self.conv_id = conv_id
            self.text = text

    def __init__(self, conversation: Conversation, policies: list[str]) -> None:
        super().__init__(classes="chat-pane")
        self.conversation = conversation
        self.policies = policies
        self._reply: Static | None = None
        self._status = ""

    def compose(self) -> ComposeResult:
        conv = self.conversation
        with Horizontal(classes="settings"):
            yield Label("KV policy")
            yield Input(conv.policy, id="policy", suggester=SuggestFromList(self.policies, case_sensitive=False),
                        placeholder=" | ".join(self.policies), select_on_focus=False)
            yield Label("system")
            yield Input(conv.system, id="system", placeholder="(the chat template's default)")
        yield VerticalScroll(id="log")
        yield Static("", id="status")
        yield Input(id="prompt", placeholder="Message (Enter sends, Esc stops the reply, F1 help)")

    @property
    def log_view(self) -> VerticalScroll:
        return self.query_one("#log", VerticalScroll)

    # --- input --------------------------------------------------------------------------------------------------
    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if event.input.id == "prompt":
            text = event.value.strip()
            if text and self.conversation.busy:  # keep the text: it can be sent once the reply ends
                self.app.notify("Still replying: wait, or press Esc to stop it.", severity="warning",
                                markup=False)
            elif text:
                event.input.value = ""
                self.post_message(self.Send(self.conversation.conv_id, text))
        elif event.input.id == "policy":
            self.apply_policy(event.value)
            self.query_one("#prompt", Input).focus()
        elif event.input.id == "system":
            self.query_one("#prompt", Input).focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "system":
            self.conversation.system = event.value

    def on_descendant_blur(self, event: object) -> None:
        """Leaving the policy field applies it, as Enter does."""
        policy = self.query_one("#policy", Input)
        if self.is_attached and policy.value.strip() != self.conversation.policy:
            self.apply_policy(policy.value)

    def apply_policy(self, spec: str) -> bool:
        """Validate with `parse_policy`; a bad spec is reported in the UI and the previous one kept."""
        spec = spec.strip() or "full"
        policy_input = self.query_one("#policy", Input)
        try:
            parse_policy(spec)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the user's to see
            self.app.notify(str(exc), title="KV policy", severity="error", markup=False)
            policy_input.value = self.conversation.policy
            return False
        self.conversation.policy = spec
        policy_input.value = spec
        self.set_status(f"KV policy for the next reply: {spec}")
        return True

    # --- transcript ---------------------------------------------------------------------------------------------
    def _append(self, widget: Static) -> None:
        self.log_view.mount(widget)
        self.log_view.scroll_end(animate=False)

    def add_user(self, text: str) -> None:
        self._append(Static(Text(text), classes="msg user"))

    def start_reply(self, waiting: str = "...") -> None:
        self._reply = Static(Text(waiting, style="dim"), classes="msg assistant")
        self._append(self._reply)

    def show_reply(self, text: str) -> None:
        if self._reply is None:
            self.start_reply()
        assert self._reply is not None
        self._reply.update(Text(text))
        self.log_view.scroll_end(animate=False)

    def end_reply(self, note: str | None = None, error: bool = False) -> None:
        if note:
            self.add_note(note, error=error)
        self._reply = None

    def add_note(self, text: str, error: bool = False) -> None:
        self._append(Static(Text(text), classes="msg note error" if error else "msg note"))

    def clear_view(self) -> None:
        self._reply = None
        self.log_view.remove_children()

    def set_status(self, text: str) -> None:
        """One fixed-height line: repaint only (no layout pass), and nothing at all when unchanged."""
        if text != self._status:
            self._status = text
            self.query_one("#status", Static).update(Text(text), layout=False)
