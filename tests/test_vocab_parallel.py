"""The embedding table and the output head split by vocabulary rows (distributed/vocab_parallel.py), without ranks:
each rank's part is computed in-process and summed (lookups) or concatenated in rank order as all_gather does
(logits), which must give the unsplit module's results: exactly for lookups, to float rounding for logits. Float
and quantized kinds, tied and untied heads, a vocabulary that does not divide by the ranks; the refusals; and the
weight bytes each rank keeps once `shard_model` split attention, MLP and vocabulary. Two real ranks:
tests/test_distributed.py."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from cortexstream.distributed import DistributedError
from cortexstream.distributed.sharding import shard_model, shard_problem
from cortexstream.distributed.vocab_parallel import (VocabParallelEmbedding, VocabParallelHead, VocabSlice,
                                                     gathered_logits, split_vocabulary, vocabulary_problem)
from tiny_models import TINY_CONFIG, tiny_model

VOCAB = TINY_CONFIG["vocab_size"]  # 269: odd, so two ranks hold different numbers of rows


class FakeGroup:
    """What splitting reads of a group (its rank and size); running a split model needs a real one."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def param_bytes(module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def every_id() -> mx.array:
    return mx.array(np.arange(VOCAB)[::-1].reshape(1, -1).copy())  # each id once, [1, V]


def simulated_lookup(parts: list[VocabParallelEmbedding], ids: mx.array) -> mx.array:
    return sum(part.partial_lookup(ids) for part in parts[1:]) + parts[0].partial_lookup(ids)


def simulated_logits(parts: list, x: mx.array) -> mx.array:
    gathered = mx.concatenate([part.partial_logits(x) for part in parts], axis=0)  # all_gather: axis 0, rank order
    return gathered_logits(gathered, parts[0].part, tuple(x.shape[:-1]))


def hidden_states(seed: int = 3) -> mx.array:
    return mx.random.normal((2, 5, TINY_CONFIG["hidden_size"]), key=mx.random.key(seed))


def test_slices_cover_the_vocabulary_once_the_last_rank_holding_the_rest():
    for ranks in (1, 2, 3, 4):
        parts = [VocabSlice(VOCAB, ranks, rank) for rank in range(ranks)]
        assert [p.start for p in parts] == [p.rank * p.width for p in parts] and parts[-1].stop == VOCAB
        assert all(a.stop == b.start for a, b in zip(parts, parts[1:]))
        assert all(p.stop - p.start == p.width for p in parts[:-1]) and 0 < parts[-1].stop - parts[-1].start
    assert [(p.start, p.stop) for p in (VocabSlice(VOCAB, 2, 0), VocabSlice(VOCAB, 2, 1))] == [(0, 135), (135, 269)]
    with pytest.raises(ValueError, match="rank: 2 is not in"):
        VocabSlice(VOCAB, 2, 2)
    with pytest.raises(ValueError, match="ranks: 0 must be"):
        VocabSlice(VOCAB, 0, 0)
    with pytest.raises(ValueError, match="rows: a vocabulary of 4 rows leaves some of 3 ranks no rows"):
        VocabSlice(4, 3, 0)  # widths 2, 2, 0


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("quantized", [False, True], ids=["float", "quantized"])
def test_split_embedding_looks_up_exactly_and_projects_as_the_whole_table(ranks, quantized):
    table = tiny_model(seed=5).model.embed_tokens
    if quantized:
        table = nn.QuantizedEmbedding.from_embedding(table, group_size=32, bits=4)
    parts = [VocabParallelEmbedding(table, VocabSlice(VOCAB, ranks, rank), group=None) for rank in range(ranks)]
    ids = every_id()
    for part in parts:  # each rank contributes its own rows and zeros elsewhere
        nonzero = np.abs(np.array(part.partial_lookup(ids))).sum(-1)[0] > 0
        assert set(np.array(ids)[0][nonzero]) == set(range(part.part.start, part.part.stop))
    assert np.array_equal(np.array(simulated_lookup(parts, ids)), np.array(table(ids)))
    x = hidden_states()
    whole, split = np.array(table.as_linear(x)), np.array(simulated_logits(parts, x))
    assert split.shape == whole.shape == (2, 5, VOCAB)
    np.testing.assert_allclose(split, whole, rtol=1e-5, atol=1e-5)
    assert np.array_equal(split.argmax(-1), whole.argmax(-1))


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "quantized"])
def test_untied_model_splits_its_head_and_embedding_separately(quantized):
    whole = tiny_model(seed=6, tie_word_embeddings=False)
    if quantized:
        nn.quantize(whole, group_size=32, bits=8)
    ranks = []
    for rank in range(2):
        model = tiny_model(seed=6, tie_word_embeddings=False)
        if quantized:
            nn.quantize(model, group_size=32, bits=8)
        assert vocabulary_problem(model, 2) is None
        split_vocabulary(model, FakeGroup(rank, 2), 2, rank)
        assert isinstance(model.model.embed_tokens, VocabParallelEmbedding)
        assert isinstance(model.lm_head, VocabParallelHead)
        assert type(model.lm_head.local) is type(whole.lm_head)  # the same kind, fewer rows
        ranks.append(model)
    x = hidden_states(4)
    logits = simulated_logits([m.lm_head for m in ranks], x)
    np.testing.assert_allclose(np.array(logits), np.array(whole.lm_head(x)), rtol=1e-5, atol=1e-5)
    ids = every_id()
    lookup = simulated_lookup([m.model.embed_tokens for m in ranks], ids)
    assert np.array_equal(np.array(lookup), np.array(whole.model.embed_tokens(ids)))


def test_a_group_of_one_runs_the_split_modules_inside_mlx_lms_forward():
    """With one rank the collectives are identities: this checks that mlx-lm's unchanged forward reaches the split
    table through `embed_tokens(ids)`, `embed_tokens.as_linear` (tied) and `lm_head` (untied)."""
    group = mx.distributed.init()
    if group.size() != 1:
        pytest.skip("this process already joined a group of several ranks")
    tokens = mx.array([[5, 17, 99, 42, 7, 268, 0]])
    for tied in (True, False):
        whole, split = (tiny_model(seed=8, tie_word_embeddings=tied) for _ in range(2))
        split_vocabulary(split, group, 1, 0)
        assert isinstance(split.model.embed_tokens, VocabParallelEmbedding)
        assert isinstance(getattr(split, "lm_head", None), VocabParallelHead) is not tied
        assert np.array_equal(np.array(split(tokens)), np.array(whole(tokens)))


def test_models_whose_vocabulary_cannot_be_split_are_refused_naming_why_before_anything_changes():
    class ScaledEmbedding(nn.Embedding):
        pass

    model = tiny_model(seed=1)
    model.model.embed_tokens = ScaledEmbedding(VOCAB, TINY_CONFIG["hidden_size"])
    problem = shard_problem(model, 2)
    assert "model.model.embed_tokens is a ScaledEmbedding" in problem and "QuantizedEmbedding" in problem
    with pytest.raises(DistributedError, match="cannot split the model over 2 ranks: .*ScaledEmbedding"):
        shard_model(model, FakeGroup(0, 2), 2)
    assert type(model.layers[0].self_attn.q_proj) is nn.Linear  # nothing was split

    untied = tiny_model(seed=1, tie_word_embeddings=False)
    untied.lm_head = nn.Sequential(untied.lm_head)
    assert "model.lm_head is a Sequential" in shard_problem(untied, 2)

    headless = tiny_model(seed=1, tie_word_embeddings=False)
    del headless["lm_head"]
    assert "no output head (lm_head) and its embedding is not tied" in shard_problem(headless, 2)

    no_table = tiny_model(seed=1)
    del no_table.model["embed_tokens"]
    assert "no embedding table (model.model.embed_tokens)" in shard_problem(no_table, 2)

    small = tiny_model(seed=1, vocab_size=4)
    assert "a vocabulary of 4 rows leaves some of 3 ranks no rows" in vocabulary_problem(small, 3)
    assert vocabulary_problem(small, 4) is None  # one row each
    assert shard_problem(tiny_model(seed=1), 2) is None


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_each_rank_keeps_half_the_weights_but_the_norms(tied):
    alone = param_bytes(tiny_model(seed=2, tie_word_embeddings=tied))
    kept = []
    for rank in range(2):
        model = tiny_model(seed=2, tie_word_embeddings=tied)
        shard_model(model, FakeGroup(rank, 2), 2)
        kept.append(param_bytes(model))
    config = TINY_CONFIG
    norms = (2 * config["num_hidden_layers"] + 1) * config["hidden_size"] * 4  # float32, whole on every rank
    assert sum(kept) == alone + norms  # every other byte is held by exactly one rank
    assert all(abs(k / alone - 0.5) < 0.01 for k in kept), (kept, alone)
