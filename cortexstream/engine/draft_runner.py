"""Draft-model speculative decoding: a smaller model with the same vocabulary proposes the tokens the target verifies.

The draft model keeps its KV in an arena of its own that mirrors the target's: the same number of blocks of the
same size, addressed by the target's block tables (the scheduler allocates once, for both), so copy-on-write copies,
freeing and preemption need nothing of their own; each plan's copies are applied to both arenas. What the draft
arena holds for a sequence is valid up to a length the scheduler tracks (`SpeculationState.draft_len`, a function
of the plans alone): blocks reached by a prefix-cache hit, a disk restore or a preemption hold nothing valid for the
drafter yet. So each drafting item (`WorkItem.model_draft`) first feeds the draft model the tokens it has not seen
(a catch-up chunk; a block shared through the prefix cache gets the same values from every sequence, since draft
KV is a function of the block's tokens), then drafts k tokens one pass at a time, all drafting requests batched in
each pass: a packed chunk pass while some request has more than one token to feed (engine/mixed_batch.py), a decode
step when each feeds one (engine/draft_decode.py).

Draft tokens are drawn from the draft model's distribution under the request's own sampling settings (greedy: its
argmax), and those distributions go with them to the rejection sampler, so the output is exactly the target's
(greedy) or follows it (sampled): engine/speculative_sampling.py.

An agreement check (`DraftRunner.agree_with`) sees every pass's proposals before the target verifies them: on
several ranks each rank drafts with its own whole copy of the draft model, and the check stops the ranks when their
drafts differ (cortexstream/distributed/draft_agreement.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from cortexstream.engine.draft_decode import feed_chunks, one_token_pass
from cortexstream.engine.forward import head_of
from cortexstream.engine.mixed_batch import MixedBatch
from cortexstream.engine.sampling import SamplingParams
from cortexstream.engine.speculative_config import SpeculativeConfig, SpeculativeMethod
from cortexstream.engine.speculative_sampling import target_logprobs
from cortexstream.engine.step_plan import WorkItem
from cortexstream.errors import InvalidArgumentError
from cortexstream.kv.arena import KVArena
from cortexstream.kv.arena_config import ArenaConfig
from cortexstream.kv.sequence_kv import SequenceKV


@dataclass(frozen=True)
class Proposal:
    """What the draft model proposed for one request: tokens and their draft log-probabilities `[k, V]`."""

    tokens: tuple[int, ...]
    logprobs: mx.array


# What checks a drafting pass's proposals (request id -> Proposal) given the requests' sampling; raises to stop.
AgreementCheck = Callable[[dict[str, Proposal], dict[str, SamplingParams]], None]


def vocab_size(model: Any) -> int | None:
    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", None)
    return int(size) if isinstance(size, int) else None


def check_pair(target: Any, target_tokenizer: Any, draft: Any, draft_tokenizer: Any, source: str) -> None:
    """Refuse a draft model whose vocabulary is not the target's (its token ids would mean other text)."""
    sizes = vocab_size(target), vocab_size(draft)
    if sizes[0] != sizes[1]:
        raise InvalidArgumentError(f"speculative: draft model {source} has a vocabulary of {sizes[1]} tokens, the "
                                   f"target's has {sizes[0]}: a draft model must share the target's tokenizer")
    for text in ("def main():\n    return 42", "The quick brown fox, 1234!", "  indented\ttabs\n"):
        if list(target_tokenizer.encode(text)) != list(draft_tokenizer.encode(text)):
            raise InvalidArgumentError(f"speculative: draft model {source} tokenizes {text!r} differently from "
                                       "the target: a draft model must share the target's tokenizer")
    if head_of(draft) is None:
        raise InvalidArgumentError(f"speculative: draft model {source} is not a model family whose passes can be "
                                   "batched here (llama, qwen2 and others with the standard mlx-lm layout)")


class DraftRunner:
    """The draft model, its mirrored arena and the per-request draft lengths (see the module docstring)."""

    def __init__(self, model: Any, target_arena: KVArena, source: str) -> None:
        self.model = model
        self.source = source
        config = ArenaConfig.for_model(model, num_tokens=target_arena.config.num_slots,
                                       block_size=target_arena.config.block_size)
        if config.num_blocks != target_arena.config.num_blocks:
            raise RuntimeError(f"draft arena: {config.num_blocks} blocks for the target's "
                               f"{target_arena.config.num_blocks}")
        self.arena = KVArena(config)
        # Called with every pass's proposals and the requests' sampling before they are verified, or None.
        self._agreement: AgreementCheck | None = None

    @classmethod
    def load(cls, source: str, target: Any, target_tokenizer: Any, target_arena: KVArena) -> "DraftRunner":
        from cortexstream.models.loader import load

        draft, draft_tokenizer = load(source)
        check_pair(target, target_tokenizer, draft, draft_tokenizer, source)
        return cls(draft, target_arena, source)

    def agree_with(self, check: "AgreementCheck | None") -> None:
        """Call `check(proposals, samplings)` after each drafting pass, before the target verifies (it raises to
        stop the step); None: no check."""
        self._agreement = check

    def mirror(self, num_blocks_used: int, copies: tuple[tuple[int, int], ...]) -> None:
        """Back the blocks the target uses and apply its copy-on-write copies to the draft KV too."""
        self.arena.ensure_blocks(num_blocks_used)
        for src, dst in copies:
            self.arena.copy_block(src, dst)

    def feed(self, items: list[WorkItem]) -> None:
        """Compute prefill items' chunks in the draft model too (`item.model_draft`, k=0: from where its KV stops
        being valid through the chunk's end), all in one pass (engine/draft_decode.py)."""
        if not items:
            return
        kvs = []
        for item in items:
            kv = SequenceKV(self.arena, contiguous=False, managed=True)
            kv.sync(item.block_table, item.model_draft.start, item.model_draft.start)
            kvs.append(kv)
        feed_chunks(self.model, self.arena, kvs, [item.model_draft.context for item in items])

    def propose(self, items: list[WorkItem], samplings: dict[str, SamplingParams]) -> dict[str, Proposal]:
        """Draft `item.model_draft.k` tokens after each item's token, all items batched in each pass."""
        kvs, feeds = {}, {}
        for item in items:
            draft = item.model_draft
            kv = SequenceKV(self.arena, contiguous=False, managed=True)
            kv.sync(item.block_table, draft.start, draft.start)
            kvs[item.request_id], feeds[item.request_id] = kv, list(draft.context)
        drafted: dict[str, list[int]] = {item.request_id: [] for item in items}
        rows: dict[str, list[mx.array]] = {item.request_id: [] for item in items}
        for step in range(max(item.model_draft.k for item in items)):
            active = [item for item in items if step < item.model_draft.k]
            chunks = [(kvs[item.request_id], feeds[item.request_id]) for item in active]
            if all(len(feed) == 1 for _, feed in chunks):  # a decode step (engine/draft_decode.py)
                logits = one_token_pass(self.model, self.arena, [kv for kv, _ in chunks],
                                        [feed[0] for _, feed in chunks])
                mx.eval(logits)
            else:  # the first pass feeds the tokens the draft model has not seen
                logits = self._forward(chunks)
            for item, row in zip(active, logits):
                sampling = samplings[item.request_id]
                lp = target_logprobs(row[None] - mx.logsumexp(row, keepdims=True), sampling)
                token = int(mx.argmax(lp, axis=-1).item()) if sampling.greedy else int(
                    mx.random.categorical(lp).item())
                drafted[item.request_id].append(token)
                rows[item.request_id].append(lp[0])
                feeds[item.request_id] = [token]
        proposals = {rid: Proposal(tuple(tokens), mx.stack(rows[rid])) for rid, tokens in drafted.items()}
        if self._agreement is not None:
            self._agreement(proposals, samplings)
        return proposals

    def _forward(self, chunks: list[tuple[SequenceKV, list[int]]]) -> list[mx.array]:
        """One draft pass over every chunk; each chunk's last-row logits `[V]`."""
        self.arena.grow_ahead()
        batch = MixedBatch(None, chunks, arena=self.arena)
        hidden = self.model.model(batch.tokens(None), cache=batch.caches())
        batch.commit()
        last = batch.logit_rows([True] * len(chunks))
        logits = head_of(self.model)(hidden[mx.array(np.asarray(last, dtype=np.int32))])[:, 0, :]
        mx.eval(logits)
        return [logits[i] for i in range(len(chunks))]


def load_drafter(config: SpeculativeConfig | None, model: Any, tokenizer: Any, arena: KVArena) -> DraftRunner | None:
    """The engine's draft model when its default speculation names one (`draft:model=SRC`), else None."""
    if config is None or config.method is not SpeculativeMethod.DRAFT:
        return None
    if head_of(model) is None:
        raise InvalidArgumentError("speculative: draft models need a target whose passes can be batched here "
                                   "(llama, qwen2 and others with the standard mlx-lm layout)")
    return DraftRunner.load(str(config.model), model, tokenizer, arena)


__all__ = ["AgreementCheck", "DraftRunner", "Proposal", "check_pair", "load_drafter"]
