"""DP noise on fusion: clipping bounds each row's norm, the noise has the stated std, it is off by default, redacted
layers stay bit-identical under it, and the epsilon accounting follows its formula."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from cortexstream import make_prompt_cache
from cortexstream.c2c import C2CFuser, C2CProjectorFuser, DPConfig, dp_epsilon
from cortexstream.c2c.pipeline import prefill
from cortexstream.c2c.safety import clip_rows, privatize
from cortexstream.errors import InvalidArgumentError
from tiny_models import tiny_model

IDS = list(range(20, 84))  # 64 tokens


def row_norms(x: mx.array) -> np.ndarray:
    b, h, n, d = x.shape
    return np.linalg.norm(np.array(x).transpose(0, 2, 1, 3).reshape(b * n, h * d), axis=-1)


def test_clipping_bounds_every_row_and_keeps_small_rows():
    mx.random.seed(0)
    delta = mx.random.normal((1, 4, 50, 8)) * mx.linspace(0.01, 5.0, 50)[None, None, :, None]
    norms = row_norms(delta)
    clipped = clip_rows(delta, 2.0)
    out = row_norms(clipped)
    assert out.max() <= 2.0 * (1 + 1e-5)
    small, big = norms <= 2.0, norms > 2.0
    assert small.any() and big.any()
    np.testing.assert_allclose(np.array(clipped).transpose(0, 2, 1, 3).reshape(50, -1)[small],
                               np.array(delta).transpose(0, 2, 1, 3).reshape(50, -1)[small], rtol=1e-6)
    np.testing.assert_allclose(out[big], 2.0, rtol=1e-5)  # direction kept, length = C


def test_privatize_without_noise_only_clips():
    target = mx.zeros((1, 2, 10, 4))
    fused = mx.full((1, 2, 10, 4), 3.0)  # row norm sqrt(8) * 3
    out = privatize(fused, target, DPConfig(clip_norm=1.0, noise_multiplier=0.0))
    assert row_norms(out - target).max() == pytest.approx(1.0, rel=1e-5)


def test_noise_has_the_stated_std():
    target = mx.random.normal((1, 4, 256, 32), key=mx.random.key(1))
    cfg = DPConfig(clip_norm=0.5, noise_multiplier=1.3, seed=7)
    noise = np.array(privatize(target + 0.0, target, cfg, key=mx.random.key(cfg.seed)) - target).ravel()
    # 32768 samples: the std estimate is within ~1.2% (3 sigma); the stated std is z * C = 0.65
    assert noise.std() == pytest.approx(0.65, rel=0.02)
    assert abs(noise.mean()) < 3 * 0.65 / math.sqrt(noise.size)
    assert noise.std() != pytest.approx(0.5, rel=0.05) and noise.std() != pytest.approx(1.3, rel=0.05)


def filled(model, ids=IDS):
    cache = make_prompt_cache(model)
    prefill(model, ids, cache)
    return cache


def states(cache):
    return [(np.array(c.state[0]), np.array(c.state[1])) for c in cache]


def test_dp_through_fuse_pure_noise_when_projection_adds_nothing():
    receiver, sharer = tiny_model(1), tiny_model(2, num_hidden_layers=3)
    fuser = C2CProjectorFuser.from_models(sharer, receiver, hidden_dim=32, intermediate_dim=32, zero_init=True)
    for p in fuser.projectors:
        p.key_gate_logit, p.value_gate_logit = mx.array(1.0), mx.array(1.0)
    tgt = filled(receiver)
    before = states(tgt)
    fuser.fuse(filled(sharer), tgt, dp=DPConfig(clip_norm=0.1, noise_multiplier=2.0, seed=3))
    noise = np.concatenate([(a - b).ravel() for pa, pb in zip(states(tgt), before) for a, b in zip(pa, pb)])
    assert noise.std() == pytest.approx(0.2, rel=0.03)
    assert fuser.last_released_rows == 2 * 2 * len(IDS)


def test_noise_off_by_default_and_seeded_noise_reproducible():
    receiver, sharer = tiny_model(1), tiny_model(2)
    fuser = C2CFuser(n_layers=2, head_dim=16, rank=4)
    a, b = filled(receiver), filled(receiver)
    pure = fuser.fused_layers([tuple(c.state) for c in filled(sharer)], [tuple(c.state) for c in a])
    fuser.fuse(filled(sharer), a)
    fuser.fuse(filled(sharer), b)
    for (ka, va), (kb, vb), (kp, vp) in zip(states(a), states(b), pure):
        assert np.array_equal(ka, kb) and np.array_equal(va, vb) and np.array_equal(ka, np.array(kp))
    cfg = DPConfig(clip_norm=1.0, noise_multiplier=0.5, seed=11)
    c, d = filled(receiver), filled(receiver)
    fuser.fuse(filled(sharer), c, dp=cfg)
    fuser.fuse(filled(sharer), d, dp=cfg)
    assert all(np.array_equal(x[0], y[0]) for x, y in zip(states(c), states(d)))
    assert not np.array_equal(states(c)[0][0], states(a)[0][0])


def test_redacted_layers_get_no_noise():
    receiver, sharer = tiny_model(1, num_hidden_layers=3), tiny_model(2, num_hidden_layers=3)
    tgt = filled(receiver)
    before = states(tgt)
    fuser = C2CFuser(n_layers=3, head_dim=16, rank=4)
    fuser.fuse(filled(sharer), tgt, layer_mask=[1, 0, 1], dp=DPConfig(clip_norm=1.0, noise_multiplier=1.0, seed=0))
    after = states(tgt)
    assert np.array_equal(before[1][0].view(np.uint32), after[1][0].view(np.uint32))
    assert np.array_equal(before[1][1].view(np.uint32), after[1][1].view(np.uint32))
    assert not np.array_equal(before[0][0], after[0][0])
    assert fuser.last_released_rows == 2 * 2 * len(IDS)


def test_epsilon_accounting():
    rho = 2 * 100 / 4.0**2
    assert dp_epsilon(4.0, 100, 1e-5) == pytest.approx(rho + 2 * math.sqrt(rho * math.log(1e5)))
    assert dp_epsilon(8.0, 100) < dp_epsilon(4.0, 100) < dp_epsilon(4.0, 200)
    assert dp_epsilon(0.0, 10) == math.inf and dp_epsilon(1.0, 0) == 0.0
    with pytest.raises(InvalidArgumentError):
        dp_epsilon(1.0, 10, delta=0.0)


@pytest.mark.parametrize("kwargs", [dict(clip_norm=0.0), dict(clip_norm=-1.0), dict(clip_norm=float("inf")),
                                    dict(clip_norm=1.0, noise_multiplier=-0.1)])
def test_dp_config_validation(kwargs):
    with pytest.raises(InvalidArgumentError):
        DPConfig(**kwargs)
