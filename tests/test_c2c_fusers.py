"""C2C fusers on tiny random models: gate 0 is the identity (bit-exact), tenants, redaction, shapes across models of
different head counts / head dims / depths, last-aligned layer mapping, and decoding from fused caches."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache

from cortexstream import make_prompt_cache
from cortexstream.c2c import C2CFuser, C2CProjectorFuser, last_aligned
from cortexstream.c2c.pipeline import fused_prompt_cache, prefill
from cortexstream.errors import InvalidArgumentError
from tiny_models import tiny_model

IDS = [5, 17, 42, 99, 7, 123, 64, 250, 31, 88, 12, 200]
SMALL = dict(hidden_dim=32, intermediate_dim=48)
SHAPES = {  # receiver = tiny default: 2 layers, 2 KV heads x 16
    "same": {},
    "heads": dict(num_key_value_heads=4),
    "head_dim": dict(head_dim=32, num_attention_heads=2, num_key_value_heads=1),
    "deeper": dict(num_hidden_layers=5, num_key_value_heads=1),
    "shallower": dict(num_hidden_layers=1, head_dim=8, num_attention_heads=8, num_key_value_heads=4),
}


def bits(cache) -> list[tuple[np.ndarray, np.ndarray]]:
    """Raw bit patterns (so -0.0 != +0.0 and NaN payloads count)."""
    return [(np.array(c.state[0]).view(np.uint32).copy(), np.array(c.state[1]).view(np.uint32).copy()) for c in cache]


def filled(model, ids=IDS, negative_zeros=False):
    cache = make_prompt_cache(model)
    prefill(model, ids, cache)
    if negative_zeros:  # a naive (1-g)K + gP turns these into +0.0: the bit-exact checks must see that
        for c in cache:
            k, v = c.state
            c.state = (mx.where(mx.arange(k.shape[-1]) == 0, mx.array(-0.0, dtype=k.dtype), k), v)
    return cache


@pytest.fixture(scope="module")
def receiver():
    return tiny_model(1)


@pytest.fixture(scope="module")
def sharer():
    return tiny_model(2)


def open_projector_fuser(src_model, tgt_model, **kw):
    fuser = C2CProjectorFuser.from_models(src_model, tgt_model, **SMALL, **kw)
    for p in fuser.projectors:
        p.key_gate_logit, p.value_gate_logit = mx.array(1.0), mx.array(1.0)
    return fuser


# --- gate 0 -------------------------------------------------------------------------------------------------------
def test_lowrank_gate_zero_is_bit_identical_and_open_gate_changes(receiver, sharer):
    fuser = C2CFuser(n_layers=2, head_dim=16, rank=4)
    fuser.close_gates()
    tgt = filled(receiver, negative_zeros=True)
    before = bits(tgt)
    assert fuser.fuse(filled(sharer), tgt) is tgt
    assert all(np.array_equal(a, b) for pair in zip(before, bits(tgt)) for a, b in zip(*pair))
    assert fuser.last_released_rows == 0
    fuser.gate.alpha = mx.array([-30.0, -30.0])  # tiny but nonzero gate: must fuse (the test can fail)
    fuser.fuse(filled(sharer), tgt)
    assert not all(np.array_equal(a[0], b[0]) for a, b in zip(before, bits(tgt)))


def test_projector_gate_zero_default_is_bit_identical(receiver):
    other = tiny_model(3, **SHAPES["deeper"])
    fuser = C2CProjectorFuser.from_models(other, receiver, **SMALL)  # untrained: logits 0 -> hard gate closed
    tgt = filled(receiver, negative_zeros=True)
    before = bits(tgt)
    fuser.fuse(filled(other), tgt)
    assert all(np.array_equal(a, b) for pair in zip(before, bits(tgt)) for a, b in zip(*pair))
    fuser.projectors[-1].value_gate_logit = mx.array(0.5)  # only V of the last layer opens
    fuser.fuse(filled(other), tgt)
    after = bits(tgt)
    assert np.array_equal(after[1][0], before[1][0]) and not np.array_equal(after[1][1], before[1][1])
    assert np.array_equal(after[0][0], before[0][0]) and np.array_equal(after[0][1], before[0][1])


# --- tenants --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("src_t,tgt_t", [("alice", "bob"), (None, "bob"), ("alice", None)])
def test_tenant_mismatch_raises_before_reading(receiver, sharer, src_t, tgt_t):
    fuser = C2CFuser(n_layers=2, head_dim=16, rank=4)
    empty = make_prompt_cache(receiver)  # unreadable: PermissionError must come first
    with pytest.raises(PermissionError):
        fuser.fuse(empty, empty, src_tenant=src_t, tgt_tenant=tgt_t)
    tgt = filled(receiver)
    before = bits(tgt)
    with pytest.raises(PermissionError):
        fuser.fuse(filled(sharer), tgt, src_tenant=src_t, tgt_tenant=tgt_t)
    assert all(np.array_equal(a, b) for pair in zip(before, bits(tgt)) for a, b in zip(*pair))
    fuser.fuse(filled(sharer), tgt, src_tenant=src_t, tgt_tenant=tgt_t, allow_cross_tenant=True)
    assert not np.array_equal(before[0][0], bits(tgt)[0][0])


def test_same_tenant_is_allowed(receiver, sharer):
    C2CFuser(n_layers=2, head_dim=16, rank=4).fuse(filled(sharer), filled(receiver), src_tenant="a", tgt_tenant="a")


# --- redaction ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["lowrank", "projector"])
@pytest.mark.parametrize("mask", [[0, 1, 1], [1, 0, 1], [True, True, False]])
def test_redacted_layers_untouched_others_change(kind, mask):
    tgt_model = tiny_model(4, num_hidden_layers=3)
    src_model = tiny_model(5, num_hidden_layers=3)
    fuser = (C2CFuser(n_layers=3, head_dim=16, rank=4) if kind == "lowrank"
             else open_projector_fuser(src_model, tgt_model))
    tgt = filled(tgt_model, negative_zeros=True)
    before = bits(tgt)
    fuser.fuse(filled(src_model), tgt, layer_mask=mask)
    after = bits(tgt)
    for layer, keep in enumerate(mask):
        same = np.array_equal(before[layer][0], after[layer][0]) and np.array_equal(before[layer][1], after[layer][1])
        assert same != bool(keep), f"layer {layer} mask {keep}"


@pytest.mark.parametrize("mask", [[1, 0], [1, 0, 1, 1], [0.5, 1, 1]])
def test_bad_masks_raise(mask):
    m = tiny_model(4, num_hidden_layers=3)
    with pytest.raises(InvalidArgumentError):
        C2CFuser(n_layers=3, head_dim=16, rank=4).fuse(filled(m), filled(m), layer_mask=mask)


# --- shapes and layer alignment -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(SHAPES))
def test_projector_fuser_shapes_across_models(receiver, name):
    src_model = tiny_model(6, **SHAPES[name])
    fuser = open_projector_fuser(src_model, receiver)
    src, tgt = filled(src_model), filled(receiver)
    shapes = [(c.state[0].shape, c.state[1].shape, c.state[0].dtype) for c in tgt]
    fuser.fuse(src, tgt)
    assert [(c.state[0].shape, c.state[1].shape, c.state[0].dtype) for c in tgt] == shapes
    assert fuser.last_released_rows == 2 * 2 * len(IDS)  # every layer, K and V, every token
    # and the other way round: the tiny receiver as sharer into a model of another shape
    back = open_projector_fuser(receiver, src_model)
    tgt2 = filled(src_model)
    shapes2 = [c.state[0].shape for c in tgt2]
    back.fuse(filled(receiver), tgt2)
    assert [c.state[0].shape for c in tgt2] == shapes2


def test_last_aligned_mapping_is_what_the_fuser_uses():
    assert last_aligned(3, 5) == {0: [2], 1: [3], 2: [4]}
    assert last_aligned(4, 2) == {0: [0], 1: [0], 2: [0], 3: [1]}  # reference clamps to sharer layer 0
    assert last_aligned(4, 2, clamp=False) == {2: [0], 3: [1]}
    assert last_aligned(11, 33, k=2)[10] == [32, 31] and last_aligned(11, 33)[9] == [31]
    tgt_model = tiny_model(7, num_hidden_layers=3)
    src_model = tiny_model(8, num_hidden_layers=5, num_key_value_heads=1)
    fuser = open_projector_fuser(src_model, tgt_model)
    assert {t: s for t, (s, _) in fuser.layer_map.items()} == {0: 2, 1: 3, 2: 4}
    src = [tuple(c.state) for c in filled(src_model)]
    tgt = [tuple(c.state) for c in filled(tgt_model)]
    fused = fuser.fused_layers(src, tgt)
    for t, s in ((0, 2), (1, 3), (2, 4)):
        p = fuser.projectors[fuser.layer_map[t][1]]
        want = p(src[s], tgt[t])
        wrong = p(src[(s + 1) % 5], tgt[t])
        assert mx.array_equal(fused[t][0], want[0]) and mx.array_equal(fused[t][1], want[1])
        assert not mx.allclose(fused[t][0], wrong[0])
    shallow = C2CProjectorFuser.from_models(tiny_model(9, num_hidden_layers=1), tgt_model, clamp=False, **SMALL)
    assert shallow.layer_map == {2: (0, 0)} and shallow.open_layers(1) == [False, False, False]


def test_lowrank_needs_same_heads_and_aligned_tokens(receiver):
    fuser = C2CFuser(n_layers=2, head_dim=16, rank=4)
    with pytest.raises(InvalidArgumentError, match="C2CProjectorFuser"):
        fuser.fuse(filled(tiny_model(6, **SHAPES["heads"])), filled(receiver))
    with pytest.raises(InvalidArgumentError, match="C2CProjectorFuser"):
        fuser.fuse(filled(tiny_model(6, **SHAPES["head_dim"])), filled(receiver))
    with pytest.raises(InvalidArgumentError, match="token-aligned"):
        fuser.fuse(filled(receiver, IDS[:-2]), filled(receiver))
    with pytest.raises(InvalidArgumentError, match="layers"):
        C2CFuser(n_layers=3, head_dim=16, rank=4).fuse(filled(receiver), filled(receiver))
    deeper = tiny_model(6, num_hidden_layers=4)  # same head shape, more layers: last-aligned
    assert fuser.layer_map(4) == {0: 2, 1: 3}
    fuser.fuse(filled(deeper), filled(receiver))


# --- decoding from fused caches -------------------------------------------------------------------------------------
def greedy(model, prompt, cache, n=6):
    out = []
    for (token, _), _ in zip(generate_step(mx.array(prompt, dtype=mx.uint32), model, prompt_cache=cache), range(n)):
        out.append(int(token))
    return out


def test_fused_cache_decodes_with_generate_step(receiver, sharer):
    fuser = C2CFuser(n_layers=2, head_dim=16, rank=4)
    fused = fuser.fuse(filled(sharer, IDS[:-1]), filled(receiver, IDS[:-1]))
    got = greedy(receiver, IDS[-1:], fused)
    assert len(got) == 6
    # Reference: the same fused K/V in a plain mlx-lm KVCache must decode to the same tokens.
    ref = []
    for c in fused:
        kv = KVCache()
        kv.state = (*(mx.array(np.array(a)) for a in c.state), len(IDS) - 1)
        ref.append(kv)
    assert greedy(receiver, IDS[-1:], ref) == got


def test_fuse_into_mlx_lm_kvcache_equals_arena_cache(receiver, sharer):
    from mlx_lm.models.cache import make_prompt_cache as mlx_lm_cache

    fuser = C2CFuser(n_layers=2, head_dim=16, rank=4)
    arena_cache, plain = filled(receiver, IDS[:-1]), mlx_lm_cache(receiver)
    prefill(receiver, IDS[:-1], plain)
    fuser.fuse(filled(sharer, IDS[:-1]), arena_cache)
    assert fuser.fuse(filled(sharer, IDS[:-1]), plain) is plain
    for a, p in zip(arena_cache, plain):
        assert p.offset == len(IDS) - 1
        assert mx.array_equal(a.state[0], p.state[0][..., : p.offset, :])
    assert greedy(receiver, IDS[-1:], plain) == greedy(receiver, IDS[-1:], arena_cache)


def test_unsupported_or_empty_caches_raise(receiver):
    from mlx_lm.models.cache import KVCache as PlainCache, RotatingKVCache

    fuser = C2CFuser(n_layers=2, head_dim=16, rank=4)
    with pytest.raises(InvalidArgumentError, match="no tokens"):
        fuser.fuse(filled(receiver), [PlainCache(), PlainCache()])
    rotating = [RotatingKVCache(max_size=8) for _ in range(2)]
    receiver(mx.array(IDS)[None], cache=rotating)
    with pytest.raises(InvalidArgumentError, match="RotatingKVCache"):
        fuser.fuse(filled(receiver), rotating)


def test_pipeline_fuses_all_but_last_token_across_shapes(receiver):
    sharer_model = tiny_model(6, **SHAPES["deeper"])
    closed = C2CProjectorFuser.from_models(sharer_model, receiver, **SMALL)
    cache, last = fused_prompt_cache(receiver, IDS, sharer_model, IDS, closed)
    assert cache[0].size() == len(IDS) - 1 and last.tolist() == IDS[-1:]
    plain = make_prompt_cache(receiver)
    assert greedy(receiver, IDS[-1:], cache) == greedy(receiver, IDS, plain)  # closed gates: plain decoding
    fuser = open_projector_fuser(sharer_model, receiver)
    cache, last = fused_prompt_cache(receiver, IDS, sharer_model, IDS, fuser)
    ref = filled(receiver, IDS[:-1])
    logits_fused = receiver(last[None], cache=cache)
    logits_plain = receiver(last[None], cache=ref)
    assert not mx.allclose(logits_fused, logits_plain, atol=1e-4)
    with pytest.raises(PermissionError):
        fused_prompt_cache(receiver, IDS, sharer_model, IDS, fuser, src_tenant="a", tgt_tenant="b")
    with pytest.raises(InvalidArgumentError, match="align"):
        fused_prompt_cache(receiver, IDS, sharer_model, IDS[:-1], fuser)


# --- trainability (for the later training work) ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["lowrank", "projector"])
def test_fused_layers_train_with_mlx_autodiff(receiver, sharer, kind):
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten

    fuser = (C2CFuser(n_layers=2, head_dim=16, rank=4) if kind == "lowrank"
             else C2CProjectorFuser.from_models(sharer, receiver, **SMALL))
    fuser.train()
    src = [tuple(c.state) for c in filled(sharer)]
    tgt = [tuple(c.state) for c in filled(receiver)]
    goal = [(k * 0.5 + 0.1, v * 0.5 - 0.1) for k, v in src]  # any fixed regression target

    def loss_fn(model, step_key):
        kwargs = {"key": step_key} if kind == "projector" else {}
        fused = model.fused_layers(src, tgt, **kwargs)
        return sum(mx.mean((fk - gk) ** 2) + mx.mean((fv - gv) ** 2) for (fk, fv), (gk, gv) in zip(fused, goal))

    grad_fn = nn.value_and_grad(fuser, loss_fn)
    opt = optim.Adam(learning_rate=1e-2)
    losses = []
    for step in range(8):
        loss, grads = grad_fn(fuser, mx.random.key(step))
        flat = dict(tree_flatten(grads))
        gate_keys = [k for k in flat if k.endswith("gate_logit") or k == "gate.alpha"]
        assert gate_keys and all(float(mx.abs(flat[k]).sum()) > 0 for k in gate_keys)
        opt.update(fuser, grads)
        mx.eval(fuser.parameters(), opt.state)
        losses.append(float(loss))
    assert losses[-1] < losses[0]
