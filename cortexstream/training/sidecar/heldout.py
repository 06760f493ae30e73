"""Held-out evaluation of a sidecar against the pooling baselines, and export of shippable weights.

The numbers are the exact (probes=None) force and consistency losses of `loss.force_matching_loss` on rows the
network never trained on, each a fraction of what evicting the window costs (1 = as bad as eviction). Rows are
a fixed random sample of the held-out collection (every layer and head), scored in batches of `batch_size` and
the per-batch ratios averaged (equal-size batches, the last one dropped if short), because exact Jacobians of a
whole collection at once do not fit in memory.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import mlx.core as mx
import numpy as np

from cortexstream.training.sidecar.loss import force_matching_loss, pooling_beads
from cortexstream.sidecar.network import SidecarNet
from cortexstream.sidecar.porting import load_sidecar, read_sidecar_info, save_sidecar
from cortexstream.training.sidecar.trajectories import ROW_FIELDS, TrajectoryStore

_FIELDS = ("window_keys", "window_values", "queries", "rest_keys", "rest_values", "rest_bias", "group")


def _rows(store: TrajectoryStore, rows: int, seed: int = 0) -> dict[str, mx.array]:
    """`rows` rows drawn without replacement from the whole collection (rows are stored layer by layer, so the
    first rows would all come from the first layers)."""
    if store.num_rows == 0:
        raise ValueError(f"{store.directory}: no rows to evaluate")
    data = store.load_all()
    pick = np.sort(np.random.default_rng(seed).permutation(store.num_rows)[:rows]).astype(np.int32)
    return {name: data[name][mx.array(pick)] for name in ROW_FIELDS}


def heldout_losses(net: SidecarNet, store: TrajectoryStore, *, rows: int = 1024, batch_size: int = 128,
                   lam: float = 1.0) -> dict[str, dict[str, float]]:
    """Exact losses of the network, of mean pooling with log-mass log N and of mean pooling without mass."""
    data = _rows(store, rows)
    total = data["group"].shape[0]
    batches = max(1, total // batch_size)
    size = min(batch_size, total)
    sums: dict[str, dict[str, float]] = {}
    for b in range(batches):
        batch = {name: data[name][b * size:(b + 1) * size] for name in _FIELDS}
        candidates = {
            "sidecar": net(batch["window_keys"], batch["window_values"], batch["group"]),
            "mean_pool_logN": pooling_beads(batch, log_mass=True),
            "mean_pool_no_mass": pooling_beads(batch, log_mass=False),
        }
        for name, (k_b, v_b, log_mass) in candidates.items():
            loss, parts = force_matching_loss(batch, k_b, v_b, log_mass, store.scale, lam=lam, probes=None)
            mx.eval(loss, parts)
            acc = sums.setdefault(name, {"loss": 0.0, "force": 0.0, "consistency": 0.0})
            acc["loss"] += loss.item()
            acc["force"] += parts["force"].item()
            acc["consistency"] += parts["consistency"].item()
    out = {name: {k: round(v / batches, 4) for k, v in acc.items()} for name, acc in sums.items()}
    for acc in out.values():
        acc["rows"] = batches * size
    return out


def export_weights(checkpoint: str, destination: str, info: Mapping[str, Any]) -> str:
    """Copy a trained checkpoint to `destination` (a .safetensors file) with extra metadata (model, data, losses).

    The shipped file keeps the training metadata (`step`, `train`) and adds `info`; `policies.sidecar` finds
    shipped weights by the `config` it stores (window, head_dim, KV heads, layers).
    """
    net = load_sidecar(checkpoint)
    meta = {k: v for k, v in read_sidecar_info(checkpoint).items() if k != "config"}
    os.makedirs(os.path.dirname(os.path.abspath(destination)), exist_ok=True)
    save_sidecar(net, destination, {**meta, **dict(info)})
    return destination
