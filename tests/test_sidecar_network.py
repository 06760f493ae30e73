"""Sidecar network: shapes, parameter budget at SmolLM2's shape, the first-order (pooling + entropy mass) start,
the policy-facing `beads` API, and that training on windows of identical tokens maps them onto that token."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest

from cortexstream.sidecar import SidecarConfig, SidecarNet
from cortexstream.training.sidecar.loss import force_matching_loss


def test_parameter_budget_at_smollm2_shape():
    net = SidecarNet(SidecarConfig(head_dim=64, window=16, num_layers=30, num_kv_heads=3))
    assert 100_000 < net.num_parameters() <= 1_000_000
    assert SidecarNet(SidecarConfig(d_model=128, encoder_layers=3)).num_parameters() <= 1_000_000
    assert SidecarNet(SidecarConfig(d_model=256, encoder_layers=1, mlp_ratio=2)).num_parameters() <= 1_000_000


def test_shapes_dtypes_and_beads_api():
    cfg = SidecarConfig(head_dim=16, value_dim=24, window=8, num_layers=2, num_kv_heads=2, d_model=32,
                        encoder_layers=1)
    net = SidecarNet(cfg)
    keys = mx.random.normal((2, 5, 8, 16)).astype(mx.float16)
    values = mx.random.normal((2, 5, 8, 24)).astype(mx.float16)
    k_b, v_b = net.beads(keys, values, layer=1)
    assert k_b.shape == (2, 5, 16) and v_b.shape == (2, 5, 24) and k_b.dtype == mx.float16
    _, _, mass = net.beads_with_mass(keys, values, layer=1)
    assert mass.shape == (2, 5) and mass.dtype == mx.float32
    # a shorter window than trained is accepted; a longer one or a wrong layer/head count is refused
    assert net.beads(keys[:, :, :4], values[:, :, :4], 0)[0].shape == (2, 5, 16)
    with pytest.raises(ValueError):
        net.beads(mx.zeros((2, 1, 9, 16)), mx.zeros((2, 1, 9, 24)), 0)
    with pytest.raises(ValueError):
        net.beads(keys, values, layer=2)
    with pytest.raises(ValueError):
        net.beads(keys[:1], values[:1], layer=0)
    # layer/head identity matters (group embedding): the same window gives different beads per group
    same_k = mx.broadcast_to(keys[:1], keys.shape)
    same_v = mx.broadcast_to(values[:1], values.shape)
    net.k_out.weight = mx.random.normal(net.k_out.weight.shape) * 0.1
    beads = net.beads(same_k, same_v, 0)[0].astype(mx.float32)
    assert mx.abs(beads[0] - beads[1]).max().item() > 1e-4


def test_initial_bead_is_first_order_pooling():
    """Zero-initialised output heads: k_b, v_b are the pooled window, log_mass the pooling entropy (~log N)."""
    net = SidecarNet(SidecarConfig(head_dim=16, window=8, num_layers=1, num_kv_heads=1, d_model=32,
                                   encoder_layers=1))
    keys, values = mx.random.normal((6, 8, 16)) * 3, mx.random.normal((6, 8, 16))
    k_b, v_b, mass = net(keys, values, mx.zeros((6,), mx.int32))
    lo, hi = keys.min(axis=1), keys.max(axis=1)
    assert bool(mx.all((k_b >= lo - 1e-5) & (k_b <= hi + 1e-5)))  # a convex combination of the window
    assert bool(mx.all(mass <= math.log(8) + 1e-5)) and bool(mx.all(mass > math.log(8) - 0.1))
    off = SidecarNet(SidecarConfig(head_dim=16, window=8, num_layers=1, num_kv_heads=1, d_model=32,
                                   encoder_layers=1, log_mass=False))
    assert mx.all(off(keys, values, mx.zeros((6,), mx.int32))[2] == 0).item()


def _identical_rows(rng: np.random.Generator, rows: int, n: int, d: int, f: int) -> dict[str, mx.array]:
    g = lambda *s: mx.array(rng.normal(size=s).astype(np.float32))  # noqa: E731
    k, v = g(rows, 1, d) * 2, g(rows, 1, d)
    return {"window_keys": mx.repeat(k, n, axis=1), "window_values": mx.repeat(v, n, axis=1),
            "queries": g(rows, f, d) * 2, "rest_keys": g(rows, f, d), "rest_values": g(rows, f, d),
            "rest_bias": g(rows, f) + 2.0, "group": mx.zeros((rows,), mx.int32)}


def test_identical_tokens_map_onto_that_token_after_training():
    n, d, scale = 8, 16, 0.25
    mx.random.seed(0)
    net = SidecarNet(SidecarConfig(head_dim=d, window=n, num_layers=1, num_kv_heads=1, d_model=32,
                                   encoder_layers=1, num_heads=2))
    for head in (net.k_out, net.v_out, net.mass_out):  # start away from the answer
        head.weight = mx.random.normal(head.weight.shape) * 0.3
        head.bias = mx.random.normal(head.bias.shape) * 0.3
    rng = np.random.default_rng(0)
    test = _identical_rows(rng, 64, n, d, 4)

    def errors() -> tuple[float, float, float]:
        k_b, v_b, mass = net(test["window_keys"], test["window_values"], test["group"])
        k, v = test["window_keys"][:, 0], test["window_values"][:, 0]
        rel = lambda a, b: (mx.linalg.norm(a - b, axis=-1) / mx.linalg.norm(b, axis=-1)).mean().item()  # noqa: E731
        return rel(k_b, k), rel(v_b, v), mx.abs(mass - math.log(n)).mean().item()

    before = errors()
    opt = optim.Adam(learning_rate=3e-3)

    def loss_fn(model, batch):
        k_b, v_b, mass = model(batch["window_keys"], batch["window_values"], batch["group"])
        return force_matching_loss(batch, k_b, v_b, mass, scale, probes=None)[0]

    step = nn.value_and_grad(net, loss_fn)
    for _ in range(250):
        loss, grads = step(net, _identical_rows(rng, 32, n, d, 4))
        opt.update(net, grads)
        mx.eval(net.parameters(), opt.state)
    k_err, v_err, m_err = errors()
    assert before[0] > 0.1 and before[1] > 0.1
    assert k_err < 0.05 and v_err < 0.05 and m_err < 0.1, (before, (k_err, v_err, m_err))


def test_all_layers_in_one_call_equals_per_layer():
    net = SidecarNet(SidecarConfig(head_dim=16, window=8, num_layers=3, num_kv_heads=2, d_model=32,
                                   encoder_layers=1))
    net.k_out.weight = mx.random.normal(net.k_out.weight.shape) * 0.1
    net.mass_out.weight = mx.random.normal(net.mass_out.weight.shape) * 0.1
    keys, values = mx.random.normal((3, 2, 4, 8, 16)), mx.random.normal((3, 2, 4, 8, 16))
    k_all, v_all, m_all = net.beads_with_mass(keys, values, None)
    for layer in range(3):
        k, v, m = net.beads_with_mass(keys[layer], values[layer], layer)
        assert mx.allclose(k, k_all[layer], atol=1e-5) and mx.allclose(m, m_all[layer], atol=1e-5)
    with pytest.raises(ValueError):
        net.beads(keys[:2], values[:2], None)
    with pytest.raises(ValueError):
        net.beads(keys, values, 0)
