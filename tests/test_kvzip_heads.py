"""KVzip at the level of heads: whole contexts for the heads a per-model profile ranks first, sinks and a window for
the others, stored without padding across layers and heads.

The allocation (numpy): fixed keys per head, whole heads in profile order, the last one partly, exactly the budget.
Profiles: files checked and matched by shape, the shipped SmolLM2 profile found, a missing one refused with the
command that measures it; measuring one on the tiny model. On the tiny model: the cache holds the budget between
passes, evicting after every chunk (no reconstruction pass, nothing recorded), and attends as the full cache masked
per (layer, head); batched equals alone; the server and `perplexity` take it.
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from cortexstream.engine import policy_prompt_cache as direct
from cortexstream.errors import InvalidArgumentError
from cortexstream.kv.prompt_cache import make_prompt_cache
from cortexstream.policies import KVzipHeads, SnapKV, parse_policy
from cortexstream.policies.head_profile import find_profile, load_profile, profile_from, save_profile
from cortexstream.policies.kvzip_heads import head_counts
from test_policies_runtime import assert_batched_matches_alone
from test_pyramidkv import _kept
from tiny_models import random_token_ids

TINY_SCORES = np.array([[0.05, 0.9], [0.3, 0.01]])  # layer 1 head 0 second, layer 0 head 1 first


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("profile") / "tiny.json")
    save_profile(profile_from("tiny", TINY_SCORES, 16, "made up for the tests"), path)
    return path


# --- the policy object and its profile --------------------------------------------------------------------------
def test_string_form_and_bad_parameters(profile_path):
    policy = parse_policy(f"kvzip_heads:budget=0.33,window=16,sinks=2,profile={profile_path}")
    assert policy == KVzipHeads(budget=0.33, window=16, sinks=2, profile=profile_path)
    assert parse_policy(policy.describe()) == policy
    for spec, word in (("kvzip_heads:window=0", "window"), ("kvzip_heads:budget=10,window=16", "budget"),
                       ("kvzip_heads:budget=1.5", "budget")):
        with pytest.raises(InvalidArgumentError, match=word):
            parse_policy(spec)


def test_profiles_are_checked_and_matched_by_shape(tmp_path, profile_path):
    assert find_profile(2, 2, profile_path).model == "tiny"
    with pytest.raises(InvalidArgumentError, match="this cache has 3 x 2"):
        find_profile(3, 2, profile_path)
    shipped = find_profile(30, 3)  # SmolLM2-135M
    assert shipped.model.startswith("SmolLM2") and shipped.array().shape == (30, 3) and shipped.source
    with pytest.raises(InvalidArgumentError, match="train head-profile"):
        find_profile(7, 5)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": "x", "layers": 2, "kv_heads": 2, "head_dim": 4, "scores": [[1, 2], [3]],
                               "source": "s"}))
    with pytest.raises(InvalidArgumentError, match="bad.json|scores"):
        load_profile(str(bad))
    with pytest.raises(InvalidArgumentError, match="missing.json"):
        load_profile(str(tmp_path / "missing.json"))


def test_head_counts_give_whole_heads_in_profile_order():
    sizes = np.array([50, 50, 50, 50])
    counts = head_counts(sizes, np.array([0.1, 0.9, 0.5, 0.0]), 10, 120)
    assert counts.tolist() == [10, 50, 50, 10]  # 40 fixed, then head 1 whole (40 more), head 2 with the last 40
    counts = head_counts(sizes, np.array([0.1, 0.9, 0.5, 0.0]), 10, 100)
    assert counts.tolist() == [10, 50, 30, 10]
    assert head_counts(np.array([5, 50]), np.array([1.0, 0.0]), 10, 30).tolist() == [5, 25]  # holds fewer: all
    with pytest.raises(InvalidArgumentError, match="cannot be kept"):
        head_counts(sizes, np.ones(4), 10, 30)


def test_select_cells_keeps_the_best_heads_whole(profile_path):
    policy = KVzipHeads(budget=40, window=8, sinks=2, profile=profile_path)
    layers, heads, n = 2, 2, 100
    positions = np.broadcast_to(np.arange(n), (layers, heads, n)).copy()
    owners = (np.arange(layers)[:, None, None] * heads + np.arange(heads)[None, :, None]) * np.ones(n, np.int64)
    keep = policy.select_cells(n, 1000, None, positions, owners)
    assert keep.sum() == layers * heads * 40
    assert keep[0, 1].all()  # the best head keeps all it holds
    assert keep[1, 0].sum() == 160 - 100 - 10 - 10 and keep[1, 0, :2].all()  # the next one what is left, newest
    for layer, head in ((0, 0), (1, 1)):  # streaming heads: sinks and window
        assert keep[layer, head].sum() == 10 and keep[layer, head, :2].all() and keep[layer, head, -8:].all()
    rng = np.random.default_rng(0)
    perm = rng.permutation(layers * heads * n)  # cells stored anywhere are chosen by owner and position
    moved = [a.reshape(-1)[perm].reshape(layers, heads, n) for a in (positions, owners)]
    chosen = policy.select_cells(n, 1000, None, *moved)
    assert np.array_equal(np.sort(perm[chosen.reshape(-1)]), np.nonzero(keep.reshape(-1))[0])
    assert policy.select_cells(40, 1000, None, positions[..., :40], owners[..., :40]) is None


# --- on the tiny model ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("new_tokens", [1, 5])
def test_the_cache_holds_the_budget_and_attends_as_the_full_cache_masked(sharp, profile_path, new_tokens):
    """Evicting after every chunk (no prompt end needed, nothing recorded, no reconstruction), each chunk computed
    on the compressed cache gives the logits of a full cache masked per (layer, head) to what was kept."""
    from test_adakv import _MaskedCache

    model, _ = sharp
    prompt, more = random_token_ids(70), random_token_ids(new_tokens, seed=9)
    policy = KVzipHeads(budget=24, window=6, sinks=2, profile=profile_path)
    cache = make_prompt_cache(model)
    state = direct.attach_policy(cache, policy, model)
    masked = [_MaskedCache(np.ones((2, 0), bool)) for _ in model.model.layers]
    sizes, seen = [], 0
    for start in range(0, len(prompt), 16):
        piece = mx.array([prompt[start:start + 16]])
        np.testing.assert_allclose(np.asarray(model(piece, cache=cache)), np.asarray(model(piece, cache=masked)),
                                   atol=2e-4)
        direct.apply_policy(cache, 200)
        seen += piece.shape[1]
        sizes.append(cache[0].size())
        for layer, cell in enumerate(masked):  # the reference masks what the policy dropped
            cell.allowed = np.zeros((2, seen), bool)
            for head, positions in enumerate(_kept(state, 2, 2)[layer]):
                cell.allowed[head, positions] = True
    assert max(sizes) == 24 and state.num_evictions >= 3 and state.reconstruction is None
    kept = _kept(state, 2, 2)
    assert len(kept[0][1]) == 70 and len(kept[0][0]) == len(kept[1][1]) == 8  # retrieval head whole, others 2 + 6
    assert 8 < len(kept[1][0]) < 70  # the next head: what the budget left, its newest
    got = model(mx.array([more]), cache=cache)
    np.testing.assert_allclose(np.asarray(got), np.asarray(model(mx.array([more]), cache=masked)), atol=2e-4)
    plain = make_prompt_cache(model)
    model(mx.array([prompt]), cache=plain)
    assert not np.allclose(np.asarray(got), np.asarray(model(mx.array([more]), cache=plain)), atol=1e-3)


def test_batched_equals_alone_and_stays_within_the_budget(sharp, profile_path):
    model, tokenizer = sharp
    prompts = [random_token_ids(60, seed=s) for s in range(3)]
    policies = [KVzipHeads(budget=30, window=8, profile=profile_path),
                KVzipHeads(budget=0.4, window=4, profile=profile_path), SnapKV(budget=30, window=8)]
    assert_batched_matches_alone(model, tokenizer, prompts, policies, max_tokens=12, context=72)


def test_perplexity_and_the_server_take_it(sharp, profile_path):
    from test_adakv import assert_perplexity_and_server_take

    # the tiny model has no shipped profile: without profile= it is refused with the command that makes one
    assert_perplexity_and_server_take(*sharp, f"kvzip_heads:budget=32,window=8,profile={profile_path}",
                                      "kvzip_heads:budget=32,window=8", "train head-profile")


def test_measuring_a_profile_on_the_tiny_model(sharp, tmp_path):
    from cortexstream.training.head_profile.measure import measure_profile

    model, tokenizer = sharp
    texts = [random_token_ids(120, seed=s) for s in range(2)]
    scores = measure_profile(model, tokenizer, texts, chunk=32, window=16)
    assert scores.shape == (2, 2) and np.isfinite(scores).all() and (scores > 0).all()
    again = measure_profile(model, tokenizer, texts[:1], chunk=32, window=16)
    assert not np.allclose(scores, again)  # each text contributes: the mean moved
    path = str(tmp_path / "p.json")
    save_profile(profile_from("tiny", scores, 16, "test"), path)
    assert np.allclose(load_profile(path).array(), scores)


def test_the_train_command_writes_a_profile_the_policy_uses(tiny_gguf, tiny, tmp_path, capsys):
    from cortexstream.cli.main import main

    text = tmp_path / "corpus.txt"
    text.write_text(" ".join(f"Sentence {i} tells of rivers, hills and the towns beside them." for i in range(60)),
                    encoding="utf-8")
    out = str(tmp_path / "tiny.json")
    assert main(["train", "head-profile", "--model", tiny_gguf, "--source", str(text), "--skip", "50",
                 "--seq-len", "120", "--texts", "2", "--chunk", "32", "--out", out, "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "agreement between texts" in printed and out in printed
    profile = load_profile(out)
    assert profile.array().shape == (2, 2) and profile.head_dim == 16 and "corpus.txt" in profile.source
    model, tokenizer = tiny
    cache = make_prompt_cache(model)
    state = direct.attach_policy(cache, KVzipHeads(budget=24, window=6, profile=out), model)
    model(mx.array([random_token_ids(60)]), cache=cache)
    direct.apply_policy(cache, 200)
    assert cache[0].size() == 24 and state.num_evictions == 1
    assert main(["train", "head-profile", "--model", tiny_gguf, "--texts", "0", "--out", out]) == 1
