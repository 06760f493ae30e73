"""The one set of trainer flags: every `cortexstream train <kind>` accepts the same loop options.

What a trainer decides is only their defaults (a compressor learns at 3e-6, a sidecar at 1e-3), given as a
`TrainerDefaults`. `--resume` / `--no-resume` exist for every trainer; their default differs on purpose: C2C and
sidecar runs are cheap to continue and resume by default, while a compressor run refuses an existing `--out`
unless `--resume` is given (its teacher pools and data ranges make a silent restart expensive to get wrong).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from cortexstream.errors import InvalidArgumentError

# Destinations of the loop flags: what `loop_config_kwargs` hands to a trainer's TrainConfig.
LOOP_FIELDS = ("steps", "batch_size", "learning_rate", "weight_decay", "warmup", "grad_clip", "checkpoint_every",
               "seed")


@dataclass(frozen=True)
class TrainerDefaults:
    """Defaults of the shared flags for one trainer. `warmup=None` means a tenth of the steps, at most
    `warmup_cap`; `resume` is what happens to an existing run folder when neither flag is given."""

    steps: int
    batch_size: int
    learning_rate: float
    weight_decay: float = 0.0
    warmup: int | None = None
    warmup_cap: int = 10
    grad_clip: float = 1.0
    checkpoint_every: int = 20
    resume: bool = True

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "checkpoint_every", "warmup_cap"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(f"TrainerDefaults.{name}: {getattr(self, name)} must be >= 1")
        if self.learning_rate <= 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise InvalidArgumentError("TrainerDefaults: learning_rate > 0, weight_decay >= 0, grad_clip >= 0")


def add_trainer_flags(p: argparse.ArgumentParser, defaults: TrainerDefaults) -> None:
    """The loop flags, the same for every trainer."""
    loop = p.add_argument_group("training loop (shared by every trainer)")
    loop.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps in total")
    loop.add_argument("--batch-size", type=int, default=defaults.batch_size)
    loop.add_argument("--learning-rate", "--lr", dest="learning_rate", type=float, default=defaults.learning_rate,
                      help="peak learning rate (linear warm-up, cosine decay to a tenth)")
    loop.add_argument("--weight-decay", type=float, default=defaults.weight_decay, help="AdamW weight decay")
    warmup = defaults.warmup if defaults.warmup is not None else f"steps / 10, at most {defaults.warmup_cap}"
    loop.add_argument("--warmup", type=int, default=defaults.warmup, help=f"warm-up steps (default: {warmup})")
    loop.add_argument("--grad-clip", type=float, default=defaults.grad_clip, help="gradient norm clip (0: none)")
    loop.add_argument("--checkpoint-every", type=int, default=defaults.checkpoint_every)
    loop.add_argument("--seed", type=int, default=0, help="every random draw of a step derives from (seed, step)")
    loop.add_argument("--stop-at", type=int, default=None,
                      help="end this invocation after that step (checkpointed); rerun with --resume to go on")
    resume = loop.add_mutually_exclusive_group()
    resume.add_argument("--resume", dest="resume", action="store_true", default=defaults.resume,
                        help="continue the run in --out exactly where it stopped" +
                             (" (default)" if defaults.resume else ""))
    resume.add_argument("--no-resume", dest="resume", action="store_false",
                        help="never continue a saved run: " + ("start over" if defaults.resume else
                                                                "a used --out is refused (default)"))
    loop.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(warmup_cap=defaults.warmup_cap)


def add_teacher_data_flags(p: argparse.ArgumentParser) -> None:
    """Where the distillation trainers (compressor, merger) take their text and teacher positions from."""
    p.add_argument("--max-offset", type=int, default=3072,
                   help="run each teacher batch at a random position offset in [0, N] (RoPE coverage)")
    p.add_argument("--segments", type=int, default=64, help="training segments (teacher pool size)")
    p.add_argument("--val-segments", type=int, default=8, help="held-out segments (0: none)")
    p.add_argument("--train-offset", type=int, default=65536, help="first training token of wiki_text()")
    p.add_argument("--val-offset", type=int, default=32768, help="first held-out token of wiki_text()")


def check_trainer_flags(args: argparse.Namespace) -> None:
    """Errors name the flag."""
    for name in ("steps", "batch_size", "checkpoint_every"):
        if getattr(args, name) < 1:
            raise InvalidArgumentError(f"--{name.replace('_', '-')}: {getattr(args, name)} must be >= 1")
    if args.learning_rate <= 0:
        raise InvalidArgumentError(f"--learning-rate: {args.learning_rate} must be > 0")
    if args.weight_decay < 0 or args.grad_clip < 0:
        raise InvalidArgumentError(f"--weight-decay {args.weight_decay} and --grad-clip {args.grad_clip} must be >= 0")
    if args.warmup is not None and args.warmup < 0:
        raise InvalidArgumentError(f"--warmup: {args.warmup} must be >= 0")
    if args.stop_at is not None and args.stop_at < 1:
        raise InvalidArgumentError(f"--stop-at: {args.stop_at} must be >= 1")


def loop_config_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """The TrainConfig fields the loop flags set (warm-up resolved)."""
    kwargs = {name: getattr(args, name) for name in LOOP_FIELDS}
    if kwargs["warmup"] is None:
        kwargs["warmup"] = min(args.warmup_cap, max(1, args.steps // 10))
    return kwargs


__all__ = ["LOOP_FIELDS", "TrainerDefaults", "add_teacher_data_flags", "add_trainer_flags", "check_trainer_flags",
           "loop_config_kwargs"]
