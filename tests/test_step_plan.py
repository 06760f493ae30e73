"""The step plan is the whole contract between scheduler and runner.

- Replay: a second runner on an arena of its own, given the plans an engine emitted, in order, computes the same
  KV and samples the same tokens (prefix-cache hits with copy-on-write, batched and mixed prefill, pipelined decode,
  an evicting policy, n > 1 forks, preemption by recompute).
- Only the scheduler and the block manager write a sequence's counters, block table and status (checked on the
  source, as tests/test_layers.py does for imports).
- The plan is plain, immutable data: no Sequence, no shared list.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
from collections import defaultdict

import mlx.core as mx
import numpy as np
import pytest

from cortexstream.engine.engine import Engine
from cortexstream.engine.runner import ModelRunner
from cortexstream.engine.sampling import SamplingParams
from cortexstream.engine.sequence import Sequence
from cortexstream.engine.step_plan import StepPlan, WorkItem
from cortexstream.kv.arena import KVArena

ROOT = pathlib.Path(__file__).resolve().parent.parent


def random_prompts(count: int, seed: int, low: int = 1, high: int = 60) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 250, size=int(rng.integers(low, high))).tolist() for _ in range(count)]


def run_recorded(engine: Engine) -> tuple[list[StepPlan], dict[str, list[int]]]:
    plans: list[StepPlan] = []
    engine.plan_listener = plans.append
    tokens: dict[str, list[int]] = defaultdict(list)
    while engine.has_unfinished:
        for out in engine.step():
            if out.token is not None:
                tokens[out.request_id].append(out.token)
    return plans, tokens


def replay(engine: Engine, plans: list[StepPlan]) -> tuple[KVArena, dict[str, list[int]]]:
    arena = KVArena(engine.arena.config)
    runner = ModelRunner(engine.model, arena)
    sampled: dict[str, list[mx.array]] = defaultdict(list)
    for plan in plans:
        result = runner.execute(plan)
        for token in result.sampled:
            sampled[token.request_id].append(token.token)
    mx.eval([t for ts in sampled.values() for t in ts])
    return arena, {rid: [int(t.item()) for t in ts] for rid, ts in sampled.items()}


def assert_same_kv(a: KVArena, b: KVArena, num_blocks: int) -> None:
    slots = num_blocks * a.config.block_size
    for layer in range(a.config.num_layers):
        for x, y in ((a.keys[layer], b.keys[layer]), (a.values[layer], b.values[layer])):
            assert np.array_equal(np.asarray(x[:, :, :slots]), np.asarray(y[:, :, :slots])), f"layer {layer}"


def assert_same_tokens(engine_tokens: dict[str, list[int]], replayed: dict[str, list[int]]) -> None:
    assert set(replayed) >= set(engine_tokens)
    for rid, tokens in engine_tokens.items():
        again = replayed[rid]
        # A token launched after the one that ended its request is computed but never read by the engine.
        assert again[: len(tokens)] == tokens, rid
        assert len(again) - len(tokens) in (0, 1), rid


def test_a_second_runner_replays_the_plans_to_the_same_kv_and_tokens(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, kv_tokens=4096, block_size=4, max_num_seqs=8, prefill_step_size=24)
    shared = list(range(5, 30))
    prompts = [shared + p for p in random_prompts(3, seed=7, low=3, high=15)] + random_prompts(3, seed=8, low=2,
                                                                                              high=40)
    for p in prompts:
        engine.add_request(p, max_tokens=9)
    engine.add_request(random_prompts(1, seed=9, low=30, high=31)[0], max_tokens=12, kv_policy="h2o:budget=16")
    engine.fork(shared + [3, 4], SamplingParams(max_tokens=7), ["parent", "child-1", "child-2"])
    plans, tokens = run_recorded(engine)
    kinds = {(bool(p.prefill), bool(p.decode)) for p in plans}
    assert (True, True) in kinds and (False, True) in kinds  # mixed steps and pure decode steps
    assert any(p.copies for p in plans), "no copy-on-write was planned: the test lost its point"
    assert any(not item.token_ids for p in plans for item in p.decode), "no pipelined decode was planned"
    arena, replayed = replay(engine, plans)
    assert_same_tokens(tokens, replayed)
    assert len(tokens) == len(prompts) + 4
    assert_same_kv(engine.arena, arena, max(p.num_blocks_used for p in plans))


def test_replay_through_preemption_by_recompute(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, kv_tokens=96, block_size=4, max_num_seqs=6)
    for p in random_prompts(6, seed=3, low=8, high=20):
        engine.add_request(p, max_tokens=14)
    plans, tokens = run_recorded(engine)
    assert engine.scheduler.num_preemptions > 0, "the arena was large enough: nothing was preempted"
    assert any(p.dropped for p in plans)
    arena, replayed = replay(engine, plans)
    assert_same_tokens(tokens, replayed)
    assert_same_kv(engine.arena, arena, max(p.num_blocks_used for p in plans))


def test_replay_detects_a_different_plan(tiny):
    # The replay check is honest: the same plans with one token changed give different KV.
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, kv_tokens=512, block_size=4)
    engine.add_request(random_prompts(1, seed=5, low=12, high=13)[0], max_tokens=4)
    plans, _ = run_recorded(engine)
    first = plans[0]
    item = first.prefill[0]
    changed = dataclasses.replace(item, token_ids=(item.token_ids[0] + 1,) + item.token_ids[1:])
    arena, _ = replay(engine, [dataclasses.replace(first, prefill=(changed,))] + plans[1:])
    with pytest.raises(AssertionError):
        assert_same_kv(engine.arena, arena, max(p.num_blocks_used for p in plans))


def test_the_plan_is_plain_immutable_data(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, kv_tokens=512, block_size=4)
    engine.add_request([1, 2, 3, 4, 5, 6], max_tokens=3)
    plans, _ = run_recorded(engine)
    item = plans[0].prefill[0]
    assert isinstance(item, WorkItem) and isinstance(item.block_table, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        item.start = 3  # type: ignore[misc]
    for plan in plans:
        for value in _values(plan):
            assert not isinstance(value, (Sequence, list, dict, set)), type(value)


def _values(obj: object):
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            if f.name in ("sampling", "kv_policy", "sampler", "bound_cache"):
                continue  # request configuration, frozen dataclasses or callables given by the caller
            value = getattr(obj, f.name)
            yield value
            yield from _values(value)
    elif isinstance(obj, tuple):
        for value in obj:
            yield value
            yield from _values(value)


# --- only the scheduler and the block manager write sequence state ---------------------------------------------------
SEQUENCE_STATE = {
    "num_computed", "num_physical", "num_inflight", "num_cached_prefix", "num_preemptions", "block_table",
    "block_hashes", "output_ids", "status", "finish_reason", "first_token_time", "kv_from_tokens", "hook", "sampler",
}
WRITERS = {"cortexstream/engine/scheduler.py", "cortexstream/engine/block_manager.py"}
# (file, field) -> why that write is not to a sequence.
NOT_A_SEQUENCE = {
    ("cortexstream/server/responses.py", "finish_reason"): "an OpenAI response choice's finish_reason",
}
MUTATORS = {"append", "extend", "clear", "insert", "pop", "remove", "sort", "reverse"}


def sequence_state_writes(source: str) -> list[tuple[int, str]]:
    """(line, field) of every write to a sequence-state field through another object (`x.field = ...`,
    `x.field += ...`, `x.field[i] = ...`, `del x.field[...]`, `x.field.append(...)`): `self.field` is a class's own."""
    found = []

    def field_of(node: ast.expr) -> str | None:
        if isinstance(node, ast.Subscript):
            node = node.value
        if isinstance(node, ast.Attribute) and node.attr in SEQUENCE_STATE:
            receiver = node.value
            if not (isinstance(receiver, ast.Name) and receiver.id == "self"):
                return node.attr
        return None

    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            targets = [node.func.value]
        for target in targets:
            for part in (target.elts if isinstance(target, ast.Tuple) else [target]):
                name = field_of(part)
                if name is not None:
                    found.append((node.lineno, name))
    return sorted(found)


def test_only_the_scheduler_and_block_manager_write_sequence_state():
    writes, allowed = [], set()
    for package in ("cortexstream", "apps", "bench"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in WRITERS:
                continue
            for line, name in sequence_state_writes(path.read_text("utf-8")):
                if (rel, name) in NOT_A_SEQUENCE:
                    allowed.add((rel, name))
                else:
                    writes.append(f"{rel}:{line}: .{name}")
    assert not writes, "sequence state written outside the scheduler / block manager:\n" + "\n".join(writes)
    assert allowed == set(NOT_A_SEQUENCE), "allow-list entries no longer needed: remove them"


def test_the_write_check_sees_what_it_claims_to():
    source = (
        "def f(seq, other):\n"
        "    seq.num_computed += 1\n"                 # 2
        "    seq.block_table[0] = 3\n"                # 3
        "    other.output_ids.append(4)\n"            # 4
        "    del seq.block_table[2:]\n"               # 5
        "    a, seq.status = 1, 2\n"                  # 6
        "    self.num_computed = 0\n"                 # a class's own field: fine
        "    n = seq.num_computed + len(seq.block_table)\n"  # reads: fine
    )
    assert sequence_state_writes(source) == [(2, "num_computed"), (3, "block_table"), (4, "output_ids"),
                                             (5, "block_table"), (6, "status")]


def test_the_runner_never_sees_the_schedulers_objects():
    # Plain data down, plain data up: the runner imports the plan, never the sequence, scheduler or block manager.
    tree = ast.parse((ROOT / "cortexstream/engine/runner.py").read_text("utf-8"))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "cortexstream.engine.step_plan" in imported
    assert not imported & {"cortexstream.engine.sequence", "cortexstream.engine.scheduler",
                           "cortexstream.engine.block_manager"}
