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
shape is refused: it would silently change what the steps compute.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_unflatten

from cortexstream.c2c.data import size, take
from cortexstream.c2c.distill import distill_terms, fused_forward
from cortexstream.c2c.fusion import CacheFuser
from cortexstream.c2c.porting import _describe, save_fuser
from cortexstream.c2c.projector import C2CProjectorFuser
from cortexstream.errors import InvalidArgumentError
from cortexstream.checkpoints import save_checkpoint

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


def _schedule(cfg: TrainConfig) -> Any:
    warmup = max(1, min(cfg.warmup, cfg.steps - 1))
    decay = optim.cosine_decay(cfg.learning_rate, max(1, cfg.steps - warmup), cfg.learning_rate * 0.1)
    return optim.join_schedules([optim.linear_schedule(cfg.learning_rate * 0.01, cfg.learning_rate, warmup), decay],
                                [warmup])


def batch_index(n: int, batch_size: int, seed: int, step: int) -> list[int]:
    """Rows of step `step`: consecutive slices of a per-epoch permutation (wrapping into the next epoch)."""
    per_epoch = max(1, n // batch_size)
    epoch, start = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return order[start * batch_size : start * batch_size + min(batch_size, n)].tolist()


def _step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step * 7919 + 17) % (2**31)


def _shape_of(fuser: CacheFuser) -> dict[str, Any]:
    described = _describe(fuser)
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
    from tqdm import tqdm

    cfg = config
    n = size(data)
    if n < 1:
        raise InvalidArgumentError("train_fuser: empty example set")
    os.makedirs(out_dir, exist_ok=True)
    state_path = os.path.join(out_dir, "state.json")
    opt = optim.AdamW(learning_rate=_schedule(cfg), weight_decay=cfg.weight_decay)
    state: dict[str, Any] = {"step": 0, "train": asdict(cfg), "fuser": _shape_of(fuser), "history": []}
    if resume and os.path.exists(state_path):
        with open(state_path, encoding="utf-8") as fh:
            saved = json.load(fh)
        ignore = {"checkpoint_every": None}
        if {**saved["train"], **ignore} != {**asdict(cfg), **ignore}:
            raise InvalidArgumentError(f"{state_path}: saved config {saved['train']} differs from {asdict(cfg)}; "
                                       "use another --out or --no-resume")
        if saved["fuser"] != state["fuser"]:
            raise InvalidArgumentError(f"{state_path}: saved fuser shape differs from this fuser's")
        fuser.load_weights(list(mx.load(os.path.join(out_dir, "fuser.safetensors")).items()), strict=True)
        opt.state = tree_unflatten(list(mx.load(os.path.join(out_dir, "optimizer.safetensors")).items()))
        state = {**saved, "train": asdict(cfg)}
    fuser.train()
    projector = isinstance(fuser, C2CProjectorFuser)

    def loss_fn(f: CacheFuser, batch: dict[str, Any], key: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        terms = loss_terms(f, receiver, batch, key)
        return terms["kl"] + cfg.align_weight * terms[cfg.align], terms["kl"], terms[cfg.align]

    value_and_grad = nn.value_and_grad(fuser, loss_fn)
    end = cfg.steps if stop_at is None else min(cfg.steps, stop_at)
    bar = tqdm(total=end, initial=state["step"], desc="c2c", unit="step", disable=not progress)
    while state["step"] < end:
        step = state["step"]
        mx.random.seed(_step_seed(cfg.seed, step))  # dropout draws from the global generator
        if projector:
            for p in fuser.projectors:
                p.update_temperature(step)
        batch = take(data, batch_index(n, cfg.batch_size, cfg.seed, step))
        (loss, kl, align), grads = value_and_grad(fuser, batch, mx.random.key(_step_seed(cfg.seed + 1, step)))
        if cfg.grad_clip:
            grads, _ = optim.clip_grad_norm(grads, cfg.grad_clip)
        opt.update(fuser, grads)
        mx.eval(fuser.parameters(), opt.state, loss, kl, align)
        state["step"] = step + 1
        state["history"] = (state["history"] + [[step, loss.item(), kl.item(), align.item()]])[-500:]
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.4f}", kl=f"{kl.item():.4f}")
        if state["step"] % cfg.checkpoint_every == 0 or state["step"] == end:
            _save(out_dir, fuser, opt, state)
    bar.close()
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


__all__ = ["TrainConfig", "batch_index", "evaluate", "loss_terms", "oracle_ppl", "train_fuser"]
