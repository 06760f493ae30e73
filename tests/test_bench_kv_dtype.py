"""`bench kv-dtype` on a tiny random model: every part measured at very small sizes and written (JSON, Markdown,
PNG), mlx-lm's caches scored like `token_nlls`, forks that keep a quantized storage, the targets judged from the
measured rows only, and options refused before anything loads."""

from __future__ import annotations

import json
import sys

import mlx.core as mx
import numpy as np
import pytest

from cortexstream.benchmarks.kv_dtype import run, run_from_args
from cortexstream.benchmarks.kv_dtype_measure import Storage
from cortexstream.engine.policy_prompt_cache import fork_cache
from cortexstream.benchmarks.kv_dtype_report import markdown, targets
from cortexstream.benchmarks.kv_dtype_settings import KVDtypeSettings
from cortexstream.cli.main import build_parser
from cortexstream.engine.policy_prompt_cache import apply_policy, attach_policy
from cortexstream.errors import InvalidArgumentError
from cortexstream.evaluation.perplexity import token_nlls
from tiny_models import tiny_model


@pytest.fixture(scope="module")
def model32():
    """The tiny model with 32-wide heads, so that group size 32 divides them."""
    return tiny_model(seed=5, head_dim=32)


def test_run_measures_every_part_and_writes_the_report(model32, tiny, tmp_path):
    settings = KVDtypeSettings(contexts=(64,), group_size=32, passkey_contexts=(400,), passkey_trials=2,
                               passkey_storages=("float32", "int8", "int4", "k=int8,v=int4", "float16"),
                               passkey_policies=("full", "streaming", "h2o"), batches=(1, 2), decode_keys=(32,),
                               decode_policies=("full", "h2o"), decode_steps=2, rounds=2)
    data = run(settings, "tiny", str(tmp_path), loaded=(model32, tiny[1]), log=lambda _: None)
    assert data["missing"] == []
    written = json.loads((tmp_path / "kv_dtype.json").read_text())
    assert written["settings"]["storages"] == ["float32", "float16", "int8", "int4", "k=int8,v=int4"]
    ours = [r for r in written["perplexity"] if r["system"] == "cortexstream"]
    assert len(ours) == 15 and {r["policy"] for r in ours} == {"full", "streaming@0.25", "h2o@0.25"}
    for r in ours:  # the policies kept a quarter of the context; the bytes follow the storage
        assert r["kept_tokens"] == (64 if r["policy"] == "full" else 16)
        assert r["bytes_per_context_token"] == pytest.approx(r["bytes_per_token"] * r["kept_tokens"] / 64)
    per_token = {r["storage"]: r["bytes_per_token"] for r in written["memory"]}
    assert per_token["float32"] == 2 * per_token["float16"] > per_token["int8"] > per_token["k=int8,v=int4"] \
        > per_token["int4"]
    reference = {r["storage"]: r for r in written["perplexity"] if r["system"] == "mlx_lm"}
    assert set(reference) == {"int8", "int4"}
    for bits, row in reference.items():
        ours_full = next(r for r in ours if r["storage"] == bits and r["policy"] == "full")
        if bits == "int8":  # same bits, same groups: the same bytes per token as the arena, and about its perplexity
            assert row["bytes_per_token"] == per_token[bits]
            assert row["ppl"] == pytest.approx(ours_full["ppl"], rel=0.01)
        else:  # the arena's 4-bit keys keep a scale per channel per block: more bytes than mlx-lm's groups
            assert row["bytes_per_token"] < per_token[bits]
    assert len(written["passkey"]) == 15 and all(r["trials"] == 2 for r in written["passkey"])
    assert {(r["batch"], r["storage"], r["policy"]) for r in written["decode"]} == {
        (b, s, p) for b in (1, 2) for s in ("float32", "int8", "int4") for p in ("full", "h2o@0.25")}
    assert {r["spec"] for r in written["decode"] if r["policy"] == "h2o@0.25"} == {"h2o:budget=0.25,sinks=4"}
    assert all(r["tokens"] == r["expected_tokens"] and len(r["tps"]) == 2 and r["tps_median"] > 0
               for r in written["decode"])
    text = (tmp_path / "kv_dtype.md").read_text()
    assert "| int8 perplexity within +0.5% of float | 64: " in text and "## Decode speed" in text
    assert "| decode at batch 8 / 4096 keys within 15% of float (int8, int4) | — | **not measured** |" in text
    assert (tmp_path / "kv_dtype.png").stat().st_size > 0


def test_mlx_lm_caches_are_scored_like_token_nlls(model32):
    from mlx_lm.models.cache import KVCache

    ids = list(np.random.default_rng(1).integers(3, 200, 90))
    ours = token_nlls(model32, ids, None, chunk_size=16)
    theirs = token_nlls(model32, ids, None, chunk_size=16, prompt_cache=[KVCache() for _ in model32.layers])
    assert theirs.shape == ours.shape and np.allclose(theirs, ours, atol=1e-4)


@pytest.mark.parametrize("policy", [None, "h2o:budget=0.5"])
def test_fork_keeps_the_quantized_storage_and_continues_like_the_original(model32, policy):
    ids = mx.array(np.random.default_rng(2).integers(3, 200, 48).astype(np.uint32))[None]
    base = Storage.parse("int4", 32, "float32").cache(model32, 64)
    attach_policy(base, policy, model32)
    mx.eval(model32(ids[:, :40], cache=base))
    apply_policy(base, 48)
    fork = fork_cache(base)
    assert fork[0].sequence.arena.config.storage.text == "int4" and fork[0].size() == base[0].size()
    original, forked = (model32(ids[:, 40:], cache=c) for c in (base, fork))
    assert mx.allclose(original, forked, atol=1e-5).item()


def _data(int4_ppl: float, decode: list[dict]) -> dict:
    def row(storage, ppl, policy="full", system="cortexstream"):
        return {"system": system, "context": 2048, "storage": storage, "policy": policy, "ppl": ppl}

    return {"settings": {"model_dtype": "float32", "contexts": [2048], "mlx_lm_bits": [8, 4]},
            "perplexity": [row("float32", 10.0), row("int8", 10.04), row("int4", int4_ppl),
                           row("int4", 10.6, "h2o@0.25"), row("int8", 10.03, system="mlx_lm")],
            "passkey": [], "decode": decode}


def test_targets_are_judged_from_the_measured_rows_only():
    speeds = [{"batch": 8, "keys": 4096, "storage": s, "tps_median": t}
              for s, t in (("float32", 100.0), ("int8", 90.0), ("int4", 80.0))]
    judged = {t["target"]: t for t in targets(_data(10.2, speeds))}
    assert judged["int8 perplexity within +0.5% of float"]["status"] == "met"
    assert judged["int8 perplexity within +0.5% of float"]["measured"] == "2048: +0.40%"
    assert judged["int4 perplexity within +3% of float"]["status"] == "met"
    assert judged["int4 + H2O 25% within +5% of the full float cache"]["status"] == "missed"  # +6%
    assert judged["at equal bits, perplexity no worse than mlx-lm QuantizedKVCache"]["status"] == "missed"
    assert judged["int8 passkey unchanged from float (same policy)"]["status"] == "not measured"
    decode = judged["decode at batch 8 / 4096 keys within 15% of float (int8, int4)"]
    assert decode["status"] == "missed" and decode["measured"] == "int8 90.0 vs 100.0 tok/s; int4 80.0 vs 100.0 tok/s"
    judged = {t["target"]: t["status"] for t in targets(_data(10.4, []))}
    assert judged["int4 perplexity within +3% of float"] == "missed"
    assert judged["decode at batch 8 / 4096 keys within 15% of float (int8, int4)"] == "not measured"


def test_markdown_says_when_there_is_no_plot(monkeypatch):
    data = _data(10.2, [])
    data["settings"].update(model="m", text_source="t", storages=["float32"], group_size=64, budget=0.25,
                            ppl_chunk=16, full_chunk=256)
    data.update(machine={"platform": "p", "cpu": "c", "cpu_count": 2, "mlx": "0", "blas": "b"}, memory=[])
    for r in data["perplexity"]:
        r.update(spec=r["policy"], bytes_per_context_token=1.0, kept_tokens=1, seconds=0.0)
    assert "No plot" not in markdown(data)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert "No plot: matplotlib is missing" in markdown(data)


@pytest.mark.parametrize("option, value, named", [
    ("--kv-dtypes", "int8;int3", "--kv-dtypes: kv_dtype: 'int3'"),
    ("--decode-kv-dtypes", "k=int8", "--decode-kv-dtypes"),
    ("--parts", "perplexity,speed", "--parts"),
    ("--passkey-contexts", "100", "--passkey-contexts"),
    ("--rounds", "0", "--rounds"),
    ("--passkey-policies", "full,lru", "--passkey-policies"),
    ("--decode-policies", "h2o,lru", "--decode-policies"),
    ("--group-size", "48", "--group-size: 48 must be 32 or 64"),
    ("--budget", "1.5", "--budget"),
    ("--kv-dtypes", ";", "--kv-dtypes: give 'auto'"),
    ("--passkey-kv-dtypes", "int8;int2", "--passkey-kv-dtypes"),
])
def test_bad_options_are_refused_before_anything_loads(tmp_path, monkeypatch, option, value, named):
    import cortexstream.benchmarks.kv_dtype as bench

    monkeypatch.setattr(bench, "load_model", lambda source: pytest.fail("loaded a model"))
    args = build_parser().parse_args(["bench", "kv-dtype", option, value, "--out", str(tmp_path)])
    with pytest.raises(InvalidArgumentError, match=named.replace("[", r"\[")):
        run_from_args(args)


def test_decode_engine_keeps_the_whole_batch_running_after_long_prefills(tiny):
    """Prompts that take many prefill steps: the first requests decode while the later ones prefill, and must still
    have tokens left for the timed steps (before the margin, a batch of 8 at 4096 keys decoded 6 a step)."""
    from cortexstream.benchmarks.kv_dtype_decode import prefilled_engine
    from cortexstream.benchmarks.kv_dtype_measure import Storage, model_dtype
    from tiny_models import random_token_ids

    model, tokenizer = tiny
    prompts = [random_token_ids(1100, seed=s) for s in range(4)]  # 9 prefill steps of 512 tokens
    engine = prefilled_engine(model, tokenizer, prompts, Storage.parse(model_dtype(model), 64, model_dtype(model)),
                              max_tokens=3, warmup=1)
    for _ in range(3):
        assert sum(out.token is not None for out in engine.step()) == 4
