"""The shipped sidecar weights on SmolLM2: `Sidecar(window=16)` needs no training step and works through
`cortexstream.perplexity` and `cortexstream.generate` (a few seconds)."""

from __future__ import annotations

import math

import pytest

import cortexstream
from cortexstream.policies.sidecar import Sidecar
from cortexstream.sidecar.shipped import shipped_files

TEXT = ("The river rises in the northern hills and flows south through farmland, past three market towns and a "
        "cathedral city, before it reaches the sea at a wide estuary where ships once unloaded wool and timber. ") * 4


@pytest.mark.real_model
def test_shipped_window16_on_smollm2(smollm):
    model, tokenizer = smollm
    windows = {info["config"]["window"] for _, info in shipped_files()}
    assert 16 in windows, "no shipped window-16 weights in cortexstream/sidecar/weights"
    policy = Sidecar(window=16, sinks=4, recent=32)
    full = cortexstream.perplexity(model, tokenizer, TEXT)
    beads = cortexstream.perplexity(model, tokenizer, TEXT, kv_policy=policy, chunk_size=16)
    assert math.isfinite(beads) and beads < 2 * full  # compressed, but still reading the same text
    assert beads != full
    out = cortexstream.generate(model, tokenizer, TEXT + " The river", max_tokens=4,
                                kv_policy="sidecar:window=16,sinks=4,recent=32")
    assert isinstance(out, str) and out
