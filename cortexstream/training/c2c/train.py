"""Training a C2C fuser in MLX: logit distillation to the full-context receiver plus optional state alignment.

The models stay frozen; only the fuser's parameters get gradients (they are the only arguments of
`nn.value_and_grad`). The task and loss are in `distill.py`; example sets in `data.py`.

Why resume is exact. Everything a step depends on is a function of (seed, step): the batch (a permutation of the
example set per epoch from `default_rng([seed, epoch])`), the Gumbel noise of the paper's gates (a key derived
from seed and step), dropout (the global MLX generator is reseeded from seed and step before each step), the gate
temperature (`update_temperature(step)`) and the learning rate (a schedule of the optimizer's own step count).
A checkpoint is the fuser (`fuser.safetensors`, the `porting.save_fuser` format), the optimizer state
(`optimizer.safetensors`) and `state.json`, each written to a temporary file and renamed, `state.json` last, so a
run killed mid-write resumes from the previous complete checkpoint. Resuming with another config or another fuser
shape is refused: it would silently change what the steps compute. The steps themselves run in the shared loop
(`cortexstream.training.loop`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np

from cortexstream.c2c.fusion import CacheFuser
from cortexstream.c2c.porting import describe_fuser, save_fuser
from cortexstream.c2c.projector import C2CProjectorFuser
from cortexstream.errors import InvalidArgumentError
from cortexstream.models.safetensors_check import check_safetensors
from cortexstream.training.c2c.data import size, take
from cortexstream.training.c2c.distill import distill_terms, fused_forward
from cortexstream.training.checkpoints import save_checkpoint
from cortexstream.training.loop import (LoopSettings, epoch_batch, load_optimizer_state, load_resumable, lr_schedule,
                                        run_steps)

ALIGN = ("mse", "cos")


@dataclass(frozen=True)
class TrainConfig:
    """align_weight x state alignment (`align`: normalised "mse" or 1 - "cos" of final hidden states) is added
    to the KL; 0 trains on logits only."""

    steps: int = 200
    batch_size: int = 4
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    warmup: int = 10
    align_weight: float = 0.0
    align: str = "mse"
    grad_clip: float = 1.0
    checkpoint_every: int = 50
    seed: int = 0

    def __post_init__(self) -> None:
        if self.align not in ALIGN:
            raise InvalidArgumentError(f"align: {self.align!r} must be one of {ALIGN}")
        for name in ("steps", "batch_size", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name}: {getattr(self, name)} must be >= 1")
        if self.learning_rate <= 0 or self.align_weight < 0:
            raise InvalidArgumentError("learning_rate must be > 0 and align_weight >= 0")


def _step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step * 7919 + 17) % (2**31)


def _shape_of(fuser: CacheFuser) -> dict[str, Any]:
    described = describe_fuser(fuser)
    described.pop("gate_temperatures", None)  # annealed during training: a function of the step, not the shape
    return json.loads(json.dumps(described))


def _save(out_dir: str, fuser: CacheFuser, opt: optim.Optimizer, state: dict[str, Any]) -> None:
    save_checkpoint(out_dir, "fuser.safetensors", lambda p: save_fuser(fuser, p), opt, state)


def loss_terms(fuser: CacheFuser, receiver: Any, batch: dict[str, Any], key: mx.array | None = None
               ) -> dict[str, mx.array]:
    """Distillation terms of the fuser on a batch (training or eval mode as the fuser is set)."""
    if isinstance(fuser, C2CProjectorFuser):
        fused = fuser.fused_layers(batch["src"], batch["tgt"], key=key)
    else:
        fused = fuser.fused_layers(batch["src"], batch["tgt"])
    return distill_terms(receiver, fused_forward(receiver, fused, batch["inputs"]), batch["oracle_hidden"],
                         batch["targets"])


def train_fuser(fuser: CacheFuser, receiver: Any, data: dict[str, Any], out_dir: str, *,
                config: TrainConfig = TrainConfig(), resume: bool = True, progress: bool = True,
                stop_at: int | None = None) -> tuple[CacheFuser, dict[str, Any]]:
    """Train `fuser` (in place) on a stacked example set; returns (fuser, state). `stop_at` ends this run early
    (checkpointed) so a later call with resume=True continues to `config.steps`."""
    cfg = config
    n = size(data)
    if n < 1:
        raise InvalidArgumentError("train_fuser: empty example set")
    os.makedirs(out_dir, exist_ok=True)
    opt = optim.AdamW(learning_rate=lr_schedule(cfg.learning_rate, cfg.steps, cfg.warmup),
                      weight_decay=cfg.weight_decay)
    state: dict[str, Any] = {"step": 0, "train": asdict(cfg), "fuser": _shape_of(fuser), "history": []}
    saved = load_resumable(out_dir, asdict(cfg), {"fuser": state["fuser"]}) if resume else None
    if saved is not None:
        weights = os.path.join(out_dir, "fuser.safetensors")
        check_safetensors(weights)  # missing or torn: named, not a terse MLX error
        fuser.load_weights(list(mx.load(weights).items()), strict=True)
        load_optimizer_state(out_dir, opt)
        state = saved
    fuser.train()
    projector = isinstance(fuser, C2CProjectorFuser)

    def loss_fn(f: CacheFuser, batch: dict[str, Any], key: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        terms = loss_terms(f, receiver, batch, key)
        return terms["kl"] + cfg.align_weight * terms[cfg.align], terms["kl"], terms[cfg.align]

    def before_step(step: int) -> None:
        mx.random.seed(_step_seed(cfg.seed, step))  # dropout draws from the global generator
        if projector:
            for p in fuser.projectors:
                p.update_temperature(step)

    def inputs(step: int) -> tuple[dict[str, Any], mx.array]:
        return (take(data, epoch_batch(step, n, cfg.batch_size, cfg.seed).tolist()),
                mx.random.key(_step_seed(cfg.seed + 1, step)))

    end = cfg.steps if stop_at is None else min(cfg.steps, stop_at)
    settings = LoopSettings(end=end, checkpoint_every=cfg.checkpoint_every, grad_clip=cfg.grad_clip, desc="c2c",
                            terms=("loss", "kl", cfg.align), progress=progress, history=500)
    run_steps(fuser, loss_fn, opt, state, settings, inputs=inputs, before_step=before_step,
              save=lambda s: _save(out_dir, fuser, opt, s))
    fuser.eval()
    return fuser, state


def evaluate(fuser: CacheFuser | None, receiver: Any, data: dict[str, Any], batch_size: int = 8) -> dict[str, float]:
    """Held-out means over all examples, eval mode (hard gates, no dropout): KL to the oracle (nats/token) and
    perplexity of the continuation for the fused receiver; `fuser=None` scores the receiver without fusion."""
    n = size(data)
    sums = {"kl": 0.0, "nll": 0.0, "mse": 0.0, "cos": 0.0}
    if fuser is not None:
        fuser.eval()
    for lo in range(0, n, batch_size):
        batch = take(data, range(lo, min(n, lo + batch_size)))
        if fuser is None:
            terms = distill_terms(receiver, batch["plain_hidden"], batch["oracle_hidden"], batch["targets"])
        else:
            active = fuser.open_layers(len(batch["src"]))
            fused = fuser.fused_layers(batch["src"], batch["tgt"], active)
            terms = distill_terms(receiver, fused_forward(receiver, fused, batch["inputs"]), batch["oracle_hidden"],
                                  batch["targets"])
        rows = batch["inputs"].shape[0]
        for k in sums:
            sums[k] += terms[k].item() * rows
    out = {k: v / n for k, v in sums.items()}
    out["ppl"] = float(np.exp(out.pop("nll")))
    return out


def oracle_ppl(receiver: Any, data: dict[str, Any], batch_size: int = 8) -> float:
    """Perplexity of the continuation for the receiver that read the whole context (the target)."""
    n, total = size(data), 0.0
    for lo in range(0, n, batch_size):
        batch = take(data, range(lo, min(n, lo + batch_size)))
        terms = distill_terms(receiver, batch["oracle_hidden"], batch["oracle_hidden"], batch["targets"])
        total += terms["nll"].item() * batch["inputs"].shape[0]
    return float(np.exp(total / n))


__all__ = ["TrainConfig", "evaluate", "loss_terms", "oracle_ppl", "train_fuser"]
