"""Server settings, validated once at start-up (every error names the option)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Handoff(str, enum.Enum):
    """How token events reach the event loop: one hop per engine step, or one per token (only for the
    diagnostic that measures the difference, bench/serve_handoff.py)."""

    PER_STEP = "per_step"
    PER_TOKEN = "per_token"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class ServerConfig:
    """Everything `create_app` needs besides the model. Engine sizes go to `Engine`, the rest to the server."""

    model_name: str = "default"
    kv_tokens: int | None = None  # arena size in tokens; None with kv_memory None: 16384
    kv_memory: float | None = None  # fraction of device memory for the arena
    # One memory budget for the whole process ("6GiB", or "0.5" of physical memory): the arena gets what weights,
    # the process's baseline and the largest step's activations leave (engine/memory_budget.py).
    max_memory: str | None = None
    block_size: int = 16
    # How the arena stores K/V ("int8", "int4", "k=int8,v=int4", "float16", ...; None: the model's float type) and
    # the group size of quantized sides (32 or 64; None: 64). One arena, one storage type: requests cannot pick.
    kv_dtype: str | None = None
    kv_group_size: int | None = None
    # The prefix cache's disk tier (engine/disk_tier.py): a directory, and the most bytes it may hold on disk.
    kv_disk: str | None = None
    kv_disk_size: str = "20GiB"
    max_num_seqs: int = 32
    max_queue: int = 256  # requests waiting beyond max_num_seqs before 429
    kv_policy: str | None = None  # default policy for requests that name none
    # Default speculative decoding ("ngram:k=4,n=3", "draft:model=PATH,k=4"; None: off); requests may override.
    speculative: str | None = None
    api_keys: tuple[str, ...] = ()  # empty: no auth, one prefix-cache tenant
    max_body_bytes: int = 4 * 1024 * 1024
    max_header_bytes: int = 16 * 1024
    shutdown_timeout: float = 30.0
    handoff: Handoff = Handoff.PER_STEP  # or its string value
    default_chat_max_tokens: int = 256
    default_completion_max_tokens: int = 16  # OpenAI's default for /v1/completions

    def __post_init__(self) -> None:
        if not isinstance(self.model_name, str) or not self.model_name:
            raise ValueError(f"model_name: {self.model_name!r} must be a non-empty string")
        if self.kv_tokens is not None and self.kv_memory is not None:
            raise ValueError("kv_tokens / kv_memory: give one of them, not both")
        if self.max_memory is not None:
            if self.kv_tokens is not None or self.kv_memory is not None:
                raise ValueError("max_memory / kv_tokens / kv_memory: give one of them: max_memory sizes the arena "
                                 "from the process's whole budget, the others size it directly")
            from cortexstream.engine.memory_budget import MemoryBudget

            MemoryBudget.parse(self.max_memory, "max_memory")  # the spelling now, the split once the model loads
        if self.kv_tokens is not None and (not isinstance(self.kv_tokens, int) or self.kv_tokens < 1):
            raise ValueError(f"kv_tokens: {self.kv_tokens!r} must be an integer >= 1")
        if self.kv_memory is not None and not 0.0 < self.kv_memory <= 0.9:
            raise ValueError(f"kv_memory: {self.kv_memory!r} must be in (0, 0.9]")
        for name in ("block_size", "max_num_seqs", "max_body_bytes", "max_header_bytes",
                     "default_chat_max_tokens", "default_completion_max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: {value!r} must be an integer >= 1")
        if not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise ValueError(f"max_queue: {self.max_queue!r} must be an integer >= 0")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout: {self.shutdown_timeout!r} must be >= 0")
        object.__setattr__(self, "handoff", parse_handoff(self.handoff))
        if any(not isinstance(k, str) or not k.strip() for k in self.api_keys):
            raise ValueError("api_keys: every key must be a non-empty string")
        if len(set(self.api_keys)) != len(self.api_keys):
            raise ValueError("api_keys: duplicate keys")
        if self.kv_dtype is not None or self.kv_group_size is not None:
            from cortexstream.kv.kv_dtype import StorageType, parse_kv_dtype

            # The spelling and the group size now; whether the group divides the model's head dim when the
            # arena is built (the placeholder float type only decides what "auto" means).
            parse_kv_dtype(self.kv_dtype, self.kv_group_size, model_dtype=StorageType.FLOAT32)
        if self.kv_disk is not None and (not isinstance(self.kv_disk, str) or not self.kv_disk.strip()):
            raise ValueError(f"kv_disk: {self.kv_disk!r} must be a directory path")
        from cortexstream.kv.disk import parse_size

        if parse_size(self.kv_disk_size, "kv_disk_size") < 1:
            raise ValueError(f"kv_disk_size: {self.kv_disk_size!r} must be more than 0 bytes")
        if self.speculative is not None:
            from cortexstream.engine.speculative_config import parse_speculative

            parse_speculative(self.speculative)  # a typo fails at start-up, before the model loads
        if self.kv_policy is not None:
            from cortexstream.policies import parse_policy

            parse_policy(self.kv_policy)  # a typo fails at start-up, naming the bad key

    @property
    def max_in_flight(self) -> int:
        """Requests accepted at once (running + queued); one more gets 429."""
        return self.max_num_seqs + self.max_queue


def parse_handoff(value: "Handoff | str") -> Handoff:
    """`value` as a Handoff; a bad one raises ValueError naming `handoff` and the choices."""
    try:
        return Handoff(value)
    except ValueError:
        choices = " or ".join(repr(h.value) for h in Handoff)
        raise ValueError(f"handoff: {value!r} must be {choices}") from None
