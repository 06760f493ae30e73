"""Tensor parallelism over the vocabulary: each rank keeps 1/N of the embedding table's rows and of the output head's.

mlx-lm's `model.shard` splits attention and MLP only, so the embedding table and the output head (the largest
matrices of a small model) would stay whole on every rank. Here both are split by vocabulary rows:

- Rank r of N keeps rows [r*W, min((r+1)*W, V)) with W = ceil(V/N): every rank holds W rows except the last, which
  holds the rest (fewer when N does not divide V). Nothing is padded in the weights.
- A lookup gathers the local rows of the ids in this rank's range and zeros for the others, then all-sums over
  the ranks: each id's row comes from exactly one rank and is added to zeros, so the result is exact.
- The output head (an `lm_head`, or the embedding's `as_linear` when the head is tied to it) computes this rank's
  logit columns as a [positions, W] block (the last rank pads its fewer columns to W). `mx.distributed.all_gather`
  stacks the ranks' blocks along axis 0 in rank order; they are reordered into [positions, N*W], which is
  vocabulary order, and cut to V: every rank gets the full logits.

The modules replace `model.model.embed_tokens` and `model.lm_head` in place; mlx-lm's model code is unchanged, as
it only calls `embed_tokens(ids)`, `embed_tokens.as_linear(h)` or `lm_head(h)`. The kinds split are float and
quantized embeddings and linears (`nn.Embedding`, `nn.QuantizedEmbedding`, `nn.Linear`, `nn.QuantizedLinear`),
whose every parameter has one row per vocabulary entry; `vocabulary_problem` names any other.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

EMBEDDING_KINDS = (nn.Embedding, nn.QuantizedEmbedding)
HEAD_KINDS = (nn.Linear, nn.QuantizedLinear)


@dataclass(frozen=True)
class VocabSlice:
    """The vocabulary rows rank `rank` of `ranks` keeps of a table of `rows` rows."""

    rows: int
    ranks: int
    rank: int

    def __post_init__(self) -> None:
        for name in ("rows", "ranks", "rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}: expected an int, got {value!r:.40}")
        if self.ranks < 1:
            raise ValueError(f"ranks: {self.ranks} must be >= 1")
        if not 0 <= self.rank < self.ranks:
            raise ValueError(f"rank: {self.rank} is not in [0, {self.ranks})")
        problem = slice_problem(self.rows, self.ranks)
        if problem is not None:
            raise ValueError(f"rows: {problem}")

    @property
    def width(self) -> int:
        """Rows per rank (the last rank may hold fewer): the logit columns each rank contributes to the gather."""
        return math.ceil(self.rows / self.ranks)

    @property
    def start(self) -> int:
        return self.rank * self.width

    @property
    def stop(self) -> int:
        return min(self.rows, self.start + self.width)


def slice_problem(rows: int, ranks: int) -> str | None:
    """Why a table of `rows` vocabulary rows cannot be split over `ranks` ranks (a rank would hold none)."""
    if rows < 1 or (ranks - 1) * math.ceil(rows / ranks) >= rows:
        return f"a vocabulary of {rows} rows leaves some of {ranks} ranks no rows"
    return None


def rows_problem(module: Any, kinds: tuple[type, ...], where: str) -> str | None:
    """Why `module` (found at `where`) cannot be split by vocabulary rows, or None."""
    if type(module) not in kinds:
        supported = ", ".join(kind.__name__ for kind in kinds)
        return (f"{where} is a {type(module).__name__}, which cannot be split by vocabulary rows "
                f"(supported: {supported})")
    rows = int(module.weight.shape[0])
    for name, value in module.items():
        if isinstance(value, mx.array) and (value.ndim == 0 or int(value.shape[0]) != rows):
            return f"{where}.{name} has shape {tuple(value.shape)}, not one row for each of the {rows} vocabulary rows"
    return None


def rows_of(module: nn.Module, part: VocabSlice) -> nn.Module:
    """A module of `module`'s kind holding copies of rows [part.start, part.stop) of its parameters (every
    parameter of the supported kinds has one row per vocabulary entry: weight, scales, biases, bias)."""
    local = copy.copy(module)
    for name, value in module.items():
        if isinstance(value, mx.array):
            # contiguous copies the rows: a view would keep the whole table's buffer alive.
            local[name] = mx.contiguous(value[part.start: part.stop])
    if isinstance(local, nn.QuantizedEmbedding):
        local.num_embeddings = part.stop - part.start
    return local


def padded_columns(logits: mx.array, part: VocabSlice) -> mx.array:
    """This rank's logits `[..., stop - start]` as `[positions, width]` rows, padded with zeros to the width."""
    short = part.width - logits.shape[-1]
    if short:
        logits = mx.pad(logits, [(0, 0)] * (logits.ndim - 1) + [(0, short)])
    return logits.reshape(-1, part.width)


def gathered_logits(gathered: mx.array, part: VocabSlice, lead: tuple[int, ...]) -> mx.array:
    """The full logits `[*lead, rows]` in vocabulary order from every rank's `padded_columns` concatenated along
    axis 0 in rank order (what `mx.distributed.all_gather` returns)."""
    positions = math.prod(lead)
    columns = gathered.reshape(part.ranks, positions, part.width).transpose(1, 0, 2)
    return columns.reshape(positions, part.ranks * part.width)[:, : part.rows].reshape(*lead, part.rows)


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by vocabulary rows over a group; serves as a tied output head too (`as_linear`)."""

    def __init__(self, table: nn.Module, part: VocabSlice, group: Any) -> None:
        super().__init__()
        self.local = rows_of(table, part)
        self.part = part
        self.group = group

    def partial_lookup(self, ids: mx.array) -> mx.array:
        """This rank's share of the lookup: the rows of the ids it holds, zeros for the others."""
        inside = (ids >= self.part.start) & (ids < self.part.stop)
        rows = self.local(mx.where(inside, ids - self.part.start, 0))
        return mx.where(inside[..., None], rows, mx.zeros((), dtype=rows.dtype))

    def __call__(self, ids: mx.array) -> mx.array:
        return mx.distributed.all_sum(self.partial_lookup(ids), group=self.group)

    def partial_logits(self, x: mx.array) -> mx.array:
        """This rank's logit columns for hidden states `x`, as `padded_columns`."""
        return padded_columns(self.local.as_linear(x), self.part)

    def as_linear(self, x: mx.array) -> mx.array:
        gathered = mx.distributed.all_gather(self.partial_logits(x), group=self.group)
        return gathered_logits(gathered, self.part, tuple(x.shape[:-1]))


class VocabParallelHead(nn.Module):
    """An output projection (`lm_head`) split by vocabulary rows over a group: every rank gets the full logits."""

    def __init__(self, head: nn.Module, part: VocabSlice, group: Any) -> None:
        super().__init__()
        self.local = rows_of(head, part)
        self.part = part
        self.group = group

    def partial_logits(self, x: mx.array) -> mx.array:
        return padded_columns(self.local(x), self.part)

    def __call__(self, x: mx.array) -> mx.array:
        gathered = mx.distributed.all_gather(self.partial_logits(x), group=self.group)
        return gathered_logits(gathered, self.part, tuple(x.shape[:-1]))


def _tied(model: Any) -> bool:
    return bool(getattr(getattr(model, "args", None), "tie_word_embeddings", False))


def vocabulary_problem(model: Any, size: int) -> str | None:
    """Why `model`'s embedding table and output head cannot be split by vocabulary rows over `size` ranks."""
    kind = getattr(model, "model_type", type(model).__name__)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if embed is None:
        return f"model type {kind!r}: no embedding table (model.model.embed_tokens) to split by vocabulary rows"
    head = getattr(model, "lm_head", None)
    if head is None and not _tied(model):
        return (f"model type {kind!r}: no output head (lm_head) and its embedding is not tied to one "
                f"(args.tie_word_embeddings), so its logits cannot be split by vocabulary rows")
    found = [(embed, EMBEDDING_KINDS, "model.model.embed_tokens")]
    if head is not None:
        found.append((head, HEAD_KINDS, "model.lm_head"))
    for module, kinds, where in found:
        problem = rows_problem(module, kinds, where) or slice_problem(int(module.weight.shape[0]), size)
        if problem is not None:
            return f"model type {kind!r}: {problem}"
    return None


def split_vocabulary(model: Any, group: Any, size: int, rank: int) -> None:
    """Keep rank `rank`'s vocabulary rows of `model`'s embedding table and output head (in place). The caller
    checked `vocabulary_problem` first."""
    body = model.model
    body.embed_tokens = VocabParallelEmbedding(body.embed_tokens, VocabSlice(int(body.embed_tokens.weight.shape[0]),
                                                                             size, rank), group)
    head = getattr(model, "lm_head", None)
    if head is not None:
        model.lm_head = VocabParallelHead(head, VocabSlice(int(head.weight.shape[0]), size, rank), group)


__all__ = ["EMBEDDING_KINDS", "HEAD_KINDS", "VocabParallelEmbedding", "VocabParallelHead", "VocabSlice",
           "gathered_logits", "padded_columns", "rows_of", "split_vocabulary", "vocabulary_problem"]
