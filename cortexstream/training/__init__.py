"""Learned components' training, kept apart from inference.

Policies and the engine load networks and shipped weights from `cortexstream.c2c`, `cortexstream.compression`
and `cortexstream.sidecar`; nothing in the request path imports this package. Here live what only training,
distillation and comparison need:

- `loop`: the one training loop (value_and_grad, gradient clipping, optimizer update, evaluation,
  checkpoints, progress bar, exact resume) and the learning-rate schedule and batch order the trainers share;
- `flags`: the one set of trainer flags (`--steps`, `--batch-size`, `--lr`, `--seed`, `--resume`, ...) every
  `cortexstream train <kind>` accepts;
- `checkpoints`: atomic checkpoint files (weights, optimizer state, `state.json`);
- `text`: training text disjoint from what the benchmarks score;
- `c2c/`, `compression/`, `sidecar/`: each component's objective, data, trainer and its CLI (`cli.py`, found by
  `cortexstream.cli.training`).
"""
