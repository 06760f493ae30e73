"""Force-matching loss: the autodiff Jacobian against central finite differences (float32) and the closed form,
Hutchinson against the exact norm, and the loss at its reference points (exact bead 0, evicted window 1)."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from cortexstream.training.sidecar.loss import (attend, attention_jacobian, basis_tangents, force_matching_loss,
                                       jacobian_products, outputs, pooling_beads, rademacher_tangents)

D, N, F, B = 8, 5, 3, 4
SCALE = 1.0 / math.sqrt(D)


def _batch(seed: int = 0, n: int = N) -> dict[str, mx.array]:
    rng = np.random.default_rng(seed)
    g = lambda *s: mx.array(rng.normal(size=s).astype(np.float32))  # noqa: E731
    return {"window_keys": g(B, n, D) * 2, "window_values": g(B, n, D), "queries": g(B, F, D) * 2,
            "rest_keys": g(B, F, D), "rest_values": g(B, F, D), "rest_bias": g(B, F) + 2.0,
            "group": mx.zeros((B,), mx.int32)}


def _finite_difference(fn, q: mx.array, eps: float) -> np.ndarray:
    """Central differences of fn: [..., Dk] -> [..., Dv], one coordinate of q at a time: [..., Dv, Dk]."""
    cols = []
    for i in range(q.shape[-1]):
        step = mx.zeros_like(q)
        step[..., i] = eps
        cols.append((np.array(fn(q + step)) - np.array(fn(q - step))) / (2 * eps))
    return np.stack(cols, axis=-1)


def test_attention_jacobian_matches_finite_differences_float32():
    rng = np.random.default_rng(1)
    q = mx.array(rng.normal(size=(6, D)).astype(np.float32))
    keys = mx.array(rng.normal(size=(6, 7, D)).astype(np.float32) * 2)
    values = mx.array(rng.normal(size=(6, 7, D)).astype(np.float32))
    bias = mx.array(rng.normal(size=(6, 7)).astype(np.float32))
    jac = np.array(attention_jacobian(q, keys, values, bias, SCALE))
    fd = _finite_difference(lambda x: attend(x, keys, values, bias, SCALE), q, eps=1e-2)
    # float32 central differences: truncation ~eps^2 * |d3O| and rounding ~1e-7 / eps, both below 2e-3 here
    assert jac.shape == (6, D, D)
    np.testing.assert_allclose(jac, fd, atol=2e-3, rtol=2e-3)
    assert np.abs(jac).max() > 0.05  # not a vacuous comparison


def test_attention_jacobian_matches_closed_form():
    """dO/dq = scale * sum_i p_i (v_i - O) k_i^T (softmax attention with fixed biases)."""
    rng = np.random.default_rng(2)
    q, keys = rng.normal(size=D), rng.normal(size=(9, D))
    values, bias = rng.normal(size=(9, D)), rng.normal(size=9)
    s = SCALE * keys @ q + bias
    p = np.exp(s - s.max())
    p /= p.sum()
    out = p @ values
    expected = SCALE * ((p[:, None] * (values - out)).T @ keys)
    got = attention_jacobian(*(mx.array(a.astype(np.float32)) for a in (q, keys, values, bias)), SCALE)
    np.testing.assert_allclose(np.array(got), expected, atol=1e-5)


def test_loss_jacobian_difference_matches_finite_differences():
    batch = _batch(3)
    k_b, v_b = mx.array(np.ones((B, D), np.float32)), mx.array(np.full((B, D), 0.5, np.float32))
    m = mx.full((B,), 1.2)
    jd, jb = jacobian_products(lambda x: outputs(batch, k_b, v_b, m, SCALE, q=x), batch["queries"],
                               basis_tangents(batch["queries"]))
    diff = np.moveaxis(np.array(jd - jb), 0, -1)  # [B, F, Dv, Dk]

    def fn(x):
        dense, bead = outputs(batch, k_b, v_b, m, SCALE, q=x)
        return dense - bead

    np.testing.assert_allclose(diff, _finite_difference(fn, batch["queries"], 1e-2), atol=2e-3, rtol=2e-3)


def test_hutchinson_estimate_is_unbiased():
    batch = _batch(4)
    k_b, v_b, m = pooling_beads(batch)
    exact = force_matching_loss(batch, k_b, v_b, m, SCALE, probes=None)[1]["force"].item()
    q = batch["queries"]
    jd, jb = jacobian_products(lambda x: outputs(batch, k_b, v_b, m, SCALE, q=x), q,
                               rademacher_tangents(q, 4000, mx.random.key(5)))
    estimate = (mx.sum(mx.square(jd - jb)) / mx.sum(mx.square(jd))).item()
    assert estimate == pytest.approx(exact, rel=0.05)
    few = force_matching_loss(batch, k_b, v_b, m, SCALE, probes=8, key=mx.random.key(1))[1]["force"].item()
    assert few == pytest.approx(exact, rel=0.5)


def test_exact_bead_has_zero_loss_and_eviction_scores_one():
    batch = _batch(5, n=1)
    zero, parts = force_matching_loss(batch, batch["window_keys"][:, 0], batch["window_values"][:, 0],
                                      mx.zeros((B,)), SCALE, probes=None)
    assert zero.item() < 1e-10
    # N identical tokens are exactly one bead with log-mass log N
    same = _batch(5, n=1)
    same["window_keys"] = mx.repeat(same["window_keys"], 6, axis=1)
    same["window_values"] = mx.repeat(same["window_values"], 6, axis=1)
    k_b, v_b, m = pooling_beads(same)
    assert force_matching_loss(same, k_b, v_b, m, SCALE, probes=None)[0].item() < 1e-9
    no_mass = force_matching_loss(same, k_b, v_b, mx.zeros((B,)), SCALE, probes=None)[0].item()
    assert no_mass > 1e-3  # without its multiplicity the bead weighs like one token
    batch = _batch(6)
    k_b, v_b, _ = pooling_beads(batch)
    _, evicted = force_matching_loss(batch, k_b, v_b, mx.full((B,), -1e4), SCALE, probes=None)
    assert evicted["consistency"].item() == pytest.approx(1.0, abs=1e-5)
    assert evicted["force"].item() == pytest.approx(1.0, abs=1e-5)


def test_loss_is_differentiable_through_the_jacobian():
    batch = _batch(7)
    k0, v0, m0 = pooling_beads(batch)

    def loss(k_b, v_b, m):
        return force_matching_loss(batch, k_b, v_b, m, SCALE, probes=None)[0]

    grads = mx.grad(loss, argnums=(0, 1, 2))(k0, v0, m0)
    eps = 1e-2
    step = mx.zeros_like(m0)
    step[0] = eps
    fd = (loss(k0, v0, m0 + step) - loss(k0, v0, m0 - step)).item() / (2 * eps)
    assert grads[2][0].item() == pytest.approx(fd, rel=2e-2, abs=1e-4)
    assert all(np.isfinite(np.array(g)).all() for g in grads)
