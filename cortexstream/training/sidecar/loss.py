"""Force-matching loss: a bead must pull future queries the way its window did (value and Jacobian in q).

Setting (one row = one window of one KV head of one layer; F future queries q, post-RoPE, from the trajectory).
Every key j contributes a logit s_j(q) = scale * q.k_j + b_j (b_j = 0 for real tokens) and the attention output
is O(q) = sum_j softmax_j(s(q)) v_j. Three sets of keys appear:

- window W: its N real (k_j, v_j);
- bead: one key k_b with logit bias b = beta (the bead's log-mass, see `network`) and value v_b;
- rest R(q): every other key the query saw in the real forward pass (sinks, older and newer tokens). It is carried
  per query as its own first-order bead, computed exactly at collection time (`trajectories`): key
  kbar_R = sum_R p k, value O_R = sum_R p v and bias L_R - scale * q0.kbar_R with L_R = log sum_R exp(s) at the
  stored query q0. At q = q0 this pseudo-key reproduces the rest's true mass, output and mass gradient, so the
  window/bead sees the relative mass it really competed with (a query that barely looked at the window barely
  constrains the bead). The only rest term not carried is its internal Jacobian J_R, which enters J_dense - J_bead
  as (w_bead - w_dense) J_R (w = share of the window/bead): it vanishes when the bead carries the right mass, which
  the consistency term enforces.

Definitions, per query: O_dense(q) = attention over {rest, window}, O_bead(q) = attention over {rest, bead};
J = dO/dq (Dv x Dk), by MLX forward-mode autodiff (`mx.jvp`), never by a hand-written formula.

    L_force = sum_q ||J_dense(q) - J_bead(q)||_F^2 / sum_q ||J_dense(q)||_F^2
    L_cons  = sum_q ||O_dense(q) - O_bead(q)||^2  / sum_q ||O_dense(q) - O_R(q)||^2
    L       = L_force + lam * L_cons

Both are normalised by what evicting the window would cost (with the window gone O = O_R and J = 0, a single
key has no Jacobian), so each term reads "fraction of the window's effect lost": eviction scores 1 and 1, and
layers/heads with large activations do not dominate. The denominators do not depend on the sidecar.
||J||_F^2 = sum_i ||J e_i||^2 exactly (probes=None: one jvp per basis vector, vmapped), or
E_u ||J u||^2 with Rademacher u (Hutchinson, probes=P: P jvps, unbiased, used for training because it costs
P/Dk of the exact norm); the same probes serve numerator and denominator.

Reading of the seed. Its "true aggregate force" sum_j grad_q Attn(q, {k_j}, {v_j}) is, taken literally, zero:
attention over a single key is that key's value whatever q is. The force a window exerts only exists relative to
the other keys the query sees, hence the Jacobian of the whole attention output with and without the window
replaced. The seed's section 2.1 defines the force as a gradient in the keys, its loss one in the query; we match
dO/dq, what a future query feels. Floor: with the bead, J_bead has no term for the window's internal covariance
(w * scale * Cov_p(v, k) inside J_dense), so L_force cannot reach 0 for a window of distinct tokens.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping

import mlx.core as mx

Batch = Mapping[str, mx.array]  # window_keys [B,N,Dk], window_values [B,N,Dv], queries/rest_keys [B,F,Dk],
# rest_values [B,F,Dv], rest_bias [B,F], group [B]  (see trajectories.ROW_FIELDS)
_TINY = 1e-12


def attend(q: mx.array, keys: mx.array, values: mx.array, bias: mx.array, scale: float) -> mx.array:
    """Softmax attention of one query per row: q [..., Dk], keys [..., K, Dk], values [..., K, Dv], bias [..., K]."""
    logits = scale * (keys @ q[..., None])[..., 0] + bias
    p = mx.softmax(logits, axis=-1, precise=True)
    return (p[..., None] * values).sum(axis=-2)


def _with_rest(q: mx.array, keys: mx.array, values: mx.array, bias: mx.array, batch: Batch, scale: float) -> mx.array:
    """Attention of queries q [B, F, Dk] over {rest(q) pseudo-key} + shared keys [B, K, Dk] (bias [B, K])."""
    f = q.shape[1]
    b, k_count = keys.shape[0], keys.shape[1]
    all_keys = mx.concatenate([batch["rest_keys"][:, :, None], mx.broadcast_to(
        keys[:, None], (b, f, k_count, keys.shape[-1]))], axis=2)
    all_values = mx.concatenate([batch["rest_values"][:, :, None], mx.broadcast_to(
        values[:, None], (b, f, k_count, values.shape[-1]))], axis=2)
    all_bias = mx.concatenate([batch["rest_bias"][:, :, None], mx.broadcast_to(bias[:, None], (b, f, k_count))], axis=2)
    return attend(q, all_keys, all_values, all_bias, scale)


def outputs(batch: Batch, k_b: mx.array, v_b: mx.array, log_mass: mx.array, scale: float,
            q: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """(O_dense, O_bead), each [B, F, Dv], at the batch's queries (or at q [B, F, Dk])."""
    q = batch["queries"] if q is None else q
    wk, wv = batch["window_keys"], batch["window_values"]
    dense = _with_rest(q, wk, wv, mx.zeros(wk.shape[:2], mx.float32), batch, scale)
    bead = _with_rest(q, k_b[:, None], v_b[:, None], log_mass[:, None], batch, scale)
    return dense, bead


def jacobian_products(fn: Callable[[mx.array], tuple[mx.array, ...]], q: mx.array,
                      tangents: mx.array) -> tuple[mx.array, ...]:
    """J u for every output of fn at q, for each tangent u in tangents [P, *q.shape]: tuple of [P, *out.shape]."""
    def one(u: mx.array) -> tuple[mx.array, ...]:
        return tuple(mx.jvp(lambda x: fn(x), [q], [u])[1])

    return mx.vmap(one)(tangents)


def basis_tangents(q: mx.array) -> mx.array:
    """The Dk basis directions, broadcast over q's rows: [Dk, *q.shape] (exact Frobenius norms)."""
    dk = q.shape[-1]
    return mx.broadcast_to(mx.eye(dk, dtype=q.dtype).reshape(dk, *([1] * (q.ndim - 1)), dk), (dk, *q.shape))


def rademacher_tangents(q: mx.array, probes: int, key: mx.array) -> mx.array:
    """P random +-1 directions per query: [P, *q.shape] (Hutchinson, E[u u^T] = I)."""
    return mx.where(mx.random.bernoulli(0.5, (probes, *q.shape), key=key), 1.0, -1.0).astype(q.dtype)


def attention_jacobian(q: mx.array, keys: mx.array, values: mx.array, bias: mx.array, scale: float) -> mx.array:
    """Full dO/dq by autodiff for single queries q [..., Dk]: [..., Dv, Dk] (used by tests and diagnostics)."""
    cols = jacobian_products(lambda x: (attend(x, keys, values, bias, scale),), q, basis_tangents(q))[0]
    return mx.moveaxis(cols, 0, -1)


def force_matching_loss(batch: Batch, k_b: mx.array, v_b: mx.array, log_mass: mx.array, scale: float, *,
                        lam: float = 1.0, probes: int | None = 8,
                        key: mx.array | None = None) -> tuple[mx.array, dict[str, mx.array]]:
    """L = L_force + lam * L_cons (module docstring) for beads k_b [B, Dk], v_b [B, Dv], log_mass [B].

    probes=None: exact Jacobian norms (Dk jvps); else Hutchinson with `probes` Rademacher directions from `key`.
    Returns (loss, {"force", "consistency"}) with the parts as scalars.
    """
    q = batch["queries"]
    tangents = basis_tangents(q) if probes is None else rademacher_tangents(
        q, probes, key if key is not None else mx.random.key(0))
    o_dense, o_bead = outputs(batch, k_b, v_b, log_mass, scale)
    j_dense, j_bead = jacobian_products(lambda x: outputs(batch, k_b, v_b, log_mass, scale, q=x), q, tangents)
    force = mx.sum(mx.square(j_dense - j_bead)) / (mx.stop_gradient(mx.sum(mx.square(j_dense))) + _TINY)
    evicted = mx.sum(mx.square(o_dense - batch["rest_values"]))
    consistency = mx.sum(mx.square(o_dense - o_bead)) / (mx.stop_gradient(evicted) + _TINY)
    return force + lam * consistency, {"force": force, "consistency": consistency}


def pooling_beads(batch: Batch, log_mass: bool = True) -> tuple[mx.array, mx.array, mx.array]:
    """Baseline bead: mean key and value with log-mass log N (the untrained first-order bead), or 0 without mass."""
    wk, wv = batch["window_keys"], batch["window_values"]
    n = wk.shape[1]
    mass = mx.full((wk.shape[0],), math.log(n) if log_mass else 0.0, dtype=mx.float32)
    return wk.mean(axis=1), wv.mean(axis=1), mass
