"""One memory budget for the server (`--max-memory`): the planner's split, its parsing and errors, the server's
options, MLX's limits set through the compute backend, and a live server whose budget leaves an arena smaller than
its concurrent requests need: every request completes, none is refused."""

from __future__ import annotations

import asyncio
import re

import httpx
import mlx.core as mx
import pytest

from cortexstream.engine.memory_budget import (
    MIN_ARENA_BLOCKS, MemoryBudget, StepShape, plan_memory, resident_bytes, step_activation_bytes, weights_bytes,
)
from cortexstream.errors import InvalidArgumentError
from cortexstream.kv.arena_config import ArenaConfig
from cortexstream.kv.disk import DiskTierConfig
from cortexstream.server.app import PREFILL_STEP_SIZE
from cortexstream.server.config import ServerConfig
from server_harness import LiveServer

MIB = 2**20
BASELINE = 300 * MIB  # a fixed process baseline, so that a split does not depend on this process's memory
SETTINGS = {"block_size": 16, "max_num_seqs": 8, "prefill_step_size": 512}


def _plan(model, total: int, **overrides):
    options = {**SETTINGS, "baseline_bytes": BASELINE, **overrides}
    return plan_memory(model, MemoryBudget(total), **options)


def budget_for_blocks(model, blocks: int, baseline: int, max_num_seqs: int, queue: int = 0) -> int:
    """The budget whose arena is `blocks` blocks of 16 tokens: every other part at that arena size, plus it."""
    arena = ArenaConfig.for_model(model, num_tokens=blocks * 16, block_size=16)
    activations = step_activation_bytes(StepShape.of(model, arena), arena, max_num_seqs, PREFILL_STEP_SIZE)[0]
    return weights_bytes(model) + baseline + queue + activations + arena.total_bytes


# --- the planner ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("total", [400 * MIB, 512 * MIB, 2048 * MIB])
def test_the_split_adds_up_to_the_budget(tiny, total):
    model = tiny[0]
    plan = _plan(model, total)
    parts = plan.parts()
    assert sum(parts.values()) == total
    assert parts["weights"] == sum(v.nbytes for v in _leaves(model.parameters())) > 0
    assert parts["baseline"] == BASELINE
    assert plan.arena.num_blocks >= MIN_ARENA_BLOCKS
    # the activations are those of the largest step on this arena, and the slack is less than one more block
    assert plan.activation_bytes == step_activation_bytes(StepShape.of(model, plan.arena), plan.arena, 8, 512)[0]
    bigger = ArenaConfig.for_model(model, num_tokens=(plan.arena.num_blocks + 1) * 16, block_size=16)
    more = step_activation_bytes(StepShape.of(model, bigger), bigger, 8, 512)[0] + bigger.total_bytes
    assert plan.slack_bytes < more - (plan.activation_bytes + plan.arena_bytes)
    # MLX gets everything but the baseline; its cache only the safety margin of the activations
    assert plan.mlx_bytes == total - BASELINE
    assert 0 < plan.cache_bytes < plan.activation_bytes


def _leaves(tree):
    from mlx.utils import tree_flatten

    return [value for _, value in tree_flatten(tree)]


def test_the_arena_grows_with_the_budget(tiny):
    plans = [_plan(tiny[0], total) for total in (400 * MIB, 600 * MIB, 1200 * MIB)]
    blocks = [p.arena.num_blocks for p in plans]
    assert blocks[0] < blocks[1] < blocks[2]
    assert len({(p.weights_bytes, p.baseline_bytes) for p in plans}) == 1
    # a longer arena means longer contexts to attend to: the activations grow with it, in proportion
    assert plans[0].activation_bytes < plans[1].activation_bytes < plans[2].activation_bytes
    extra = [(p.activation_bytes - plans[0].activation_bytes) / (p.arena_bytes - plans[0].arena_bytes)
             for p in plans[1:]]
    assert extra[0] == pytest.approx(extra[1], rel=0.01)


def test_a_budget_for_a_number_of_blocks_gives_that_arena(tiny):
    model = tiny[0]
    for blocks in (MIN_ARENA_BLOCKS, 100, 1000):
        plan = _plan(model, budget_for_blocks(model, blocks, BASELINE, 8))
        assert plan.arena.num_blocks == blocks and plan.slack_bytes == 0


def test_the_kv_storage_and_the_disk_queue_change_the_arena(tiny):
    model = tiny[0]
    plain = _plan(model, 600 * MIB)
    half = _plan(model, 600 * MIB, kv_dtype="float16")
    assert half.arena.bytes_per_token * 2 == plain.arena.bytes_per_token
    assert half.arena.num_slots > plain.arena.num_slots
    queued = _plan(model, 600 * MIB, disk_queue_bytes=64 * MIB)
    assert queued.disk_queue_bytes == 64 * MIB and queued.arena.num_blocks < plain.arena.num_blocks
    assert sum(queued.parts().values()) == 600 * MIB


def test_a_budget_too_small_is_refused_with_every_number(tiny):
    model = tiny[0]
    weights = weights_bytes(model)
    with pytest.raises(InvalidArgumentError) as caught:
        _plan(model, weights + BASELINE + MIB, what="--max-memory")
    message = str(caught.value)
    assert message.startswith("--max-memory: a budget of ")
    assert weights < MIB  # the tiny model's, shown in KiB
    for figure in (f"weights {weights / 1024:.1f} KiB", f"process baseline {BASELINE / MIB:.1f} MiB",
                   "activations of the largest step", "max_num_seqs 8", "prefill_step_size 512",
                   f"({MIN_ARENA_BLOCKS} blocks x 16 tokens x 512 bytes)"):
        assert figure in message
    least = float(re.search(r"give at least ([0-9.]+) MiB", message).group(1))
    # the least budget named is enough, and less is not
    assert _plan(model, int((least + 0.1) * MIB)).arena.num_blocks == MIN_ARENA_BLOCKS
    with pytest.raises(InvalidArgumentError):
        _plan(model, int((least - 0.1) * MIB))


def test_bad_planner_settings_are_named(tiny):
    for name, value in (("block_size", 0), ("max_num_seqs", -1), ("prefill_step_size", 1.5)):
        with pytest.raises(InvalidArgumentError, match=f"^{name}:"):
            _plan(tiny[0], 600 * MIB, **{name: value})
    with pytest.raises(InvalidArgumentError, match="^disk_queue_bytes:"):
        _plan(tiny[0], 600 * MIB, disk_queue_bytes=-1)


def test_the_measured_baseline_is_resident_memory_less_the_weights(tiny):
    model = tiny[0]
    before = resident_bytes()
    plan = plan_memory(model, MemoryBudget(before + 256 * MIB), **SETTINGS)
    after = resident_bytes()
    assert before > weights_bytes(model)
    assert before - plan.weights_bytes - 16 * MIB <= plan.baseline_bytes <= after - plan.weights_bytes + 16 * MIB


# --- parsing ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("6GiB", 6 * 2**30), ("1.5GB", 1_500_000_000), ("512 MiB", 512 * MIB), ("800000000", 800_000_000),
    ("0.5", 4 * 2**30), (".25", 2 * 2**30), ("0.95", int(8 * 2**30 * 0.95)),
])
def test_sizes_and_fractions_of_physical_memory(text, expected):
    budget = MemoryBudget.parse(text, physical_bytes=8 * 2**30)
    assert budget.total_bytes == expected
    if "." in text and not text[-1].isalpha():
        assert "of 8.0 GiB" in budget.source


@pytest.mark.parametrize("text, reason", [
    ("0.99", r"must be in \(0, 0.95\]"), ("1.0", r"must be in \(0, 0.95\]"), ("0.0", r"must be in \(0, 0.95\]"),
    ("0", "more than 0 bytes"), ("6G", "is not a size.*or a fraction"), ("lots", "is not a size"),
    ("-1GiB", "is not a size"), ("", "must be a size"),
])
def test_bad_budgets_are_refused_naming_the_option(text, reason):
    with pytest.raises(InvalidArgumentError, match=f"^--max-memory: .*{reason}"):
        MemoryBudget.parse(text, "--max-memory", physical_bytes=8 * 2**30)


def test_a_budget_is_a_positive_number_of_bytes():
    for bad in (0, -5, 1.5, True):
        with pytest.raises(InvalidArgumentError, match="total_bytes"):
            MemoryBudget(bad)


# --- server options and MLX's limits ----------------------------------------------------------------------------
@pytest.mark.parametrize("options", [{"kv_tokens": 4096}, {"kv_memory": 0.5}])
def test_max_memory_excludes_the_arena_sizes(options):
    with pytest.raises(ValueError, match="^max_memory / kv_tokens / kv_memory:"):
        ServerConfig(max_memory="2GiB", **options)
    assert ServerConfig(max_memory="2GiB").max_memory == "2GiB"


def test_an_engine_passed_in_cannot_take_a_budget(tiny):
    from cortexstream.server.app import create_app

    with pytest.raises(ValueError, match="^max_memory: sizes the engine create_app builds"):
        create_app(tiny[0], tiny[1], ServerConfig(max_memory="2GiB"), engine=object())


def test_a_misspelt_max_memory_fails_at_start_up():
    with pytest.raises(ValueError, match="^max_memory: '2 gigs' is not a size"):
        ServerConfig(max_memory="2 gigs")


def test_the_command_line_refuses_max_memory_with_kv_tokens(capsys):
    from cortexstream.cli.main import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "--max-memory", "0.5"]).max_memory == "0.5"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--max-memory", "2GiB", "--kv-tokens", "100"])
    assert "argument --kv-tokens: not allowed with argument --max-memory" in capsys.readouterr().err


@pytest.fixture
def restore_mlx_limits():
    """The limits are process-wide: put them back for the tests that run after."""
    memory = mx.get_memory_limit()
    cache = mx.set_cache_limit(0)
    mx.set_cache_limit(cache)
    yield
    mx.set_memory_limit(memory)
    mx.set_cache_limit(cache)


def test_the_backend_sets_mlx_memory_and_cache_limits(restore_mlx_limits):
    from cortexstream.backend import ComputeBackend

    backend = ComputeBackend.for_engine(0)
    previous = backend.limit_memory(3 * 2**30, 64 * MIB)
    assert mx.get_memory_limit() == 3 * 2**30
    assert backend.limit_memory(*previous) == (3 * 2**30, 64 * MIB)
    with pytest.raises(ValueError, match="cache_bytes"):
        backend.limit_memory(2**30, -1)
    backend.close()


# --- a live server under a budget -------------------------------------------------------------------------------
def _metric(text: str, name: str, labels: str = "") -> float:
    pattern = rf'^{re.escape(name)}{{model_name="tiny"{re.escape(labels)}}} (\S+)$'
    match = re.search(pattern, text, re.MULTILINE)
    assert match, f"{name}{labels} not in /metrics"
    return float(match.group(1))


def test_requests_needing_more_kv_than_the_budget_leaves_all_complete(tiny, tmp_path, restore_mlx_limits):
    model, tokenizer = tiny
    max_num_seqs, max_queue, requests = 4, 4, 8
    weights = weights_bytes(model)
    queue = DiskTierConfig("unused", 64 * MIB).writer_queue_bytes  # what the server reserves for the disk tier
    budget = budget_for_blocks(model, 96, max(0, resident_bytes() - weights), max_num_seqs, queue)
    with LiveServer(model, tokenizer, kv_tokens=None, max_memory=str(budget), max_num_seqs=max_num_seqs,
                    max_queue=max_queue, kv_disk=str(tmp_path / "kv"), kv_disk_size="64MiB") as server:
        plan = server.state.memory_plan
        assert plan is not None and plan.budget.total_bytes == budget
        blocks = server.state.arena_limits.num_blocks
        assert blocks == plan.arena.num_blocks and blocks * 16 == plan.arena.num_slots
        assert mx.get_memory_limit() == plan.mlx_bytes
        # eight prompts of a third of the arena each (distinct, so no prefix is shared): over twice the arena
        prompts = [f"{i} " + "".join(chr(97 + (i * 7 + j * j) % 26) for j in range(blocks * 16)) for i in
                   range(requests)]
        prompts = [tokenizer.decode(tokenizer.encode(p)[: blocks * 16 // 3]) for p in prompts]
        needed = sum(len(tokenizer.encode(p)) for p in prompts)
        assert needed > 2 * blocks * 16

        async def run() -> list:
            client = server.async_client()
            return await asyncio.gather(*(client.completions.create(model="tiny", prompt=p, max_tokens=8,
                                                                    temperature=0) for p in prompts),
                                        return_exceptions=True)

        results = asyncio.run(run())
        failures = [r for r in results if isinstance(r, Exception)]
        assert not failures, failures  # a 429 would be an openai.RateLimitError here
        assert all(r.choices[0].finish_reason in ("length", "stop") for r in results)
        assert sum(r.usage.prompt_tokens for r in results) > 2 * blocks * 16
        text = httpx.get(f"{server.url}/metrics").text
    assert _metric(text, "cortexstream:memory_budget_bytes") == budget
    assert _metric(text, "cortexstream:memory_plan_bytes", ',part="arena"') == plan.arena_bytes
    parts = sum(_metric(text, "cortexstream:memory_plan_bytes", f',part="{part}"') for part in plan.parts())
    assert parts == budget
    finished = re.findall(r'^cortexstream:request_success_total\{[^}]*\} (\S+)$', text, re.MULTILINE)
    assert sum(float(n) for n in finished) == requests


# --- a draft model ----------------------------------------------------------------------------------------------
def test_a_draft_model_takes_its_weights_and_a_mirrored_arena_from_the_budget(tiny):
    from cortexstream.engine.memory_budget import DraftCost
    from tiny_models import tiny_model

    model = tiny[0]
    draft_model = tiny_model(seed=11, num_hidden_layers=1)
    draft = DraftCost.of(draft_model, 16)
    assert draft.weights_bytes == weights_bytes(draft_model) > 0
    assert draft.bytes_per_token == ArenaConfig.for_model(draft_model, num_tokens=16, block_size=16).bytes_per_token
    total = 512 * MIB
    alone, paired = _plan(model, total), _plan(model, total, draft=draft)
    parts = paired.parts()
    assert sum(parts.values()) == total and paired.mlx_bytes == total - BASELINE
    assert parts["draft_weights"] == draft.weights_bytes
    assert parts["draft_arena"] == paired.arena.num_slots * draft.bytes_per_token  # block for block
    assert paired.arena.num_blocks < alone.arena.num_blocks  # the draft's share comes out of the target's arena
    assert alone.parts()["draft_weights"] == alone.parts()["draft_arena"] == 0
    with pytest.raises(InvalidArgumentError, match="the draft model's weights and smallest arena"):
        _plan(model, weights_bytes(model) + BASELINE + MIB, draft=draft)


def test_the_server_plan_measures_a_draft_model_named_by_its_default_speculation(tiny_gguf):
    from cortexstream.models.loader import load
    from cortexstream.server.app import memory_plan

    model, _ = load(tiny_gguf)
    budget = f"{(resident_bytes() >> 20) + 512}MiB"  # the baseline is this process's peak: the suite's, not ours
    plain = memory_plan(model, ServerConfig(max_memory=budget))
    drafted = memory_plan(model, ServerConfig(max_memory=budget, speculative=f"draft:model={tiny_gguf},k=3"))
    assert plain.draft_weights_bytes == 0
    assert drafted.draft_weights_bytes == weights_bytes(model)  # the same file as draft: the same parameters
    assert drafted.draft_arena_bytes > 0 and drafted.arena.num_blocks < plain.arena.num_blocks
