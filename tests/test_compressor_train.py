"""Compressor training on a tiny model: it learns, it resumes exactly, it keeps off the benchmark's tokens, CLI."""

from __future__ import annotations

import json
import os

import mlx.core as mx
import numpy as np
import pytest

from cortexstream.compression import CompressorConfig, KVCompressor
from cortexstream.training.compression import data as data_module
from cortexstream.training.compression.data import cut_segments, wiki_segments
from cortexstream.training.compression.train import TrainConfig, train_compressor
from cortexstream.errors import InvalidArgumentError
from cortexstream.port import load_safetensors
from tiny_models import random_token_ids

CFG = TrainConfig(factor=4, prefix=40, queries=8, recent=8, sinks=2, steps=6, batch_size=2, checkpoint_every=2,
                  learning_rate=3e-3, warmup=2, init="random", max_offset=0)


def _segments(count=6, offset=0):
    ids = random_token_ids(4000, seed=1)
    return cut_segments(ids, offset, count, CFG.prefix + CFG.queries, "random tokens")


def _weights(comp):
    return {k: np.array(v) for k, v in comp.state_dict().items()}


def test_training_lowers_the_kl_and_records_its_data(sharp, tmp_path):
    model, _ = sharp
    cfg = TrainConfig(**{**CFG.__dict__, "steps": 40, "checkpoint_every": 20})
    comp, state = train_compressor(model, _segments(), str(tmp_path), cfg, val=_segments(2, 3000), progress=False)
    assert state["step"] == 40 and [e["step"] for e in state["evals"]] == [0, 20, 40]
    assert state["final"]["train"] < 0.5 * state["evals"][0]["train"]  # it learned on its training segments
    assert set(state["baselines"]) == {"meanpool", "meanpool_logbias", "evict"}
    tensors, meta = load_safetensors(str(tmp_path / "compressor.safetensors"))
    assert json.loads(meta["train_data"])["train"] == "random tokens tokens [0, 288)"
    assert int(meta["train_step"]) == 40 and int(meta["factor"]) == 4
    again = KVCompressor.from_file(str(tmp_path / "compressor.safetensors"))
    assert all(np.array_equal(w, np.array(again.state_dict()[k])) for k, w in _weights(comp).items())


def test_resume_continues_exactly(sharp, tmp_path):
    model, _ = sharp
    straight, _ = train_compressor(model, _segments(), str(tmp_path / "a"), CFG, progress=False)
    train_compressor(model, _segments(), str(tmp_path / "b"), CFG, progress=False, stop_at=3)
    resumed, state = train_compressor(model, _segments(), str(tmp_path / "b"), CFG, progress=False)
    assert state["step"] == 6 and [h[0] for h in state["history"]] == list(range(6))
    for key, value in _weights(straight).items():
        np.testing.assert_array_equal(np.array(resumed.state_dict()[key]), value, err_msg=key)
    other = TrainConfig(**{**CFG.__dict__, "learning_rate": 1e-2})
    with pytest.raises(InvalidArgumentError, match="differs from this one"):
        train_compressor(model, _segments(), str(tmp_path / "b"), other, progress=False)


def test_bad_configs_and_segments_are_refused(sharp, tmp_path):
    with pytest.raises(InvalidArgumentError, match="prefix: 20 tokens leave no window"):
        TrainConfig(prefix=20, sinks=4, recent=16)
    with pytest.raises(InvalidArgumentError, match="need 5000 tokens, the text has 4000"):
        cut_segments(random_token_ids(4000), 0, 10, 500, "x")
    with pytest.raises(InvalidArgumentError, match="prefix \\+ queries = 48"):
        train_compressor(sharp[0], cut_segments(random_token_ids(400), 0, 2, 30, "x"), str(tmp_path), CFG)


def test_wiki_segments_stay_off_the_benchmark_tokens(monkeypatch, tiny):
    import cortexstream.evaluation.wiki_corpus as wiki_corpus

    _, tokenizer = tiny
    monkeypatch.setattr(wiki_corpus, "wiki_text", lambda: ("the cat sat on the mat. " * 40000, "synthetic"))
    train, val = wiki_segments(tokenizer, train_offset=65536, val_offset=32768, train=3, val=2, length=100)
    assert (train.start, train.stop, val.start, val.stop) == (65536, 65836, 32768, 32968)
    with pytest.raises(InvalidArgumentError, match="overlap the tokens that `bench quality` scores"):
        wiki_segments(tokenizer, train_offset=65536, val_offset=0, train=3, val=2, length=100)
    with pytest.raises(InvalidArgumentError, match="overlap the training tokens"):
        wiki_segments(tokenizer, train_offset=30000, val_offset=30100, train=3, val=2, length=100)


def test_cli_trains_resumes_and_exports(tiny_gguf, tmp_path, monkeypatch, capsys):
    from cortexstream.cli.main import main

    monkeypatch.setattr(data_module, "wiki_segments", lambda tok, **kw: (_segments(), _segments(2, 3000)))
    out = str(tmp_path / "run")
    exports = [str(tmp_path / f"c.{ext}") for ext in ("safetensors", "pth", "bin")]
    base = ["train", "compressor", "--model", tiny_gguf, "--out", out, "--prefix", "40", "--queries", "8",
            "--recent", "8", "--sinks", "2", "--steps", "4", "--batch-size", "2", "--no-progress"]
    assert main(base + ["--stop-at", "2"]) == 0
    assert main(base) != 0 and "holds a run already; pass --resume" in capsys.readouterr().err
    assert main(base + ["--resume"] + [a for path in exports for a in ("--export", path)]) == 0
    assert json.load(open(os.path.join(out, "state.json")))["step"] == 4
    trained = KVCompressor.from_file(os.path.join(out, "compressor.safetensors"))
    want = {k: np.array(v.astype(mx.float16)) for k, v in trained.state_dict().items()}
    for path in exports:  # float16 exports, identical whatever the format
        loaded = KVCompressor.from_file(path)
        assert loaded.factor == 4 and loaded.config.num_layers == 2
        for key, value in want.items():
            np.testing.assert_array_equal(np.array(loaded.state_dict()[key].astype(mx.float16)), value)


def test_teacher_pool_matches_a_plain_cache_and_shifted_positions_are_consistent(sharp):
    """Offset 0: the pool's prefix K/V are a plain full-cache run's. Any offset: the student over an uncompressed
    prefix reproduces the teacher exactly (KL 0), so the offsets reach RoPE consistently on both sides."""
    from mlx_lm.models.cache import KVCache

    from cortexstream.training.compression.data import TeacherPool
    from cortexstream.training.compression.objective import compression_loss
    from cortexstream.training.compression.train import mean_kl

    model, _ = sharp
    segments = _segments(4)
    plain = TeacherPool(model, segments, CFG.prefix, batch_size=2, progress=False)
    caches = [KVCache() for _ in model.model.layers]
    model.model(mx.array(segments.tokens[:2]), cache=caches)
    np.testing.assert_allclose(np.array(plain.keys[1][:2]), np.array(caches[1].keys[:, :, : CFG.prefix]), atol=1e-5)
    shifted = TeacherPool(model, segments, CFG.prefix, batch_size=2, progress=False, max_offset=500, seed=3)
    assert len(set(shifted.offsets.tolist())) == 2 and shifted.offsets.max() > 0
    assert not np.allclose(np.array(shifted.keys[0][:2]), np.array(plain.keys[0][:2]), atol=1e-3)  # rotated
    _, kl, mse = compression_loss(model, shifted.batch(np.arange(4)), None, sinks=CFG.prefix, recent=0, factor=4)
    assert kl.item() < 1e-6 and mse.item() < 1e-8  # nothing merged: student == teacher
    assert mean_kl(model, shifted, None, CFG) > 1e-3  # evicting the old tokens does change the predictions


def test_teacher_pools_are_stored_and_reused(sharp, tmp_path):
    from cortexstream.training.compression import data
    from cortexstream.training.compression.train import teacher_pool

    model, _ = sharp
    cfg = TrainConfig(**{**CFG.__dict__, "max_offset": 300})
    first = teacher_pool(model, _segments(4), cfg, 0, "t", str(tmp_path), "tiny", False)
    built = []
    original = data.TeacherPool.__init__
    try:
        data.TeacherPool.__init__ = lambda *a, **k: built.append(1) or original(*a, **k)
        again = teacher_pool(model, _segments(4), cfg, 0, "t", str(tmp_path), "tiny", False)
        other = teacher_pool(model, _segments(4), cfg, 1, "t", str(tmp_path), "tiny", False)  # another seed: rebuilt
    finally:
        data.TeacherPool.__init__ = original
    assert built == [1] and len(os.listdir(tmp_path)) == 2
    np.testing.assert_array_equal(again.offsets, first.offsets)
    for a, b in zip(first.keys + [first.teacher_logp, first.queries], again.keys + [again.teacher_logp, again.queries]):
        assert mx.array_equal(a, b).item()
    assert not np.array_equal(other.offsets, first.offsets)


def test_meanpool_init_reproduces_mean_pooling_exactly(sharp, tmp_path):
    from cortexstream.training.compression.data import TeacherPool
    from cortexstream.training.compression.objective import mean_pool
    from cortexstream.training.compression.train import mean_kl, meanpool_init, merge_fn

    model, _ = sharp
    pool = TeacherPool(model, _segments(4), CFG.prefix, batch_size=2, progress=False)
    comp = KVCompressor(CompressorConfig(2, 16, 4, image=False))
    meanpool_init(comp, pool)
    x = pool.keys[1][:2, :, 8:24]  # [B, H, 16, D]: 4 windows
    got_k, got_v = comp.merge_windows(x, x * 0.5, 1)
    want_k, want_v = mean_pool(4)(1, x, x * 0.5)
    np.testing.assert_allclose(np.array(got_k), np.array(want_k), atol=1e-5)
    np.testing.assert_allclose(np.array(got_v), np.array(want_v), atol=1e-5)
    assert abs(mean_kl(model, pool, merge_fn(comp), CFG) - mean_kl(model, pool, mean_pool(4), CFG)) < 1e-4
    with pytest.raises(InvalidArgumentError, match="dropout: must be 0 with init='meanpool'"):
        TrainConfig(init="meanpool", dropout=0.1)
