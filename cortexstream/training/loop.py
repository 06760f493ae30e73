"""The one training loop of the learned components (C2C fuser, KV compressor, sidecar).

Each trainer supplies what differs: the module, its loss (a tuple whose first element is minimised, the rest
are logged), the inputs of a step, and the checkpoint writer. The loop supplies what was written three times
before: `nn.value_and_grad`, gradient-norm clipping, the optimizer update, one `mx.eval` per step, the loss
history, the progress bar, evaluation and checkpointing every `checkpoint_every` steps and at the end.

Why resume is exact. Everything a step computes is a function of (seed, step) and the checkpointed state: the
batch (`epoch_batch`: a permutation per epoch from `default_rng([seed, epoch])`), any randomness the trainer
reseeds in `before_step`, and the learning rate (`lr_schedule`, a schedule of the optimizer's own step count,
which is saved with the optimizer state). `load_resumable` refuses a saved run whose settings differ (apart from
`checkpoint_every`), since continuing it would silently change what the steps compute.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_unflatten

from cortexstream.atomic_files import read_json_file
from cortexstream.errors import InvalidArgumentError, ModelLoadError
from cortexstream.models.safetensors_check import check_safetensors

STATE_FILE = "state.json"
OPTIMIZER_FILE = "optimizer.safetensors"
# Fields of a training config that may change between a run and its resumption: they decide when to save, not
# what a step computes.
RESUMABLE_CHANGES = ("checkpoint_every",)


def lr_schedule(learning_rate: float, steps: int, warmup: int) -> Any:
    """Linear warm-up from 1 % of `learning_rate`, then cosine decay to 10 % of it at `steps`."""
    warmup = max(1, min(warmup, steps - 1))
    decay = optim.cosine_decay(learning_rate, max(1, steps - warmup), learning_rate * 0.1)
    return optim.join_schedules([optim.linear_schedule(learning_rate * 0.01, learning_rate, warmup), decay],
                                [warmup])


def epoch_batch(step: int, pool_size: int, batch_size: int, seed: int) -> np.ndarray:
    """Rows of step `step`: consecutive slices of a per-epoch permutation (a function of seed and step only)."""
    per_epoch = max(1, pool_size // batch_size)
    epoch, slot = divmod(step, per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(pool_size)
    return order[slot * batch_size: slot * batch_size + min(batch_size, pool_size)]


def _comparable(config: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in RESUMABLE_CHANGES}


def load_resumable(out_dir: str, train: Mapping[str, Any], same: Mapping[str, Any] | None = None, *,
                   hint: str = "use another --out or --no-resume") -> dict[str, Any] | None:
    """The saved state of the run in `out_dir`, or None when there is none.

    `train` is this run's training config (as a dict); `same` names further parts of the state (data, network
    shape, ...) that must equal the saved ones. A difference raises InvalidArgumentError naming it."""
    path = os.path.join(out_dir, STATE_FILE)
    if not os.path.exists(path):
        return None
    saved = read_json_file(path, "training state")  # a torn state.json is an error naming the file
    if not isinstance(saved, dict) or not isinstance(saved.get("train"), dict):
        raise ModelLoadError(f"{path}: training state has no 'train' config; {hint}")
    if _comparable(saved["train"]) != _comparable(train):
        raise InvalidArgumentError(f"{path}: saved config {saved['train']} differs from this one ({dict(train)}); "
                                   f"{hint}")
    for name, value in (same or {}).items():
        if saved.get(name) != value:
            raise InvalidArgumentError(f"{path}: saved {name} {saved.get(name)} differs from this one ({value}); "
                                       f"{hint}")
    return {**saved, "train": dict(train)}


def load_optimizer_state(out_dir: str, optimizer: optim.Optimizer) -> None:
    """Restore the optimizer's full state (step count, moments) from a checkpoint folder."""
    path = os.path.join(out_dir, OPTIMIZER_FILE)
    check_safetensors(path)  # missing or torn: a ModelLoadError naming the file, not MLX's terse error
    optimizer.state = tree_unflatten(list(mx.load(path).items()))


@dataclass(frozen=True)
class LoopSettings:
    """How the loop runs, apart from what it trains: `end` is the step this call stops at (checkpointed);
    `terms` names the loss tuple's elements for the progress bar; `history` bounds the stored loss rows."""

    end: int
    checkpoint_every: int
    grad_clip: float
    desc: str
    terms: tuple[str, ...]
    progress: bool = True
    history: int = 200

    def __post_init__(self) -> None:
        if self.end < 0 or self.checkpoint_every < 1 or self.history < 1:
            raise InvalidArgumentError(f"loop: end {self.end} >= 0, checkpoint_every {self.checkpoint_every} >= 1 "
                                       f"and history {self.history} >= 1 required")
        if self.grad_clip < 0:
            raise InvalidArgumentError(f"loop: grad_clip {self.grad_clip} must be >= 0 (0: no clipping)")


def run_steps(module: nn.Module, loss_fn: Callable[..., Sequence[mx.array]], optimizer: optim.Optimizer,
              state: dict[str, Any], settings: LoopSettings, *, inputs: Callable[[int], tuple[Any, ...]],
              save: Callable[[dict[str, Any]], None], before_step: Callable[[int], None] | None = None,
              evaluate: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Train `module` in place from `state["step"]` to `settings.end`; returns `state` (updated).

    `loss_fn(module, *inputs(step))` returns (loss, *logged terms). `before_step(step)` runs first in each step
    (reseeding, annealing); `evaluate(state)` runs at each checkpoint, before `save(state)`."""
    from tqdm import tqdm

    value_and_grad = nn.value_and_grad(module, loss_fn)
    bar = tqdm(total=settings.end, initial=state["step"], desc=settings.desc, unit="step",
               disable=not settings.progress)
    while state["step"] < settings.end:
        step = state["step"]
        if before_step is not None:
            before_step(step)
        terms, grads = value_and_grad(module, *inputs(step))
        if settings.grad_clip:
            grads, _ = optim.clip_grad_norm(grads, settings.grad_clip)
        optimizer.update(module, grads)
        mx.eval(module.parameters(), optimizer.state, *terms)
        values = [t.item() for t in terms]
        state["step"] = step + 1
        state["history"] = (state["history"] + [[step, *values]])[-settings.history:]
        bar.update(1)
        bar.set_postfix({name: f"{v:.4f}" for name, v in zip(settings.terms, values)})
        if state["step"] % settings.checkpoint_every == 0 or state["step"] == settings.end:
            if evaluate is not None:
                evaluate(state)
            save(state)
    bar.close()
    return state


__all__ = ["LoopSettings", "epoch_batch", "load_optimizer_state", "load_resumable", "lr_schedule", "run_steps"]
