"""The parts of distributed ranks that need no second process: what can be split and shared, the plan as sent
and rebuilt, the answers' format, launch detection, and a follower replaying an engine's plans (tokens checked
against rank 0's). Two real ranks: tests/test_distributed.py."""

from __future__ import annotations

import json
from dataclasses import replace

import mlx.core as mx
import pytest

from cortexstream.distributed import DistributedError, launched
from cortexstream.distributed.follower import Follower
from cortexstream.distributed.leader import engine_problem
from cortexstream.distributed.messages import Answer, AnswerKind, Heartbeat, OpenEngine, RunStep, Stop
from cortexstream.distributed.plan_wire import PlanDecoder, PlanEncoder, SeededSamplerRef, policy_problem
from cortexstream.distributed.sharding import shard_problem
from cortexstream.engine.engine import Engine
from cortexstream.engine.sampling import SamplingParams
from cortexstream.engine.seeded import seeded_sampler
from cortexstream.engine.step_plan import NewRequest, StepPlan, WorkItem, WorkKind
from cortexstream.policies import KVPolicy, parse_policy
from tiny_models import tiny_model


def test_heads_that_do_not_divide_are_refused_naming_the_counts():
    assert shard_problem(tiny_model(seed=1), 2) is None  # 4 query heads, 2 KV heads, MLP width 128
    smollm_like = tiny_model(seed=1, num_attention_heads=9, num_key_value_heads=3)
    problem = shard_problem(smollm_like, 2)
    assert "9 query heads, 3 KV heads" in problem and "query heads and KV heads do not divide by 2 ranks" in problem
    assert "KV heads do not divide by 4" in shard_problem(tiny_model(seed=1), 4)
    assert "no model.shard" in shard_problem(object(), 2)


def test_policies_that_decide_from_positions_or_select_or_merge_per_head_are_shared_and_the_rest_refused_saying_why():
    for spec in (None, "streaming:sinks=4,window=64", "h2o:budget=0.5", "expected:budget=0.5", "d2o:budget=0.5",
                 "snapkv:budget=0.5", "kvzip:budget=0.5", "meanpool", "meanpool:log_mass=0", "tome"):
        assert policy_problem(parse_policy(spec)) is None, spec
    merge_why = "merges slots without declaring a per-head merge (merges_per_head)"
    refused = (("compressor", ("merges", merge_why, "full KV head count")),
               ("sidecar", ("merges", "uses_logit_bias", merge_why, "full KV head count")))
    for spec, whys in refused:
        problem = policy_problem(parse_policy(spec))
        assert problem is not None and "each rank's own KV heads" in problem, spec
        assert all(why in problem for why in whys), problem

    class SharedSelection(KVPolicy):  # scores one selection for every head: not declared per head
        evicts = needs_attention_scores = True

    assert "does not declare a per-head selection (selects_per_head)" in policy_problem(SharedSelection())

    class CrossHeadPool(type(parse_policy("meanpool"))):  # a merge not declared per head: a selection claim is no help
        merges_per_head = False
        selects_per_head = True

    assert merge_why in policy_problem(CrossHeadPool())

    class PerHeadMergeSharedSelection(type(parse_policy("meanpool"))):  # merges per head, selects across heads
        needs_attention_scores = True

    problem = policy_problem(PerHeadMergeSharedSelection())
    assert "selects_per_head" in problem and "merges_per_head" not in problem


def _new(request_id: str, sampling: SamplingParams, **kw) -> NewRequest:
    return NewRequest(request_id, 1, sampling, kw.pop("kv_policy", parse_policy(None)), (1, 2, 3), 64, **kw)


def _decode(request_id: str, token: int | None = None) -> WorkItem:
    return WorkItem(request_id, WorkKind.DECODE, () if token is None else (token,), 3, 3, (0,), True)


def test_the_encoder_refuses_what_cannot_be_sent_and_names_it():
    greedy = SamplingParams()
    cases = [
        (StepPlan(new_requests=(_new("a", greedy, sampler=lambda lp: mx.argmax(lp, axis=-1)),)), "sampler"),
        (StepPlan(new_requests=(_new("a", greedy, bound_cache=object()),)), "prompt_cache"),
        (StepPlan(new_requests=(_new("a", greedy, kv_policy=parse_policy("compressor")),)), "kv_policy"),
        (StepPlan(restores=((0, b"x"),)), "kv_disk"),
    ]
    for plan, name in cases:
        with pytest.raises(DistributedError, match=name):
            PlanEncoder().encode(plan)


def test_seeded_samplers_travel_as_references_and_come_back_as_one_closure_each():
    sampling = SamplingParams(temperature=0.8, seed=5)
    first, second = seeded_sampler(sampling, 5), seeded_sampler(sampling, 5)
    encoder, decoder = PlanEncoder(), PlanDecoder()
    plan, random = encoder.encode(StepPlan(new_requests=(_new("a", sampling, sampler=first),
                                                         _new("b", sampling, sampler=second))))
    refs = [spec.sampler for spec in plan.new_requests]
    assert all(isinstance(ref, SeededSamplerRef) for ref in refs) and refs[0] != refs[1] and not random
    again, _ = encoder.encode(StepPlan(new_requests=(_new("a", sampling, sampler=first),)))  # re-admitted
    assert again.new_requests[0].sampler == refs[0]
    rebuilt = decoder.decode(plan)
    assert decoder.decode(again).new_requests[0].sampler is rebuilt.new_requests[0].sampler
    # Draws from a rebuilt closure are those of a fresh seeded sampler with the same seed.
    logprobs = mx.log(mx.softmax(mx.array([[0.1, 0.5, 0.2, 0.9, 0.3]]), axis=-1))
    fresh = seeded_sampler(sampling, 5)
    mine = rebuilt.new_requests[1].sampler
    assert [int(mine(logprobs).item()) for _ in range(8)] == [int(fresh(logprobs).item()) for _ in range(8)]


def test_a_step_that_samples_an_unseeded_request_gets_a_seed_for_every_rank():
    encoder = PlanEncoder()
    _, random = encoder.encode(StepPlan(new_requests=(_new("t", SamplingParams(temperature=0.7)),
                                                      _new("g", SamplingParams()))))
    assert not random  # nothing sampled yet
    assert encoder.encode(StepPlan(decode=(_decode("t"),)))[1]
    assert not encoder.encode(StepPlan(decode=(_decode("g"),)))[1]
    assert not encoder.encode(StepPlan(dropped=("t",), decode=(_decode("t"),)))[1]


def test_answers_are_json_and_garbage_is_refused():
    answer = Answer(AnswerKind.ACK, 1, step=7)
    assert Answer.decode(answer.encode()) == answer
    assert json.loads(answer.encode())["kind"] == "ack"
    with pytest.raises(ValueError):
        Answer.decode(b"\x80not json")


def test_launch_detection(monkeypatch, tmp_path):
    monkeypatch.delenv("MLX_RANK", raising=False)
    assert not launched()
    monkeypatch.setenv("MLX_RANK", "0")
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text("")  # mlx.launch with one rank: runs alone
    monkeypatch.setenv("MLX_HOSTFILE", str(hostfile))
    assert not launched()
    hostfile.write_text(json.dumps([["127.0.0.1:5000"], ["127.0.0.1:5001"]]))
    assert launched()


def test_engines_the_ranks_cannot_share_are_refused(tiny, tmp_path):
    model, tokenizer = tiny
    assert engine_problem(Engine(model, tokenizer, kv_tokens=256)) is None
    assert engine_problem(Engine(model, tokenizer, kv_tokens=256, kv_policy="h2o:budget=0.5")) is None
    assert engine_problem(Engine(model, tokenizer, kv_tokens=256, kv_policy="snapkv:budget=0.5")) is None
    assert engine_problem(Engine(model, tokenizer, kv_tokens=256, kv_policy="kvzip:budget=0.5")) is None
    assert engine_problem(Engine(model, tokenizer, kv_tokens=256, kv_policy="tome")) is None
    assert "merges_per_head" in engine_problem(Engine(model, tokenizer, kv_tokens=256, kv_policy="sidecar"))
    assert "kv_disk" in engine_problem(Engine(model, tokenizer, kv_tokens=256, kv_disk=str(tmp_path / "disk")))


class FakeChannel:
    """A follower's channel that hands out recorded messages and keeps the answers."""

    def __init__(self, messages: list) -> None:
        self.rank, self.timeout = 1, 30.0
        self.messages, self.acks, self.failures, self.texts = list(messages), [], [], []

    def receive(self):
        return self.messages.pop(0)

    def ack(self, step: int, text: str = "") -> None:
        self.acks.append(step)
        self.texts.append(text)

    def fail(self, reason: str) -> None:
        self.failures.append(reason)

    def leader_state(self):
        from cortexstream.distributed.follower_channel import LeaderState

        return LeaderState.SENT


def _recorded(tiny, kv_policy: str | None = None,
              prompts=([5, 9, 30, 2], [7, 7, 100])) -> tuple[Engine, list[StepPlan], dict[str, list[int]]]:
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, kv_tokens=512, max_num_seqs=2, pipeline=False, kv_policy=kv_policy)
    plans: list[StepPlan] = []
    engine.plan_listener = plans.append
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=6))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.token is not None:
                tokens.setdefault(out.request_id, []).append(out.token)
    return engine, plans, tokens


def _follow(tiny, engine: Engine, plans: list[StepPlan]) -> tuple[FakeChannel, dict[str, list[int]]]:
    spec = OpenEngine(1, engine.arena.config, True, True, 0)
    messages = [spec] + [RunStep(1, i + 1, plan) for i, plan in enumerate(plans)] + [Heartbeat(), Stop()]
    channel = FakeChannel(messages)
    follower = Follower(tiny[0], tiny[1], channel)
    sampled: dict[str, list[int]] = {}
    follower.on_result = lambda result: [sampled.setdefault(s.request_id, []).extend(s.token.reshape(-1).tolist())
                                         for s in result.sampled]
    follower.run()
    return channel, sampled


def test_a_follower_replays_the_plans_to_the_same_tokens_and_acks_every_step(tiny):
    engine, plans, tokens = _recorded(tiny)
    channel, sampled = _follow(tiny, engine, plans)
    assert channel.acks[-1] == len(plans) and channel.acks == sorted(channel.acks) and not channel.failures
    assert sampled == tokens
    from cortexstream.distributed.ledger import BlockLedger

    sent = BlockLedger()  # what rank 0's leader folds in for the plans it sends
    for plan in plans:
        sent.apply(plan, 1)
    assert channel.texts[-1] == sent.digest() and not any(channel.texts[:-1])  # the digest comes with Stop's ack


def test_a_follower_that_sampled_another_token_stops_saying_so(tiny):
    engine, plans, _ = _recorded(tiny)
    at = next(i for i, plan in enumerate(plans) if any(item.token_ids for item in plan.decode))
    item = next(item for item in plans[at].decode if item.token_ids)
    wrong = replace(item, token_ids=((item.token_ids[0] + 1) % 256,))
    plans[at] = replace(plans[at], decode=tuple(wrong if d is item else d for d in plans[at].decode))
    with pytest.raises(DistributedError, match="the ranks diverged"):
        _follow(tiny, engine, plans)


def test_a_follower_whose_policy_kept_other_slot_counts_than_rank_0s_stops_saying_so(tiny):
    prompts = ([(7 * j) % 200 + 3 for j in range(30)], list(range(10, 40)))
    engine, plans, tokens = _recorded(tiny, "h2o:budget=12,sinks=2", prompts)
    assert engine.stats()["evicted_tokens"] > 0
    channel, sampled = _follow(tiny, engine, plans)  # the same evictions: the same slots
    assert sampled == tokens and not channel.failures
    # A plan that starts a request from one slot fewer than the policy left it (as if rank 0 evicted more).
    at = next(i for i, plan in enumerate(plans) if i and any(item.physical_start < item.start for item in plan.decode))
    item = next(item for item in plans[at].decode if item.physical_start < item.start)
    moved = replace(item, physical_start=item.physical_start - 1)
    plans[at] = replace(plans[at], decode=tuple(moved if d is item else d for d in plans[at].decode))
    with pytest.raises(DistributedError, match="the ranks evicted differently"):
        _follow(tiny, engine, plans)


def test_a_follower_runs_kvzip_reconstruction_chunks_and_stops_when_it_did_not_compress_as_rank_0(tiny):
    prompts = ([(7 * j) % 200 + 3 for j in range(30)], list(range(10, 40)))
    engine, plans, tokens = _recorded(tiny, "kvzip:budget=12,sinks=2,chunk=8", prompts)
    scoring = [i for i, plan in enumerate(plans) if plan.score]
    assert len(scoring) >= 2 and engine.stats()["evicted_tokens"] > 0
    channel, sampled = _follow(tiny, engine, plans)  # every chunk run and rolled back, the last compresses
    assert sampled == tokens and not channel.failures
    from cortexstream.distributed.ledger import BlockLedger

    sent = BlockLedger()
    for plan in plans:
        sent.apply(plan, 1)
    assert channel.texts[-1] == sent.digest()
    # Without its chunks a rank never compresses: the next plan starts the request from fewer slots than it holds.
    skipped = [replace(plan, score=()) if plan.score else plan for plan in plans]
    with pytest.raises(DistributedError, match="the ranks evicted differently"):
        _follow(tiny, engine, skipped)


def test_the_block_ledger_digest_tells_apart_plans_that_place_kv_differently():
    from cortexstream.distributed.ledger import BlockLedger

    def item(table: tuple[int, ...]) -> WorkItem:
        return WorkItem("r1", WorkKind.DECODE, (5,), 20, 20, table, True)

    plans = [StepPlan(decode=(item((0, 1)),), num_blocks_used=2), StepPlan(copies=((1, 2),), decode=(item((0, 2)),))]
    a, b, c = BlockLedger(), BlockLedger(), BlockLedger()
    for plan in plans:
        a.apply(plan, 1)
        b.apply(plan, 1)
    c.apply(plans[0], 1)
    c.apply(replace(plans[1], decode=(item((0, 3)),)), 1)
    assert a.digest() == b.digest() != c.digest()
    assert a.tables == {"1/r1": (0, 2)} and a.copies == 1
    a.apply(StepPlan(dropped=("r1",)), 1)
    assert a.tables == {}


def test_an_engine_on_a_split_model_that_no_rank_session_relays_refuses_instead_of_hanging(tiny):
    """A model marked split (shard_model marks it) cannot be stepped by an engine nobody attached to the ranks: the
    first step refuses before scheduling anything; with a listener relaying its plans it runs."""
    from cortexstream.engine.engine import Engine
    from cortexstream.engine.sampling import SamplingParams
    from cortexstream.errors import GenerationError
    from cortexstream.models.split_mark import mark_split, split_ranks
    from tiny_models import random_token_ids, tiny_model

    model, tokenizer = tiny_model(seed=3), tiny[1]  # a model of its own: the mark stays on the object
    assert split_ranks(model) == 1
    mark_split(model, 2)
    assert split_ranks(model) == 2
    engine = Engine(model, tokenizer, kv_tokens=256)
    rid = engine.add_request(random_token_ids(12), SamplingParams(max_tokens=2, temperature=0.0))
    with pytest.raises(GenerationError, match="split over 2 ranks and this engine is not attached"):
        engine.step()
    assert engine.stats()["running"] == 0 and engine.stats()["waiting"] == 1  # nothing was scheduled
    relayed = []
    engine.plan_listener = relayed.append  # what DistributedLeader.attach installs (its relay), here a recorder
    outputs = [o for _ in range(6) for o in engine.step()]
    assert relayed and any(o.request_id == rid and o.finished for o in outputs)
