"""The prefix cache's disk tier in the engine (engine/disk_tier.py): blocks written behind, found again by a new
engine on the same directory (a restart), read back instead of recomputed with the same greedy tokens, and never
shared across models, KV storage, block sizes or tenants; damaged files are recomputed, never loaded."""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest

from cortexstream.engine.engine import Engine
from cortexstream.kv.disk import DiskTierLockedError, DiskTierUnavailableError
from tests.test_engine import run_all
from tests.tiny_models import tiny_model

BS = 4


def _prompt(seed: int, n: int = 70) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, 250, size=n)]


def _engine(model, tokenizer, directory, **options) -> Engine:
    options.setdefault("block_size", BS)
    return Engine(model, tokenizer, kv_tokens=1024, kv_disk=str(directory), kv_disk_size="64MiB", **options)


def _greedy(engine: Engine, prompt: list[int], n: int = 12, tenant: str | None = None) -> list[int]:
    rid = engine.add_request(prompt, max_tokens=n, tenant=tenant)
    return run_all(engine)[rid]["tokens"]


def _without_disk(model, tokenizer, prompt, n=12, **options) -> list[int]:
    options.setdefault("block_size", BS)
    return _greedy(Engine(model, tokenizer, kv_tokens=1024, **options), prompt, n)


def test_restart_reads_prefix_back_with_the_same_tokens(tiny, tmp_path):
    model, tokenizer = tiny
    prompt = _prompt(1)
    expected = _without_disk(model, tokenizer, prompt)
    with _engine(model, tokenizer, tmp_path) as first:
        assert _greedy(first, prompt) == expected
        assert first.stats()["disk_restored_blocks"] == 0
    assert glob.glob(str(tmp_path / "*")), "the tier wrote nothing"
    second = _engine(model, tokenizer, tmp_path)
    computed_before = second.num_prompt_tokens_computed
    assert _greedy(second, prompt) == expected
    stats = second.stats()
    full_blocks = len(prompt) // BS
    assert stats["disk_hit_blocks"] == full_blocks
    assert stats["disk_restored_blocks"] == full_blocks
    assert stats["disk_restored_tokens"] == full_blocks * BS
    # Only the tokens past the restored blocks were computed (the last prompt token at least).
    assert second.num_prompt_tokens_computed - computed_before == len(prompt) - full_blocks * BS
    second.close()


def test_restore_while_another_request_decodes_keeps_both_exact(tiny, tmp_path):
    model, tokenizer = tiny
    shared, other = _prompt(2, 90), _prompt(3, 30)
    expected_shared = _without_disk(model, tokenizer, shared, 16)
    expected_other = _without_disk(model, tokenizer, other, 24)
    with _engine(model, tokenizer, tmp_path) as first:
        _greedy(first, shared, 16)
    # `shared` prefills while `other` decodes: a fixed budget ("auto" follows measured step times) keeps its
    # chunks the same every run.
    engine = _engine(model, tokenizer, tmp_path, prefill_tokens_while_decoding=8)
    a = engine.add_request(other, max_tokens=24)
    results = {}
    from tests.test_engine import collect
    collect(engine.step(), results)  # `other` is running before `shared` arrives
    b = engine.add_request(shared, max_tokens=16)
    run_all(engine, results)
    assert results[a]["tokens"] == expected_other
    assert results[b]["tokens"] == expected_shared
    assert engine.stats()["disk_restored_blocks"] == len(shared) // BS
    engine.close()


@pytest.mark.parametrize("change", ["model", "kv_dtype", "block_size", "tenant"])
def test_blocks_never_cross_models_storage_block_sizes_or_tenants(tiny, tmp_path, change):
    import cortexstream

    model, tokenizer = tiny
    prompt = _prompt(4)
    with _engine(model, tokenizer, tmp_path) as first:
        _greedy(first, prompt, tenant="alice")
    options, tenant, other_model = {}, "alice", model
    if change == "model":
        other_model = tiny_model(seed=8)
    elif change == "kv_dtype":
        options["kv_dtype"] = "float16"  # the tiny model's head dim is too small for quantized groups
    elif change == "block_size":
        options["block_size"] = 8
    else:
        tenant = "bob"
    second = _engine(other_model, tokenizer, tmp_path, **options)
    _greedy(second, prompt, tenant=tenant)
    assert second.stats()["disk_hit_blocks"] == 0
    second.close()


def test_damaged_segment_is_recomputed_never_loaded(tiny, tmp_path):
    model, tokenizer = tiny
    prompt = _prompt(5, 80)
    expected = _without_disk(model, tokenizer, prompt)
    with _engine(model, tokenizer, tmp_path) as first:
        _greedy(first, prompt)
    segments = [p for p in glob.glob(str(tmp_path / "*")) if os.path.isfile(p) and os.path.getsize(p) > 4096]
    assert segments
    rng = np.random.default_rng(0)
    for path in segments:  # flip bytes all over the payloads
        data = bytearray(open(path, "rb").read())
        for i in rng.integers(len(data) // 4, len(data), size=50):
            data[i] ^= 0xFF
        open(path, "wb").write(bytes(data))
    second = _engine(model, tokenizer, tmp_path)
    assert _greedy(second, prompt) == expected
    stats = second.stats()
    assert stats["disk_restored_blocks"] < len(prompt) // BS
    assert stats["disk_corrupt_skipped"] + stats["disk_failed_blocks"] > 0
    second.close()


def test_second_engine_on_the_same_directory(tiny, tmp_path):
    model, tokenizer = tiny
    first = _engine(model, tokenizer, tmp_path)
    with pytest.raises(DiskTierLockedError, match=str(tmp_path)):
        _engine(model, tokenizer, tmp_path)
    fallback = _engine(model, tokenizer, tmp_path, kv_disk_required=False)
    assert fallback.disk is None and str(tmp_path) in fallback.disk_problem
    prompt = _prompt(6, 20)
    assert _greedy(fallback, prompt) == _without_disk(model, tokenizer, prompt)
    first.close()
    _engine(model, tokenizer, tmp_path).close()  # free again once the owner closed


def test_unusable_directory(tiny, tmp_path):
    model, tokenizer = tiny
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(DiskTierUnavailableError, match="file"):
        _engine(model, tokenizer, not_a_dir)
    engine = _engine(model, tokenizer, not_a_dir, kv_disk_required=False)
    assert engine.disk is None and engine.disk_problem


def test_preempted_sequence_comes_back_from_disk(tiny, tmp_path):
    model, tokenizer = tiny
    prompts = [_prompt(10 + i, 60) for i in range(3)]
    expected = [_without_disk(model, tokenizer, p, 40) for p in prompts]
    # Preempted prompts come back while others decode: a fixed budget ("auto" follows measured step times) keeps
    # their chunks, and so when preemption strikes, the same every run.
    engine = Engine(model, tokenizer, kv_tokens=48 * BS, block_size=BS, kv_disk=str(tmp_path),
                    kv_disk_size="64MiB", prefill_tokens_while_decoding=8)
    ids = [engine.add_request(p, max_tokens=40) for p in prompts]
    results = run_all(engine)
    assert [results[i]["tokens"] for i in ids] == expected
    assert engine.scheduler.num_preemptions > 0
    assert engine.stats()["disk_restored_blocks"] > 0
    engine.close()


def test_snapshot_and_tui_show_which_blocks_are_on_disk(tiny, tmp_path):
    from cortexstream.tui.messages import FLAG_ON_DISK
    from cortexstream.tui.widgets.block_map import _cell

    model, tokenizer = tiny
    engine = _engine(model, tokenizer, tmp_path)
    prompt = _prompt(7, 40)
    _greedy(engine, prompt)
    assert engine.disk.flush(10.0)
    view = engine.snapshot()
    assert view.disk_blocks and set(view.disk_blocks) <= set(view.prefix_cached_blocks)
    assert len(view.disk_blocks) == engine.stats()["disk_blocks"]
    glyph, style = _cell(3, FLAG_ON_DISK)
    assert "underline" in style and "underline" not in _cell(3, 0)[1]
    engine.close()
    assert Engine(model, tokenizer, kv_tokens=256, block_size=BS).snapshot().disk_blocks == ()


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_smollm_round_trip_through_disk_gives_the_recomputed_tokens(smollm, tmp_path, kv_dtype):
    model, tokenizer = smollm
    text = ("The lighthouse keeper wrote down the ships that passed each night, and the list grew long. " * 12)
    prompt = tokenizer.encode(text)
    options = {"block_size": 16, "kv_dtype": kv_dtype}
    expected = _without_disk(model, tokenizer, prompt, 16, **options)
    with _engine(model, tokenizer, tmp_path, **options) as first:
        assert _greedy(first, prompt, 16) == expected
    with _engine(model, tokenizer, tmp_path, **options) as second:
        assert _greedy(second, prompt, 16) == expected
        assert second.stats()["disk_restored_blocks"] == len(prompt) // 16


def test_a_long_prefix_is_restored_in_batches(tiny, tmp_path):
    """More blocks than one read batch (`RESTORE_BATCH_BLOCKS`): read batch after batch, same tokens."""
    from cortexstream.engine.disk_prefix import RESTORE_BATCH_BLOCKS

    model, tokenizer = tiny
    prompt = _prompt(9, n=(2 * RESTORE_BATCH_BLOCKS + 5) * BS + 2)
    expected = _without_disk(model, tokenizer, prompt)
    with _engine(model, tokenizer, tmp_path) as first:
        assert _greedy(first, prompt) == expected
    second = _engine(model, tokenizer, tmp_path)
    computed_before = second.num_prompt_tokens_computed
    assert _greedy(second, prompt) == expected
    assert second.stats()["disk_restored_blocks"] == len(prompt) // BS > 2 * RESTORE_BATCH_BLOCKS
    assert second.num_prompt_tokens_computed - computed_before == len(prompt) - (len(prompt) // BS) * BS
    second.close()
