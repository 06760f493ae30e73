"""The one training loop and the one set of trainer flags that the C2C, compressor and sidecar trainers share."""

from __future__ import annotations

import json
import os

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest

from cortexstream.cli.main import build_parser
from cortexstream.cli.training import TRAINERS
from cortexstream.errors import InvalidArgumentError
from cortexstream.training.checkpoints import save_checkpoint
from cortexstream.training.flags import LOOP_FIELDS, loop_config_kwargs
from cortexstream.training.loop import (LoopSettings, epoch_batch, load_optimizer_state, load_resumable, lr_schedule,
                                        run_steps)

LOOP_FLAGS = ["--steps", "7", "--batch-size", "3", "--lr", "0.02", "--weight-decay", "0.1", "--warmup", "2",
              "--grad-clip", "0.5", "--checkpoint-every", "4", "--seed", "9", "--stop-at", "5", "--no-progress"]
REQUIRED = {"compressor": ["--out", "run"], "merger": ["--out", "run"]}
X = mx.array(np.random.default_rng(0).normal(size=(12, 4)).astype(np.float32))
Y = X @ mx.array([[1.0], [-2.0], [0.5], [3.0]])


@pytest.mark.parametrize("kind", sorted(TRAINERS))
def test_every_trainer_takes_the_same_loop_flags(kind):
    args = build_parser().parse_args(["train", kind, *REQUIRED.get(kind, []), *LOOP_FLAGS, "--resume"])
    assert loop_config_kwargs(args) == {"steps": 7, "batch_size": 3, "learning_rate": 0.02, "weight_decay": 0.1,
                                        "warmup": 2, "grad_clip": 0.5, "checkpoint_every": 4, "seed": 9}
    assert args.stop_at == 5 and args.no_progress and args.resume
    assert not build_parser().parse_args(["train", kind, *REQUIRED.get(kind, []), "--no-resume"]).resume


def test_trainers_keep_their_own_defaults():
    parse = build_parser().parse_args
    c2c, sidecar, comp = parse(["train", "c2c"]), parse(["train", "sidecar"]), parse(["train", "compressor",
                                                                                         "--out", "r"])
    assert (c2c.learning_rate, sidecar.learning_rate, comp.learning_rate) == (1e-3, 1e-3, 3e-6)
    assert (c2c.resume, sidecar.resume, comp.resume) == (True, True, False)  # a compressor refuses a used --out
    assert loop_config_kwargs(parse(["train", "sidecar", "--steps", "3000"]))["warmup"] == 100  # capped steps/10
    assert loop_config_kwargs(parse(["train", "c2c", "--steps", "50"]))["warmup"] == 5
    assert loop_config_kwargs(comp)["warmup"] == 5 and set(LOOP_FIELDS) == set(loop_config_kwargs(comp))


def test_epoch_batches_cover_the_pool_once_per_epoch_and_depend_on_seed_and_step_only():
    seen = np.concatenate([epoch_batch(step, 10, 3, seed=4) for step in range(3)])
    assert len(set(seen.tolist())) == 9 and epoch_batch(7, 10, 3, 4).tolist() == epoch_batch(7, 10, 3, 4).tolist()
    assert len(epoch_batch(0, 2, 5, 0)) == 2  # a pool smaller than a batch gives the whole pool


def test_the_schedule_warms_up_then_decays_to_a_tenth():
    schedule = lr_schedule(1.0, steps=20, warmup=5)
    assert schedule(0).item() == pytest.approx(0.01) and schedule(5).item() == pytest.approx(1.0)
    assert schedule(20).item() == pytest.approx(0.1)


def _train(out_dir: str, end: int, resume: bool) -> tuple[nn.Linear, dict]:
    os.makedirs(out_dir, exist_ok=True)
    mx.random.seed(0)
    model = nn.Linear(4, 1)
    opt = optim.AdamW(learning_rate=lr_schedule(0.05, 8, 2))
    state = {"step": 0, "train": {"steps": 8, "checkpoint_every": 3}, "history": []}
    saved = load_resumable(out_dir, state["train"]) if resume else None
    if saved is not None:
        model.load_weights(f"{out_dir}/w.safetensors")
        load_optimizer_state(out_dir, opt)
        state = saved
    checkpoints = []

    def save(s: dict) -> None:
        checkpoints.append(s["step"])
        save_checkpoint(out_dir, "w.safetensors", model.save_weights, opt, s)

    def loss_fn(m: nn.Linear, rows: mx.array) -> tuple[mx.array, mx.array]:
        err = m(X[rows]) - Y[rows]
        return (err * err).mean(), mx.abs(err).mean()

    settings = LoopSettings(end=end, checkpoint_every=3, grad_clip=1.0, desc="t", terms=("mse", "mae"),
                            progress=False)
    run_steps(model, loss_fn, opt, state, settings, save=save,
              inputs=lambda step: (mx.array(epoch_batch(step, 12, 4, 0)),))
    state["checkpoints"] = checkpoints
    return model, state


def test_a_run_stopped_and_resumed_ends_where_one_run_ends(tmp_path):
    whole, state = _train(str(tmp_path / "a"), 8, resume=False)
    assert state["checkpoints"] == [3, 6, 8] and [row[0] for row in state["history"]] == list(range(8))
    assert state["history"][-1][1] < state["history"][0][1]
    _train(str(tmp_path / "b"), 4, resume=False)
    resumed, second = _train(str(tmp_path / "b"), 8, resume=True)
    assert second["checkpoints"] == [6, 8] and second["step"] == 8
    assert mx.array_equal(resumed.weight, whole.weight) and mx.array_equal(resumed.bias, whole.bias)


def test_resume_refuses_another_config_but_not_another_checkpoint_interval(tmp_path):
    (tmp_path / "state.json").write_text(json.dumps({"step": 2, "train": {"steps": 8, "checkpoint_every": 3},
                                                     "shape": [4, 1]}))
    assert load_resumable(str(tmp_path), {"steps": 8, "checkpoint_every": 5})["train"]["checkpoint_every"] == 5
    with pytest.raises(InvalidArgumentError, match="saved config"):
        load_resumable(str(tmp_path), {"steps": 9, "checkpoint_every": 3})
    with pytest.raises(InvalidArgumentError, match="saved shape"):
        load_resumable(str(tmp_path), {"steps": 8, "checkpoint_every": 3}, {"shape": [4, 2]})
    assert load_resumable(str(tmp_path / "empty"), {"steps": 8}) is None


def test_loop_settings_are_checked():
    with pytest.raises(InvalidArgumentError, match="checkpoint_every"):
        LoopSettings(end=3, checkpoint_every=0, grad_clip=1.0, desc="t", terms=("loss",))
    with pytest.raises(InvalidArgumentError, match="grad_clip"):
        LoopSettings(end=3, checkpoint_every=1, grad_clip=-1.0, desc="t", terms=("loss",))
