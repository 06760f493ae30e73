"""TUI settings, from the `cortexstream tui` command line or built directly by tests."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any


@dataclass
class TuiConfig:
    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct)
    dtype: str | None = None
    keep_quantized: bool = False
    kv_tokens: int = 8192  # arena size in tokens
    block_size: int = 16
    kv_dtype: str | None = None  # arena storage: "int8", "int4", "k=int8,v=int4", ... (None: the model's float type)
    kv_group_size: int | None = None  # group size of int8/int4 sides (32 or 64; None: 64)
    kv_disk: str | None = None  # the prefix cache's disk tier directory (None: RAM only)
    kv_disk_size: str = "20GiB"
    max_num_seqs: int = 16
    max_tokens: int = 512
    temperature: float = 0.0
    repetition_penalty: float | None = None
    system: str = ""  # default system prompt of new conversations ("" = the chat template's own)
    kv_policy: str = "full"  # default KV policy of new conversations
    speculative: str | None = None  # speculative decoding of every reply ("ngram:k=4,n=3"; None: off)
    # One prefix-cache tenant for all conversations (identical system prompts then share blocks) instead of
    # one tenant per conversation (the default: conversations never share KV, like users of a server).
    share_prefix: bool = False
    # Snapshot tests: hide what varies from run to run (speeds, TTFT, BLAS name).
    deterministic: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TuiConfig":
        def opt(name: str, default: Any) -> Any:
            value = getattr(args, name, None)
            return default if value is None else value

        return cls(
            model=getattr(args, "model", None),
            dtype=getattr(args, "dtype", None),
            keep_quantized=bool(getattr(args, "keep_quantized", False)),
            kv_tokens=opt("kv_tokens", cls.kv_tokens),
            block_size=opt("block_size", cls.block_size),
            kv_dtype=getattr(args, "kv_dtype", None),
            kv_group_size=getattr(args, "kv_group_size", None),
            kv_disk=getattr(args, "kv_disk", None),
            kv_disk_size=opt("kv_disk_size", cls.kv_disk_size),
            max_tokens=opt("max_tokens", cls.max_tokens),
            temperature=opt("temp", cls.temperature),
            repetition_penalty=getattr(args, "repetition_penalty", None),
            system=opt("system", cls.system),
            kv_policy=opt("kv_policy", cls.kv_policy),
            speculative=getattr(args, "speculative", None),
            share_prefix=bool(getattr(args, "share_prefix", False)),
        )

    def sampling(self) -> dict[str, Any]:
        """Keyword arguments for `Engine.add_request`."""
        kwargs: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": self.temperature}
        if self.repetition_penalty is not None:
            kwargs["repetition_penalty"] = self.repetition_penalty
        return kwargs

    def tenant(self, conv_id: int) -> str:
        return "tui" if self.share_prefix else f"tui-chat-{conv_id}"
