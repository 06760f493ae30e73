"""Draft-model speculative decoding (engine/draft_runner.py): a draft model with the target's vocabulary proposes,
the target verifies; greedy output equals plain decoding alone, batched, with preemption and a prefix-cache hit;
the draft model identical to the target accepts every draft; mismatched vocabularies are refused."""

from __future__ import annotations

import numpy as np
import pytest

from cortexstream.engine.engine import Engine
from cortexstream.errors import InvalidArgumentError
from tests.test_engine import run_all
from tests.tiny_models import TINY_CONFIG, tiny_model, write_tiny_gguf

BS = 4


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory) -> str:
    """A different random model with the tiny tokenizer: a draft that is often wrong."""
    path = str(tmp_path_factory.mktemp("draft") / "draft.gguf")
    write_tiny_gguf(path, tiny_model(seed=11, num_hidden_layers=1), {**TINY_CONFIG, "num_hidden_layers": 1})
    return path


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(3, 250, size=int(n))] for n in rng.integers(5, 40, size=count)]


def _plain(model, tokenizer, prompts, max_tokens=20):
    engine = Engine(model, tokenizer, kv_tokens=4096, block_size=BS)
    ids = [engine.add_request(p, max_tokens=max_tokens) for p in prompts]
    results = run_all(engine)
    return [results[i]["tokens"] for i in ids]


def _speculative(model, tokenizer, prompts, draft, max_tokens=20, **options):
    options.setdefault("kv_tokens", 4096)
    engine = Engine(model, tokenizer, block_size=BS, speculative=f"draft:model={draft},k=4", **options)
    ids = [engine.add_request(p, max_tokens=max_tokens) for p in prompts]
    results = run_all(engine)
    return [results[i]["tokens"] for i in ids], engine


def test_draft_equal_to_target_accepts_everything(tiny, tiny_gguf):
    model, tokenizer = tiny
    prompts = _prompts(3, seed=1)
    expected = _plain(model, tokenizer, prompts)
    got, engine = _speculative(model, tokenizer, prompts, tiny_gguf)
    assert got == expected
    stats = engine.stats()
    assert stats["spec_drafted_tokens"] > 0
    assert stats["spec_accepted_tokens"] == stats["spec_drafted_tokens"]


def test_a_different_draft_gives_plain_greedy_output(tiny, other_draft):
    model, tokenizer = tiny
    prompts = _prompts(5, seed=2)
    expected = _plain(model, tokenizer, prompts)
    for group in ([prompts[0]], prompts):  # alone and batched
        got, engine = _speculative(model, tokenizer, group, other_draft)
        assert got == expected[: len(group)]
    stats = engine.stats()
    assert stats["spec_accepted_tokens"] < stats["spec_drafted_tokens"]
    assert engine.arena.allocator.num_used_blocks == engine.block_manager.num_cached_blocks


def test_preemption_prefix_hits_and_forks_with_a_draft_model(tiny, other_draft, tiny_gguf):
    from cortexstream.engine.sampling import SamplingParams

    model, tokenizer = tiny
    prompts = _prompts(4, seed=3)
    expected = _plain(model, tokenizer, prompts, max_tokens=40)
    got, engine = _speculative(model, tokenizer, prompts, other_draft, max_tokens=40, kv_tokens=36 * BS)
    assert got == expected
    assert engine.scheduler.num_preemptions > 0
    engine = Engine(model, tokenizer, kv_tokens=4096, block_size=BS, speculative=f"draft:model={tiny_gguf}")
    for _ in range(2):  # the second run hits the prefix cache: the draft model catches up from position 0
        rid = engine.add_request(prompts[0], max_tokens=40)
        assert run_all(engine)[rid]["tokens"] == expected[0]
    engine.fork(list(prompts[1]), SamplingParams(max_tokens=40), ["a", "b"])
    results = run_all(engine)
    assert results["a"]["tokens"] == results["b"]["tokens"] == expected[1]
    assert engine.stats()["spec_accepted_tokens"] == engine.stats()["spec_drafted_tokens"]


def test_sampled_requests_run_with_a_draft_model(tiny, other_draft):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, kv_tokens=4096, block_size=BS, speculative=f"draft:model={other_draft}")
    ids = [engine.add_request(p, max_tokens=20, temperature=0.9, top_p=0.9) for p in _prompts(3, seed=4)]
    results = run_all(engine)
    assert all(len(results[i]["tokens"]) == 20 or results[i]["reason"] == "stop" for i in ids)
    stats = engine.stats()
    assert stats["spec_verify_steps"] > 0
    # a different random model's samples are not the target's: rejection sampling turns some of them down
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_drafted_tokens"]


def test_bad_draft_models_are_refused(tiny, tiny_gguf, tmp_path):
    model, tokenizer = tiny
    wrong = str(tmp_path / "wrong_vocab.gguf")
    write_tiny_gguf(wrong, tiny_model(seed=3, vocab_size=TINY_CONFIG["vocab_size"] + 8),
                    {**TINY_CONFIG, "vocab_size": TINY_CONFIG["vocab_size"] + 8}, tokenizer=False)
    with pytest.raises(Exception, match="vocabulary|tokeniz"):
        Engine(model, tokenizer, kv_tokens=1024, block_size=BS, speculative=f"draft:model={wrong}")
    plain = Engine(model, tokenizer, kv_tokens=1024, block_size=BS)
    with pytest.raises(InvalidArgumentError, match="has not loaded"):
        plain.add_request([5, 6, 7], max_tokens=4, speculative=f"draft:model={tiny_gguf}")


def test_the_public_calls_load_a_draft_model_for_their_private_engine(tiny, other_draft):
    """`generate`, `stream_generate` and `batch_generate` without an engine: the private engine loads the draft
    model the request names, and the greedy text is plain decoding's."""
    from cortexstream import batch_generate, generate, stream_generate

    model, tokenizer = tiny
    prompts = _prompts(3, seed=4)
    spec = f"draft:model={other_draft},k=3"
    plain = batch_generate(model, tokenizer, prompts, max_tokens=16)
    drafted = batch_generate(model, tokenizer, prompts, max_tokens=16, speculative=spec)
    assert drafted.texts == plain.texts
    alone = generate(model, tokenizer, prompts[0], max_tokens=16)
    assert generate(model, tokenizer, prompts[0], max_tokens=16, speculative=spec) == alone
    streamed = list(stream_generate(model, tokenizer, prompts[0], max_tokens=16, speculative=spec))
    assert "".join(r.text for r in streamed) == alone and len(streamed) == 16


def test_the_draft_model_computes_each_prompt_chunk_in_its_step(tiny, other_draft, monkeypatch):
    """With a draft model, each prefill chunk is fed to it in the chunk's own step (`WorkItem.model_draft`, k=0),
    so the first drafting pass after the prompt feeds one token, not the prompt: no pause of a draft-model prefill
    between the first two output tokens. Greedy output is plain decoding's."""
    from cortexstream.engine.draft_runner import DraftRunner
    from cortexstream.engine.verify_cost import PLAIN_STEPS_TO_MEASURE

    model, tokenizer = tiny
    prompt = _prompts(1, seed=9)[0] * 3  # 15-117 tokens: several chunks of 16
    expected = _plain(model, tokenizer, [prompt], max_tokens=12)
    feeds, contexts = [], []
    feed, propose = DraftRunner.feed, DraftRunner.propose
    monkeypatch.setattr(DraftRunner, "feed", lambda self, items: (
        feeds.extend((i.model_draft.start, len(i.model_draft.context), i.model_draft.k) for i in items),
        feed(self, items))[1])
    monkeypatch.setattr(DraftRunner, "propose", lambda self, items, samplings: (
        contexts.extend(len(i.model_draft.context) for i in items), propose(self, items, samplings))[1])
    engine = Engine(model, tokenizer, kv_tokens=4096, block_size=BS, prefill_step_size=16,
                    speculative=f"draft:model={other_draft},k=3")
    rid = engine.add_request(prompt, max_tokens=12)
    assert run_all(engine)[rid]["tokens"] == expected[0]
    assert [start for start, _, _ in feeds] == list(range(0, len(prompt), 16))
    assert sum(n for _, n, _ in feeds) == len(prompt) and {k for _, _, k in feeds} == {0}
    # the first drafting pass feeds the tokens since the prompt (after the plain steps that time the batch's
    # pipelined period: engine/verify_cost.py), then kept drafts + one
    assert contexts and contexts[0] <= 1 + PLAIN_STEPS_TO_MEASURE and max(contexts[1:]) <= 3
    assert contexts[0] < len(prompt) // 4
