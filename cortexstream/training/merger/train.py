"""Training the merger of evicted tokens in MLX: AdamW, progress bar, checkpoints, exact resume (shared loop).

Data as for the window compressor (`training.compression.data`): segments of held-out Wikipedia text, a teacher
pool of full-cache targets, position offsets for RoPE coverage. On top, H2O's choice of slots in every prefix at
`budget` (`scores`). A step runs the queries over the kept slots with the groups folded by the merger and minimises
KL to the full cache. Baselines in the same layout: plain eviction (H2O) and D2O's fixed fold; the run's
`state.json` records them beside the merger's held-out KL, so whether the learned fold beats them is read off
one scale.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np

from cortexstream.compression.evicted_merger import (Merger, MergerNetwork, anchor_init, check_network, check_threshold,
                                                     load_merger, new_merger, save_merger)
from cortexstream.kv.arena_config import model_kv_shape
from cortexstream.errors import InvalidArgumentError
from cortexstream.policies.base import check_budget
from cortexstream.policies.h2o import H2O
from cortexstream.training.checkpoints import save_checkpoint
from cortexstream.training.compression.data import Segments
from cortexstream.training.compression.train import pool_fingerprint, teacher_pool
from cortexstream.training.loop import (LoopSettings, epoch_batch, load_optimizer_state, load_resumable, lr_schedule,
                                        run_steps)
from cortexstream.training.merger.objective import Fold, d2o, evict_fold, learned, merger_loss
from cortexstream.training.merger.scores import keep_slots, prefix_scores

WEIGHTS = "merger.safetensors"


@dataclass(frozen=True)
class MergerTrainConfig:
    """budget: H2O's share of each prefix (what it keeps); threshold: the cosine a dropped token needs to join a
    kept token's group; prefix P / queries Q: tokens per segment."""

    network: str = MergerNetwork.COMPRESSOR.value
    budget: float = 0.2
    threshold: float = 0.5
    sinks: int = 4
    prefix: int = 512
    queries: int = 32
    steps: int = 300
    batch_size: int = 4
    learning_rate: float = 3e-4
    weight_decay: float = 0.0
    warmup: int = 10
    max_offset: int = 3072
    grad_clip: float = 1.0
    checkpoint_every: int = 50
    seed: int = 0

    def __post_init__(self) -> None:
        check_network("MergerTrainConfig", self.network)
        check_budget("budget", self.budget)
        check_threshold("MergerTrainConfig", self.threshold)
        for name in ("prefix", "queries", "steps", "batch_size", "checkpoint_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name}: must be a positive integer, got {getattr(self, name)!r}")
        if self.learning_rate <= 0:
            raise InvalidArgumentError(f"learning_rate: must be > 0, got {self.learning_rate}")

    def policy(self) -> H2O:
        return H2O(budget=self.budget, sinks=self.sinks)


class MergerData:
    """A teacher pool and the policy's kept slots `[S, L, H, k]` for each of its prefixes. With `cache_dir`, the
    pool and the prefixes' H2O scores are stored there and reused by runs on the same data (another network,
    budget or threshold)."""

    def __init__(self, model: Any, segments: Segments, cfg: MergerTrainConfig, seed: int, desc: str,
                 progress: bool, cache_dir: str | None = None, model_name: str = "") -> None:
        self.pool = teacher_pool(model, segments, cfg, seed, desc, cache_dir, model_name, progress)
        path = None if cache_dir is None else os.path.join(
            cache_dir, f"h2o-scores-{pool_fingerprint(model, segments, cfg, seed, model_name)}.npy")
        if path is not None and os.path.exists(path):
            scores = np.load(path)
        else:
            scores = prefix_scores(model, segments, cfg.prefix, self.pool.offsets, batch_size=cfg.batch_size,
                                   progress=progress).astype(np.float32)
            if path is not None:
                np.save(path + ".tmp.npy", scores)
                os.replace(path + ".tmp.npy", path)
        self.keep = mx.array(keep_slots(scores, cfg.policy()))
        self.source = segments.source

    def __len__(self) -> int:
        return len(self.pool)

    def batch(self, index: np.ndarray) -> dict[str, Any]:
        out = self.pool.batch(index)
        out["keep"] = self.keep[mx.array(np.asarray(index, dtype=np.int32))]
        return out


def mean_kl(model: Any, data: MergerData, fold: Fold, cfg: MergerTrainConfig, desc: str = "KL",
            progress: bool = False) -> float:
    """KL averaged over every query token of the data (no gradient)."""
    from tqdm import tqdm

    total = 0.0
    for lo in tqdm(range(0, len(data), cfg.batch_size), desc=desc, unit="batch", disable=not progress,
                   leave=False):
        index = np.arange(lo, min(lo + cfg.batch_size, len(data)))
        _, kl = merger_loss(model, data.batch(index), fold, threshold=cfg.threshold)
        total += kl.item() * len(index)
    return total / len(data)


def train_merger(model: Any, train: Segments, out_dir: str, config: MergerTrainConfig = MergerTrainConfig(), *,
                 val: Segments | None = None, resume: bool = True, progress: bool = True,
                 stop_at: int | None = None, model_name: str = "",
                 pool_cache: str | None = None) -> tuple[Merger, dict[str, Any]]:
    """Train (or resume) a merger of evicted tokens for `model`. Returns (merger, state); state["baselines"] and
    state["evals"] hold mean KLs (nats per query token) of eviction, D2O and the merger. pool_cache: a folder
    where teacher pools and H2O scores are stored and reused."""
    cfg = config
    if train.tokens.shape[1] != cfg.prefix + cfg.queries:
        raise InvalidArgumentError(f"train: segments of {train.tokens.shape[1]} tokens, config needs "
                                   f"prefix + queries = {cfg.prefix + cfg.queries}")
    os.makedirs(out_dir, exist_ok=True)
    data_info = {"train": train.source, "val": val.source if val is not None else None}
    mx.random.seed(cfg.seed)
    layers, heads, head_dim, _ = model_kv_shape(model)
    merger = new_merger(cfg.network, layers, head_dim, heads)
    anchor_init(merger)
    opt = optim.AdamW(learning_rate=lr_schedule(cfg.learning_rate, cfg.steps, cfg.warmup),
                      weight_decay=cfg.weight_decay)
    state: dict[str, Any] = {"step": 0, "train": asdict(cfg), "data": data_info, "model": model_name,
                             "history": [], "evals": [], "baselines": None}
    saved = load_resumable(out_dir, asdict(cfg), {"data": data_info}, hint="use another --out") if resume else None
    if saved is not None:
        merger = load_merger(os.path.join(out_dir, WEIGHTS))
        load_optimizer_state(out_dir, opt)
        state = saved
    sets = {"train": MergerData(model, train, cfg, cfg.seed, "teacher", progress, pool_cache, model_name)}
    if val is not None:
        sets["val"] = MergerData(model, val, cfg, cfg.seed + 1, "teacher (val)", progress, pool_cache, model_name)
    if state["baselines"] is None:
        state["baselines"] = {name: {split: mean_kl(model, d, fold, cfg, f"KL {name} ({split})", progress)
                                     for split, d in sets.items()}
                              for name, fold in (("h2o", evict_fold), ("d2o", d2o))}
        state["evals"].append(_evaluate(model, merger, sets, cfg, 0, progress))

    def loss_fn(m: Merger, batch: dict[str, Any]) -> tuple[mx.array, mx.array]:
        return merger_loss(model, batch, learned(m), threshold=cfg.threshold)

    def inputs(step: int) -> tuple[dict[str, Any]]:
        return (sets["train"].batch(epoch_batch(step, len(sets["train"]), cfg.batch_size, cfg.seed)),)

    def evaluate(state: dict[str, Any]) -> None:
        if "val" in sets:
            state["evals"].append(_evaluate(model, merger, {"val": sets["val"]}, cfg, state["step"], progress))

    def save(state: dict[str, Any]) -> None:
        meta = metadata(state)
        save_checkpoint(out_dir, WEIGHTS, lambda p: save_merger(merger, p, meta), opt, state)

    end = cfg.steps if stop_at is None else min(cfg.steps, stop_at)
    settings = LoopSettings(end=end, checkpoint_every=cfg.checkpoint_every, grad_clip=cfg.grad_clip,
                            desc="merger", terms=("loss", "kl"), progress=progress)
    run_steps(merger, loss_fn, opt, state, settings, inputs=inputs, evaluate=evaluate, save=save)
    if state["step"] == cfg.steps and "final" not in state:
        state["final"] = _evaluate(model, merger, sets, cfg, state["step"], progress)
        save(state)
    return merger, state


def metadata(state: dict[str, Any]) -> dict[str, str]:
    """What a saved merger records: that it folds evicted tokens, its training settings and last losses."""
    meta = {"train_step": str(state["step"]), "train_config": json.dumps(state["train"]),
            "train_data": json.dumps(state["data"]), "trained_on_model": state.get("model", ""),
            "baselines": json.dumps(state.get("baselines"))}
    if state.get("evals"):
        meta["train_last_eval"] = json.dumps(state["evals"][-1])
    return meta


def _evaluate(model: Any, merger: Merger, sets: dict[str, MergerData], cfg: MergerTrainConfig, step: int,
              progress: bool = False) -> dict[str, Any]:
    return {"step": step, **{split: mean_kl(model, d, learned(merger), cfg, f"KL merger ({split})", progress)
                             for split, d in sets.items()}}


__all__ = ["MergerData", "MergerTrainConfig", "WEIGHTS", "mean_kl", "metadata", "train_merger"]
