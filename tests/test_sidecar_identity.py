"""After a short training on windows of identical tokens, a sidecar maps such a window to that token.

A window of N copies of (k, v) is exactly one key k with value v and logit bias log N, for every query. The
network starts with random (non-zero) correction heads, so at first its beads are far from (k, v, log N); it is
trained with the real force-matching loss on random tokens and scored on tokens it never saw.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from cortexstream.sidecar import SidecarConfig, SidecarNet
from cortexstream.training.sidecar.loss import force_matching_loss

N, D, F = 4, 8, 6
SCALE = D ** -0.5


def _batch(rng: np.random.Generator, rows: int) -> dict[str, mx.array]:
    k = rng.standard_normal((rows, 1, D)) * 2.0
    v = rng.standard_normal((rows, 1, D))
    arrays = {
        "window_keys": np.repeat(k, N, axis=1), "window_values": np.repeat(v, N, axis=1),
        "queries": rng.standard_normal((rows, F, D)) * 2.0,
        "rest_keys": rng.standard_normal((rows, F, D)), "rest_values": rng.standard_normal((rows, F, D)),
        "rest_bias": rng.uniform(0.0, 3.0, (rows, F)),
    }
    batch = {name: mx.array(a.astype(np.float32)) for name, a in arrays.items()}
    batch["group"] = mx.zeros((rows,), mx.int32)
    return batch


def _errors(net: SidecarNet, batch: dict[str, mx.array]) -> tuple[float, float, float]:
    k_b, v_b, beta = net(batch["window_keys"], batch["window_values"], batch["group"])
    k, v = batch["window_keys"][:, 0], batch["window_values"][:, 0]
    rel = lambda a, b: float(mx.max(mx.linalg.norm(a - b, axis=-1) / mx.linalg.norm(b, axis=-1)))  # noqa: E731
    return rel(k_b, k), rel(v_b, v), float(mx.max(mx.abs(beta - math.log(N))))


def test_identical_window_maps_to_its_token_after_training():
    mx.random.seed(0)
    net = SidecarNet(SidecarConfig(head_dim=D, window=N, num_layers=1, num_kv_heads=1, d_model=16,
                                   encoder_layers=1, num_heads=2))
    for head in (net.k_out, net.v_out, net.mass_out):  # start away from the answer
        head.weight = mx.random.normal(head.weight.shape) * 0.5
        head.bias = mx.random.normal(head.bias.shape) * 0.5
    rng = np.random.default_rng(0)
    test = _batch(np.random.default_rng(99), 64)
    before = _errors(net, test)
    assert min(before) > 0.3, before  # the untrained network is really wrong

    def loss_fn(model, batch):
        k_b, v_b, beta = model(batch["window_keys"], batch["window_values"], batch["group"])
        return force_matching_loss(batch, k_b, v_b, beta, SCALE, probes=None)[0]

    step = nn.value_and_grad(net, loss_fn)
    opt = optim.Adam(learning_rate=1e-2)
    for _ in range(200):
        loss, grads = step(net, _batch(rng, 64))
        opt.update(net, grads)
        mx.eval(net.parameters(), opt.state, loss)
    k_err, v_err, mass_err = _errors(net, test)
    assert k_err < 0.05 and v_err < 0.05 and mass_err < 0.05, (before, (k_err, v_err, mass_err))
