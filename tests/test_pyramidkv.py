"""PyramidKV: SnapKV's votes, more keys in lower layers than upper ones, stored without padding (cells of upper
layers holding lower layers' keys, `engine.pooled_layers`).

The schedule (numpy): integers summing to layers x voted, falling linearly, capped by each layer's room. The choice:
exactly budget x heads x layers cells, sinks and window per (layer, head), owners followed wherever cells are. The
layout: a layer's keys read back from other layers' cells. On tiny models: after the prompt is compressed the first
layer keeps more keys than the sequence has slots while the arena holds exactly the budget, and the next pass (one
token, or a chunk under the causal mask) gives the logits of the full cache with each (layer, head) masked to its
kept positions, also after a second compression (a later turn); batched equals alone; int8 blocks; the server and
`perplexity` take it; several ranks refuse it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from cortexstream.engine import policy_prompt_cache as direct
from cortexstream.engine import pooled_state
from cortexstream.engine.pooled_layers import foreign_cells, read_foreign
from cortexstream.errors import InvalidArgumentError
from cortexstream.kv.prompt_cache import make_prompt_cache
from cortexstream.kv.sequence_kv import private_sequence
from cortexstream.policies import PyramidKV, SnapKV, parse_policy
from cortexstream.policies.pyramidkv import layer_counts
from test_adakv import _MaskedCache, assert_perplexity_and_server_take, int8_run
from test_policies_runtime import assert_batched_matches_alone
from tiny_models import random_token_ids, tiny_model


@pytest.fixture(scope="module")
def deep(tiny):
    """A sharpened tiny model with 4 layers (a pyramid with a middle), and the tiny tokenizer."""
    model = tiny_model(seed=11, num_hidden_layers=4)
    for layer in model.model.layers:
        layer.self_attn.q_proj.weight = layer.self_attn.q_proj.weight * 4.0
    mx.eval(model.parameters())
    return model, tiny[1]


# --- the policy object ------------------------------------------------------------------------------------------
def test_string_form_and_bad_parameters():
    policy = parse_policy("pyramidkv:budget=0.2,window=16,kernel=5,sinks=2,beta=10")
    assert policy == PyramidKV(budget=0.2, window=16, kernel=5, sinks=2, beta=10)
    assert parse_policy(policy.describe()) == policy
    for spec, word in (("pyramidkv:beta=0.5", "beta"), ("pyramidkv:beta=x", "beta"), ("pyramidkv:merge=0.5", "merge"),
                       ("pyramidkv:kernel=4", "kernel")):
        with pytest.raises(InvalidArgumentError, match=word):
            parse_policy(spec)


def test_layer_counts_fall_linearly_and_respect_room():
    counts = layer_counts(4, 20, 20.0, np.full(4, 1000))
    assert counts.sum() == 80 and list(counts) == sorted(counts, reverse=True)
    assert counts[0] == 39 and counts[-1] == 1  # 2k - k/beta and k/beta
    assert list(layer_counts(3, 10, 1.0, np.full(3, 50))) == [10, 10, 10]  # beta 1: every layer the same
    capped = layer_counts(4, 20, 20.0, np.array([25, 1000, 1000, 0]))
    assert capped.sum() == 80 and capped[0] == 25 and capped[3] == 0 and capped[1] > counts[1]
    with pytest.raises(InvalidArgumentError, match="room"):
        layer_counts(2, 20, 20.0, np.array([10, 10]))


def test_select_cells_keeps_the_budget_with_more_below_and_follows_owners():
    policy = PyramidKV(budget=12, window=2, kernel=1, sinks=1, beta=4)
    layers, heads, n = 3, 2, 30
    rng = np.random.default_rng(0)
    scores = rng.random((layers, heads, n))
    positions = np.broadcast_to(np.arange(n), (layers, heads, n)).copy()
    owners = (np.arange(layers)[:, None, None] * heads + np.arange(heads)[None, :, None]) * np.ones(n, np.int64)
    keep = policy.select_cells(n, 100, scores, positions, owners)
    assert keep.shape == (layers, heads, n) and keep.sum() == layers * heads * 12
    per_layer = keep.sum(axis=(1, 2)) // heads
    assert per_layer[0] > 12 > per_layer[2] and per_layer.sum() == 36
    assert keep[:, :, 0].all() and keep[:, :, -2:].all()  # sinks and windows of every (layer, head)
    # the same cells rearranged (any cell anywhere, owners and positions moved with it) are chosen alike
    perm = rng.permutation(layers * heads * n)
    moved = [a.reshape(-1)[perm].reshape(layers, heads, n) for a in (scores, positions, owners)]
    chosen = policy.select_cells(n, 100, *moved)
    assert np.array_equal(np.sort(perm[chosen.reshape(-1)]), np.nonzero(keep.reshape(-1))[0])
    assert policy.select_cells(12, 100, scores[..., :12], positions[..., :12], owners[..., :12]) is None


def test_foreign_cells_are_read_back_from_the_lenders():
    seq = private_sequence(3, 2, 4, 4, 16, "float32", block_size=4)
    rng = np.random.default_rng(1)
    keys = [mx.array(rng.standard_normal((2, 8, 4)).astype(np.float32)) for _ in range(3)]
    values = [mx.array(rng.standard_normal((2, 8, 4)).astype(np.float32)) for _ in range(3)]
    for layer in range(3):
        seq.arena.write(layer, seq.blocks, 0, keys[layer], values[layer])
    seq.lengths = [8] * 3
    owners = [np.zeros((2, 8), np.int16) + np.arange(2)[:, None] for _ in range(3)]
    layers = [np.full((2, 8), m, np.int16) for m in range(3)]
    layers[2][1, 5], owners[2][1, 5] = 0, 0  # layer 2, column 1, slot 5 holds layer 0's head-0 key
    layers[1][0, 7], owners[1][0, 7] = 0, 1  # layer 1, column 0, slot 7 holds layer 0's head-1 key
    found = foreign_cells(owners, layers)
    assert found[1] is None and found[2] is None and len(found[0]) == 2
    assert found[0].lenders.tolist() == [1, 2] and found[0].heads.tolist() == [1, 0]
    k, v = read_foreign(seq, found[0])
    np.testing.assert_array_equal(np.asarray(k), np.stack([np.asarray(keys[1][0, 7]), np.asarray(keys[2][1, 5])]))
    np.testing.assert_array_equal(np.asarray(v), np.stack([np.asarray(values[1][0, 7]), np.asarray(values[2][1, 5])]))


# --- on the tiny model ------------------------------------------------------------------------------------------
def _kept(state, layers: int, heads: int) -> list[list[np.ndarray]]:
    """Per (layer, head): the positions of the keys it owns, wherever they are stored."""
    return [[np.sort(np.concatenate([state.positions[m][(state.owners[m] == h) & (state.owner_layers[m] == layer)]
                                     for m in range(layers)])) for h in range(heads)] for layer in range(layers)]


def compressed(model, policy, prompt: list[int], context: int):
    """A prompt cache with `policy` attached, told the prompt's end, fed it whole and compressed; (cache, state)."""
    cache = make_prompt_cache(model)
    state = direct.attach_policy(cache, policy, model)
    state.expect_prompt_end(len(prompt))
    model(mx.array([prompt]), cache=cache)
    direct.apply_policy(cache, context)
    return cache, state


def _masked_reference(model, tokens: list[int], kept, length: int):
    reference = [KVCache() for _ in model.model.layers]
    model(mx.array([tokens]), cache=reference)
    masked = []
    for layer, ref in enumerate(reference):
        allowed = np.zeros((len(kept[layer]), length), bool)
        for head, positions in enumerate(kept[layer]):
            allowed[head, positions] = True
        cell = _MaskedCache(allowed)
        cell.state = ref.state
        masked.append(cell)
    return masked, reference


@pytest.mark.parametrize("new_tokens", [1, 5])
def test_compressed_cache_attends_as_the_full_cache_masked_per_layer_and_head(deep, new_tokens):
    model, _ = deep
    layers, heads = len(model.model.layers), 2
    prompt, more = random_token_ids(70), random_token_ids(new_tokens, seed=9)
    cache, state = compressed(model, PyramidKV(budget=24, window=4, sinks=2, kernel=3, beta=4), prompt, 200)
    assert cache[0].size() == 24 and all(c.sequence.lengths == [24] * layers for c in cache[:1])
    kept = _kept(state, layers, heads)
    counts = [len(kept[layer][0]) for layer in range(layers)]
    assert counts[0] > 24 > counts[-1] and sum(counts) == 24 * layers  # more below, the budget on average
    assert all(len(kept[layer][h]) == counts[layer] for layer in range(layers) for h in range(heads))
    assert state.foreign[0] is not None and state.is_pooled(layers - 1)
    got = model(mx.array([more]), cache=cache)
    masked, reference = _masked_reference(model, prompt, kept, len(prompt))
    want = model(mx.array([more]), cache=masked)
    full = model(mx.array([more]), cache=reference)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-4)
    assert not np.allclose(np.asarray(want), np.asarray(full), atol=1e-3)  # the masks matter: the test can fail


def test_a_later_turn_compresses_again_over_lent_cells(deep):
    """The turn is computed on the compressed cache (checked against the masked full cache), its window votes
    over own and lent cells, and the second compression keeps the budget and attends as its masks say."""
    model, _ = deep
    layers = len(model.model.layers)
    prompt, turn, probe = random_token_ids(70), random_token_ids(30, seed=4), random_token_ids(1, seed=5)
    cache, state = compressed(model, PyramidKV(budget=30, window=4, sinks=2, kernel=3, beta=4), prompt, 110)
    first = _kept(state, layers, 2)
    masked, _ = _masked_reference(model, prompt, first, len(prompt))
    state.expect_prompt_end(len(prompt) + len(turn))
    got = model(mx.array([turn]), cache=cache)
    np.testing.assert_allclose(np.asarray(got), np.asarray(model(mx.array([turn]), cache=masked)), atol=2e-4)
    direct.apply_policy(cache, 110)
    assert cache[0].size() == 30 and state.num_evictions == 2
    kept = _kept(state, layers, 2)
    assert any(len(np.setdiff1d(kept[layer][h], first[layer][h])) for layer in range(layers) for h in range(2))
    for layer, cell in enumerate(masked):  # the reference now masks to the second choice
        cell.allowed = np.zeros((2, len(prompt) + len(turn)), bool)
        for head, positions in enumerate(kept[layer]):
            cell.allowed[head, positions] = True
    got = model(mx.array([probe]), cache=cache)
    np.testing.assert_allclose(np.asarray(got), np.asarray(model(mx.array([probe]), cache=masked)), atol=2e-4)


def test_batched_equals_alone_and_stays_within_the_budget(deep, monkeypatch):
    model, tokenizer = deep
    calls = {"foreign": 0}
    original = pooled_state.attend_columns

    def counting(cells, *args, **kwargs):
        calls["foreign"] += cells.num_local < cells.num_extras  # extras past the layer's own are foreign
        return original(cells, *args, **kwargs)

    monkeypatch.setattr(pooled_state, "attend_columns", counting)
    prompts = [random_token_ids(60, seed=s) for s in range(3)]
    policies = [PyramidKV(budget=30, window=8, beta=4), PyramidKV(budget=0.4, window=4), SnapKV(budget=30, window=8)]
    assert_batched_matches_alone(model, tokenizer, prompts, policies, max_tokens=12, context=72)
    assert calls["foreign"] > 0  # lower layers read their keys from upper layers' cells


def test_on_int8_blocks_the_arena_holds_the_budget(tiny):
    model = tiny_model(seed=11, head_dim=32, num_hidden_layers=3)  # int8 groups of 32 need a head dim of 32
    for layer in model.model.layers:
        layer.self_attn.q_proj.weight = layer.self_attn.q_proj.weight * 4.0
    tokens, physical, lent = int8_run(model, tiny[1], PyramidKV(budget=24, window=4, beta=4),
                                      lambda state: state.foreign[0] is not None)
    assert len(tokens) == 8 and physical and max(physical) == 24 and any(lent)


def test_several_ranks_refuse_it():
    from cortexstream.distributed import policy_problem

    assert "pools_heads" in policy_problem(PyramidKV())


def test_perplexity_and_the_server_take_it(deep):
    assert_perplexity_and_server_take(*deep, "pyramidkv:budget=32,window=8,beta=4", "pyramidkv:beta=0", "beta")


@pytest.mark.parametrize("reduce", ["sum", "max"])
def test_one_masked_call_equals_the_per_head_gathers(monkeypatch, reduce):
    """Short passes attend every cell in one call, each query head masked to its group's cells; it gives the
    per-head path's output and scores (lent cells skipped, foreign cells attended, causal mask, biases)."""
    from cortexstream.engine import pooled_heads
    from cortexstream.engine.pooled_heads import Foreign, Reduce, attend_cells

    rng = np.random.default_rng(4)
    heads, group, slots, dim, queries = 2, 2, 9, 8, 3
    q = mx.array(rng.standard_normal((1, heads * group, queries, dim)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, heads, slots, dim)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, heads, slots, dim)).astype(np.float32))
    owners = rng.integers(0, heads, (heads, slots)).astype(np.int16)
    mine = np.ones((heads, slots), bool)
    mine[1, 2:4] = False  # lent to another layer
    bias = rng.standard_normal((heads, slots)).astype(np.float32)
    far = Foreign(mx.array(rng.standard_normal((3, dim)).astype(np.float32)),
                  mx.array(rng.standard_normal((3, dim)).astype(np.float32)), np.array([0, 1, 1]))
    kind = Reduce.SUM if reduce == "sum" else Reduce.MAX
    record = 0 if kind is Reduce.MAX else 1
    args = (q, k, v, 0.4, "causal", None, owners, bias, 8, record, kind, mine, far)
    flat = attend_cells(*args)
    monkeypatch.setattr(pooled_heads, "FLAT_QUERIES", 0)
    loop = attend_cells(*args)
    for a, b in zip(flat, loop):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    assert np.asarray(flat[1])[1, 2:4].max() == 0  # lent cells get nothing
