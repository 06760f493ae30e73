"""The sidecar: a small set encoder that coarse-grains a window of N (key, value) pairs into one bead.

Physics that fixes the output parameterisation. For a query q, a window W contributes to attention through its
partition function Z_W(q) = sum_j exp(s_j), s_j = scale * q.k_j, and its softmax-weighted value O_W(q). A bead
(k_b, v_b, beta) contributes exp(scale * q.k_b + beta) and v_b. Exact replacement in every context needs
log Z_W(q) = scale * q.k_b + beta and O_W(q) = v_b for all q, which is impossible: log Z_W is a log-sum-exp
(convex in q) and the bead's log-mass is linear in q. The best one can do is match it to first order around the
queries that actually occur. Linearising at q0 with p = softmax_j(s_j(q0)) gives exactly

    k_b = sum_j p_j k_j,   v_b = sum_j p_j v_j,   beta = H(p) = -sum_j p_j log p_j,

i.e. the bead's log-multiplicity is the entropy of the pooling distribution (log N for uniform pooling: a bead
must weigh like N tokens, not like one). What a single bead cannot carry is the curvature of log Z_W (the
covariance of keys under p) and the window's own internal Jacobian Cov_p(v, k): that part of the force is lost
by construction and the loss measures how much.

So the network does not regress (k_b, v_b) from scratch: learned attention pooling (a Set-Transformer PMA seed
over a transformer encoding of the window) yields pooling weights a_j, and the outputs are

    k_b = sum_j a_j k_j + rms_k * dk(z),   v_b = sum_j a_j v_j + rms_v * dv(z),   beta = H(a) + db(z)

with z the pooled embedding and dk, dv, db zero-initialised linear heads. At initialisation a bead is the
first-order (entropy-weighted) pooling of its window; training only learns corrections. Inputs are normalised by
the window's RMS (keys have large per-layer/head offsets) and the corrections are scaled back, so the network is
scale-equivariant. One network serves every layer and KV head through a learned (layer, head) embedding: a
per-layer network would cost num_layers times the parameters (30 x at SmolLM2) for data that shares its physics.

log_mass=False trains a network whose beta is fixed at 0 (the key must absorb the mass); a policy that cannot add
a per-key bias to the attention logits needs such weights. See `cortexstream.sidecar` for how a policy applies beta.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

_EPS = 1e-6


@dataclass(frozen=True)
class SidecarConfig:
    """Shape of a sidecar. `window` is the largest window it accepts; `num_layers * num_kv_heads` embeddings."""

    head_dim: int = 64
    value_dim: int = 0  # 0: same as head_dim
    window: int = 16
    num_layers: int = 30
    num_kv_heads: int = 3
    d_model: int = 64  # chosen over 128 x 3 layers, which fit worse after the same steps (docs/performance.md)
    encoder_layers: int = 2
    num_heads: int = 4
    mlp_ratio: int = 4
    log_mass: bool = True

    @property
    def v_dim(self) -> int:
        return self.value_dim or self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SidecarConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"SidecarConfig: unknown fields {unknown}")
        return cls(**dict(data))


class Attention(nn.Module):
    """Multi-head attention with biased projections; returns the output and the per-head weights."""

    def __init__(self, dims: int, num_heads: int):
        super().__init__()
        if dims % num_heads:
            raise ValueError(f"d_model {dims} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.q_proj, self.k_proj = nn.Linear(dims, dims), nn.Linear(dims, dims)
        self.v_proj, self.o_proj = nn.Linear(dims, dims), nn.Linear(dims, dims)

    def __call__(self, x_q: mx.array, x_kv: mx.array) -> tuple[mx.array, mx.array]:
        *lead, lq, d = x_q.shape
        lk, h = x_kv.shape[-2], self.num_heads

        def split(x: mx.array, n: int) -> mx.array:  # [..., n, d] -> [..., h, n, d/h]
            return x.reshape(*lead, n, h, d // h).swapaxes(-2, -3)

        q, k, v = split(self.q_proj(x_q), lq), split(self.k_proj(x_kv), lk), split(self.v_proj(x_kv), lk)
        weights = mx.softmax((q @ k.swapaxes(-1, -2)) * (1.0 / math.sqrt(d // h)), axis=-1)
        out = (weights @ v).swapaxes(-2, -3).reshape(*lead, lq, d)
        return self.o_proj(out), weights


class EncoderLayer(nn.Module):
    """Pre-norm transformer encoder layer (LayerNorm, self-attention, GELU MLP), no dropout."""

    def __init__(self, dims: int, num_heads: int, mlp_ratio: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dims), nn.LayerNorm(dims)
        self.attn = Attention(dims, num_heads)
        self.fc1, self.fc2 = nn.Linear(dims, dims * mlp_ratio), nn.Linear(dims * mlp_ratio, dims)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.norm1(x)
        x = x + self.attn(y, y)[0]
        return x + self.fc2(nn.gelu(self.fc1(self.norm2(x))))


class SidecarNet(nn.Module):
    """Phi_theta: window [..., N, D] of (k, v) -> bead (k_b, v_b, log_mass). See the module docstring."""

    def __init__(self, config: SidecarConfig | None = None, **overrides: Any):
        super().__init__()
        cfg = SidecarConfig.from_dict({**(config.to_dict() if config else {}), **overrides})
        self.config = cfg
        d = cfg.d_model
        self.in_proj = nn.Linear(cfg.head_dim + cfg.v_dim + 2, d)
        self.pos_embed = nn.Embedding(cfg.window, d)
        self.group_embed = nn.Embedding(cfg.num_layers * cfg.num_kv_heads, d)
        self.layers = [EncoderLayer(d, cfg.num_heads, cfg.mlp_ratio) for _ in range(cfg.encoder_layers)]
        self.norm = nn.LayerNorm(d)
        self.seed = mx.random.normal((1, d)) * 0.02
        self.pool = Attention(d, cfg.num_heads)
        self.k_out, self.v_out, self.mass_out = nn.Linear(d, cfg.head_dim), nn.Linear(d, cfg.v_dim), nn.Linear(d, 1)
        for head in (self.k_out, self.v_out, self.mass_out):  # start at the first-order pooling bead
            head.weight = mx.zeros_like(head.weight)
            head.bias = mx.zeros_like(head.bias)

    def num_parameters(self) -> int:
        return sum(v.size for _, v in tree_flatten(self.parameters()))

    def __call__(self, keys: mx.array, values: mx.array, group: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """keys [..., N, Dk], values [..., N, Dv], group [...] (= layer * num_kv_heads + kv_head), N <= window.

        Returns float32 k_b [..., Dk], v_b [..., Dv], log_mass [...] (zeros when `config.log_mass` is False).
        """
        cfg, n = self.config, keys.shape[-2]
        if n > cfg.window or values.shape[-2] != n:
            raise ValueError(f"sidecar: window of {n} tokens (values {values.shape[-2]}); at most {cfg.window}")
        keys, values = keys.astype(mx.float32), values.astype(mx.float32)
        rms_k = mx.sqrt(mx.mean(keys * keys, axis=(-2, -1), keepdims=True) + _EPS)
        rms_v = mx.sqrt(mx.mean(values * values, axis=(-2, -1), keepdims=True) + _EPS)
        scales = mx.broadcast_to(mx.concatenate([mx.log(rms_k), mx.log(rms_v)], axis=-1), (*keys.shape[:-1], 2))
        x = self.in_proj(mx.concatenate([keys / rms_k, values / rms_v, scales], axis=-1))
        x = x + self.pos_embed.weight[:n] + self.group_embed(group)[..., None, :]
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        seed = mx.broadcast_to(self.seed, (*x.shape[:-2], 1, x.shape[-1]))
        z, weights = self.pool(seed, x)
        z = z[..., 0, :]
        a = mx.mean(weights[..., 0, :], axis=-2)  # [..., N]: pooling distribution, averaged over pooling heads
        k_b = (a[..., None] * keys).sum(axis=-2) + rms_k[..., 0, :] * self.k_out(z)
        v_b = (a[..., None] * values).sum(axis=-2) + rms_v[..., 0, :] * self.v_out(z)
        if cfg.log_mass:
            entropy = -(a * mx.log(mx.maximum(a, 1e-30))).sum(axis=-1)
            log_mass = entropy + self.mass_out(z)[..., 0]
        else:
            log_mass = mx.zeros(k_b.shape[:-1], mx.float32)
        return k_b, v_b, log_mass

    def _groups(self, keys: mx.array, layer: int | None) -> mx.array:
        cfg = self.config
        layers = range(cfg.num_layers) if layer is None else [layer]
        lead = keys.shape[:-2]  # [H, W] for one layer, [L, H, W] for all
        heads = lead[-2]
        if heads != cfg.num_kv_heads or (layer is None and lead[0] != cfg.num_layers) or \
                (layer is not None and not 0 <= layer < cfg.num_layers):
            raise ValueError(f"sidecar: windows {tuple(lead)} (layer {layer}) outside the trained "
                             f"{cfg.num_layers} layers x {cfg.num_kv_heads} KV heads")
        group = mx.array([[lay * heads + h for h in range(heads)] for lay in layers], dtype=mx.int32)
        group = mx.broadcast_to(group[..., None], (len(layers), heads, lead[-1]))
        return group if layer is None else group[0]

    def beads_with_mass(self, keys: mx.array, values: mx.array,
                        layer: int | None) -> tuple[mx.array, mx.array, mx.array]:
        """Per layer: keys [H, W, N, Dk], values [H, W, N, Dv] -> k [H, W, Dk], v [H, W, Dv] (input dtype) and
        float32 log_mass [H, W]: the additive logit bias each bead needs (0 for a log_mass=False network).
        layer=None: every layer in one call, keys [L, H, W, N, Dk] -> [L, H, W, ...] (one launch instead of L)."""
        if keys.ndim != (5 if layer is None else 4):
            raise ValueError(f"sidecar: keys {tuple(keys.shape)} must be [H, W, N, D] (or [L, H, W, N, D], layer=None)")
        k_b, v_b, log_mass = self(keys, values, self._groups(keys, layer))
        return k_b.astype(keys.dtype), v_b.astype(values.dtype), log_mass

    def beads(self, keys: mx.array, values: mx.array, layer: int | None) -> tuple[mx.array, mx.array]:
        """Per layer: keys [H, W, N, Dk], values [H, W, N, Dv] -> (k_bead [H, W, Dk], v_bead [H, W, Dv]).

        For a network with `config.log_mass` the bead also needs its logit bias (`beads_with_mass`); without it
        each bead attends like one token instead of its window's mass.
        """
        k_b, v_b, _ = self.beads_with_mass(keys, values, layer)
        return k_b, v_b
