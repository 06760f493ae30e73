"""Offline training of the sidecar on collected trajectories: AdamW, progress bar, checkpoints, exact resume.

Why resume is exact. Everything a step depends on is a function of (seed, step): the batch (an epoch's order is
drawn from `default_rng([seed, epoch])`: chunks are shuffled, taken `mix_chunks` at a time and their rows
shuffled together, so at most two groups of chunks are in memory), the Hutchinson probes (`mx.random.key` of a
hash of seed and step) and the learning rate (a schedule of the optimizer's own step counter). A checkpoint holds
the weights (`sidecar.safetensors`), the full optimizer state (`optimizer.safetensors`: step, moments) and
`state.json` (step, configs, recent losses), each written to a temporary file and renamed, `state.json` last, so
a run killed mid-write resumes from the previous complete checkpoint. Resuming with a different TrainConfig
(other than `checkpoint_every`) would silently change the data order or schedule, so it is refused. The steps
themselves run in the shared loop (`cortexstream.training.loop`).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any, Mapping

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np

from cortexstream.sidecar.network import SidecarConfig, SidecarNet
from cortexstream.sidecar.porting import load_sidecar, save_sidecar
from cortexstream.training.checkpoints import save_checkpoint
from cortexstream.training.loop import LoopSettings, load_optimizer_state, load_resumable, lr_schedule, run_steps
from cortexstream.training.sidecar.loss import force_matching_loss
from cortexstream.training.sidecar.trajectories import TrajectoryStore

_BATCH_FIELDS = ("window_keys", "window_values", "queries", "rest_keys", "rest_values", "rest_bias", "group")


@dataclass(frozen=True)
class TrainConfig:
    """probes: Hutchinson directions per query (None: exact Jacobian norms); lam weighs the consistency term."""

    steps: int = 2000
    batch_size: int = 128
    learning_rate: float = 1e-3
    weight_decay: float = 0.01
    warmup: int = 100
    lam: float = 1.0
    probes: int | None = 8
    grad_clip: float = 1.0
    checkpoint_every: int = 200
    mix_chunks: int = 4
    seed: int = 0


class BatchStream:
    """Deterministic batches: `batch(step)` depends only on (seed, step), whatever was loaded before."""

    def __init__(self, store: TrajectoryStore, batch_size: int, seed: int, mix_chunks: int):
        if store.num_rows < batch_size:
            raise ValueError(f"trajectories have {store.num_rows} rows, fewer than batch_size {batch_size}")
        self.store, self.batch_size, self.seed, self.mix = store, batch_size, seed, max(1, mix_chunks)
        self.per_epoch = store.num_rows // batch_size
        self._cache: dict[tuple[int, int], dict[str, mx.array]] = {}

    def _plan(self, epoch: int) -> list[tuple[list[int], np.ndarray]]:
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(len(self.store.chunk_rows)).tolist()
        groups = [order[i:i + self.mix] for i in range(0, len(order), self.mix)]
        return [(g, rng.permutation(sum(self.store.chunk_rows[c] for c in g))) for g in groups]

    def _group(self, epoch: int, index: int, chunks: list[int], perm: np.ndarray) -> dict[str, mx.array]:
        key = (epoch, index)
        if key not in self._cache:
            if len(self._cache) >= 2:
                self._cache.pop(next(iter(self._cache)))
            parts = [self.store.load_chunk(c) for c in chunks]
            rows = {name: mx.concatenate([p[name] for p in parts]) for name in _BATCH_FIELDS}
            order = mx.array(perm.astype(np.int32))
            self._cache[key] = {name: a[order] for name, a in rows.items()}
        return self._cache[key]

    def batch(self, step: int) -> dict[str, mx.array]:
        epoch, start = divmod(step, self.per_epoch)
        start *= self.batch_size
        pieces: list[dict[str, mx.array]] = []
        offset, need = 0, self.batch_size
        for index, (chunks, perm) in enumerate(self._plan(epoch)):
            size = len(perm)
            if need and start < offset + size:
                lo = max(start, offset) - offset
                hi = min(size, lo + need)
                rows = self._group(epoch, index, chunks, perm)
                pieces.append({name: a[lo:hi] for name, a in rows.items()})
                need -= hi - lo
                start = offset + hi
            offset += size
        return {name: mx.concatenate([p[name] for p in pieces]) for name in _BATCH_FIELDS}


def _probe_key(seed: int, step: int) -> mx.array:
    return mx.random.key((seed * 1_000_003 + step) % (2**31))


def _save(out_dir: str, net: SidecarNet, opt: optim.Optimizer, state: dict[str, Any]) -> None:
    metadata = {"step": state["step"], "train": state["train"]}
    save_checkpoint(out_dir, "sidecar.safetensors", lambda p: save_sidecar(net, p, metadata), opt, state)


def train_sidecar(trajectories: str | TrajectoryStore, out_dir: str, *,
                  network: SidecarConfig | Mapping[str, Any] | None = None, config: TrainConfig = TrainConfig(),
                  resume: bool = True, progress: bool = True,
                  stop_at: int | None = None) -> tuple[SidecarNet, dict[str, Any]]:
    """Train (or resume training) a sidecar on a trajectory collection; returns (network, state dict).

    network: SidecarConfig fields overriding what the trajectories imply (head_dim, value_dim, window, layers, KV
    heads come from the collection). stop_at: end this run after that step (checkpointed), e.g. to split a long
    run; a later call with resume=True continues to `config.steps`.
    """
    store = trajectories if isinstance(trajectories, TrajectoryStore) else TrajectoryStore(trajectories)
    meta = store.meta
    implied = {"head_dim": meta["head_dim"], "value_dim": 0 if meta["value_dim"] == meta["head_dim"] else
               meta["value_dim"], "window": meta["collect"]["window"], "num_layers": meta["num_layers"],
               "num_kv_heads": meta["num_kv_heads"]}
    given = network.to_dict() if isinstance(network, SidecarConfig) else dict(network or {})
    os.makedirs(out_dir, exist_ok=True)
    mx.random.seed(config.seed)
    net = SidecarNet(SidecarConfig.from_dict({**implied, **given}))
    opt = optim.AdamW(learning_rate=lr_schedule(config.learning_rate, config.steps, config.warmup),
                      weight_decay=config.weight_decay)
    state: dict[str, Any] = {"step": 0, "train": asdict(config), "network": net.config.to_dict(), "history": []}
    saved = load_resumable(out_dir, asdict(config), {"network": net.config.to_dict()}) if resume else None
    if saved is not None:
        net = load_sidecar(os.path.join(out_dir, "sidecar.safetensors"))
        net.train()
        load_optimizer_state(out_dir, opt)
        state = saved
    scale, cfg = store.scale, config
    stream = BatchStream(store, cfg.batch_size, cfg.seed, cfg.mix_chunks)

    def loss_fn(model: SidecarNet, batch: dict[str, mx.array], key: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        k_b, v_b, log_mass = model(batch["window_keys"], batch["window_values"], batch["group"])
        loss, parts = force_matching_loss(batch, k_b, v_b, log_mass, scale, lam=cfg.lam, probes=cfg.probes, key=key)
        return loss, parts["force"], parts["consistency"]

    end = cfg.steps if stop_at is None else min(cfg.steps, stop_at)
    settings = LoopSettings(end=end, checkpoint_every=cfg.checkpoint_every, grad_clip=cfg.grad_clip, desc="sidecar",
                            terms=("loss", "force", "cons"), progress=progress)
    run_steps(net, loss_fn, opt, state, settings, save=lambda s: _save(out_dir, net, opt, s),
              inputs=lambda step: (stream.batch(step), _probe_key(cfg.seed, step)))
    net.eval()
    return net, state


def evaluate(net: SidecarNet, batch: Mapping[str, mx.array], scale: float, *, lam: float = 1.0,
             probes: int | None = None) -> dict[str, float]:
    """Exact (probes=None) force and consistency losses of a network on a batch of rows."""
    k_b, v_b, log_mass = net(batch["window_keys"], batch["window_values"], batch["group"])
    loss, parts = force_matching_loss(batch, k_b, v_b, log_mass, scale, lam=lam, probes=probes)
    return {"loss": loss.item(), **{k: v.item() for k, v in parts.items()}}


__all__ = ["BatchStream", "TrainConfig", "evaluate", "train_sidecar"]
