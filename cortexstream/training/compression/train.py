"""Training a KV compressor in MLX on the loaded model's own K/V: AdamW, progress bar, checkpoints, exact resume.

Objective (see `objective`): KL(next-token distribution with the full cache || with the compressed cache) on the
Q tokens after a P-token prefix whose older part is merged, plus an optional hidden-state MSE. The model is
frozen; only the compressor's text K/V MLPs get gradients (the image MLPs are not created: `image=False`).

Why resume is exact. A step depends only on (seed, step) and the checkpointed state: the batch is drawn from an
epoch permutation `default_rng([seed, epoch])` over the (deterministic) teacher pool, dropout uses a key derived
from (seed, step), and the learning rate is a schedule of the optimizer's own step counter. A checkpoint is the
weights (`compressor.safetensors`), the full optimizer state (`optimizer.safetensors`) and `state.json`, each
written to a temporary file and renamed, `state.json` last. Resuming with a different TrainConfig (other than
`checkpoint_every`) or other data is refused, since it would silently change the run. The steps themselves run in
the shared loop (`cortexstream.training.loop`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Any

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np

from cortexstream.atomic_files import read_json_file, write_json_atomic
from cortexstream.compression.compressor import CompressorConfig, KVCompressor, head_dim_of
from cortexstream.errors import InvalidArgumentError
from cortexstream.training.checkpoints import save_checkpoint
from cortexstream.training.compression.data import Segments, TeacherPool
from cortexstream.training.compression.objective import MergeFn, compression_loss, mean_pool
from cortexstream.training.loop import (LoopSettings, epoch_batch, load_optimizer_state, load_resumable, lr_schedule,
                                        run_steps)


@dataclass(frozen=True)
class TrainConfig:
    """prefix P / queries Q: tokens per segment; sinks/recent: raw tokens around the merged range while training
    (a smaller `recent` than the policy's puts more of the prefix under compression, so the loss sees it)."""

    factor: int = 4
    prefix: int = 256
    queries: int = 32
    sinks: int = 4
    recent: int = 16
    steps: int = 100
    batch_size: int = 4
    learning_rate: float = 3e-6  # small: Adam moves every weight by ~lr a step, inputs are large
    weight_decay: float = 0.0
    warmup: int = 5
    mse_weight: float = 0.0
    log_mass_bias: bool = False  # add log(factor) to merged slots' attention logits (not in the reference)
    dropout: float = 0.0  # the reference trains with 0.4
    max_offset: int = 3072  # teacher segments start at a random position in [0, max_offset] (see data.TeacherPool)
    init: str = "meanpool"  # "random" (the reference) or "meanpool": start exactly at mean pooling (`meanpool_init`)
    grad_clip: float = 1.0
    checkpoint_every: int = 20
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("factor", "prefix", "queries", "steps", "batch_size", "checkpoint_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name}: must be a positive integer, got {getattr(self, name)!r}")
        if self.factor < 2:
            raise InvalidArgumentError(f"factor: must be >= 2, got {self.factor}")
        if self.prefix - self.sinks - self.recent < self.factor:
            raise InvalidArgumentError(f"prefix: {self.prefix} tokens leave no window of {self.factor} to merge "
                                       f"after {self.sinks} sinks and {self.recent} recent tokens")
        if self.init not in ("random", "meanpool"):
            raise InvalidArgumentError(f"init: '{self.init}' is not 'random' or 'meanpool'")
        if self.init == "meanpool" and self.dropout:
            raise InvalidArgumentError("dropout: must be 0 with init='meanpool' (it would drop the shifted "
                                       "activations, see meanpool_init)")
        if self.learning_rate <= 0 or self.mse_weight < 0:
            raise InvalidArgumentError("learning_rate must be > 0 and mse_weight >= 0")


def meanpool_init(comp: KVCompressor, pool: TeacherPool) -> None:
    """Set every text MLP to compute the window mean exactly, inside the reference architecture.

    Linear(D*f, D) -> ReLU -> Linear(D, D) -> ReLU -> Linear(D, D) can be the identity on the mean m of the window:
    first layer = averaging matrix with bias +c, then identity, then identity with bias -c, where c exceeds any |m|
    so both ReLUs stay in their linear region. c = a power of two >= 4 * max|x| over the pool's K (resp. V) of
    that layer (a margin for other text), exact in float16/32. Training starts at the mean-pooling baseline and
    only has to improve on it, instead of first learning a near-identity through ReLUs from random weights.
    """
    c = comp.config
    average = mx.concatenate([mx.eye(c.head_dim) / c.factor] * c.factor, axis=1)  # token-major windows
    eye, zeros = mx.eye(c.head_dim), mx.zeros((c.head_dim,))
    for layer in range(c.num_layers):
        for mlp, data in ((comp.compress_tk[layer], pool.keys[layer]), (comp.compress_tv[layer], pool.values[layer])):
            shift = float(2.0 ** math.ceil(math.log2(4.0 * max(mx.abs(data).max().item(), 1.0))))
            mlp[0].weight, mlp[0].bias = average, mx.full((c.head_dim,), shift)
            mlp[3].weight, mlp[3].bias = eye, zeros
            mlp[6].weight, mlp[6].bias = eye, mx.full((c.head_dim,), -shift)
    mx.eval(comp.parameters())


def merge_fn(compressor: KVCompressor) -> MergeFn:
    return lambda layer, keys, values: compressor.merge_windows(keys, values, layer)


def mean_kl(model: Any, pool: TeacherPool, merge: MergeFn | None, cfg: TrainConfig, *,
            log_mass_bias: bool = False) -> float:
    """KL averaged over every query token of the pool (no gradient)."""
    total = 0.0
    for lo in range(0, len(pool), cfg.batch_size):
        index = np.arange(lo, min(lo + cfg.batch_size, len(pool)))
        _, kl, _ = compression_loss(model, pool.batch(index), merge, sinks=cfg.sinks, recent=cfg.recent,
                                    factor=cfg.factor, log_mass_bias=log_mass_bias)
        total += kl.item() * len(index)
    return total / len(pool)


def baselines(model: Any, pools: dict[str, TeacherPool], cfg: TrainConfig) -> dict[str, dict[str, float]]:
    """KL of the untrained alternatives in the same layout: mean pooling (without and with a log(factor) logit
    bias on merged slots) and evicting the merged range."""
    runs = {"meanpool": (mean_pool(cfg.factor), False), "meanpool_logbias": (mean_pool(cfg.factor), True),
            "evict": (None, False)}
    return {name: {split: mean_kl(model, pool, merge, cfg, log_mass_bias=bias) for split, pool in pools.items()}
            for name, (merge, bias) in runs.items()}


def checkpoint_metadata(state: dict[str, Any]) -> dict[str, str]:
    """What a saved compressor records about its training (safetensors metadata values are strings)."""
    meta = {"train_step": str(state["step"]), "train_config": json.dumps(state["train"]),
            "train_data": json.dumps(state["data"]), "trained_on_model": state.get("model", "")}
    if state.get("evals"):
        meta["train_last_eval"] = json.dumps(state["evals"][-1])
    return meta


def _save(out_dir: str, comp: KVCompressor, opt: optim.Optimizer, state: dict[str, Any]) -> None:
    metadata = checkpoint_metadata(state)
    save_checkpoint(out_dir, "compressor.safetensors", lambda p: comp.save(p, metadata=metadata), opt, state)


def train_compressor(model: Any, train: Segments, out_dir: str, config: TrainConfig = TrainConfig(), *,
                     val: Segments | None = None, resume: bool = True, progress: bool = True,
                     stop_at: int | None = None, model_name: str = "",
                     pool_cache: str | None = None) -> tuple[KVCompressor, dict[str, Any]]:
    """Train (or resume) a compressor for `model` on `train` segments of prefix + queries tokens.

    pool_cache: a folder where teacher pools are stored and reused (they do not depend on the factor, so runs
    for several factors on the same data share them).
    Returns (compressor in eval mode, state). state["baselines"] and state["evals"] hold mean KLs (nats per query
    token) on the training pool and the `val` pool. stop_at: end this run after that step (checkpointed).
    """
    cfg = config
    if train.tokens.shape[1] != cfg.prefix + cfg.queries:
        raise InvalidArgumentError(f"train: segments of {train.tokens.shape[1]} tokens, config needs "
                                   f"prefix + queries = {cfg.prefix + cfg.queries}")
    os.makedirs(out_dir, exist_ok=True)
    comp_cfg = CompressorConfig(len(model.model.layers), head_dim_of(model), cfg.factor, image=False,
                                dropout=cfg.dropout)
    data = {"train": train.source, "val": val.source if val is not None else None}
    mx.random.seed(cfg.seed)
    comp = KVCompressor(comp_cfg)
    opt = optim.AdamW(learning_rate=lr_schedule(cfg.learning_rate, cfg.steps, cfg.warmup),
                      weight_decay=cfg.weight_decay)
    state: dict[str, Any] = {"step": 0, "train": asdict(cfg), "compressor": asdict(comp_cfg), "data": data,
                             "model": model_name, "history": [], "evals": [], "baselines": None}
    saved = load_resumable(out_dir, asdict(cfg), {"data": data}, hint="use another --out") if resume else None
    if saved is not None:
        comp = KVCompressor.from_file(os.path.join(out_dir, "compressor.safetensors"))
        comp = KVCompressor(comp_cfg).update(comp.parameters())  # keep this run's dropout setting
        load_optimizer_state(out_dir, opt)
        state = saved
    pools = {"train": teacher_pool(model, train, cfg, cfg.seed, "teacher", pool_cache, model_name, progress)}
    if val is not None:
        pools["val"] = teacher_pool(model, val, cfg, cfg.seed + 1, "teacher (val)", pool_cache, model_name, progress)
    if state["baselines"] is None:
        if cfg.init == "meanpool":
            meanpool_init(comp, pools["train"])
        state["baselines"] = _cached_baselines(model, pools, cfg, pool_cache)
        state["evals"].append(_evaluate(model, comp, pools, cfg, 0))

    def loss_fn(c: KVCompressor, batch: dict[str, Any]) -> tuple[mx.array, mx.array, mx.array]:
        return compression_loss(model, batch, merge_fn(c), sinks=cfg.sinks, recent=cfg.recent, factor=cfg.factor,
                                mse_weight=cfg.mse_weight, log_mass_bias=cfg.log_mass_bias)

    def before_step(step: int) -> None:
        mx.random.seed((cfg.seed * 1_000_003 + step) % (2**31))  # dropout masks: a function of (seed, step)

    def inputs(step: int) -> tuple[dict[str, Any]]:
        return (pools["train"].batch(epoch_batch(step, len(pools["train"]), cfg.batch_size, cfg.seed)),)

    def evaluate(state: dict[str, Any]) -> None:
        if "val" in pools:
            comp.eval()
            state["evals"].append(_evaluate(model, comp, {"val": pools["val"]}, cfg, state["step"]))
            comp.train()

    end = cfg.steps if stop_at is None else min(cfg.steps, stop_at)
    comp.train()
    settings = LoopSettings(end=end, checkpoint_every=cfg.checkpoint_every, grad_clip=cfg.grad_clip,
                            desc=f"compressor x{cfg.factor}", terms=("loss", "kl", "mse"), progress=progress)
    run_steps(comp, loss_fn, opt, state, settings, inputs=inputs, before_step=before_step, evaluate=evaluate,
              save=lambda s: _save(out_dir, comp, opt, s))
    comp.eval()
    if state["step"] == cfg.steps and "final" not in state:
        state["final"] = _evaluate(model, comp, pools, cfg, state["step"])
        _save(out_dir, comp, opt, state)
    return comp, state


def teacher_pool(model: Any, segments: Segments, cfg: Any, seed: int, desc: str, cache_dir: str | None,
                 model_name: str, progress: bool) -> TeacherPool:
    """The teacher pool of `segments` (cfg: any config with prefix, batch_size and max_offset), stored in and
    reused from `cache_dir` when given (keyed by the tokens, those settings, the seed and the model)."""
    def build() -> TeacherPool:
        return TeacherPool(model, segments, cfg.prefix, batch_size=cfg.batch_size, progress=progress, desc=desc,
                           max_offset=cfg.max_offset, seed=seed)

    if cache_dir is None:
        return build()
    os.makedirs(cache_dir, exist_ok=True)
    fingerprint = pool_fingerprint(model, segments, cfg, seed, model_name)
    return TeacherPool.cached(os.path.join(cache_dir, f"pool-{fingerprint}.safetensors"), fingerprint, build)


def pool_fingerprint(model: Any, segments: Segments, cfg: Any, seed: int, model_name: str) -> str:
    """What a stored teacher pool depends on, hashed (also names what is stored beside it)."""
    digest = hashlib.sha256(segments.tokens.tobytes())
    digest.update(json.dumps([segments.source, cfg.prefix, cfg.batch_size, cfg.max_offset, seed, model_name,
                              len(model.model.layers)]).encode())
    return digest.hexdigest()[:24]


def _cached_baselines(model: Any, pools: dict[str, TeacherPool], cfg: TrainConfig,
                      cache_dir: str | None) -> dict[str, dict[str, float]]:
    """`baselines`, stored next to the cached pools (they depend on the pools, factor, sinks and recent only)."""
    if cache_dir is None:
        return baselines(model, pools, cfg)
    key = json.dumps([{k: float(np.asarray(p.teacher_logp[:1, :1, :8]).sum()) for k, p in pools.items()},
                      {k: p.source for k, p in pools.items()}, cfg.factor, cfg.sinks, cfg.recent, cfg.max_offset])
    path = os.path.join(cache_dir, f"baselines-{hashlib.sha256(key.encode()).hexdigest()[:24]}.json")
    if os.path.exists(path):
        return read_json_file(path, "cached baselines")
    result = baselines(model, pools, cfg)
    write_json_atomic(path, result, indent=None)
    return result


def _evaluate(model: Any, comp: KVCompressor, pools: dict[str, TeacherPool], cfg: TrainConfig,
              step: int) -> dict[str, Any]:
    return {"step": step, **{split: mean_kl(model, pool, merge_fn(comp), cfg, log_mass_bias=cfg.log_mass_bias)
                             for split, pool in pools.items()}}


__all__ = ["TrainConfig", "baselines", "checkpoint_metadata", "mean_kl", "pool_fingerprint", "teacher_pool", "train_compressor"]
