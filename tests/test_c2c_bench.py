"""`bench c2c` latency paths on tiny models: both reach the receiver's first-token logits, the relay leaves the
sharer's cache as it found it (every trial starts from the same state), and the C2C path really fuses."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from cortexstream.benchmarks.c2c_latency import c2c_once, handoff_latency, relay_once, sharer_state
from cortexstream.c2c import C2CProjectorFuser
from tiny_models import tiny_model

CONTEXT = 10


def test_relay_restores_the_sharer_cache(tiny):
    _, tokenizer = tiny
    sharer = tiny_model(41)
    ids = np.random.default_rng(0).integers(3, 250, CONTEXT + 6).tolist()
    cache = sharer_state(sharer, ids, len(ids) - 1)
    before = [(c.offset, np.array(c.keys[..., : c.offset, :])) for c in cache]
    row = relay_once(sharer, tokenizer, cache, ids[-1], tiny_model(42), tokenizer, ids[CONTEXT:], relay_tokens=5)
    assert row["total"] > 0 and row["receiver_tokens"] >= len(ids) - CONTEXT
    for (offset, keys), c in zip(before, cache):
        assert c.offset == offset and np.array_equal(np.array(c.keys[..., :offset, :]), keys)


def test_c2c_path_fuses_and_reports_both_paths(tiny):
    _, tokenizer = tiny
    receiver = tiny_model(43)
    sharer = tiny_model(44, num_hidden_layers=3, num_key_value_heads=1, head_dim=32, num_attention_heads=2)
    fuser = C2CProjectorFuser.from_models(sharer, receiver, hidden_dim=16, intermediate_dim=16)
    for p in fuser.projectors:
        p.key_gate_logit, p.value_gate_logit = mx.array(1.0), mx.array(1.0)
    ids = np.random.default_rng(1).integers(3, 250, CONTEXT + 6).tolist()
    out = handoff_latency(receiver, tokenizer, sharer, tokenizer, fuser, ids, ids, CONTEXT, relay_tokens=(3,),
                          trials=1)
    assert out["fused_layers"] == len(receiver.layers) and out["c2c"]["total"] > 0
    assert out["relay"]["3"]["speedup_c2c"] > 0
    cache = sharer_state(sharer, ids, len(ids) - 1)
    fuser.last_released_rows = 0
    c2c_once(receiver, fuser, cache, ids[CONTEXT:], CONTEXT)
    assert fuser.last_released_rows > 0  # the fuser changed the receiver's cache
