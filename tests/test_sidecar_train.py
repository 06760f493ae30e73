"""Sidecar training loop: deterministic batches, checkpoint files, and resume == uninterrupted training (bitwise)."""

from __future__ import annotations

import json
import os

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from cortexstream.training.sidecar.train import TrainConfig, train_sidecar
from cortexstream.training.sidecar.trajectories import CollectConfig, TrajectoryStore, collect_trajectories
from cortexstream.sidecar.porting import load_sidecar, read_sidecar_info
from cortexstream.training.sidecar.train import BatchStream
from tiny_models import tiny_model

NET = {"d_model": 32, "encoder_layers": 1, "num_heads": 2}
TRAIN = TrainConfig(steps=6, batch_size=16, learning_rate=3e-3, warmup=2, probes=4, checkpoint_every=3,
                    mix_chunks=2, seed=5)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> TrajectoryStore:
    directory = str(tmp_path_factory.mktemp("traj"))
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 250, 40).tolist() for _ in range(3)]
    collect_trajectories(tiny_model(seed=2), seqs, directory,
                         CollectConfig(window=8, queries_per_window=4, rows_per_chunk=12), progress=False)
    return TrajectoryStore(directory)


def test_batches_are_a_function_of_step(store):
    a, b = BatchStream(store, 16, 1, 2), BatchStream(store, 16, 1, 2)
    late = b.batch(7)
    for step in range(8):
        batch = a.batch(step)
        assert batch["window_keys"].shape == (16, 8, 16)
    assert all(mx.array_equal(late[k], a.batch(7)[k]) for k in late)
    # one epoch visits distinct rows (keys of different rows differ almost surely)
    epoch = mx.concatenate([a.batch(s)["window_keys"] for s in range(a.per_epoch)])
    flat = np.array(epoch).reshape(epoch.shape[0], -1)
    assert len({row.tobytes() for row in flat}) == a.per_epoch * 16


def _params(net) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in tree_flatten(net.parameters())}


def test_resume_equals_uninterrupted(store, tmp_path):
    full, full_state = train_sidecar(store, str(tmp_path / "full"), network=NET, config=TRAIN, progress=False)
    part, part_state = train_sidecar(store, str(tmp_path / "split"), network=NET, config=TRAIN, progress=False,
                                     stop_at=3)
    assert part_state["step"] == 3
    resumed, state = train_sidecar(store, str(tmp_path / "split"), network=NET, config=TRAIN, progress=False)
    assert state["step"] == 6 and [h[0] for h in state["history"]] == list(range(6))
    assert state["history"] == full_state["history"]
    a, b = _params(full), _params(resumed)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["k_out.weight"], np.zeros_like(a["k_out.weight"]))  # it did train
    # the checkpoint on disk is the returned network, with its config and step
    disk = load_sidecar(str(tmp_path / "full" / "sidecar.safetensors"))
    assert all(np.array_equal(v, _params(disk)[k]) for k, v in a.items())
    info = read_sidecar_info(str(tmp_path / "full" / "sidecar.safetensors"))
    assert info["step"] == 6 and info["config"]["window"] == 8 and info["config"]["num_kv_heads"] == 2
    with open(tmp_path / "full" / "state.json", encoding="utf-8") as fh:
        assert json.load(fh)["step"] == 6
    assert not [f for f in os.listdir(tmp_path / "full") if ".tmp" in f]


def test_resume_refuses_a_different_config(store, tmp_path):
    train_sidecar(store, str(tmp_path), network=NET, config=TRAIN, progress=False, stop_at=3)
    with pytest.raises(ValueError, match="differs"):
        train_sidecar(store, str(tmp_path), network=NET, config=TrainConfig(**{**TRAIN.__dict__, "seed": 6}),
                      progress=False)
    with pytest.raises(ValueError, match="network"):
        train_sidecar(store, str(tmp_path), network={**NET, "d_model": 16}, config=TRAIN, progress=False)
    # checkpoint_every may change; resume=False starts over
    _, state = train_sidecar(store, str(tmp_path), network=NET, config=TrainConfig(**{**TRAIN.__dict__,
                             "checkpoint_every": 1}), progress=False)
    assert state["step"] == 6
    _, fresh = train_sidecar(store, str(tmp_path), network=NET, config=TRAIN, progress=False, resume=False,
                             stop_at=1)
    assert fresh["step"] == 1


def test_too_few_rows(store, tmp_path):
    with pytest.raises(ValueError, match="fewer than batch_size"):
        train_sidecar(store, str(tmp_path), network=NET, config=TrainConfig(batch_size=10_000), progress=False)
