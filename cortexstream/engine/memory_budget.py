"""One memory budget for a serving process, and how it is split: weights, the process's baseline, the
activations and scratch of the largest step the scheduler runs, a disk-tier writer queue, and the KV arena (the
rest, in whole blocks).

`MemoryBudget.parse("6GiB")` or `MemoryBudget.parse("0.5")` (a fraction of physical memory) gives the total;
`plan_memory(model, budget, ...)` gives a `MemoryPlan`. The arena is the only part that grows with the budget:
admission already waits for free blocks, so a budget-sized arena is what keeps the process inside its budget.

The largest step (`step_activation_bytes`), with C the arena's token slots (the longest context a sequence can
have: chunked prefill attends to the whole prefix), P = prefill_step_size, S = max_num_seqs, and
Q = ceil(1.25 P) + S the most token rows of one forward pass (a batched prefill pads its chunks to at most 1.25x
their tokens, engine/runner.py; a mixed pass adds the decode rows to the chunk), all in float32 (4 bytes, an upper
bound for half-precision models):

    hidden    = Q * (4 d + (H + 2 Hkv) Dh + 3 I) * 4          one layer's live tensors: residual, its norm, the
                                                              attention output, q/k/v, the MLP's gate, up, product
    scores    = H * Q * (C + Q) * 4                           attention scores of Q queries against C + Q keys
                                                              (unfused SDPA materialises them; the mask and the
                                                              softmax reuse that buffer, MLX donates it)
    context   = (C + Q) * Hkv * (Dh + Dv) * 4                 one layer's K and V read back (gathered, dequantized
                                                              or concatenated with the chunk's own)
    logits    = 3 * R * V * 4                                 logits, log-probabilities and a sampling copy of the
                                                              R sampled rows (R = S; Q when the model's head cannot
                                                              be called on the last positions alone)
    step      = SAFETY_FACTOR * (hidden + scores + context + logits) + arena_bytes / layers

The last term is the arena's growth: a layer's buffers are padded one layer at a time, and the old buffer lives
until the copy is done. `scores`, `context` and the growth grow with C, so the arena size solves a linear
equation: budget = weights + baseline + queue + A0 + C (bytes_per_token + A1).

A draft model (`draft:model=SRC` speculation) adds its weights and its arena, which mirrors the target's block
for block (engine/draft_runner.py), so it costs `block_size * its bytes_per_token` more per block; its passes and
the target's do not run at once, so the activations are the larger of the two models' estimates.

MLX keeps freed buffers in a cache for reuse; the plan lets it keep the safety margin's share
(`MemoryPlan.cache_bytes`), so that the live activations plus the cache stay within the activations' part.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from cortexstream.errors import InvalidArgumentError
from cortexstream.kv.arena_config import ArenaConfig, device_memory_bytes, model_kv_shape

SAFETY_FACTOR = 1.5  # on the estimated activations: allocator rounding, temporaries the estimate does not name
PREFILL_PADDING = 1.25  # a batched prefill pass's padded size over its real tokens (ModelRunner's grouping)
MIN_ARENA_BLOCKS = 4  # the least arena a budget must leave: one short request and a copy-on-write block
MAX_FRACTION = 0.95  # a fraction of physical memory above this leaves nothing for the OS
FLOAT32 = 4
GIB = 2**30


@dataclass(frozen=True)
class MemoryBudget:
    """The most bytes the process may hold resident (`total_bytes`); `source` is how it was given."""

    total_bytes: int
    source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.total_bytes, int) or isinstance(self.total_bytes, bool) or self.total_bytes < 1:
            raise InvalidArgumentError(f"MemoryBudget.total_bytes: {self.total_bytes!r} must be a positive integer")

    @classmethod
    def parse(cls, text: str, what: str = "max_memory", physical_bytes: int | None = None) -> "MemoryBudget":
        """A size ("6GiB", "1.5GB", "800000000") or a fraction of physical memory in (0, 0.95] ("0.5"). A number
        without a unit is a fraction when it has a decimal point, else bytes. `physical_bytes`: the machine's
        memory (None: asked of the device when a fraction needs it). `what` names the option in errors."""
        from cortexstream.kv.disk import parse_size

        if not isinstance(text, str) or not text.strip():
            raise InvalidArgumentError(f"{what}: {text!r} must be a size such as '6GiB' or a fraction of physical "
                                       f"memory such as '0.5'")
        stripped = text.strip()
        if "." in stripped and stripped.replace(".", "", 1).isdigit():
            fraction = float(stripped)
            if not 0.0 < fraction <= MAX_FRACTION:
                raise InvalidArgumentError(f"{what}: {text!r} as a fraction of physical memory must be in "
                                           f"(0, {MAX_FRACTION}]; write a size with a unit (e.g. '6GiB') for bytes")
            physical = device_memory_bytes() if physical_bytes is None else physical_bytes
            return cls(int(physical * fraction), f"{fraction:g} of {physical / GIB:.1f} GiB")
        try:
            size = parse_size(stripped, what)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{exc}; or a fraction of physical memory in (0, {MAX_FRACTION}] such as "
                                       "'0.5'") from None
        if size < 1:
            raise InvalidArgumentError(f"{what}: {text!r} must be more than 0 bytes")
        return cls(size, stripped)


@dataclass(frozen=True)
class MemoryPlan:
    """How a budget is split. `activation_bytes` includes the safety factor and the arena's growth; `slack_bytes`
    is what rounding the arena down to whole blocks left over. The parts (`parts()`) add up to the budget."""

    budget: MemoryBudget
    weights_bytes: int
    baseline_bytes: int
    activation_bytes: int
    disk_queue_bytes: int
    arena: ArenaConfig
    slack_bytes: int
    cache_bytes: int  # the most freed buffers MLX may keep for reuse: the safety factor's share of the activations
    draft_weights_bytes: int = 0  # a draft model's parameters (0: none)
    draft_arena_bytes: int = 0  # its arena, as many blocks as the target's

    @property
    def arena_bytes(self) -> int:
        return self.arena.total_bytes

    @property
    def mlx_bytes(self) -> int:
        """What MLX itself allocates (weights, arena, activations; the slack too): its memory limit."""
        return (self.weights_bytes + self.arena_bytes + self.activation_bytes + self.slack_bytes
                + self.draft_weights_bytes + self.draft_arena_bytes)

    def parts(self) -> dict[str, int]:
        """Every part in bytes, in the order they are taken from the budget."""
        return {"weights": self.weights_bytes, "baseline": self.baseline_bytes,
                "activations": self.activation_bytes, "disk_queue": self.disk_queue_bytes,
                "arena": self.arena_bytes, "draft_weights": self.draft_weights_bytes,
                "draft_arena": self.draft_arena_bytes, "slack": self.slack_bytes}

    def summary(self) -> str:
        """One line for the server's banner and logs."""
        text = ", ".join(f"{name} {value / 2**20:.0f}" for name, value in self.parts().items() if value)
        source = f" ({self.budget.source})" if self.budget.source else ""
        return f"{self.budget.total_bytes / 2**20:.0f} MiB{source} = {text} MiB; arena {self.arena.num_slots} tokens"


@dataclass(frozen=True)
class StepShape:
    """What the largest step's activations depend on, read from the model."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    value_head_dim: int
    vocab: int
    layers: int
    head_on_last_rows: bool  # the output projection runs on the sampled rows only (engine/forward.head_of)

    @classmethod
    def of(cls, model: Any, arena: ArenaConfig) -> "StepShape":
        from cortexstream.engine.forward import head_of

        args = getattr(model, "args", None)

        def dim(name: str, fallback: int) -> int:
            value = getattr(args, name, None)
            return int(value) if isinstance(value, int) and value > 0 else fallback

        embed = getattr(getattr(getattr(model, "model", None), "embed_tokens", None), "weight", None)
        rows, width = tuple(embed.shape) if embed is not None and len(embed.shape) == 2 else (0, 0)
        hidden = dim("hidden_size", int(width))  # the embedding's width is packed in quantized models: args first
        vocab = dim("vocab_size", int(rows))
        if hidden <= 0 or vocab <= 0:
            raise InvalidArgumentError("model: its hidden size and vocabulary are not known (args.hidden_size, "
                                       "args.vocab_size); a memory budget cannot be planned for it")
        heads = dim("num_attention_heads", arena.num_kv_heads)
        return cls(hidden, dim("intermediate_size", 4 * hidden), heads, arena.num_kv_heads, arena.head_dim,
                   arena.value_head_dim, vocab, arena.num_layers, head_of(model) is not None)


def step_activation_terms(shape: StepShape, max_num_seqs: int, prefill_step_size: int) -> tuple[int, int]:
    """(A0, A1): the largest step's activations are SAFETY_FACTOR x (A0 + A1 x C) bytes for an arena of C token
    slots (the module docstring's formula, without the arena-growth term)."""
    rows = math.ceil(PREFILL_PADDING * prefill_step_size) + max_num_seqs
    per_row = 4 * shape.hidden + (shape.heads + 2 * shape.kv_heads) * shape.head_dim + 3 * shape.intermediate
    kv_width = shape.kv_heads * (shape.head_dim + shape.value_head_dim)
    sampled = max_num_seqs if shape.head_on_last_rows else rows
    fixed = (rows * per_row + shape.heads * rows * rows + rows * kv_width + 3 * sampled * shape.vocab) * FLOAT32
    per_slot = (shape.heads * rows + kv_width) * FLOAT32
    return fixed, per_slot


def step_activation_bytes(shape: StepShape, arena: ArenaConfig, max_num_seqs: int,
                          prefill_step_size: int) -> tuple[int, int]:
    """(planned, margin): the largest step's activations and scratch for `arena` with the safety factor and the
    growth term, and the safety factor's share of it (what MLX's buffer cache may hold)."""
    fixed, per_slot = step_activation_terms(shape, max_num_seqs, prefill_step_size)
    estimate = fixed + per_slot * arena.num_slots
    planned = math.ceil(SAFETY_FACTOR * estimate)
    return planned + arena.total_bytes // arena.num_layers, planned - estimate


@dataclass(frozen=True)
class DraftCost:
    """What a draft model adds to a plan: its weights, its arena's bytes per token slot, its step's activations."""

    weights_bytes: int
    bytes_per_token: int
    num_layers: int
    shape: StepShape

    @classmethod
    def of(cls, draft: Any, block_size: int) -> "DraftCost":
        """Read from the loaded draft model (its arena stores the model's float type, as DraftRunner's does)."""
        probe = ArenaConfig.for_model(draft, num_tokens=block_size, block_size=block_size)
        return cls(weights_bytes(draft), probe.bytes_per_token, probe.num_layers, StepShape.of(draft, probe))

    @classmethod
    def measure(cls, source: str, block_size: int) -> "DraftCost":
        """Load the draft model from `source`, measure it and drop it (the engine loads its own copy), returning
        the buffers it held to the system."""
        import gc

        import mlx.core as mx

        from cortexstream.models.loader import load

        draft, _ = load(source)
        cost = cls.of(draft, block_size)
        del draft
        gc.collect()
        mx.clear_cache()
        return cost

    def arena_bytes(self, num_slots: int) -> int:
        return num_slots * self.bytes_per_token


def weights_bytes(model: Any) -> int:
    """Bytes of the model's parameters (quantized weights with their scales and biases)."""
    from mlx.utils import tree_flatten

    return sum(int(value.nbytes) for _, value in tree_flatten(model.parameters()))


def resident_bytes() -> int:
    """This process's resident memory now: VmRSS on Linux; elsewhere the peak so far (getrusage), which is never
    below the current figure."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # bytes on macOS, KiB elsewhere


def plan_memory(model: Any, budget: MemoryBudget, *, block_size: int, max_num_seqs: int, prefill_step_size: int,
                kv_dtype: str | None = None, kv_group_size: int | None = None, disk_queue_bytes: int = 0,
                baseline_bytes: int | None = None, what: str = "max_memory",
                draft: DraftCost | None = None) -> MemoryPlan:
    """Split `budget` for serving the loaded `model` (see the module docstring). `baseline_bytes`: the process's
    memory besides the weights (None: resident memory now minus the weights, which counts the interpreter, the
    libraries and whatever loading left behind). `disk_queue_bytes`: what the disk tier's writer may hold queued.
    `draft`: a draft model's share (DraftCost.of), None without one.
    Raises InvalidArgumentError naming `what` with every figure when the rest cannot hold MIN_ARENA_BLOCKS blocks."""
    for name, value in (("block_size", block_size), ("max_num_seqs", max_num_seqs),
                        ("prefill_step_size", prefill_step_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidArgumentError(f"{name}: {value!r} must be an integer >= 1")
    if not isinstance(disk_queue_bytes, int) or disk_queue_bytes < 0:
        raise InvalidArgumentError(f"disk_queue_bytes: {disk_queue_bytes!r} must be an integer >= 0")
    model_kv_shape(model)  # an unsupported model fails here, naming what it lacks
    storage = {"block_size": block_size, "kv_dtype": kv_dtype, "kv_group_size": kv_group_size}
    probe = ArenaConfig.for_model(model, num_tokens=block_size, **storage)
    shape = StepShape.of(model, probe)
    weights = weights_bytes(model)
    baseline = max(0, resident_bytes() - weights) if baseline_bytes is None else baseline_bytes
    fixed, per_slot = step_activation_terms(shape, max_num_seqs, prefill_step_size)
    growth_per_slot = probe.bytes_per_token / probe.num_layers
    draft_weights, draft_per_slot = 0, 0.0
    if draft is not None:  # its activations: the larger of the two models' terms (their passes alternate)
        draft_fixed, draft_slot = step_activation_terms(draft.shape, max_num_seqs, prefill_step_size)
        fixed, per_slot = max(fixed, draft_fixed), max(per_slot, draft_slot)
        draft_weights = draft.weights_bytes
        draft_per_slot = draft.bytes_per_token * (1 + 1 / draft.num_layers)  # its arena and its growth
    per_block = block_size * (probe.bytes_per_token + SAFETY_FACTOR * per_slot + growth_per_slot + draft_per_slot)
    taken = weights + draft_weights + baseline + disk_queue_bytes + math.ceil(SAFETY_FACTOR * fixed)
    blocks = int((budget.total_bytes - taken) // per_block) if budget.total_bytes > taken else 0
    while blocks >= MIN_ARENA_BLOCKS:  # ceil roundings may cost one block
        arena = ArenaConfig.for_model(model, num_bytes=blocks * probe.bytes_per_block, **storage)
        activations, margin = step_activation_bytes(shape, arena, max_num_seqs, prefill_step_size)
        draft_arena = 0
        if draft is not None:
            draft_activations = step_activation_bytes(draft.shape, arena, max_num_seqs, prefill_step_size)
            activations, margin = max((activations, margin), draft_activations)
            activations += math.ceil(draft.arena_bytes(arena.num_slots) / draft.num_layers)  # its growth
            draft_arena = draft.arena_bytes(arena.num_slots)
        slack = budget.total_bytes - (weights + baseline + disk_queue_bytes + activations + arena.total_bytes
                                      + draft_weights + draft_arena)
        if slack >= 0:
            return MemoryPlan(budget, weights, baseline, activations, disk_queue_bytes, arena, slack, margin,
                              draft_weights, draft_arena)
        blocks -= 1
    least = ArenaConfig.for_model(model, num_tokens=MIN_ARENA_BLOCKS * block_size, **storage)
    least_activations = step_activation_bytes(shape, least, max_num_seqs, prefill_step_size)[0]
    need = weights + baseline + disk_queue_bytes + least_activations + least.total_bytes
    with_draft = ""
    if draft is not None:
        least_draft = draft.weights_bytes + draft.arena_bytes(least.num_slots)
        need += least_draft
        with_draft = f" + the draft model's weights and smallest arena {_mib(least_draft)}"
    raise InvalidArgumentError(
        f"{what}: a budget of {_mib(budget.total_bytes)} ({budget.source or budget.total_bytes}) leaves no room for "
        f"the KV arena: weights {_mib(weights)} + process baseline {_mib(baseline)} + activations of the largest "
        f"step {_mib(least_activations)} (max_num_seqs {max_num_seqs}, prefill_step_size {prefill_step_size}) + "
        f"disk-tier writer queue {_mib(disk_queue_bytes)} + the smallest arena {_mib(least.total_bytes)} "
        f"({MIN_ARENA_BLOCKS} blocks x {block_size} tokens x {probe.bytes_per_token} bytes){with_draft} = "
        f"{_mib(need)}; give at "
        f"least {_mib(need)}, or lower max_num_seqs")


def _mib(value: int) -> str:
    if value >= 2**20 or value == 0:
        return f"{value / 2**20:.1f} MiB"
    return f"{value / 2**10:.1f} KiB" if value >= 2**10 else f"{value} bytes"
