"""C2C training: the distillation task is consistent (an exact fuser reaches KL 0), training lowers the loss,
resume is exact, example sets are cached only under the same description."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from cortexstream.c2c import C2CFuser, C2CProjectorFuser
from cortexstream.training.c2c.data import example_set, size, take
from cortexstream.training.c2c.distill import Split
from cortexstream.training.c2c.train import TrainConfig, evaluate, loss_terms, train_fuser
from cortexstream.training.loop import epoch_batch
from tiny_models import tiny_model

SPLIT = Split(context=12, bridge=6, target=5)


@pytest.fixture(scope="module")
def pair():
    receiver = tiny_model(21)
    sharer = tiny_model(22, num_hidden_layers=3, num_key_value_heads=1, head_dim=32, num_attention_heads=2)
    return receiver, sharer


def windows(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 250, SPLIT.length).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def same_data(pair):
    receiver, _ = pair
    return example_set(None, receiver, receiver, windows(8), SPLIT, {"test": "same"})


@pytest.fixture(scope="module")
def cross_data(pair):
    receiver, sharer = pair
    return example_set(None, receiver, sharer, windows(8, 1), SPLIT, {"test": "cross"})


def test_without_fusion_the_receiver_is_far_from_the_oracle(pair, same_data):
    receiver, _ = pair
    plain = evaluate(None, receiver, same_data)
    assert plain["kl"] > 1e-3  # the context A matters, or the task would be empty


def test_a_copy_fuser_rebuilds_the_oracle_cache_and_lowers_kl(pair, same_data):
    """Same model: the sharer's B cache is the oracle's; rotating K back by the fixed RoPE offset |A| (V as is)
    must give, in every layer, exactly the K/V the oracle holds at B (at the receiver's positions), and bring
    the receiver closer to the oracle than no fusion. Proves positions, caches and the loss agree."""
    from mlx_lm.models.cache import KVCache

    receiver, _ = pair
    head_dim = receiver.args.head_dim
    rope = receiver.model.layers[0].self_attn.rope
    basis = mx.eye(head_dim)[:, None, None, :]  # each basis vector as its own batch row, all at one position
    rot_t = rope(basis, offset=SPLIT.context)[:, 0, 0, :]  # row j = R(|A|) e_j, so the matrix is R(|A|)^T
    fuser = C2CFuser(n_layers=len(receiver.layers), head_dim=head_dim, rank=head_dim, gate_init=math.inf)
    for p in fuser.projectors:
        p.k_down.weight, p.k_up.weight = rot_t, mx.eye(head_dim)
        p.v_down.weight, p.v_up.weight = mx.eye(head_dim), mx.eye(head_dim)
    ids = windows(1)[0]
    head = SPLIT.context + SPLIT.bridge - 1
    oracle = [KVCache() for _ in receiver.layers]
    receiver(mx.array(ids[:head])[None], cache=oracle)
    one = take(same_data, [0])
    fused = fuser.fused_layers(one["src"], one["tgt"])
    for layer, ((k, v), cache) in enumerate(zip(fused, oracle)):
        ok = cache.state[0][..., SPLIT.context:head, :]
        ov = cache.state[1][..., SPLIT.context:head, :]
        if layer == 0:  # layer 0's K depends on token and position only: the rotation must equal the receiver's
            assert mx.allclose(k, one["tgt"][0][0], atol=1e-5)
        assert mx.allclose(v, ov, atol=1e-6)
        assert mx.allclose(k, mx.einsum("bhnd,ed->bhne", ok, rot_t), atol=1e-6)
    assert evaluate(fuser, receiver, same_data)["kl"] < evaluate(None, receiver, same_data)["kl"]


def test_low_rank_training_lowers_heldout_kl(pair, same_data, tmp_path):
    receiver, _ = pair
    train, held = take(same_data, range(6)), take(same_data, range(6, 8))
    fuser = C2CFuser(n_layers=len(receiver.layers), head_dim=receiver.args.head_dim, rank=8, gate_init=-3.0)
    before = evaluate(fuser, receiver, held)["kl"]
    cfg = TrainConfig(steps=40, batch_size=3, learning_rate=1e-2, warmup=2, checkpoint_every=40)
    fuser, state = train_fuser(fuser, receiver, train, str(tmp_path), config=cfg, progress=False)
    first, last = state["history"][0][2], np.mean([h[2] for h in state["history"][-5:]])
    assert last < 0.7 * first
    assert evaluate(fuser, receiver, held)["kl"] < before


def test_projector_training_lowers_loss_across_models(pair, cross_data, tmp_path):
    receiver, sharer = pair
    fuser = C2CProjectorFuser.from_models(sharer, receiver, hidden_dim=32, intermediate_dim=32, dropout=0.0)
    cfg = TrainConfig(steps=40, batch_size=4, learning_rate=3e-3, warmup=2, checkpoint_every=40, align_weight=0.5)
    _, state = train_fuser(fuser, receiver, cross_data, str(tmp_path), config=cfg, progress=False)
    first = np.mean([h[1] for h in state["history"][:3]])
    last = np.mean([h[1] for h in state["history"][-3:]])
    assert last < first


@pytest.mark.parametrize("kind", ["lowrank", "projector"])
def test_resume_is_exact(pair, same_data, cross_data, tmp_path, kind):
    receiver, sharer = pair

    def make():
        mx.random.seed(5)
        if kind == "lowrank":
            return C2CFuser(n_layers=len(receiver.layers), head_dim=receiver.args.head_dim, rank=4, gate_init=-2.0)
        return C2CProjectorFuser.from_models(sharer, receiver, hidden_dim=16, intermediate_dim=16, dropout=0.2)

    data = same_data if kind == "lowrank" else cross_data
    cfg = TrainConfig(steps=6, batch_size=3, learning_rate=5e-3, warmup=2, checkpoint_every=2)
    straight, s1 = train_fuser(make(), receiver, data, str(tmp_path / "a"), config=cfg, progress=False)
    train_fuser(make(), receiver, data, str(tmp_path / "b"), config=cfg, progress=False, stop_at=3)
    resumed, s2 = train_fuser(make(), receiver, data, str(tmp_path / "b"), config=cfg, progress=False)
    assert s1["history"] == s2["history"]
    for (name, a), (_, b) in zip(_flat(straight), _flat(resumed)):
        assert np.array_equal(np.array(a), np.array(b)), name


def _flat(module):
    from mlx.utils import tree_flatten

    return tree_flatten(module.parameters())


def test_resume_refuses_another_config(pair, same_data, tmp_path):
    receiver, _ = pair
    fuser = C2CFuser(n_layers=len(receiver.layers), head_dim=receiver.args.head_dim, rank=4, gate_init=-2.0)
    train_fuser(fuser, receiver, same_data, str(tmp_path), config=TrainConfig(steps=2, batch_size=2),
                progress=False)
    with pytest.raises(ValueError, match="config"):
        train_fuser(fuser, receiver, same_data, str(tmp_path), config=TrainConfig(steps=2, batch_size=3),
                    progress=False)


def test_batches_cover_each_epoch_once():
    seen = sorted(i for step in range(4) for i in epoch_batch(step, 8, 2, seed=3).tolist())
    assert seen == list(range(8))
    assert epoch_batch(5, 8, 2, 3).tolist() == epoch_batch(5, 8, 2, 3).tolist()


def test_example_sets_are_reused_only_for_the_same_description(pair, tmp_path):
    receiver, _ = pair
    path = str(tmp_path / "ex.safetensors")
    a = example_set(path, receiver, receiver, windows(2), SPLIT, {"data": "x"})
    b = example_set(path, receiver, receiver, windows(2, seed=9), SPLIT, {"data": "x"})  # same description: cached
    assert np.array_equal(np.array(a["inputs"]), np.array(b["inputs"]))
    c = example_set(path, receiver, receiver, windows(2, seed=9), SPLIT, {"data": "y"})
    assert not np.array_equal(np.array(a["inputs"]), np.array(c["inputs"]))
    assert size(c) == 2


def test_loss_terms_have_gradients_only_for_the_fuser(pair, same_data):
    import mlx.nn as nn

    receiver, _ = pair
    fuser = C2CFuser(n_layers=len(receiver.layers), head_dim=receiver.args.head_dim, rank=4, gate_init=-1.0)
    grads = nn.value_and_grad(fuser, lambda f, b: loss_terms(f, receiver, b)["kl"])(fuser, take(same_data, [0, 1]))[1]
    from mlx.utils import tree_flatten

    assert any(float(mx.abs(g).sum()) > 0 for _, g in tree_flatten(grads))
